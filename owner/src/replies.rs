//! A connection's replies, queued in order and sent with one `writev`: headers and other small
//! bytes are copied into one buffer, values are referenced where they lie (the pool, or a buffer
//! read from the SSD) and go to the socket with no copy in user space. A pipelining client's
//! answers to a batch of small reads thus cost one system call, not one copy and call each.

use std::io::{self, IoSlice};

use tokio::io::AsyncWriteExt;

use crate::{pool::PoolSlice, ssd::store::DiskValue};

/// Queued bytes past which the queue is sent even while more requests wait.
const FLUSH_BYTES: usize = 256 << 10;
/// At most this many parts per `writev` (the kernel takes 1024).
const MAX_PARTS: usize = 512;

enum Part {
    /// `small[start..end]`.
    Small(usize, usize),
    Pool(PoolSlice),
    Disk(DiskValue),
}

#[derive(Default)]
pub struct Replies {
    small: Vec<u8>,
    parts: Vec<Part>,
    queued: usize,
    /// A value read from the SSD is queued: it holds read-budget permits until sent.
    disk: bool,
}

impl Replies {
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        let start = self.small.len();
        self.small.extend_from_slice(bytes);
        let end = self.small.len();
        match self.parts.last_mut() {
            Some(Part::Small(_, e)) if *e == start => *e = end,
            _ => self.parts.push(Part::Small(start, end)),
        }
        self.queued += bytes.len();
    }

    /// Queues a value from the pool; its range stays held until the value is sent.
    pub fn push_pool(&mut self, value: PoolSlice) {
        self.queued += value.len();
        self.parts.push(Part::Pool(value));
    }

    pub fn push_disk(&mut self, value: DiskValue) {
        self.queued += value.len();
        self.parts.push(Part::Disk(value));
        self.disk = true;
    }

    /// Whether to send what is queued without waiting for the requests behind: enough is
    /// queued, or a value read from the SSD is (its read-budget permits go back only once it is
    /// sent, and a disk read behind it in the same batch may need them).
    pub fn full(&self) -> bool {
        self.disk || self.queued >= FLUSH_BYTES || self.parts.len() + 3 >= MAX_PARTS
    }

    /// Sends everything queued, in order, then releases the values' ranges.
    pub async fn flush<W: AsyncWriteExt + Unpin>(&mut self, w: &mut W) -> io::Result<()> {
        if self.parts.is_empty() {
            return Ok(());
        }
        let mut slices: Vec<IoSlice<'_>> = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Small(a, b) => IoSlice::new(&self.small[*a..*b]),
                Part::Pool(v) => IoSlice::new(v),
                Part::Disk(v) => IoSlice::new(v),
            })
            .filter(|s| !s.is_empty())
            .collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            let n = w.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        drop(slices);
        self.parts.clear();
        self.small.clear();
        self.queued = 0;
        self.disk = false;
        Ok(())
    }
}
