//! The only place that turns addresses into bytes: ranges inside regions the application
//! registered (it promised they stay valid until it unregisters them, and unregistering waits
//! for every `Use` of the region), buffers this engine allocates for `allocate_managed_buffer`,
//! and peers' managed buffers mapped for same-host copies.
//!
//! A transfer and the application touching the same bytes at once is the application's race, as
//! with RDMA: the engine only guarantees it never touches memory outside registered regions.
#![allow(unsafe_code)]

use std::{
    alloc::{alloc_zeroed, dealloc, Layout},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

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

/// A managed buffer: zeroed, page-aligned memory, in a memory file (`memfd`) where the OS has
/// one, so that a peer on this host can map the very pages and copy with plain `memcpy` (see
/// `Mapping`); in ordinary memory otherwise. Freed when dropped, memory and file together.
pub struct Managed {
    pub addr: u64,
    pub len: u64,
    /// The memory file behind the buffer (sealed at its length); None for ordinary memory.
    pub fd: Option<OwnedFd>,
}

impl Managed {
    /// A buffer of `len` bytes; None when memory is short or `len` is 0.
    pub fn allocate(len: u64) -> Option<Managed> {
        let n = usize::try_from(len).ok().filter(|&n| n > 0)?;
        if let Some(m) = Self::in_memory_file(len, n) {
            return Some(m);
        }
        let layout = Layout::from_size_align(n, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        (!p.is_null()).then_some(Managed {
            addr: p as usize as u64,
            len,
            fd: None,
        })
    }

    fn in_memory_file(len: u64, n: usize) -> Option<Managed> {
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: a constant, NUL-terminated name; the flags are valid.
        let raw = unsafe { libc::memfd_create(c"mooncake-managed".as_ptr(), flags) };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Sealed at its length: a peer's mapping can never find its pages cut away (SIGBUS), and
        // a peer can tell the file from any other (`Pidfd::map_file` checks the seals).
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid descriptor, a length that fits in off_t (from a usize), valid seals.
        let sized = unsafe {
            libc::ftruncate(fd.as_raw_fd(), n as libc::off_t) == 0
                && libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) == 0
        };
        if !sized {
            return None;
        }
        let p = map_shared(&fd, n).ok()?;
        Some(Managed {
            addr: p as u64,
            len,
            fd: Some(fd),
        })
    }
}

impl Drop for Managed {
    /// Frees the buffer; its owner drops it only once nothing uses it (its region was
    /// unregistered). A peer that mapped the memory file keeps the pages until it drops its
    /// mapping; this process's are gone, and the file is closed after them.
    fn drop(&mut self) {
        match self.fd {
            // SAFETY: the mapping `in_memory_file` made, with its length; no transfer uses it.
            Some(_) => unsafe {
                libc::munmap(self.addr as usize as *mut libc::c_void, self.len as usize);
            },
            None => {
                let layout =
                    Layout::from_size_align(self.len as usize, ALIGN).expect("allocated with it");
                // SAFETY: `addr` came from `alloc_zeroed` with this layout, and its region was
                // unregistered, so no transfer uses it any more.
                unsafe { dealloc(self.addr as usize as *mut u8, layout) }
            }
        }
    }
}

/// Maps the first `n` bytes of the file `fd` (at least that long), shared, readable and writable,
/// where the kernel places it. Not populated up front: that would give pages to every byte of a
/// buffer nobody has touched yet.
fn map_shared(fd: &OwnedFd, n: usize) -> std::io::Result<usize> {
    // SAFETY: a new mapping at an address the kernel picks, of a descriptor we hold; the caller
    // checked the file is long enough.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// A handle on a process of this host (`pidfd_open`): it tells when the process has exited, and
/// takes descriptors from it.
pub struct Pidfd {
    fd: OwnedFd,
}

impl Pidfd {
    pub fn open(pid: i32) -> std::io::Result<Pidfd> {
        // SAFETY: a plain system call on integers; the result is checked.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the descriptor is new and ours.
        Ok(Pidfd {
            fd: unsafe { OwnedFd::from_raw_fd(raw as i32) },
        })
    }

    /// Whether the process has exited.
    pub fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    /// Maps `len` bytes of the process's managed buffer held as descriptor `fd`. Taking a
    /// process's descriptor (`pidfd_getfd`) needs the permission `process_vm_readv` needs. The
    /// descriptor must be a memory file sealed against shrinking, at least `len` bytes long:
    /// anything else (another file, or a number reused) is refused, not mapped.
    pub fn map_file(&self, fd: i32, len: u64) -> std::io::Result<Mapping> {
        let n = usize::try_from(len)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| std::io::Error::other(format!("a mapping of {len} bytes")))?;
        let last = || std::io::Error::last_os_error();
        // SAFETY: a plain system call on integers; the result is checked.
        let theirs = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.fd.as_raw_fd(), fd, 0) };
        if theirs < 0 {
            return Err(last());
        }
        // SAFETY: the descriptor is new and ours.
        let file = unsafe { OwnedFd::from_raw_fd(theirs as i32) };
        // SAFETY: a valid descriptor; F_GET_SEALS fails on anything but a memory file.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        // SAFETY: `st` is plain data the call fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a pointer to `st`.
        let stat = unsafe { libc::fstat(file.as_raw_fd(), &mut st) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 || stat != 0 || (st.st_size as u64) < len {
            return Err(std::io::Error::other(format!(
                "descriptor {fd} of the peer is not a sealed memory file of {len} bytes"
            )));
        }
        // The file is at least `n` bytes long and cannot shrink.
        Ok(Mapping {
            addr: map_shared(&file, n)?,
            len: n,
        })
    }
}

/// A peer's memory file (a managed buffer of a process on this host) mapped into this process,
/// unmapped when dropped. Copies through it are plain `memcpy`s: about twice what
/// `process_vm_readv` moves, which copies in the kernel page by page.
pub struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// Copies between this process's registered memory and the mapped file: `pairs` of (local
    /// address, offset in the file, length); `read` copies the file's bytes into ours. Refused,
    /// with nothing copied, when a range (as the target answered it) runs past the mapping.
    pub fn copy(&self, read: bool, pairs: &[(u64, u64, u64)]) -> std::io::Result<()> {
        let inside = |&(_, off, n): &(u64, u64, u64)| {
            off.checked_add(n).is_some_and(|end| end <= self.len as u64)
        };
        if !pairs.iter().all(inside) {
            return Err(std::io::Error::other(
                "the target granted a range outside its buffer",
            ));
        }
        for &(local, off, n) in pairs {
            let mapped = (self.addr + off as usize) as *mut u8;
            let local = local as usize as *mut u8;
            // SAFETY: the local range lies in a region this process registered and holds a
            // `Use` of (the caller's duty, as for `copy_with_process`); the mapped range lies
            // inside this mapping (checked above), which the target granted for this copy and holds
            // until released. The two are different addresses; they reach the same pages only if
            // the application registered one buffer with two engines of one process, its own
            // race, as with any copy it runs into a buffer it is using.
            unsafe {
                if read {
                    std::ptr::copy_nonoverlapping(mapped, local, n as usize);
                } else {
                    std::ptr::copy_nonoverlapping(local, mapped, n as usize);
                }
            }
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `map_file` made; no copy runs through it any more (copies borrow
        // it).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
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
