//! Data transports the client can use; each implements `mooncake_common::transport::DataTransport`.

pub mod tcp;

pub use tcp::TcpTransport;
