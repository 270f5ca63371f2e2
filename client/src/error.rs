//! The client's errors and their one mapping to Mooncake-compatible codes.

use mooncake_common::{transport::TransferError, Code};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("invalid client configuration: {0}")]
    Config(String),
    #[error("destination buffer of {have} bytes is smaller than the object ({need} bytes)")]
    BufferTooSmall { need: u64, have: usize },
    #[error("master answered {code}: {message}")]
    Master { code: Code, message: String },
    #[error("master call failed: {0}")]
    Rpc(String),
    #[error("master call timed out after {0:?}")]
    RpcTimeout(std::time::Duration),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("the read of {0} finished after its lease expired; the bytes are not trusted")]
    LeaseExpired(String),
}

impl ClientError {
    pub fn code(&self) -> Code {
        match self {
            ClientError::Invalid(_)
            | ClientError::Config(_)
            | ClientError::BufferTooSmall { .. } => Code::InvalidParams,
            ClientError::Master { code, .. } => *code,
            ClientError::Rpc(_) => Code::RpcFail,
            ClientError::RpcTimeout(_) => Code::RpcTimeout,
            ClientError::Transfer(e) => e.code(),
            ClientError::LeaseExpired(_) => Code::LeaseExpired,
        }
    }

    pub(crate) fn master(code: i32, message: impl Into<String>) -> Self {
        ClientError::Master {
            code: Code::from_i32(code),
            message: message.into(),
        }
    }
}
