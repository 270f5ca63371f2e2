//! The master's framed RPC: the same protobuf messages as its gRPC service, carried over a plain
//! TCP connection without HTTP/2 (no flow-control windows, no per-call stream setup), on the
//! same port. A connection starts with an 8-byte hello; then each request frame gets one
//! response frame with the same id. The hot calls' messages are written and read by the
//! borrowed codecs in `keys` and `replicas`, byte for byte what prost writes and reads.
//!
//! ```text
//! hello    : b"MCRP" | u32 version                     (both directions)
//! request  : u32 body length | u32 method | u64 id | body (protobuf request)
//! response : u32 body length | i32 status | u64 id | body (protobuf response, or an error text)
//! ```

pub mod fields;
pub mod keys;
mod pb;
pub mod replicas;

pub const MAGIC: [u8; 4] = *b"MCRP";
pub const VERSION: u32 = 1;
pub const HELLO_LEN: usize = 8;
pub const HEADER_LEN: usize = 16;
/// Largest body either side accepts (a batch of a million keys fits).
pub const MAX_BODY: usize = 256 << 20;

/// Response statuses (the body is an error text for the non-zero ones).
pub const STATUS_OK: i32 = 0;
pub const STATUS_BAD_REQUEST: i32 = 1;
pub const STATUS_INTERNAL: i32 = 2;
/// This master may not answer (not the elected leader): ask etcd for the leader and retry there.
pub const STATUS_UNAVAILABLE: i32 = 3;
/// The connection did not authenticate where the master requires it (see
/// `mooncake_common::auth`); the body says what to configure. The master closes it after this.
pub const STATUS_UNAUTHENTICATED: i32 = 4;
/// The connection's credential does not allow the call (`UseTenant` of another tenant, an
/// owner's call from a tenant's worker).
pub const STATUS_DENIED: i32 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Method {
    MountSegment = 1,
    UnmountSegment = 2,
    Heartbeat = 3,
    BatchPutStart = 4,
    BatchPutEnd = 5,
    BatchPutRevoke = 6,
    BatchGetReplicas = 7,
    BatchExists = 8,
    BatchRemove = 9,
    RemoveAll = 10,
    ListSegments = 11,
    CreateReplicaTask = 12,
    QueryTask = 13,
    BatchReplicaClear = 14,
    BatchReleaseLeases = 15,
    /// Body: a tenant's name (UTF-8). The connection's later calls act in that tenant (see
    /// `mooncake_common::tenant`); answered with an empty body, or `STATUS_DENIED` /
    /// `STATUS_BAD_REQUEST` and why.
    UseTenant = 16,
    AbandonPutStart = 17,
}

impl Method {
    pub fn from_u32(v: u32) -> Option<Method> {
        use Method::*;
        Some(match v {
            1 => MountSegment,
            2 => UnmountSegment,
            3 => Heartbeat,
            4 => BatchPutStart,
            5 => BatchPutEnd,
            6 => BatchPutRevoke,
            7 => BatchGetReplicas,
            8 => BatchExists,
            9 => BatchRemove,
            10 => RemoveAll,
            11 => ListSegments,
            12 => CreateReplicaTask,
            13 => QueryTask,
            14 => BatchReplicaClear,
            15 => BatchReleaseLeases,
            16 => UseTenant,
            17 => AbandonPutStart,
            _ => return None,
        })
    }
}

pub fn hello() -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..].copy_from_slice(&VERSION.to_le_bytes());
    b
}

/// Checks a peer's hello; the error says what is wrong.
pub fn check_hello(b: &[u8; HELLO_LEN]) -> Result<(), String> {
    if b[..4] != MAGIC {
        return Err("the peer does not speak the framed master RPC".into());
    }
    let v = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    if v != VERSION {
        return Err(format!(
            "framed master RPC version {v} is not supported (this build speaks {VERSION})"
        ));
    }
    Ok(())
}

/// A frame header: (body length, method or status, id).
pub fn encode_header(len: usize, word: u32, id: u64) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[..4].copy_from_slice(&(len as u32).to_le_bytes());
    b[4..8].copy_from_slice(&word.to_le_bytes());
    b[8..].copy_from_slice(&id.to_le_bytes());
    b
}

pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<(usize, u32, u64), String> {
    let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    if len > MAX_BODY {
        return Err(format!(
            "frame body of {len} bytes exceeds the limit of {MAX_BODY}"
        ));
    }
    let word = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let id = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    Ok((len, word, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_hello() {
        let h = encode_header(1234, Method::BatchExists as u32, 99);
        assert_eq!(decode_header(&h).unwrap(), (1234, 8, 99));
        assert!(decode_header(&encode_header(MAX_BODY + 1, 1, 1)).is_err());
        check_hello(&hello()).unwrap();
        let mut bad = hello();
        bad[4] = 7;
        assert!(check_hello(&bad).unwrap_err().contains("version 7"));
        assert!(check_hello(b"PRI * HT").is_err());
        for m in 1..=17 {
            assert_eq!(Method::from_u32(m).unwrap() as u32, m);
        }
        assert!(Method::from_u32(18).is_none());
    }
}
