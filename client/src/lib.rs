//! The requester-only client embedded in inference workers: batch put/get of KV-cache blocks
//! between the caller's memory and the owners, with the master deciding placement and leases.
//! It contributes no memory and pulls in nothing owner-only. Raw memory access lives in
//! `transport::local::mapping` alone.
#![deny(unsafe_code)]

pub mod client;
pub mod config;
pub mod device;
pub mod error;
mod get;
mod group;
mod leases;
pub mod master;
mod put;
mod spin;
pub mod transport;

pub use client::{Client, ObjectDesc};
pub use config::{resolve_preferred, ClientConfig, MasterProtocol, PREFERRED_SEGMENT_ENV};
pub use error::ClientError;
pub use mooncake_common::Code;
pub use mooncake_common::{
    master_api::SegmentUsage, MasterApi, ReplicaLocation, ReplicateConfig, SegmentName, Tier,
};
pub use put::PutOutcome;
