//! Protobuf's wire primitives for the hand-written codecs: varints, the tag of a field, and a
//! walk over a message's fields that never panics on malformed input.

/// Wire type of a varint field.
pub(super) const VARINT: u64 = 0;
/// Wire type of a length-delimited field (bytes, strings, messages).
pub(super) const LEN: u64 = 2;
/// Largest field number protobuf allows.
const MAX_FIELD: u32 = (1 << 29) - 1;

/// The tag of field `field` with wire type `wire`.
pub(super) fn tag(field: u32, wire: u64) -> u64 {
    u64::from(field) << 3 | wire
}

/// Appends field `field` as `uint64` (left out when zero, as prost leaves it).
pub(super) fn put_u64(field: u32, v: u64, out: &mut Vec<u8>) {
    if v != 0 {
        put_varint(tag(field, VARINT), out);
        put_varint(v, out);
    }
}

/// Bytes `put_u64` appends.
pub(super) fn u64_len(field: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        varint_len(tag(field, VARINT)) + varint_len(v)
    }
}

pub(super) enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
    Other,
}

/// Calls `f` with every field of the message `body` in order. `known` names the fields the
/// caller reads, each with its wire type: one of them arriving with another wire type is an
/// error, as prost makes it, not a field silently left unread.
pub(super) fn walk<'a>(
    body: &'a [u8],
    known: &[(u32, u64)],
    mut f: impl FnMut(u32, Value<'a>) -> Result<(), String>,
) -> Result<(), String> {
    let mut at = 0usize;
    while at < body.len() {
        let key = get_varint(body, &mut at)?;
        let (field, wire) = (field_number(key)?, key & 7);
        if let Some(&(_, want)) = known.iter().find(|(n, _)| *n == field) {
            if want != wire {
                return Err(format!(
                    "field {field} has wire type {wire}, expected {want}"
                ));
            }
        }
        let value = match wire {
            0 => Value::Int(get_varint(body, &mut at)?),
            1 => {
                at = skip(body, at, 8)?;
                Value::Other
            }
            5 => {
                at = skip(body, at, 4)?;
                Value::Other
            }
            2 => {
                let len = get_varint(body, &mut at)?;
                let len = usize::try_from(len).map_err(|_| "length overflows".to_string())?;
                let end = skip(body, at, len)?;
                let b = &body[at..end];
                at = end;
                Value::Bytes(b)
            }
            w => return Err(format!("unsupported wire type {w}")),
        };
        f(field, value)?;
    }
    Ok(())
}

/// The field number of a field's key; 0 and numbers beyond protobuf's range are errors.
#[inline]
pub(super) fn field_number(key: u64) -> Result<u32, String> {
    u32::try_from(key >> 3)
        .ok()
        .filter(|f| (1..=MAX_FIELD).contains(f))
        .ok_or_else(|| format!("field number {} is not valid", key >> 3))
}

#[inline]
pub(super) fn skip(body: &[u8], at: usize, n: usize) -> Result<usize, String> {
    at.checked_add(n)
        .filter(|end| *end <= body.len())
        .ok_or_else(|| "message truncated".to_string())
}

pub(super) fn put_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(super) fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

#[inline]
pub(super) fn get_varint(body: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *body.get(*at).ok_or("message truncated")?;
        *at += 1;
        if shift == 63 && b > 1 {
            // The tenth byte holds the 64th bit alone.
            return Err("varint overflows 64 bits".into());
        }
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint too long".into())
}
