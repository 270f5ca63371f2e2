//! The client's errors and their one mapping to Mooncake-compatible codes.

use mooncake_common::{transport::TransferError, ApiError, Code};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("invalid client configuration: {0}")]
    Config(String),
    #[error("destination buffer of {have} bytes is smaller than the object ({need} bytes)")]
    BufferTooSmall { need: u64, have: usize },
    /// The master refused this key.
    #[error("master answered {code}: {message}")]
    Master { code: Code, message: String },
    /// The master call itself failed (unreachable, deadline, unreadable answer, bad request).
    #[error("master call failed: {0}")]
    Rpc(ApiError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("the read of {0} finished after its lease expired; the bytes are not trusted")]
    LeaseExpired(String),
    /// A copy between device memory and its host staging buffer failed.
    #[error("device copy failed: {0}")]
    Device(#[from] crate::device::DeviceError),
}

impl ClientError {
    pub fn code(&self) -> Code {
        match self {
            ClientError::Invalid(_)
            | ClientError::Config(_)
            | ClientError::BufferTooSmall { .. } => Code::InvalidParams,
            ClientError::Master { code, .. } => *code,
            ClientError::Rpc(e) => e.code,
            ClientError::Transfer(e) => e.code(),
            ClientError::LeaseExpired(_) => Code::LeaseExpired,
            ClientError::Device(_) => Code::TransferFail,
        }
    }

    /// Whether the same call may succeed if tried again later (see `Code::is_retryable`).
    pub fn is_retryable(&self) -> bool {
        self.code().is_retryable()
    }

    pub(crate) fn master(code: Code, message: impl Into<String>) -> Self {
        ClientError::Master {
            code,
            message: message.into(),
        }
    }

    /// A copy for every key of a batch that failed as a whole (io errors are not `Clone`:
    /// a transfer error is copied by code and text).
    pub(crate) fn for_each_key(&self) -> ClientError {
        match self {
            ClientError::Rpc(e) => ClientError::Rpc(e.clone()),
            other => ClientError::Master {
                code: other.code(),
                message: other.to_string(),
            },
        }
    }
}

impl From<ApiError> for ClientError {
    fn from(e: ApiError) -> Self {
        ClientError::Rpc(e)
    }
}
