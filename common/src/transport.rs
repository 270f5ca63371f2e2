//! The seam between the client and the owners' memory: a data transport moves one object's bytes
//! to or from a range of an owner's segment. TCP is the first implementation (in the client crate);
//! a same-host shared-memory path and RDMA implement the same trait and pass the same conformance
//! suite. Implementations own their connections and enforce their own deadlines: a future returned
//! here always finishes, with an error at the latest when the transport's deadline passes.

use std::time::Duration;

use futures::future::{join_all, BoxFuture};

use crate::{auth::Seal, wire::FrameError, Code, ObjectKey, SegmentName, Stamp};

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("cannot connect to owner {target}: {source}")]
    Connect {
        target: SegmentName,
        source: std::io::Error,
    },
    #[error("transfer with owner {target} timed out after {after:?}")]
    Timeout {
        target: SegmentName,
        after: Duration,
    },
    #[error("connection to owner {target} failed: {source}")]
    Io {
        target: SegmentName,
        source: std::io::Error,
    },
    #[error("owner {target} speaks a different protocol: {source}")]
    Protocol {
        target: SegmentName,
        source: FrameError,
    },
    #[error("owner {target} refused the transfer: {code}: {message}")]
    Remote {
        target: SegmentName,
        code: Code,
        message: String,
    },
}

impl TransferError {
    /// A copy for reporting one batch-wide failure on every item (io errors are not Clone, so
    /// the copy keeps their kind and text).
    pub fn duplicate(&self) -> TransferError {
        let io = |e: &std::io::Error| std::io::Error::new(e.kind(), e.to_string());
        match self {
            TransferError::Connect { target, source } => TransferError::Connect {
                target: target.clone(),
                source: io(source),
            },
            TransferError::Timeout { target, after } => TransferError::Timeout {
                target: target.clone(),
                after: *after,
            },
            TransferError::Io { target, source } => TransferError::Io {
                target: target.clone(),
                source: io(source),
            },
            TransferError::Protocol { target, source } => TransferError::Protocol {
                target: target.clone(),
                source: source.clone(),
            },
            TransferError::Remote {
                target,
                code,
                message,
            } => TransferError::Remote {
                target: target.clone(),
                code: *code,
                message: message.clone(),
            },
        }
    }

    /// The Mooncake code a caller sees for this failure.
    pub fn code(&self) -> Code {
        match self {
            TransferError::Connect { .. }
            | TransferError::Timeout { .. }
            | TransferError::Io { .. }
            | TransferError::Protocol { .. } => Code::TransferFail,
            TransferError::Remote { code, .. } => *code,
        }
    }
}

/// One object to write in a batch: its key, where it goes, the grant it is written under (and
/// the master's seal on it), and its bytes in order.
pub struct WriteItem<'a> {
    pub key: &'a ObjectKey,
    pub offset: u64,
    pub stamp: Stamp,
    pub seal: Seal,
    pub parts: &'a [&'a [u8]],
}

/// One object to read in a batch: its key, where it is, the version (put id) the owner must
/// hold, and the buffers it fills in order.
pub struct ReadItem<'a, 'b> {
    pub key: &'a ObjectKey,
    pub offset: u64,
    pub put_id: u64,
    /// The master's seal on the read (see `auth::seal`).
    pub seal: Seal,
    pub parts: &'a mut [&'b mut [u8]],
}

/// Total length of an object given as parts.
pub fn parts_len<P: AsRef<[u8]>>(parts: &[P]) -> u64 {
    parts.iter().map(|p| p.as_ref().len() as u64).sum()
}

impl WriteItem<'_> {
    /// The object's length.
    pub fn len(&self) -> u64 {
        parts_len(self.parts)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ReadItem<'_, '_> {
    /// The object's length (what the parts hold together).
    pub fn len(&self) -> u64 {
        parts_len(self.parts)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes moved so far, by path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Through the same-host shared-memory path.
    pub local_bytes: u64,
    /// Over TCP.
    pub tcp_bytes: u64,
    /// Keys and bytes of gets served from owners' memory and from their SSD tiers (counted by
    /// the client, not the transport).
    pub memory_keys: u64,
    pub memory_bytes: u64,
    pub disk_keys: u64,
    pub disk_bytes: u64,
    /// Keys gets looked up (hits and misses), and keys and bytes puts stored (counted by the
    /// client).
    pub get_keys: u64,
    pub put_keys: u64,
    pub put_bytes: u64,
}

impl std::ops::AddAssign for TransferStats {
    fn add_assign(&mut self, o: TransferStats) {
        self.local_bytes += o.local_bytes;
        self.tcp_bytes += o.tcp_bytes;
        self.memory_keys += o.memory_keys;
        self.memory_bytes += o.memory_bytes;
        self.disk_keys += o.disk_keys;
        self.disk_bytes += o.disk_bytes;
        self.get_keys += o.get_keys;
        self.put_keys += o.put_keys;
        self.put_bytes += o.put_bytes;
    }
}

/// Moves bytes between the caller's memory and a range of an owner's segment. An object may be
/// scattered over several caller buffers (e.g. K and V): `parts` are its bytes in order.
pub trait DataTransport: Send + Sync + 'static {
    /// Writes the concatenation of the item's parts at its offset of `target`'s segment, naming
    /// the key and stamp the range now holds. Returns only after the owner acknowledged that the
    /// bytes landed; an owner that already saw a later grant of the range refuses.
    fn write<'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a WriteItem<'a>,
    ) -> BoxFuture<'a, Result<(), TransferError>>;

    /// Fills the item's parts, in order, from its offset of `target`'s segment, which must hold
    /// version `put_id` of its key; the range read is as long as the parts together.
    fn read<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a mut ReadItem<'k, 'b>,
    ) -> BoxFuture<'a, Result<(), TransferError>>;

    /// Writes several objects to one owner; one result per item, in order. Transports that can
    /// do better than one exchange per object override it.
    fn write_batch<'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a [WriteItem<'a>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(join_all(items.iter().map(|i| self.write(target, i))))
    }

    /// Reads several objects from one owner; one result per item, in order.
    fn read_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(join_all(items.iter_mut().map(|i| self.read(target, i))))
    }

    /// Reads several objects from the SSD tier of one owner, which reads each from disk and
    /// streams it back; an item's `put_id` is the version the record on disk must carry (its
    /// `offset` is unused). Transports without a way to ask the owner refuse.
    fn read_disk_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        let refused = items
            .iter()
            .map(|_| {
                Err(TransferError::Remote {
                    target: target.clone(),
                    code: Code::InvalidParams,
                    message: "this transport cannot read from an owner's ssd tier".into(),
                })
            })
            .collect();
        Box::pin(std::future::ready(refused))
    }

    /// Bytes moved so far, by path.
    fn stats(&self) -> TransferStats {
        TransferStats::default()
    }
}
