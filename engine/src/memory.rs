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
    /// The bytes at `addr..addr + len`, which `Regions::lookup` checked lie in this region of
    /// host memory (a device's is never read as host memory: see `device`).
    pub fn bytes(&self, addr: u64, len: u64) -> &[u8] {
        assert!(self.covers(addr, len), "a use covers only its own range");
        assert!(self.device().is_none(), "device memory is not host memory");
        // SAFETY: the range lies inside a region the application registered as valid memory,
        // and the region stays registered (its memory alive) while this `Use` exists.
        unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
    }

    /// The bytes at `addr..addr + len` to fill.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, addr: u64, len: u64) -> &mut [u8] {
        assert!(self.covers(addr, len), "a use covers only its own range");
        assert!(self.device().is_none(), "device memory is not host memory");
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

/// Copies between this process and process `pid` with `process_vm_readv` (`read`: theirs into
/// ours) or `process_vm_writev`: `pairs` of (local address, remote address, length). Returns the
/// OS error of a failed call (EPERM where the OS forbids it, ESRCH when the process is gone).
pub fn copy_with_process(pid: i32, read: bool, pairs: &[(u64, u64, u64)]) -> std::io::Result<()> {
    // At most this many iovecs per call (IOV_MAX is 1024).
    const BATCH: usize = 512;
    for chunk in pairs.chunks(BATCH) {
        let iov = |addr: u64, n: u64| libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: n as usize,
        };
        let mut local: Vec<libc::iovec> = chunk.iter().map(|&(l, _, n)| iov(l, n)).collect();
        let mut remote: Vec<libc::iovec> = chunk.iter().map(|&(_, r, n)| iov(r, n)).collect();
        let mut left: usize = chunk.iter().map(|p| p.2 as usize).sum();
        let (mut li, mut ri) = (0usize, 0usize);
        while left > 0 {
            // SAFETY: every local iovec lies in a region this process registered and holds a
            // `Use` of for the call (the caller's duty, see `TransferEngine::transfer`); the
            // remote ones are checked by the kernel against the target's address space, and the
            // target checked and holds them (PeerGrant).
            let n = unsafe {
                let (lp, lc) = (local[li..].as_ptr(), (local.len() - li) as libc::c_ulong);
                let (rp, rc) = (remote[ri..].as_ptr(), (remote.len() - ri) as libc::c_ulong);
                if read {
                    libc::process_vm_readv(pid, lp, lc, rp, rc, 0)
                } else {
                    libc::process_vm_writev(pid, lp, lc, rp, rc, 0)
                }
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "process_vm copied nothing",
                ));
            }
            // A partial copy stops at an iovec boundary on either side: skip what moved.
            let n = n as usize;
            left -= n;
            advance(&mut local, &mut li, n);
            advance(&mut remote, &mut ri, n);
        }
    }
    Ok(())
}

/// Drops `n` copied bytes from the front of `iov[*at..]`.
fn advance(iov: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 {
        let v = &mut iov[*at];
        if n >= v.iov_len {
            n -= v.iov_len;
            *at += 1;
        } else {
            v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
}
