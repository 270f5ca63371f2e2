//! NVIDIA GPU memory through the CUDA driver API (cudarc, the driver library loaded at run time):
//! device pointers are recognised with `cuPointerGetAttribute` and copied with the synchronous
//! driver copies in the device's primary context, through page-locked staging buffers kept for
//! reuse. Without a CUDA driver, `open` says so.

use std::sync::Arc;

use cudarc::driver::{result, sys, DriverError};
use parking_lot::Mutex;

use super::{staged::SLICE_BYTES, DeviceError, DeviceMemory, Staging, StagingBuffer};

/// Page-locked slabs kept for reuse per device (a staged batch holds about three at once).
const POOL_SLABS: usize = 4;

pub struct CudaMemory {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    pinned: Arc<PinnedPool>,
}

/// Page-locked host memory of one device's context: slabs of `SLICE_BYTES` come back here when
/// a staged slice is done; larger buffers are freed at once. The pool holds its own reference
/// on the primary context, so buffers still in use outlive a dropped `CudaMemory` safely.
struct PinnedPool {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    free: Mutex<Vec<usize>>,
}

// SAFETY: the context handle is only passed to the thread-safe driver API; the slab addresses
// are plain host memory owned by the pool.
unsafe impl Send for PinnedPool {}
// SAFETY: as above; the free list is behind a mutex.
unsafe impl Sync for PinnedPool {}

impl PinnedPool {
    fn new(device: sys::CUdevice) -> Result<Self, DriverError> {
        // SAFETY: `device` is a valid device handle; the context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }?;
        Ok(PinnedPool {
            device,
            ctx,
            free: Mutex::new(Vec::new()),
        })
    }

    /// `cap` bytes of page-locked memory.
    fn alloc(&self, cap: usize) -> Result<*mut u8, DriverError> {
        // SAFETY: the pool's context is retained until Drop.
        let _entered = unsafe { Entered::push(self.ctx) }?;
        // SAFETY: a plain host allocation of `cap` bytes, freed with `free_host` only.
        unsafe { result::malloc_host(cap, 0) }.map(|p| p.cast())
    }

    fn release(&self, ptr: *mut u8) {
        // SAFETY: `ptr` came from `alloc` of this pool and is freed once; the context is
        // retained until Drop.
        unsafe {
            let _entered = Entered::push(self.ctx);
            let _ = result::free_host(ptr.cast());
        }
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        for ptr in std::mem::take(self.free.get_mut()) {
            self.release(ptr as *mut u8);
        }
        // SAFETY: retained once in `new`, released once here.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A staging buffer in page-locked memory: the first `len` of `cap` bytes.
struct Pinned {
    ptr: *mut u8,
    cap: usize,
    len: usize,
    pool: Arc<PinnedPool>,
}

// SAFETY: the buffer is owned by this value alone until Drop hands it back.
unsafe impl Send for Pinned {}

impl StagingBuffer for Pinned {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points at `cap >= len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.cap == SLICE_BYTES {
            let mut free = self.pool.free.lock();
            if free.len() < POOL_SLABS {
                free.push(self.ptr as usize);
                return;
            }
        }
        self.pool.release(self.ptr);
    }
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
        let pinned = match PinnedPool::new(device) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                // SAFETY: retained just above.
                let _ = unsafe { result::primary_ctx::release(device) };
                return Err(fail(e));
            }
        };
        Ok(CudaMemory {
            ordinal,
            device,
            ctx,
            name,
            pinned,
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

    /// This device's context, current on this thread until the guard drops; then the thread's
    /// previous context is current again (the caller's CUDA runtime follows the current context:
    /// torch's current device would otherwise move to whichever GPU was asked last).
    fn enter(&self) -> Result<Entered, DeviceError> {
        // SAFETY: `ctx` is this device's primary context, retained until Drop.
        unsafe { Entered::push(self.ctx) }.map_err(|e| self.error(e))
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

/// A context made current on this thread, the previous one current again when dropped (on the
/// same thread: the guard is not Send).
struct Entered(std::marker::PhantomData<*const ()>);

impl Entered {
    /// # Safety
    /// `ctx` must be a live context (retained by the caller for the guard's life).
    unsafe fn push(ctx: sys::CUcontext) -> Result<Entered, DriverError> {
        // SAFETY: the caller keeps `ctx` alive.
        let rc = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(DriverError(rc));
        }
        Ok(Entered(std::marker::PhantomData))
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread (the guard cannot leave it).
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

impl CudaMemory {
    /// Refuses a copy of a range that is not wholly memory of this device: the copies take
    /// any address, and one into host memory (a caller's mistake) would write wherever it
    /// points.
    fn check_owned(&self, ptr: usize, len: usize) -> Result<(), DeviceError> {
        if len == 0 || self.owns(ptr, len) {
            return Ok(());
        }
        Err(DeviceError {
            device: self.name.clone(),
            message: format!("[{ptr:#x}, +{len}) is not memory allocated on this GPU"),
        })
    }
}

impl DeviceMemory for CudaMemory {
    fn name(&self) -> &str {
        &self.name
    }

    fn owns(&self, ptr: usize, len: usize) -> bool {
        let Ok(_entered) = self.enter() else {
            return false;
        };
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
                    && (ptr as u64).checked_add(len as u64).is_some_and(|end| end <= s + n)
        )
    }

    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check_owned(src, dst.len())?;
        let _entered = self.enter()?;
        // SAFETY: [src, src + len) is memory of this device (checked just above: with unified
        // addressing, host memory would pass as a device pointer too); `dst` is host memory of
        // that length.
        unsafe { result::memcpy_dtoh_sync(dst, src as sys::CUdeviceptr) }.map_err(|e| self.error(e))
    }

    fn copy_from_host(&self, src: &[u8], dst: usize) -> Result<(), DeviceError> {
        self.check_owned(dst, src.len())?;
        let _entered = self.enter()?;
        // SAFETY: as in `copy_to_host`, the other way.
        unsafe { result::memcpy_htod_sync(dst as sys::CUdeviceptr, src) }.map_err(|e| self.error(e))
    }

    /// Page-locked memory: a pooled slab for a slice, an allocation of its own for a larger
    /// one; pageable memory when the driver has no page-locked memory to give (copies are then
    /// slower, not wrong).
    fn staging(&self, len: usize) -> Result<Staging, DeviceError> {
        let pooled = (len <= SLICE_BYTES)
            .then(|| self.pinned.free.lock().pop())
            .flatten();
        let cap = if len <= SLICE_BYTES { SLICE_BYTES } else { len };
        let ptr = match pooled {
            Some(p) => p as *mut u8,
            None => match self.pinned.alloc(cap) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(device = %self.name, bytes = cap, error = ?e,
                        "no page-locked staging memory; staging through pageable memory");
                    // Refused rather than aborting the process where memory is short.
                    let mut buf = Vec::new();
                    buf.try_reserve_exact(len).map_err(|_| DeviceError {
                        device: self.name.clone(),
                        message: format!("no host memory for {len} bytes of staging"),
                    })?;
                    buf.resize(len, 0);
                    return Ok(Box::new(buf));
                }
            },
        };
        Ok(Box::new(Pinned {
            ptr,
            cap,
            len,
            pool: self.pinned.clone(),
        }))
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // SAFETY: retained once in `open`, released once here.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}
