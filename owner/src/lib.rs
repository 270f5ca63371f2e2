//! The owner: contributes a pinned memory pool to the store, mounts it at the master as a
//! segment named by its data endpoint, and serves reads and writes of ranges of it.
//! Raw memory access lives in `pool` alone, fd passing and peeking in `fdpass`.
#![deny(unsafe_code)]

pub mod catalog;
pub mod config;
pub mod daemon;
pub mod dataplane;
#[allow(unsafe_code)]
mod fdpass;
pub mod local;
pub mod master_link;
#[allow(unsafe_code)]
pub mod pool;
mod ranges;
mod replies;
pub mod seals;
pub mod ssd;

pub use config::OwnerConfig;
pub use daemon::{OwnerError, RunningOwner, SHUTDOWN_WITHIN};
