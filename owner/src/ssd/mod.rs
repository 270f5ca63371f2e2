//! The owner's SSD tier: block-aligned buffers and the disk engines that move them to and from a
//! file opened with O_DIRECT. This module owns how bytes reach the disk (the `DiskEngine` seam and
//! its io_uring and pread implementations); it does not decide where objects live on the disk.

#[allow(unsafe_code)]
mod buf;
pub mod engine;
mod pread;
#[allow(unsafe_code)]
mod uring;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod test_dir;

pub use buf::{AlignedBuf, ALIGN};
pub use engine::{open_direct, open_engine, DiskEngine, EngineKind};

mod bufpool;
pub mod record;
mod recover;
pub mod store;
#[cfg(test)]
mod store_tests;

pub use store::{DiskValue, Lost, Recovered, SsdError, SsdStore, Victim};
pub mod worker;
