//! The owner's SSD tier, storage only: block-aligned buffers, the disk engines that move them to
//! and from a file opened with O_DIRECT (the `DiskEngine` seam, its io_uring and pread
//! implementations, and the factory that picks one), the on-disk record formats, and the ring-log
//! store that decides where objects live on the disk. It never talks to the master: the control
//! loop that takes work from the master is `crate::master_link::tasks`.

#[allow(unsafe_code)]
mod buf;
pub mod engine;
mod engines;
mod pread;
#[allow(unsafe_code)]
mod uring;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod test_dir;

pub use buf::{AlignedBuf, ALIGN};
pub use engine::{open_direct, DiskEngine, EngineKind};
pub use engines::open_engine;

mod bufpool;
pub mod record;
mod recover;
pub mod store;
#[cfg(test)]
mod store_tests;

pub use store::{DiskValue, Dropped, Lost, Recovered, SsdError, SsdStore, Victim};
