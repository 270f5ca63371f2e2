//! The devices whose memory `register_buffer` recognises as such: every CUDA GPU of the machine
//! (feature `cuda`, the driver loaded at run time), none without the feature or a driver. A
//! pointer that is neither registered host memory nor such a device's is refused (-600).

use std::sync::Arc;

use mooncake_client::device::DeviceMemory;
use pyo3::prelude::*;

pub fn detect() -> Vec<Arc<dyn DeviceMemory>> {
    #[cfg(feature = "cuda")]
    {
        mooncake_client::device::cuda::CudaMemory::all()
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn DeviceMemory>)
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// Device-like memory on the host for tests of the GPU path where no GPU exists (see
/// `mooncake_client::device::host_backed`): attach one to a store with
/// `store._attach_host_backed_device()`; its addresses fault if read directly.
#[pyclass(module = "mooncake_rs._native", frozen)]
pub struct HostBackedDevice {
    pub(crate) device: Arc<mooncake_client::device::host_backed::HostBackedDevice>,
}

#[pymethods]
impl HostBackedDevice {
    /// `size` zero bytes of device memory; its address.
    fn alloc(&self, size: usize) -> usize {
        self.device.alloc(size)
    }

    fn write(&self, ptr: usize, data: Vec<u8>) -> PyResult<()> {
        self.device
            .copy_from_host(&data, ptr)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
    }

    fn read<'py>(
        &self,
        py: Python<'py>,
        ptr: usize,
        size: usize,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let mut out = vec![0u8; size];
        self.device
            .copy_to_host(ptr, &mut out)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }
}
