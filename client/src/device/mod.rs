//! Memory a transfer cannot read or write directly (a GPU's), behind one seam. A registered
//! device range is never read as host memory: its bytes move through host staging buffers with
//! the device's own copies, and a batch is staged in slices so that the copies of one slice
//! overlap the network transfer of another (`staged`).
//!
//! Implementations: `cuda::CudaMemory` (feature `cuda`, the driver loaded at run time) and
//! `host_backed::HostBackedDevice`, device-like memory on the host (addresses that cannot be
//! dereferenced, explicit copies only) that runs the same staging code where no GPU exists.

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
pub mod host_backed;
mod staged;

pub use staged::DeviceRange;

/// A device copy that failed, with the device's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {message}")]
pub struct DeviceError {
    pub device: String,
    pub message: String,
}

/// A device's memory as transfers see it: which addresses are its, and copies to and from
/// host memory. Copies may block the calling thread (they run on blocking threads).
pub trait DeviceMemory: Send + Sync + 'static {
    /// For messages: "cuda:0", "host-backed".
    fn name(&self) -> &str;

    /// Whether `[ptr, ptr + len)` is memory of this device.
    fn owns(&self, ptr: usize, len: usize) -> bool;

    /// Copies `dst.len()` bytes from device address `src` into host memory.
    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `src` to device address `dst`.
    fn copy_from_host(&self, src: &[u8], dst: usize) -> Result<(), DeviceError>;
}
