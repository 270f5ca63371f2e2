//! `AlignedBuf`: a zeroed heap buffer whose address and capacity are multiples of `ALIGN`, as
//! O_DIRECT needs. It owns its allocation; the disk engines borrow its pointer only while they own
//! the buffer itself. Its bytes are always initialised, so a safe slice never shows uninitialised
//! memory.

use std::{
    alloc::{self, Layout},
    fmt,
    ops::{Deref, DerefMut},
    ptr::NonNull,
};

/// The alignment of buffer addresses, lengths and file offsets for direct I/O.
pub const ALIGN: usize = 4096;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a `Vec<u8>`); moving it to another
// thread moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `cap` bytes (rounded up to a multiple of `ALIGN`, at least
    /// `ALIGN`) and length 0. Aborts like `Vec` when memory runs out.
    pub fn with_capacity(cap: usize) -> AlignedBuf {
        let cap = cap
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .expect("buffer capacity overflows usize");
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap, len: 0 }
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, ALIGN).expect("buffer capacity exceeds isize::MAX")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length. Bytes past the old length keep what they held (zero, or earlier data).
    ///
    /// # Panics
    /// If `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "buffer length {len} exceeds its capacity {}",
            self.cap
        );
        self.len = len;
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation holds `cap >= len` initialised (zeroed at allocation) bytes and
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated in `with_capacity` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_rounded() {
        for cap in [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN] {
            let mut buf = AlignedBuf::with_capacity(cap);
            assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
            assert_eq!(buf.capacity() % ALIGN, 0);
            assert!(buf.capacity() >= cap.max(ALIGN));
            assert!(buf.is_empty());
            buf.set_len(buf.capacity());
            assert!(buf.iter().all(|&b| b == 0));
            buf[0] = 7;
            buf.clear();
            assert_eq!(buf.len(), 0);
        }
    }

    #[test]
    #[should_panic(expected = "exceeds its capacity")]
    fn set_len_past_capacity_panics() {
        AlignedBuf::with_capacity(ALIGN).set_len(ALIGN + 1);
    }
}
