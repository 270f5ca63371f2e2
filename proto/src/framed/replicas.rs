//! `BatchGetReplicasResponse` and `BatchPutStartResponse` written and read without message
//! structs and a `String` per replica: the master encodes straight from its state, the client
//! reads replica locations as slices of the answer. A get of 64 small values otherwise spends more on these allocations than
//! on the lookups. The bytes are exactly prost's for the generated types (zero fields omitted,
//! negative codes as ten-byte varints), so either side may use those instead.

use std::ops::Range;

use super::{
    fields::{
        get_replicas_response as response, get_replicas_result as result, put_start_response,
        put_start_result as started, replica_location as loc,
    },
    pb::{put_u64, put_varint, tag, u64_len, varint_len, walk, Value, LEN, VARINT},
};

/// One replica's location, its segment borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaRef<'a> {
    pub segment: &'a str,
    pub offset: u64,
    pub size: u64,
    /// `ReplicaTier` as its number.
    pub tier: i32,
    pub put_id: u64,
    /// The master's seal, as it travels (empty: none).
    pub seal: &'a [u8],
}

/// One key's answer: its replicas are `replicas[range]` of the decoded response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub code: i32,
    pub size: u64,
    pub replicas: Range<usize>,
}

#[derive(Debug, Default)]
pub struct Decoded<'a> {
    pub results: Vec<Found>,
    pub replicas: Vec<ReplicaRef<'a>>,
    pub lease_ttl_ms: u64,
    pub epoch: u64,
}

/// Builds a response one result at a time.
#[derive(Default)]
pub struct Encoder {
    out: Vec<u8>,
}

/// Bytes of a non-empty string field (empty ones are left out, as prost leaves them).
#[inline]
fn str_len(field: u32, s: &str) -> usize {
    bytes_len(field, s.as_bytes())
}

#[inline]
fn put_str(field: u32, s: &str, out: &mut Vec<u8>) {
    put_bytes(field, s.as_bytes(), out)
}

#[inline]
fn bytes_len(field: u32, b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        varint_len(tag(field, LEN)) + varint_len(b.len() as u64) + b.len()
    }
}

#[inline]
fn put_bytes(field: u32, b: &[u8], out: &mut Vec<u8>) {
    if !b.is_empty() {
        put_varint(tag(field, LEN), out);
        put_varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }
}

/// int32 goes on the wire sign-extended to 64 bits.
fn i32_wire(v: i32) -> u64 {
    i64::from(v) as u64
}

fn replica_len(r: &ReplicaRef<'_>) -> usize {
    str_len(loc::SEGMENT, r.segment)
        + u64_len(loc::OFFSET, r.offset)
        + u64_len(loc::SIZE, r.size)
        + u64_len(loc::TIER, i32_wire(r.tier))
        + u64_len(loc::PUT_ID, r.put_id)
        + bytes_len(loc::SEAL, r.seal)
}

/// Bytes `put_replica` writes for every replica of `replicas` as field `field`.
fn replicas_len<'r>(field: u32, replicas: impl Iterator<Item = ReplicaRef<'r>>) -> usize {
    let tag_len = varint_len(tag(field, LEN));
    replicas
        .map(|r| {
            let n = replica_len(&r);
            tag_len + varint_len(n as u64) + n
        })
        .sum()
}

/// A `ReplicaLocation` as field `field` of the enclosing message.
fn put_replica(field: u32, r: &ReplicaRef<'_>, out: &mut Vec<u8>) {
    put_varint(tag(field, LEN), out);
    put_varint(replica_len(r) as u64, out);
    put_str(loc::SEGMENT, r.segment, out);
    put_u64(loc::OFFSET, r.offset, out);
    put_u64(loc::SIZE, r.size, out);
    put_u64(loc::TIER, i32_wire(r.tier), out);
    put_u64(loc::PUT_ID, r.put_id, out);
    put_bytes(loc::SEAL, r.seal, out);
}

impl Encoder {
    pub fn with_capacity(bytes: usize) -> Self {
        Encoder {
            out: Vec::with_capacity(bytes),
        }
    }

    /// Appends one key's result.
    pub fn result<'r, I>(&mut self, code: i32, size: u64, replicas: I)
    where
        I: IntoIterator<Item = ReplicaRef<'r>>,
        I::IntoIter: Clone,
    {
        let replicas = replicas.into_iter();
        let lens = replicas_len(result::REPLICAS, replicas.clone());
        let body = u64_len(result::CODE, i32_wire(code)) + u64_len(result::SIZE, size) + lens;
        let out = &mut self.out;
        put_varint(tag(response::RESULTS, LEN), out);
        put_varint(body as u64, out);
        put_u64(result::CODE, i32_wire(code), out);
        put_u64(result::SIZE, size, out);
        for r in replicas {
            put_replica(result::REPLICAS, &r, out);
        }
    }

    /// Appends one put's start (a `PutStartResult`, field 1 of `BatchPutStartResponse`).
    pub fn put_start_result<'r, I>(&mut self, code: i32, message: &str, put_id: u64, replicas: I)
    where
        I: IntoIterator<Item = ReplicaRef<'r>>,
        I::IntoIter: Clone,
    {
        let replicas = replicas.into_iter();
        let body = u64_len(started::CODE, i32_wire(code))
            + str_len(started::MESSAGE, message)
            + u64_len(started::PUT_ID, put_id)
            + replicas_len(started::REPLICAS, replicas.clone());
        let out = &mut self.out;
        put_varint(tag(put_start_response::RESULTS, LEN), out);
        put_varint(body as u64, out);
        put_u64(started::CODE, i32_wire(code), out);
        put_str(started::MESSAGE, message, out);
        put_u64(started::PUT_ID, put_id, out);
        for r in replicas {
            put_replica(started::REPLICAS, &r, out);
        }
    }

    /// The encoded `BatchGetReplicasResponse`, with the lease every hit got and the answering
    /// master's epoch.
    pub fn finish(mut self, lease_ttl_ms: u64, epoch: u64) -> Vec<u8> {
        put_u64(response::LEASE_TTL_MS, lease_ttl_ms, &mut self.out);
        put_u64(response::EPOCH, epoch, &mut self.out);
        self.out
    }

    /// The encoded `BatchPutStartResponse`.
    pub fn finish_put_start(self) -> Vec<u8> {
        self.out
    }
}

/// Reads a response; unknown fields are skipped, malformed input is an error (never a panic).
pub fn decode(body: &[u8]) -> Result<Decoded<'_>, String> {
    let mut d = Decoded::default();
    let known = [
        (response::RESULTS, LEN),
        (response::LEASE_TTL_MS, VARINT),
        (response::EPOCH, VARINT),
    ];
    walk(body, &known, |field, value| {
        match (field, value) {
            (response::RESULTS, Value::Bytes(b)) => {
                let start = d.replicas.len();
                let mut found = Found {
                    code: 0,
                    size: 0,
                    replicas: start..start,
                };
                let known = [
                    (result::CODE, VARINT),
                    (result::SIZE, VARINT),
                    (result::REPLICAS, LEN),
                ];
                walk(b, &known, |f, v| {
                    match (f, v) {
                        (result::CODE, Value::Int(c)) => found.code = c as i32,
                        (result::SIZE, Value::Int(s)) => found.size = s,
                        (result::REPLICAS, Value::Bytes(r)) => d.replicas.push(replica(r)?),
                        _ => {}
                    }
                    Ok(())
                })?;
                found.replicas = start..d.replicas.len();
                d.results.push(found);
            }
            (response::LEASE_TTL_MS, Value::Int(ttl)) => d.lease_ttl_ms = ttl,
            (response::EPOCH, Value::Int(epoch)) => d.epoch = epoch,
            _ => {}
        }
        Ok(())
    })?;
    Ok(d)
}

/// One put's start as read from a `BatchPutStartResponse`; its replicas are
/// `replicas[range]` of the decoded answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started<'a> {
    pub code: i32,
    pub message: &'a str,
    pub put_id: u64,
    pub replicas: Range<usize>,
}

/// Reads a `BatchPutStartResponse`: the starts, and every replica they name.
#[allow(clippy::type_complexity)]
pub fn decode_put_start(body: &[u8]) -> Result<(Vec<Started<'_>>, Vec<ReplicaRef<'_>>), String> {
    let (mut starts, mut replicas) = (Vec::new(), Vec::new());
    walk(
        body,
        &[(put_start_response::RESULTS, LEN)],
        |field, value| {
            if let (put_start_response::RESULTS, Value::Bytes(b)) = (field, value) {
                let start = replicas.len();
                let mut st = Started {
                    code: 0,
                    message: "",
                    put_id: 0,
                    replicas: start..start,
                };
                let known = [
                    (started::CODE, VARINT),
                    (started::MESSAGE, LEN),
                    (started::PUT_ID, VARINT),
                    (started::REPLICAS, LEN),
                ];
                walk(b, &known, |f, v| {
                    match (f, v) {
                        (started::CODE, Value::Int(c)) => st.code = c as i32,
                        (started::MESSAGE, Value::Bytes(m)) => {
                            st.message = std::str::from_utf8(m)
                                .map_err(|_| "message is not UTF-8".to_string())?
                        }
                        (started::PUT_ID, Value::Int(id)) => st.put_id = id,
                        (started::REPLICAS, Value::Bytes(r)) => replicas.push(replica(r)?),
                        _ => {}
                    }
                    Ok(())
                })?;
                st.replicas = start..replicas.len();
                starts.push(st);
            }
            Ok(())
        },
    )?;
    Ok((starts, replicas))
}

fn replica(body: &[u8]) -> Result<ReplicaRef<'_>, String> {
    let mut r = ReplicaRef {
        segment: "",
        offset: 0,
        size: 0,
        tier: 0,
        put_id: 0,
        seal: &[],
    };
    let known = [
        (loc::SEGMENT, LEN),
        (loc::OFFSET, VARINT),
        (loc::SIZE, VARINT),
        (loc::TIER, VARINT),
        (loc::PUT_ID, VARINT),
        (loc::SEAL, LEN),
    ];
    walk(body, &known, |f, v| {
        match (f, v) {
            (loc::SEGMENT, Value::Bytes(s)) => {
                r.segment =
                    std::str::from_utf8(s).map_err(|_| "segment is not UTF-8".to_string())?
            }
            (loc::OFFSET, Value::Int(x)) => r.offset = x,
            (loc::SIZE, Value::Int(x)) => r.size = x,
            (loc::TIER, Value::Int(x)) => r.tier = x as i32,
            (loc::PUT_ID, Value::Int(x)) => r.put_id = x,
            (loc::SEAL, Value::Bytes(b)) => r.seal = b,
            _ => {}
        }
        Ok(())
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master as pb;
    use proptest::prelude::*;
    use prost::Message;

    fn replica_strategy() -> impl Strategy<Value = pb::ReplicaLocation> {
        (
            "[a-z0-9.:\\[\\]]{0,40}",
            any::<u64>(),
            any::<u64>(),
            0i32..3,
            any::<u64>(),
            prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 24)],
        )
            .prop_map(
                |(segment, offset, size, tier, put_id, seal)| pb::ReplicaLocation {
                    segment,
                    offset,
                    size,
                    tier,
                    put_id,
                    seal,
                },
            )
    }

    fn result_strategy() -> impl Strategy<Value = pb::GetReplicasResult> {
        (
            prop_oneof![Just(0i32), -1000i32..0, any::<i32>()],
            any::<u64>(),
            proptest::collection::vec(replica_strategy(), 0..4),
        )
            .prop_map(|(code, size, replicas)| pb::GetReplicasResult {
                code,
                size,
                replicas,
            })
    }

    proptest! {
        #[test]
        fn matches_prost_both_ways(
            results in proptest::collection::vec(result_strategy(), 0..20),
            lease_ttl_ms: u64,
            epoch: u64,
        ) {
            let theirs = pb::BatchGetReplicasResponse { results: results.clone(), lease_ttl_ms, epoch };
            let mut enc = Encoder::default();
            for r in &results {
                let refs: Vec<ReplicaRef<'_>> = r.replicas.iter().map(|l| ReplicaRef {
                    segment: &l.segment,
                    offset: l.offset,
                    size: l.size,
                    tier: l.tier,
                    put_id: l.put_id,
                    seal: &l.seal,
                }).collect();
                enc.result(r.code, r.size, refs.iter().copied());
            }
            let ours = enc.finish(lease_ttl_ms, epoch);
            prop_assert_eq!(&ours, &theirs.encode_to_vec());
            let d = decode(&ours).unwrap();
            prop_assert_eq!(d.lease_ttl_ms, lease_ttl_ms);
            prop_assert_eq!(d.epoch, epoch);
            prop_assert_eq!(d.results.len(), results.len());
            for (f, r) in d.results.iter().zip(&results) {
                prop_assert_eq!(f.code, r.code);
                prop_assert_eq!(f.size, r.size);
                let got = &d.replicas[f.replicas.clone()];
                prop_assert_eq!(got.len(), r.replicas.len());
                for (g, l) in got.iter().zip(&r.replicas) {
                    prop_assert_eq!(g.segment, l.segment.as_str());
                    prop_assert_eq!((g.offset, g.size, g.tier, g.put_id), (l.offset, l.size, l.tier, l.put_id));
                    prop_assert_eq!(g.seal, l.seal.as_slice());
                }
            }
        }

        #[test]
        fn put_starts_match_prost_both_ways(
            starts in proptest::collection::vec(
                (any::<i32>(), "[a-z é]{0,30}", any::<u64>(), proptest::collection::vec(replica_strategy(), 0..3)),
                0..20,
            ),
        ) {
            let results: Vec<pb::PutStartResult> = starts
                .into_iter()
                .map(|(code, message, put_id, replicas)| pb::PutStartResult { code, message, put_id, replicas })
                .collect();
            let theirs = pb::BatchPutStartResponse { results: results.clone() };
            let mut enc = Encoder::default();
            for r in &results {
                enc.put_start_result(r.code, &r.message, r.put_id, r.replicas.iter().map(|l| ReplicaRef {
                    segment: &l.segment,
                    offset: l.offset,
                    size: l.size,
                    tier: l.tier,
                    put_id: l.put_id,
                    seal: &l.seal,
                }));
            }
            let ours = enc.finish_put_start();
            prop_assert_eq!(&ours, &theirs.encode_to_vec());
            let (got, reps) = decode_put_start(&ours).unwrap();
            prop_assert_eq!(got.len(), results.len());
            for (g, r) in got.iter().zip(&results) {
                prop_assert_eq!((g.code, g.message, g.put_id), (r.code, r.message.as_str(), r.put_id));
                let rs = &reps[g.replicas.clone()];
                prop_assert_eq!(rs.len(), r.replicas.len());
                for (a, b) in rs.iter().zip(&r.replicas) {
                    prop_assert_eq!(a.segment, b.segment.as_str());
                    prop_assert_eq!((a.offset, a.size, a.tier, a.put_id), (b.offset, b.size, b.tier, b.put_id));
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&bytes);
            let _ = decode_put_start(&bytes);
        }
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert!(decode(&[0x0a, 5, 0x08]).is_err(), "truncated result");
        assert!(decode(&[0x0a, 3, 0x1a, 1, 0x0b]).is_err(), "bad replica");
        assert!(
            decode(&[0x0a, 4, 0x1a, 2, 0x0a, 0xff]).is_err(),
            "truncated segment"
        );
        // A known field with another wire type, as prost refuses it.
        assert!(decode(&[0x0a, 2, 0x1a, 0]).is_ok(), "an empty replica");
        assert!(decode(&[0x0a, 2, 0x18, 1]).is_err(), "replicas as a varint");
        assert!(decode(&[0x0a, 2, 0x08, 1]).is_ok(), "code as a varint");
        assert!(decode(&[0x0a, 2, 0x0a, 0]).is_err(), "code as bytes");
        assert!(
            decode(&[0x0a, 4, 0x1a, 2, 0x08, 1]).is_err(),
            "segment as a varint"
        );
        assert!(
            decode(&[0x10, 0x01]).is_ok() && decode(&[0x12, 0]).is_err(),
            "lease TTL"
        );
        assert!(decode_put_start(&[0x08, 1]).is_err(), "results as a varint");
        assert!(
            decode_put_start(&[0x0a, 2, 0x12, 0]).is_ok(),
            "empty message"
        );
        assert!(
            decode_put_start(&[0x0a, 2, 0x10, 1]).is_err(),
            "message as a varint"
        );
        for bad in [&[0x0a, 2, 0x18, 1][..], &[0x0a, 4, 0x1a, 2, 0x08, 1]] {
            assert!(
                pb::BatchGetReplicasResponse::decode(bad).is_err(),
                "prost agrees"
            );
        }
    }
}
