//! Data transports the client can use; each implements `mooncake_common::transport::DataTransport`.
//! `HybridTransport` is the default: same-host shared memory where it can, TCP elsewhere.

pub mod hybrid;
pub mod local;
pub mod tcp;

pub use hybrid::{HybridConfig, HybridTransport};
pub use tcp::TcpTransport;
