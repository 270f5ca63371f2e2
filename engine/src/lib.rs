//! Point-to-point transfers between processes' registered memory, with the calls of Mooncake's
//! `TransferEngine`: prefill and decode workers register their KV-cache regions and move blocks
//! between them directly, without the store.
//!
//! - A peer is named by its session name, `host:rpc_port`, and met by incarnation: requests name
//!   the process first met under that name, and a restarted one refuses them (`peers`).
//! - Every request is checked on its target against the regions that target registered, and a
//!   caller's own buffers must lie in regions it registered: no request reads or writes memory
//!   that its owner did not offer, and unregistering waits for the transfers that use a region.
//! - The bytes move over the store's TCP transport (its framing, connection pools, pipelining and
//!   threads), or, with a peer on the same host, in one `process_vm_readv`/`writev` copy that the
//!   target grants range by range, or a `memcpy` through a mapping of the target's managed buffer
//!   (`local`); every call under a deadline.
//!
//! Raw memory access lives in `memory` alone.
#![deny(unsafe_code)]

mod directory;
mod engine;
mod error;
mod idle;
mod local;
mod memory;
mod peers;
mod regions;
mod requester;
mod server;
mod small;

pub use engine::{
    Devices, EngineConfig, EngineStats, Metadata, TransferEngine, TransferOp, TransferRequest,
};
pub use error::EngineError;
pub use requester::{MetPeer, Requester};
