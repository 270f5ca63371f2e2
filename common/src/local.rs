//! The same-host path's control protocol. An owner listens on a Unix-domain socket next to its
//! TCP endpoint; a local client says hello with the segment it wants and receives the pool's
//! memfd (SCM_RIGHTS), so it copies bytes itself. Every copy is bracketed by a begin/end exchange
//! in which the owner takes and releases range locks and keeps its key index exact, so the
//! same-host path gives the same guarantees as TCP (no read of a range being written, no read of
//! a range that does not hold the key). Only processes allowed to open the socket file can map
//! the pool.
//!
//! ```text
//! frame:  u32 body length | u8 op | body
//! Hello      (c->o) u8 version | segment name reply: i32 status | u64 pool size  (+ memfd)
//! BeginWrite (c->o) u32 n | n x item          reply: u32 n | n x i32 status
//! EndWrite   (c->o) u32 n | n x (u64 offset, u64 len, u8 commit)   reply: as BeginWrite
//! BeginRead  (c->o) u32 n | n x item          reply: as BeginWrite
//! EndRead    (c->o) u32 n | n x (u64 offset, u64 len)              no reply
//! item: u64 offset | u64 len | u64 grant | u16 flags | seal [24] | u16 key length | key
//! ```
//!
//! An item's grant, flags and seal mean what they mean in a TCP request header (`wire`): a write's
//! stamp, or the version a read must find.

use std::path::{Path, PathBuf};

use crate::{
    auth::{Seal, SEAL_LEN},
    ids::MAX_KEY_LEN,
    SegmentName,
};

/// Environment variable naming the directory of owners' sockets (both sides must agree).
pub const SOCKET_DIR_ENV: &str = "MOONCAKE_SOCKET_DIR";
/// Setting it to "0" in a client turns the same-host path off.
pub const SHM_ENV: &str = "MOONCAKE_SHM";
pub const DEFAULT_SOCKET_DIR: &str = "/tmp";
/// The protocol's version, the first byte of a hello; an owner refuses another.
pub const VERSION: u8 = 3;
/// Largest control frame; a batch of thousands of keys fits many times over.
pub const MAX_FRAME: usize = 64 << 20;
pub const MAX_ITEMS: usize = 1 << 20;
/// Bytes an item takes in a begin frame besides its key: offset, length, grant, flags, seal,
/// key length.
const ITEM_FIXED: usize = 3 * 8 + 2 + SEAL_LEN + 2;

/// A batch of items with keys of these lengths, split in order into runs that each fit one
/// begin frame with room to spare (half the owner's limits on bytes and on items): a batch of
/// any size goes through as several exchanges instead of one the owner refuses.
pub fn exchanges(key_lens: impl IntoIterator<Item = usize>) -> Vec<std::ops::Range<usize>> {
    runs_within(key_lens, MAX_FRAME / 2, MAX_ITEMS / 2)
}

fn runs_within(
    key_lens: impl IntoIterator<Item = usize>,
    max_bytes: usize,
    max_items: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    let mut end = 0;
    for (i, key_len) in key_lens.into_iter().enumerate() {
        let size = ITEM_FIXED + key_len;
        if i > start && (bytes + size > max_bytes || i - start == max_items) {
            runs.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
        end = i + 1;
    }
    if end > start {
        runs.push(start..end);
    }
    runs
}

/// Where the owner of `segment` listens for local clients.
pub fn socket_path(dir: &Path, segment: &SegmentName) -> PathBuf {
    let name: String = segment
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("mooncake-{name}.sock"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum LocalOp {
    Hello = 1,
    BeginWrite = 2,
    EndWrite = 3,
    BeginRead = 4,
    EndRead = 5,
}

impl LocalOp {
    pub fn from_u8(v: u8) -> Option<LocalOp> {
        Some(match v {
            1 => LocalOp::Hello,
            2 => LocalOp::BeginWrite,
            3 => LocalOp::EndWrite,
            4 => LocalOp::BeginRead,
            5 => LocalOp::EndRead,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed same-host control frame: {0}")]
pub struct LocalFrameError(pub &'static str);

/// Builds one frame; `finish` patches the length prefix.
/// One range of a begin: where, how long, under which grant, and the key (a `&str` when
/// written, the raw bytes when read back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item<K> {
    pub offset: u64,
    pub len: u64,
    pub grant: u64,
    pub flags: u16,
    /// The master's seal on the access (see `auth::seal`).
    pub seal: Seal,
    pub key: K,
}

pub struct FrameWriter {
    buf: Vec<u8>,
}

impl FrameWriter {
    pub fn new(op: LocalOp) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&[0, 0, 0, 0, op as u8]);
        FrameWriter { buf }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }

    /// An item: offset, length and key.
    pub fn item(&mut self, item: Item<&str>) -> &mut Self {
        let key = item.key;
        self.u64(item.offset).u64(item.len).u64(item.grant);
        self.buf.extend_from_slice(&item.flags.to_le_bytes());
        self.buf.extend_from_slice(item.seal.as_bytes());
        self.buf
            .extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.bytes(key.as_bytes())
    }

    pub fn finish(mut self) -> Vec<u8> {
        let body = (self.buf.len() - 4) as u32;
        self.buf[..4].copy_from_slice(&body.to_le_bytes());
        self.buf
    }
}

/// Reads the body of one frame (after its length prefix and op).
pub struct FrameReader<'a> {
    buf: &'a [u8],
}

impl<'a> FrameReader<'a> {
    pub fn new(body: &'a [u8]) -> Self {
        FrameReader { buf: body }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], LocalFrameError> {
        if self.buf.len() < n {
            return Err(LocalFrameError("truncated"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, LocalFrameError> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, LocalFrameError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub fn i32(&mut self) -> Result<i32, LocalFrameError> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub fn u64(&mut self) -> Result<u64, LocalFrameError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A count of items, bounded.
    pub fn count(&mut self) -> Result<usize, LocalFrameError> {
        let n = self.u32()? as usize;
        if n > MAX_ITEMS {
            return Err(LocalFrameError("too many items"));
        }
        Ok(n)
    }

    /// (offset, len, key bytes).
    pub fn item(&mut self) -> Result<Item<&'a [u8]>, LocalFrameError> {
        let offset = self.u64()?;
        let len = self.u64()?;
        let grant = self.u64()?;
        let flags = self.u16()?;
        let seal = Seal::from_bytes(self.take(SEAL_LEN)?).expect("24 bytes");
        let klen = self.u16()? as usize;
        if klen == 0 || klen > MAX_KEY_LEN {
            return Err(LocalFrameError("bad key length"));
        }
        Ok(Item {
            offset,
            len,
            grant,
            flags,
            seal,
            key: self.take(klen)?,
        })
    }

    fn u16(&mut self) -> Result<u16, LocalFrameError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Splits a frame's header: (body length, op) from its first five bytes.
pub fn frame_header(h: [u8; 5]) -> Result<(usize, LocalOp), LocalFrameError> {
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if !(1..=MAX_FRAME).contains(&len) {
        return Err(LocalFrameError("bad frame length"));
    }
    let op = LocalOp::from_u8(h[4]).ok_or(LocalFrameError("unknown op"))?;
    Ok((len - 1, op))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_split_into_runs_that_fit_a_frame() {
        assert!(exchanges([]).is_empty());
        assert_eq!(exchanges([10; 1000]), vec![0..1000]);
        // By bytes: three items of (52 + 48) bytes fit 300, a fourth does not.
        assert_eq!(runs_within([48; 7], 300, 100), vec![0..3, 3..6, 6..7]);
        // By items.
        assert_eq!(runs_within([1; 5], 1 << 20, 2), vec![0..2, 2..4, 4..5]);
        // An item larger than the budget goes alone.
        assert_eq!(runs_within([1, 500, 1], 300, 100), vec![0..1, 1..2, 2..3]);
        // Keys of the longest kind: each run's begin frame is within the owner's limit.
        let lens = vec![MAX_KEY_LEN; 40_000];
        let runs = exchanges(lens.iter().copied());
        assert!(runs.len() > 1);
        assert_eq!(runs.first().unwrap().start, 0);
        assert_eq!(runs.last().unwrap().end, lens.len());
        for pair in runs.windows(2) {
            assert_eq!(pair[0].end, pair[1].start);
        }
        let key = "k".repeat(MAX_KEY_LEN);
        let mut w = FrameWriter::new(LocalOp::BeginWrite);
        w.u32(runs[0].len() as u32);
        for _ in runs[0].clone() {
            w.item(Item {
                offset: 0,
                len: 1,
                grant: 1,
                flags: 0,
                seal: Seal::default(),
                key: key.as_str(),
            });
        }
        let frame = w.finish();
        assert!(frame.len() - 5 <= MAX_FRAME / 2, "{}", frame.len());
        let (len, _) = frame_header(frame[..5].try_into().unwrap()).unwrap();
        assert_eq!(len, frame.len() - 5);
    }

    #[test]
    fn frames_round_trip_and_truncation_is_an_error() {
        let mut w = FrameWriter::new(LocalOp::BeginWrite);
        let a = Item {
            offset: 64,
            len: 100,
            grant: 9,
            flags: 3,
            seal: Seal::new(123, [7; 16]),
            key: "a",
        };
        let b = Item {
            offset: 1 << 40,
            len: 7,
            grant: u64::MAX,
            flags: 0,
            seal: Seal::default(),
            key: "key-2",
        };
        w.u32(2).item(a).item(b);
        let f = w.finish();
        let (len, op) = frame_header(f[..5].try_into().unwrap()).unwrap();
        assert_eq!((len, op), (f.len() - 5, LocalOp::BeginWrite));
        let mut r = FrameReader::new(&f[5..]);
        assert_eq!(r.count().unwrap(), 2);
        let bytes = |i: Item<&'static str>| Item {
            offset: i.offset,
            len: i.len,
            grant: i.grant,
            flags: i.flags,
            seal: i.seal,
            key: i.key.as_bytes(),
        };
        assert_eq!(r.item().unwrap(), bytes(a));
        assert_eq!(r.item().unwrap(), bytes(b));
        assert!(r.is_empty());
        let mut short = FrameReader::new(&f[5..f.len() - 1]);
        short.count().unwrap();
        short.item().unwrap();
        assert!(short.item().is_err());
        assert!(frame_header([0, 0, 0, 0, 1]).is_err());
        assert!(frame_header([1, 0, 0, 0, 99]).is_err());
    }

    #[test]
    fn socket_paths_are_file_names() {
        let s = SegmentName::parse("[::1]:80").unwrap();
        assert_eq!(
            socket_path(Path::new("/tmp"), &s),
            PathBuf::from("/tmp/mooncake-___1__80.sock")
        );
        let s = SegmentName::parse("10.0.0.5:1234").unwrap();
        assert_eq!(
            socket_path(Path::new("/d"), &s),
            PathBuf::from("/d/mooncake-10.0.0.5_1234.sock")
        );
    }
}
