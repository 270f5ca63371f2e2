//! The data plane's wire format: fixed-size little-endian headers with a magic, a version byte and
//! bounded lengths. A request header is followed by the key and, for a write, the payload; a
//! response header is followed by the payload of a read or by an error message. Only headers are
//! encoded here: payloads move straight between sockets and the owner's pool or the caller's buffer.
//!
//! ```text
//! request  (64 B): magic u16 | version u8 | op u8 | key_len u16 | flags u16 | request_id u64 | offset u64 | length u64 | grant u64 | seal [24]
//! response (24 B): magic u16 | version u8 | op u8 | status i32 | request_id u64 | length u64
//! ```
//!
//! `grant` is the put id the access belongs to: a write's own (the owner fences a write whose
//! grant is older than one it already saw for the range), the version a read or a disk read must
//! find. A write's `flags` carry the rest of its `Stamp` (replica count and pins). `seal` is the
//! master's seal on the grant or lease (see `auth::seal`), all zero in a cluster without a secret.
//! A transfer engine's `PeerWrite`, `PeerRead` and `PeerGrant` carry the target's incarnation
//! there instead (the random number it drew at start, learnt from `PeerHello`): a target that
//! restarted refuses requests meant for its predecessor (`SegmentNotFound`), and one naming no
//! incarnation (0: an engine of an older release) with `InvalidParams`. A `PeerGrant` with
//! `PEER_GRANT_FILES` in its `flags` asks the target to say where each granted range lies in a
//! memory file (see the engine's `local::Grant`); without it, the answer is the target's pid.

use crate::{auth::Seal, ids::MAX_KEY_LEN, Code};

pub const MAGIC: u16 = 0x4D43; // "MC"
pub const VERSION: u8 = 3;
pub const REQUEST_HEADER_LEN: usize = 64;
pub const RESPONSE_HEADER_LEN: usize = 24;
/// `PeerGrant` flag: the caller maps memory files, and wants to know where the ranges lie.
pub const PEER_GRANT_FILES: u16 = 1;
/// Longest error message an owner sends back; longer ones are truncated by the sender.
pub const MAX_ERROR_MESSAGE: u64 = 1024;
/// Absolute sanity bound on one payload; owners also check every range against their segment.
pub const MAX_PAYLOAD: u64 = 1 << 40;
/// A payload remainder at least this large is received straight into its destination rather than
/// through a connection's read buffer: one more receive call costs less than copying it twice.
pub const DIRECT_RECEIVE: usize = 16 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Store `length` payload bytes at `offset`, recording that the range holds `key`.
    Write = 1,
    /// Return `length` bytes at `offset`, which must hold `key`.
    Read = 2,
    /// Liveness probe; no key, no payload.
    Ping = 3,
    /// Return the `length`-byte value of `key` from the owner's SSD tier; `grant` carries the
    /// object's version (put id), which the record on disk must match.
    ReadDisk = 4,
    /// Transfer engine: store `length` payload bytes at address `offset` of the target's memory,
    /// which must lie in a region the target registered. The key names the target
    /// (`host:port`), so a connection that reached another process is refused.
    PeerWrite = 5,
    /// Transfer engine: return `length` bytes at address `offset` of a registered region.
    PeerRead = 6,
    /// Transfer engine: return the target's registered regions, (address u64, length u64) each.
    PeerRegions = 7,
    /// Transfer engine: who the target is, as payload: its pid (u64), its incarnation (u64), and
    /// its host identity (boot id and pid namespace, for the same-host path).
    PeerHello = 8,
    /// Transfer engine, same-host path: the payload lists (address u64, length u64) ranges the
    /// caller is about to copy with `process_vm_readv`/`writev`; the target checks them against
    /// its regions and holds them until `PeerRelease` (or the connection closes), answering with
    /// its pid (u64), the process the caller must copy with.
    PeerGrant = 9,
    /// Transfer engine, same-host path: the copies of the last `PeerGrant` are done.
    PeerRelease = 10,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        match v {
            1 => Some(Op::Write),
            2 => Some(Op::Read),
            3 => Some(Op::Ping),
            4 => Some(Op::ReadDisk),
            5 => Some(Op::PeerWrite),
            6 => Some(Op::PeerRead),
            7 => Some(Op::PeerRegions),
            8 => Some(Op::PeerHello),
            9 => Some(Op::PeerGrant),
            10 => Some(Op::PeerRelease),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:#06x}: the peer is not speaking the mooncake data-plane protocol")]
    BadMagic(u16),
    #[error(
        "unsupported protocol version {0} (this build speaks {VERSION}): upgrade the older side"
    )]
    UnsupportedVersion(u8),
    #[error("unknown opcode {0}")]
    UnknownOp(u8),
    #[error("key length {0} is out of range 1..={MAX_KEY_LEN}")]
    BadKeyLength(u16),
    #[error("payload length {0} exceeds the limit of {MAX_PAYLOAD}")]
    PayloadTooLarge(u64),
    #[error("error message length {0} exceeds the limit of {MAX_ERROR_MESSAGE}")]
    MessageTooLarge(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: Op,
    pub key_len: u16,
    pub flags: u16,
    pub request_id: u64,
    pub offset: u64,
    pub length: u64,
    pub grant: u64,
    pub seal: Seal,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.op as u8;
        b[4..6].copy_from_slice(&self.key_len.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.length.to_le_bytes());
        b[32..40].copy_from_slice(&self.grant.to_le_bytes());
        b[40..64].copy_from_slice(self.seal.as_bytes());
        b
    }

    /// Validates everything that can be checked without knowing the segment.
    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, FrameError> {
        check_preamble(b)?;
        let op = Op::from_u8(b[3]).ok_or(FrameError::UnknownOp(b[3]))?;
        let key_len = u16::from_le_bytes([b[4], b[5]]);
        let length = u64_at(b, 24);
        let needs_key = op != Op::Ping;
        if (needs_key && (key_len == 0 || key_len as usize > MAX_KEY_LEN))
            || (!needs_key && key_len != 0)
        {
            return Err(FrameError::BadKeyLength(key_len));
        }
        if length > MAX_PAYLOAD {
            return Err(FrameError::PayloadTooLarge(length));
        }
        Ok(RequestHeader {
            op,
            key_len,
            flags: u16::from_le_bytes([b[6], b[7]]),
            request_id: u64_at(b, 8),
            offset: u64_at(b, 16),
            length,
            grant: u64_at(b, 32),
            seal: Seal::from_bytes(&b[40..64]).expect("24 bytes"),
        })
    }

    /// Bytes that follow this header on the wire.
    pub fn body_len(&self) -> u64 {
        self.key_len as u64 + if self.op == Op::Write { self.length } else { 0 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub op: Op,
    /// A `Code` value; 0 means the payload (for a read) follows, otherwise an error message does.
    pub status: i32,
    pub request_id: u64,
    pub length: u64,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut b = [0u8; RESPONSE_HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.op as u8;
        b[4..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, FrameError> {
        check_preamble(b)?;
        let op = Op::from_u8(b[3]).ok_or(FrameError::UnknownOp(b[3]))?;
        let status = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let length = u64_at(b, 16);
        if status != 0 && length > MAX_ERROR_MESSAGE {
            return Err(FrameError::MessageTooLarge(length));
        }
        if length > MAX_PAYLOAD {
            return Err(FrameError::PayloadTooLarge(length));
        }
        Ok(ResponseHeader {
            op,
            status,
            request_id: u64_at(b, 8),
            length,
        })
    }

    pub fn code(&self) -> Code {
        Code::from_i32(self.status)
    }
}

fn check_preamble(b: &[u8]) -> Result<(), FrameError> {
    let magic = u16::from_le_bytes([b[0], b[1]]);
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if b[2] != VERSION {
        return Err(FrameError::UnsupportedVersion(b[2]));
    }
    Ok(())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Write),
            Just(Op::Read),
            Just(Op::Ping),
            Just(Op::ReadDisk)
        ]
    }

    proptest! {
        #[test]
        fn request_round_trips(op in op(), key_len in 1u16..=MAX_KEY_LEN as u16, flags: u16,
                               request_id: u64, offset: u64, length in 0..=MAX_PAYLOAD, grant: u64,
                               expiry_us: u64, tag: [u8; 16]) {
            let key_len = if op == Op::Ping { 0 } else { key_len };
            let seal = Seal::new(expiry_us, tag);
            let h = RequestHeader { op, key_len, flags, request_id, offset, length, grant, seal };
            prop_assert_eq!(RequestHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn response_round_trips(op in op(), ok: bool, request_id: u64, length in 0..=MAX_ERROR_MESSAGE) {
            let h = ResponseHeader { op, status: if ok { 0 } else { -704 }, request_id, length };
            prop_assert_eq!(ResponseHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), REQUEST_HEADER_LEN)) {
            let mut b = [0u8; REQUEST_HEADER_LEN];
            b.copy_from_slice(&bytes);
            let _ = RequestHeader::decode(&b);
            let mut r = [0u8; RESPONSE_HEADER_LEN];
            r.copy_from_slice(&bytes[..RESPONSE_HEADER_LEN]);
            let _ = ResponseHeader::decode(&r);
        }
    }

    #[test]
    fn rejects_malformed_headers() {
        let good = RequestHeader {
            op: Op::Read,
            key_len: 3,
            flags: 0,
            request_id: 1,
            offset: 0,
            length: 10,
            grant: 7,
            seal: Seal::default(),
        };
        let mut b = good.encode();
        b[0] = 0;
        assert!(matches!(
            RequestHeader::decode(&b),
            Err(FrameError::BadMagic(_))
        ));
        let mut b = good.encode();
        b[2] = 9;
        assert_eq!(
            RequestHeader::decode(&b),
            Err(FrameError::UnsupportedVersion(9))
        );
        let mut b = good.encode();
        b[3] = 77;
        assert_eq!(RequestHeader::decode(&b), Err(FrameError::UnknownOp(77)));
        let b = RequestHeader { key_len: 0, ..good }.encode();
        assert_eq!(RequestHeader::decode(&b), Err(FrameError::BadKeyLength(0)));
        let b = RequestHeader {
            length: MAX_PAYLOAD + 1,
            ..good
        }
        .encode();
        assert_eq!(
            RequestHeader::decode(&b),
            Err(FrameError::PayloadTooLarge(MAX_PAYLOAD + 1))
        );
        let r = ResponseHeader {
            op: Op::Read,
            status: -1,
            request_id: 0,
            length: MAX_ERROR_MESSAGE + 1,
        };
        assert!(ResponseHeader::decode(&r.encode()).is_err());
    }
}
