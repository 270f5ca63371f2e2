//! What a transfer engine call can fail with, and the codes Mooncake's engine returns for it.

use std::time::Duration;

use mooncake_common::transport::TransferError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("address {addr:#x} (+{len} bytes) is not inside a registered region")]
    NotRegistered { addr: u64, len: u64 },
    #[error("region {addr:#x} (+{len} bytes) overlaps a registered one")]
    Overlapped { addr: u64, len: u64 },
    #[error("region {addr:#x} is still in use by transfers after {after:?}; it stays registered")]
    Busy { addr: u64, after: Duration },
    #[error(
        "managed buffer {addr:#x} (+{len} bytes) still holds the registered region {region:#x}: \
         unregister it first; the buffer stays allocated"
    )]
    InUse { addr: u64, len: u64, region: u64 },
    #[error("cannot serve transfers on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "transfer engine {target} restarted since this engine first reached it: the memory it \
         registered then is gone, so nothing was moved; calls to it fail so until its buffers' \
         addresses are looked up again (peer_regions, get_first_buffer_address), which reaches \
         the new process"
    )]
    Restarted { target: String },
    #[error("transfer to {target} failed: {source}")]
    Transfer {
        target: String,
        source: TransferError,
    },
}

impl EngineError {
    /// Mooncake's code for the failure (`error.h`): what its Python binding returns.
    pub fn code(&self) -> i32 {
        match self {
            EngineError::Invalid(_) => -1,
            EngineError::NotRegistered { .. } => -3,
            EngineError::Busy { .. } | EngineError::InUse { .. } => -4,
            EngineError::Overlapped { .. } => -7,
            EngineError::Bind { .. } => -102,
            EngineError::Transfer { .. } | EngineError::Restarted { .. } => -1,
        }
    }
}
