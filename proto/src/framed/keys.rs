//! Key lists in protobuf messages without a `String` per key: encoding a `repeated string` field
//! from borrowed `&str`s, and reading one back as slices of the message's bytes. The hot batch
//! calls (exists over 10k keys) pay per-key allocation otherwise on both sides. The bytes are
//! exactly what prost writes and reads for `repeated string` (field, wire type 2, length, UTF-8),
//! so the other side may use the generated types.

use super::{
    fields::keyed,
    pb::{
        field_number, get_varint, put_u64, put_varint, skip, tag, u64_len, varint_len, walk, Value,
        LEN, VARINT,
    },
};

/// Appends field `field` as `repeated string` holding `keys` to `out`.
pub fn encode_strings(field: u32, keys: &[&str], out: &mut Vec<u8>) {
    let field_tag = tag(field, LEN);
    for k in keys {
        put_varint(field_tag, out);
        put_varint(k.len() as u64, out);
        out.extend_from_slice(k.as_bytes());
    }
}

/// Bytes `encode_strings` appends.
pub fn strings_len(field: u32, keys: &[&str]) -> usize {
    let tag_len = varint_len(tag(field, LEN));
    keys.iter()
        .map(|k| tag_len + varint_len(k.len() as u64) + k.len())
        .sum()
}

/// Every value of field `field` (a `repeated string`) in the message `body`, in order, as slices
/// of `body`; other fields are skipped. Malformed input is an error, never a panic.
pub fn decode_strings(body: &[u8], field: u32) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < body.len() {
        let key = get_varint(body, &mut at)?;
        let (num, wire) = (field_number(key)?, key & 7);
        if num == field && wire != LEN {
            return Err(format!(
                "field {field} has wire type {wire}, expected {LEN}"
            ));
        }
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

/// Appends field `field` as `uint64` (left out when zero, as prost leaves it).
pub fn encode_u64(field: u32, v: u64, out: &mut Vec<u8>) {
    put_u64(field, v, out);
}

/// Bytes `encode_u64` appends.
pub fn u64_field_len(field: u32, v: u64) -> usize {
    u64_len(field, v)
}

/// The value of field `field` (a `uint64`) in the message `body`: the last one, as prost reads
/// it, or 0 when absent. Malformed input is an error, never a panic.
pub fn decode_u64(body: &[u8], field: u32) -> Result<u64, String> {
    let mut v = 0;
    walk(body, &[(field, VARINT)], |f, value| {
        if let (true, Value::Int(x)) = (f == field, value) {
            v = x;
        }
        Ok(())
    })?;
    Ok(v)
}

/// Appends field `field` as `repeated` messages of the shape `{ string key = 1; uint64 n = 2; }`
/// (`PutStartItem` with its size, `PutRef` with its put id), from borrowed keys; zero fields
/// are left out, as prost leaves them.
pub fn encode_keyed(field: u32, items: &[(&str, u64)], out: &mut Vec<u8>) {
    let field_tag = tag(field, LEN);
    for &(k, n) in items {
        put_varint(field_tag, out);
        put_varint(keyed_item_len(k, n) as u64, out);
        if !k.is_empty() {
            put_varint(tag(keyed::KEY, LEN), out);
            put_varint(k.len() as u64, out);
            out.extend_from_slice(k.as_bytes());
        }
        if n != 0 {
            put_varint(tag(keyed::NUMBER, VARINT), out);
            put_varint(n, out);
        }
    }
}

/// Bytes `encode_keyed` appends.
pub fn keyed_len(field: u32, items: &[(&str, u64)]) -> usize {
    let tag_len = varint_len(tag(field, LEN));
    items
        .iter()
        .map(|&(k, n)| {
            let inner = keyed_item_len(k, n);
            tag_len + varint_len(inner as u64) + inner
        })
        .sum()
}

fn keyed_item_len(k: &str, n: u64) -> usize {
    let key = if k.is_empty() {
        0
    } else {
        varint_len(tag(keyed::KEY, LEN)) + varint_len(k.len() as u64) + k.len()
    };
    let num = if n == 0 {
        0
    } else {
        varint_len(tag(keyed::NUMBER, VARINT)) + varint_len(n)
    };
    key + num
}

/// Every item of field `field` (repeated `{ string key = 1; uint64 number = 2; }`) in the message
/// `body`, in order, the keys as slices of `body`. Every other length-delimited field goes to
/// `other` (field number, bytes); the rest is skipped. The fields `other` reads (`others`) must
/// be length-delimited, as `field` must. Malformed input is an error, never a panic.
pub fn decode_keyed<'a>(
    body: &'a [u8],
    field: u32,
    others: &[u32],
    mut other: impl FnMut(u32, &'a [u8]) -> Result<(), String>,
) -> Result<Vec<(&'a str, u64)>, String> {
    let mut out = Vec::new();
    let known: Vec<(u32, u64)> = std::iter::once(field)
        .chain(others.iter().copied())
        .map(|f| (f, LEN))
        .collect();
    walk(body, &known, |f, v| match v {
        Value::Bytes(b) if f == field => {
            let (mut key, mut n) = ("", 0);
            walk(b, &[(keyed::KEY, LEN), (keyed::NUMBER, VARINT)], |f, v| {
                match (f, v) {
                    (keyed::KEY, Value::Bytes(s)) => {
                        key = std::str::from_utf8(s).map_err(|_| "key is not UTF-8".to_string())?
                    }
                    (keyed::NUMBER, Value::Int(x)) => n = x,
                    _ => {}
                }
                Ok(())
            })?;
            out.push((key, n));
            Ok(())
        }
        Value::Bytes(b) => other(f, b),
        _ => Ok(()),
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master as pb;
    use proptest::prelude::*;
    use prost::Message;

    proptest! {
        #[test]
        fn matches_prost_both_ways(
            keys in proptest::collection::vec("[a-z0-9/é]{0,300}", 0..50),
            force: bool,
            epoch in prop_oneof![Just(0u64), any::<u64>()],
        ) {
            let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            let mut ours = Vec::new();
            encode_strings(1, &refs, &mut ours);
            prop_assert_eq!(ours.len(), strings_len(1, &refs));
            let theirs = pb::BatchExistsRequest { keys: keys.clone(), ..Default::default() }.encode_to_vec();
            prop_assert_eq!(&ours, &theirs);
            // Keys, releases and their epoch together, as a lookup carries them: prost reads
            // them back, and so do we.
            let mut both = ours.clone();
            encode_strings(2, &refs[..refs.len() / 2], &mut both);
            encode_u64(3, epoch, &mut both);
            prop_assert_eq!(both.len(), ours.len() + strings_len(2, &refs[..refs.len() / 2]) + u64_field_len(3, epoch));
            let read = pb::BatchGetReplicasRequest::decode(&both[..]).unwrap();
            prop_assert_eq!(&read.keys, &keys);
            prop_assert_eq!(&read.release[..], &keys[..keys.len() / 2]);
            prop_assert_eq!(read.release_epoch, epoch);
            prop_assert_eq!(decode_strings(&both, 2).unwrap(), &refs[..refs.len() / 2]);
            prop_assert_eq!(decode_u64(&both, 3).unwrap(), epoch);
            let theirs = pb::BatchExistsRequest { keys: vec![], release: keys.clone(), release_epoch: epoch }.encode_to_vec();
            prop_assert_eq!(decode_u64(&theirs, 3).unwrap(), epoch);
            // Reading skips other fields (here the bool of a remove request).
            let remove = pb::BatchRemoveRequest { keys: keys.clone(), force }.encode_to_vec();
            prop_assert_eq!(decode_strings(&remove, 1).unwrap(), refs);
        }

        #[test]
        fn keyed_items_match_prost_both_ways(
            items in proptest::collection::vec(("[a-z0-9/é]{0,300}", prop_oneof![Just(0u64), any::<u64>()]), 0..50),
            preferred in proptest::collection::vec("[a-z0-9.:]{0,20}", 0..3),
            replica_num in 0u32..4,
        ) {
            let refs: Vec<(&str, u64)> = items.iter().map(|(k, n)| (k.as_str(), *n)).collect();
            let mut ours = Vec::new();
            encode_keyed(1, &refs, &mut ours);
            prop_assert_eq!(ours.len(), keyed_len(1, &refs));
            let end = pb::BatchPutEndRequest {
                items: items.iter().map(|(key, put_id)| pb::PutRef { key: key.clone(), put_id: *put_id }).collect(),
            };
            prop_assert_eq!(&ours, &end.encode_to_vec());
            // A start request: the items, then its config handed over as another field.
            let config = pb::ReplicateConfig { replica_num, preferred_segments: preferred, soft_pin: true, hard_pin: false, upsert: true };
            let start = pb::BatchPutStartRequest {
                items: items.iter().map(|(key, size)| pb::PutStartItem { key: key.clone(), size: *size }).collect(),
                config: Some(config.clone()),
                token: (replica_num as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            };
            let mut seen = None;
            let mut others = Vec::new();
            let start = start.encode_to_vec();
            let got = decode_keyed(&start, 1, &[2], |f, b| {
                others.push(f);
                seen = Some(pb::ReplicateConfig::decode(b).map_err(|e| e.to_string())?);
                Ok(())
            }).unwrap();
            prop_assert_eq!(others, vec![2]);
            prop_assert_eq!(got, refs);
            prop_assert_eq!(seen, Some(config));
            // The token, a varint field of its own, read as the master reads it.
            prop_assert_eq!(decode_u64(&start, 3).unwrap(), (replica_num as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_strings(&bytes, 1);
            let _ = decode_keyed(&bytes, 1, &[], |_, _| Ok(()));
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
        assert!(
            decode_keyed(&[0x0a, 3, 0x0a, 1, 0xff], 1, &[], |_, _| Ok(())).is_err(),
            "key not UTF-8"
        );
        assert!(
            decode_keyed(&[0x0a, 4, 0x0a, 5], 1, &[], |_, _| Ok(())).is_err(),
            "item overruns"
        );
        // What prost refuses: a known field with another wire type, field number 0, and a
        // varint whose tenth byte carries more than the 64th bit.
        assert!(decode_strings(&[0x08, 1], 1).is_err(), "keys as a varint");
        assert!(decode_strings(&[0x02, 0], 1).is_err(), "field 0");
        let mut eleven_bits_over = vec![0x08];
        eleven_bits_over.extend([0xff; 9]);
        eleven_bits_over.push(0x02);
        assert!(
            decode_u64(&eleven_bits_over, 1).is_err(),
            "varint over 64 bits"
        );
        assert!(decode_u64(&[0x0a, 0], 1).is_err(), "a uint64 as bytes");
        assert!(
            decode_keyed(&[0x0a, 2, 0x08, 1], 1, &[], |_, _| Ok(())).is_err(),
            "a key as a varint"
        );
        assert!(
            decode_keyed(&[0x10, 1], 1, &[2], |_, _| Ok(())).is_err(),
            "a config as a varint"
        );
        assert!(
            pb::BatchPutStartRequest::decode(&[0x10, 1][..]).is_err(),
            "prost agrees"
        );
        let mut max = vec![0x08];
        max.extend([0xff; 9]);
        max.push(0x01);
        assert_eq!(decode_u64(&max, 1).unwrap(), u64::MAX);
        for bad in [&[0x08, 1][..], &[0x02, 0], &eleven_bits_over] {
            assert!(pb::BatchExistsRequest::decode(bad).is_err(), "prost agrees");
        }
    }
}
