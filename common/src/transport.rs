//! The seam between the client and the owners' memory: a data transport moves one object's bytes
//! to or from a range of an owner's segment. TCP is the first implementation (in the client crate);
//! a same-host shared-memory path and RDMA implement the same trait and pass the same conformance
//! suite. Implementations own their connections and enforce their own deadlines: a future returned
//! here always finishes, with an error at the latest when the transport's deadline passes.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::{wire::FrameError, Code, ObjectKey, SegmentName};

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

/// Moves bytes between the caller's memory and a range of an owner's segment. An object may be
/// scattered over several caller buffers (e.g. K and V): `parts` are its bytes in order.
pub trait DataTransport: Send + Sync + 'static {
    /// Writes the concatenation of `parts` at `offset` of `target`'s segment, naming the key the
    /// range now holds. Returns only after the owner acknowledged that the bytes landed.
    fn write<'a>(
        &'a self,
        target: &'a SegmentName,
        key: &'a ObjectKey,
        offset: u64,
        parts: &'a [&'a [u8]],
    ) -> BoxFuture<'a, Result<(), TransferError>>;

    /// Fills `parts`, in order, from `offset` of `target`'s segment, which must hold `key`; the
    /// range read is as long as the parts together.
    fn read<'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        key: &'a ObjectKey,
        offset: u64,
        parts: &'a mut [&'b mut [u8]],
    ) -> BoxFuture<'a, Result<(), TransferError>>;
}
