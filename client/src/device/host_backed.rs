//! Device-like memory on the host, for running the device staging path where no GPU exists: it
//! hands out addresses in the non-canonical half of the x86-64 address space (any direct read
//! or write of them faults at once), and its bytes move only through `copy_to_host` and
//! `copy_from_host`, like a GPU's.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use super::{DeviceError, DeviceMemory, Staging};

/// Where allocations start: not a valid user-space address on any 64-bit Linux.
const BASE: usize = 0x7ead_0000_0000_0000;

#[derive(Default)]
pub struct HostBackedDevice {
    /// Allocations by their (fake) address.
    blocks: Mutex<BTreeMap<usize, Vec<u8>>>,
    /// The size of every staging buffer asked for, in order.
    staged: Mutex<Vec<usize>>,
}

impl HostBackedDevice {
    pub fn new() -> Self {
        Self::default()
    }

    /// `len` zero bytes of "device" memory; returns its address.
    pub fn alloc(&self, len: usize) -> usize {
        let mut blocks = self.blocks.lock();
        let at = blocks
            .last_key_value()
            .map_or(BASE, |(a, b)| a + b.len().max(1).next_multiple_of(4096));
        blocks.insert(at, vec![0; len]);
        at
    }

    pub fn free(&self, addr: usize) {
        self.blocks.lock().remove(&addr);
    }

    /// The sizes of the staging buffers transfers asked for since the last call.
    pub fn take_staging_sizes(&self) -> Vec<usize> {
        std::mem::take(&mut self.staged.lock())
    }

    /// Runs `f` on the block holding `[addr, addr + len)`, at that offset.
    fn with_range<T>(
        &self,
        addr: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Result<T, DeviceError> {
        let mut blocks = self.blocks.lock();
        let found = blocks.range_mut(..=addr).next_back().filter(|(a, b)| {
            addr.checked_add(len)
                .is_some_and(|end| end <= **a + b.len())
        });
        match found {
            Some((a, b)) => {
                let at = addr - *a;
                Ok(f(&mut b[at..at + len]))
            }
            None => Err(DeviceError {
                device: self.name().into(),
                message: format!("[{addr:#x}, +{len}) is not allocated memory of this device"),
            }),
        }
    }
}

impl DeviceMemory for HostBackedDevice {
    fn name(&self) -> &str {
        "host-backed"
    }

    fn owns(&self, ptr: usize, len: usize) -> bool {
        self.with_range(ptr, len, |_| ()).is_ok()
    }

    fn copy_to_host(&self, src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.with_range(src, dst.len(), |b| dst.copy_from_slice(b))
    }

    fn copy_from_host(&self, src: &[u8], dst: usize) -> Result<(), DeviceError> {
        self.with_range(dst, src.len(), |b| b.copy_from_slice(src))
    }

    fn staging(&self, len: usize) -> Result<Staging, DeviceError> {
        self.staged.lock().push(len);
        Ok(Box::new(vec![0u8; len]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_moves_only_through_copies_within_allocations() {
        let d = HostBackedDevice::new();
        let a = d.alloc(100);
        let b = d.alloc(10);
        assert!(a >= BASE && b >= a + 100);
        assert!(d.owns(a, 100) && d.owns(a + 50, 50) && !d.owns(a + 50, 51) && !d.owns(0x1000, 1));
        d.copy_from_host(b"hello", a + 10).unwrap();
        let mut out = [0u8; 7];
        d.copy_to_host(a + 9, &mut out).unwrap();
        assert_eq!(&out, b"\0hello\0");
        assert!(
            d.copy_to_host(b + 5, &mut [0u8; 6]).is_err(),
            "past the end"
        );
        assert!(
            !d.owns(a + 10, usize::MAX),
            "a length that wraps is refused, not a panic"
        );
        d.free(a);
        assert!(!d.owns(a, 1));
    }
}
