//! The metadata master: tracks segments, replica placement, leases and owner liveness, allocates
//! space inside owners' segments and evicts. It never touches object bytes.
#![forbid(unsafe_code)]

pub mod clock;
pub mod config;
pub mod core;
pub mod error;
pub mod ha;
pub mod http;
pub mod metrics;
pub mod server;
pub mod service;
pub mod wire;

pub use config::MasterConfig;
pub use error::MasterError;
pub use server::RunningMaster;
