//! The only place that turns addresses into bytes: ranges inside regions the application
//! registered (it promised they stay valid until it unregisters them, and unregistering waits
//! for every `Use` of the region), and buffers this engine allocates for `allocate_managed_buffer`.
//!
//! A transfer and the application touching the same bytes at once is the application's race, as
//! with RDMA: the engine only guarantees it never touches memory outside registered regions.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};

use crate::regions::Use;

/// Managed buffers are page-aligned.
const ALIGN: usize = 4096;

impl Use {
    /// The bytes at `addr..addr + len`, which `Regions::lookup` checked lie in this region.
    pub fn bytes(&self, addr: u64, len: u64) -> &[u8] {
        assert!(self.covers(addr, len), "a use covers only its own range");
        // SAFETY: the range lies inside a region the application registered as valid memory,
        // and the region stays registered (its memory alive) while this `Use` exists.
        unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
    }

    /// The bytes at `addr..addr + len` to fill.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, addr: u64, len: u64) -> &mut [u8] {
        assert!(self.covers(addr, len), "a use covers only its own range");
        // SAFETY: as in `bytes`; the application gave the region to transfers to write into,
        // and does not touch the bytes a transfer targets while it runs.
        unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize) }
    }
}

/// A zeroed, page-aligned buffer of `len` bytes; None when memory is short or `len` is 0.
pub fn allocate(len: u64) -> Option<u64> {
    let layout = Layout::from_size_align(usize::try_from(len).ok()?, ALIGN).ok()?;
    if layout.size() == 0 {
        return None;
    }
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { alloc_zeroed(layout) };
    (!p.is_null()).then_some(p as usize as u64)
}

/// Frees a buffer `allocate` returned with the same `len`, once nothing uses it.
pub fn free(addr: u64, len: u64) {
    let layout = Layout::from_size_align(len as usize, ALIGN).expect("allocated with it");
    // SAFETY: `addr` came from `allocate(len)` (the engine's record says so) and its region was
    // unregistered, so no transfer uses it any more.
    unsafe { dealloc(addr as usize as *mut u8, layout) }
}
