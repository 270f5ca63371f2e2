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

pub use staged::{DeviceParts, DeviceRange};

/// A device copy that failed, with the device's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {message}")]
pub struct DeviceError {
    pub device: String,
    pub message: String,
}

/// Host memory a staged transfer copies through: one slice of a batch at a time.
pub trait StagingBuffer: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl StagingBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A staging buffer of any kind.
pub type Staging = Box<dyn StagingBuffer>;

/// A device's memory as transfers see it: which addresses are its, and copies to and from
/// host memory. Copies may block the calling thread (they run on blocking threads).
pub trait DeviceMemory: Send + Sync + 'static {
    /// For messages: "cuda:0", "host-backed".
    fn name(&self) -> &str;

    /// Whether `[ptr, ptr + len)` is memory of this device.
    fn owns(&self, ptr: usize, len: usize) -> bool;

    /// Whether `[ptr, ptr + len)` begins or ends in memory of this device. A range of which the
    /// device owns only a part (past the end of one allocation, say) would be taken for host
    /// memory and dereferenced: callers refuse it.
    fn owns_an_end(&self, ptr: usize, len: usize) -> bool {
        len > 0 && (self.owns(ptr, 1) || self.owns(ptr.saturating_add(len - 1), 1))
    }

    /// Copies `dst.len()` bytes from device address `src` into host memory.
    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `src` to device address `dst`.
    fn copy_from_host(&self, src: &[u8], dst: usize) -> Result<(), DeviceError>;

    /// `len` bytes of host memory for staging copies to and from this device. Pageable here;
    /// a GPU hands out page-locked memory (its copies then run at full bus speed), reused
    /// across calls.
    fn staging(&self, len: usize) -> Result<Staging, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }
}
