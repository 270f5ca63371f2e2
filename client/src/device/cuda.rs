//! NVIDIA GPU memory through the CUDA driver API (cudarc, the driver library loaded at run time):
//! device pointers are recognised with `cuPointerGetAttribute` and copied with the synchronous
//! driver copies in the device's primary context. Without a CUDA driver, `open` says so.

use cudarc::driver::{result, sys, DriverError};

use super::{DeviceError, DeviceMemory};

pub struct CudaMemory {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
}

// SAFETY: a primary context may be made current on any thread; every call below does so first,
// and the driver API is thread-safe.
unsafe impl Send for CudaMemory {}
// SAFETY: as above; no state here changes after `open`.
unsafe impl Sync for CudaMemory {}

impl CudaMemory {
    /// GPU `ordinal`'s memory. An error when this machine has no CUDA driver or no such GPU.
    pub fn open(ordinal: i32) -> Result<Self, DeviceError> {
        let name = format!("cuda:{ordinal}");
        let fail = |e: DriverError| DeviceError {
            device: name.clone(),
            message: format!("{e:?}"),
        };
        // SAFETY: only looks for the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError {
                device: name,
                message: "no CUDA driver (libcuda.so) on this machine".into(),
            });
        }
        result::init().map_err(fail)?;
        let device = result::device::get(ordinal).map_err(fail)?;
        // SAFETY: `device` is a valid device handle; the context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }.map_err(fail)?;
        Ok(CudaMemory {
            ordinal,
            device,
            ctx,
            name,
        })
    }

    /// Every GPU of this machine; none without a CUDA driver.
    pub fn all() -> Vec<CudaMemory> {
        // SAFETY: only looks for the driver library.
        if !unsafe { sys::is_culib_present() } || result::init().is_err() {
            return Vec::new();
        }
        let count = result::device::get_count().unwrap_or(0);
        (0..count).filter_map(|i| Self::open(i).ok()).collect()
    }

    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is this device's primary context, retained until Drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| self.error(e))
    }

    fn error(&self, e: DriverError) -> DeviceError {
        DeviceError {
            device: self.name.clone(),
            message: format!("{e:?}"),
        }
    }

    fn attribute(&self, attr: sys::CUpointer_attribute, ptr: usize) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: every attribute asked here is at most 64 bits wide and `value` has room for
        // it; an address the driver does not know answers an error, not a fault.
        let rc = unsafe {
            sys::cuPointerGetAttribute(
                (&mut value as *mut u64).cast(),
                attr,
                ptr as sys::CUdeviceptr,
            )
        };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(value)
    }
}

impl DeviceMemory for CudaMemory {
    fn name(&self) -> &str {
        &self.name
    }

    fn owns(&self, ptr: usize, len: usize) -> bool {
        if self.current().is_err() {
            return false;
        }
        let ty = self.attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        );
        let ordinal = self.attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        );
        let start = self.attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        );
        let size = self.attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            ptr,
        );
        // The memory type is a 32-bit enum; the upper half of `value` stays 0.
        matches!(
            (ty, ordinal, start, size),
            (Some(t), Some(o), Some(s), Some(n))
                if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64
                    && o == self.ordinal as u64
                    && ptr as u64 + len as u64 <= s + n
        )
    }

    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: the caller checked with `owns` that [src, src + len) is memory of this
        // device; `dst` is host memory of that length.
        unsafe { result::memcpy_dtoh_sync(dst, src as sys::CUdeviceptr) }.map_err(|e| self.error(e))
    }

    fn copy_from_host(&self, src: &[u8], dst: usize) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: as in `copy_to_host`, the other way.
        unsafe { result::memcpy_htod_sync(dst as sys::CUdeviceptr, src) }.map_err(|e| self.error(e))
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // SAFETY: retained once in `open`, released once here.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}
