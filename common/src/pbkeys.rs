//! Keys lists in protobuf messages without a `String` per key: encoding a `repeated string` field
//! from borrowed `&str`s, and reading one back as slices of the message's bytes. The hot batch
//! calls (exists over 10k keys) pay per-key allocation otherwise on both sides. The bytes are
//! exactly what prost writes and reads for `repeated string` (field, wire type 2, length, UTF-8),
//! so the other side may use the generated types.

/// Appends field `field` as `repeated string` holding `keys` to `out`.
pub fn encode_strings(field: u32, keys: &[&str], out: &mut Vec<u8>) {
    let tag = u64::from(field << 3 | 2);
    for k in keys {
        put_varint(tag, out);
        put_varint(k.len() as u64, out);
        out.extend_from_slice(k.as_bytes());
    }
}

/// Bytes `encode_strings` appends.
pub fn encoded_len(field: u32, keys: &[&str]) -> usize {
    let tag = varint_len(u64::from(field << 3 | 2));
    keys.iter()
        .map(|k| tag + varint_len(k.len() as u64) + k.len())
        .sum()
}

/// Every value of field `field` (a `repeated string`) in the message `body`, in order, as slices
/// of `body`; other fields are skipped. Malformed input is an error, never a panic.
pub fn decode_strings(body: &[u8], field: u32) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < body.len() {
        let key = get_varint(body, &mut at)?;
        let (num, wire) = ((key >> 3) as u32, (key & 7) as u8);
        match wire {
            0 => {
                get_varint(body, &mut at)?;
            }
            1 => at = skip(body, at, 8)?,
            5 => at = skip(body, at, 4)?,
            2 => {
                let len = get_varint(body, &mut at)?;
                let len = usize::try_from(len).map_err(|_| "length overflows".to_string())?;
                let end = skip(body, at, len)?;
                if num == field {
                    let s = std::str::from_utf8(&body[at..end])
                        .map_err(|_| format!("field {field} is not UTF-8"))?;
                    out.push(s);
                }
                at = end;
            }
            w => return Err(format!("unsupported wire type {w}")),
        }
    }
    Ok(out)
}

pub(crate) fn skip(body: &[u8], at: usize, n: usize) -> Result<usize, String> {
    at.checked_add(n)
        .filter(|end| *end <= body.len())
        .ok_or_else(|| "message truncated".to_string())
}

pub(crate) fn put_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

pub(crate) fn get_varint(body: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *body.get(*at).ok_or("message truncated")?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint too long".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::master as pb;
    use proptest::prelude::*;
    use prost::Message;

    proptest! {
        #[test]
        fn matches_prost_both_ways(keys in proptest::collection::vec("[a-z0-9/é]{0,300}", 0..50), force: bool) {
            let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            let mut ours = Vec::new();
            encode_strings(1, &refs, &mut ours);
            prop_assert_eq!(ours.len(), encoded_len(1, &refs));
            let theirs = pb::BatchExistsRequest { keys: keys.clone() }.encode_to_vec();
            prop_assert_eq!(&ours, &theirs);
            // Reading skips other fields (here the bool of a remove request).
            let remove = pb::BatchRemoveRequest { keys: keys.clone(), force }.encode_to_vec();
            prop_assert_eq!(decode_strings(&remove, 1).unwrap(), refs);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_strings(&bytes, 1);
        }
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert!(decode_strings(&[0x0a, 5, b'a'], 1).is_err(), "truncated");
        assert!(
            decode_strings(&[0x0a, 2, 0xff, 0xfe], 1).is_err(),
            "not UTF-8"
        );
        assert!(decode_strings(&[0x0b], 1).is_err(), "wire type 3");
        assert!(decode_strings(&[0x80; 11], 1).is_err(), "endless varint");
    }
}
