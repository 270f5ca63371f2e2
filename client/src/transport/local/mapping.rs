//! The client's view of a same-host owner's pool: the memfd received over the owner's socket,
//! mapped shared, and the copies in and out of it. Copies happen only inside ranges the owner
//! has locked for this client (see `LocalOwner`), and every offset is checked against the pool.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    sync::Arc,
};

use memmap2::{MmapOptions, MmapRaw};
use mooncake_common::memcopy::copy_streaming;

/// Values read out at least this large are copied with streaming stores: a buffer of many of them
/// outgrows the cache anyway and is handed on (to a device, a file or a socket) rather than read
/// at once, so reading each destination line in first only costs. Smaller ones go through the
/// cache, where a caller reading them next finds them.
const STREAM_OUT_MIN: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
#[error("range [{offset}, +{len}) is outside the mapped pool of {size} bytes")]
pub struct OutOfRange {
    offset: u64,
    len: u64,
    size: u64,
}

/// Clones share the one mapping.
#[derive(Clone)]
pub struct SharedPool {
    map: Arc<MmapRaw>,
    len: u64,
    /// The memory file mapped (device and inode): a file it keeps alive, so no other file
    /// takes its number while it is mapped.
    file: (u64, u64),
}

/// Faults in the page tables of the whole mapping, writable where the kernel can (MAP_POPULATE
/// maps shared pages read-only, so every first write would still fault).
fn prefault(map: &MmapRaw) {
    // SAFETY: the range is exactly the mapping, kept alive by the caller's reference; madvise
    // does not touch contents.
    let rc = unsafe {
        libc::madvise(
            map.as_mut_ptr().cast(),
            map.len(),
            libc::MADV_POPULATE_WRITE,
        )
    };
    if rc != 0 {
        // Before Linux 5.14: read-populate. SAFETY: as above.
        unsafe { libc::madvise(map.as_mut_ptr().cast(), map.len(), libc::MADV_WILLNEED) };
    }
}

impl SharedPool {
    /// Maps the whole pool and starts pre-faulting its page tables on a thread of its own, so
    /// copies take no faults once it is done, and the first call does not wait for it (a large
    /// pool takes seconds: about 0.6 s per GiB here).
    pub fn map(fd: OwnedFd, len: u64) -> io::Result<SharedPool> {
        Self::map_or_reuse(fd, len, None)
    }

    /// `map`, unless `old` maps this very memory file (as `fd` names it) at this length: then
    /// `old`'s mapping, shared. A connection to an owner that broke and is made again need not
    /// map (and pre-fault) a pool of hundreds of GiB again.
    pub fn map_or_reuse(fd: OwnedFd, len: u64, old: Option<&SharedPool>) -> io::Result<SharedPool> {
        let file = File::from(fd);
        let meta = file.metadata()?;
        if let Some(old) = old {
            if len == old.len && (meta.dev(), meta.ino()) == old.file {
                return Ok(old.clone());
            }
        }
        // SAFETY: a valid descriptor owned by `file`; F_GET_SEALS fails on anything but a
        // memory file.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            // Another client could truncate it: every copy through the mapping could then die
            // with SIGBUS.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the owner's pool is not a memory file sealed against shrinking; refusing to map it",
            ));
        }
        let actual = meta.len();
        if actual < len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("owner announced a pool of {len} bytes but the memfd has {actual}"),
            ));
        }
        let map = Arc::new(MmapOptions::new().len(len as usize).map_raw(&file)?);
        let held = Arc::clone(&map);
        let spawned = std::thread::Builder::new()
            .name("mooncake-prefault".into())
            .spawn(move || prefault(&held));
        if spawned.is_err() {
            prefault(&map);
        }
        Ok(SharedPool {
            map,
            len,
            file: (meta.dev(), meta.ino()),
        })
    }

    /// Whether `self` and `other` are one mapping.
    pub fn shares_mapping_with(&self, other: &SharedPool) -> bool {
        Arc::ptr_eq(&self.map, &other.map)
    }

    /// Whether `fd` (as an owner's hello sent it) is the memory file this pool maps, of the
    /// same length. A restarted owner sends another: copies through this mapping would miss its
    /// pool.
    pub fn maps(&self, fd: OwnedFd, len: u64) -> io::Result<bool> {
        let meta = File::from(fd).metadata()?;
        Ok(len == self.len && (meta.dev(), meta.ino()) == self.file)
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), OutOfRange> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OutOfRange {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies the concatenation of `parts` to `offset`. The owner holds the range locked for
    /// this client's write.
    pub fn copy_in(&self, offset: u64, parts: &[&[u8]]) -> Result<(), OutOfRange> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        self.check(offset, total)?;
        let mut at = offset as usize;
        for p in parts {
            // SAFETY: [at, at + p.len()) lies inside the mapping (checked above); the owner has
            // locked the range exclusively for this client, so no reader or writer it serves
            // overlaps it (nor does another copy of this batch: its ranges are disjoint), and `p`
            // is caller memory that cannot overlap a mapping we created.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), p.len()) };
            // Read back much later, by then out of cache: streaming stores (see `memcopy`).
            copy_streaming(dst, p);
            at += p.len();
        }
        Ok(())
    }

    /// Fills `parts`, in order, from `offset`. The owner holds the range locked for this
    /// client's read and has checked it holds the key.
    pub fn copy_out(&self, offset: u64, parts: &mut [&mut [u8]]) -> Result<(), OutOfRange> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        self.check(offset, total)?;
        let mut at = offset as usize;
        for p in parts.iter_mut() {
            // SAFETY: as in `copy_in`; the read lock keeps writers of this owner out of the range
            // while we copy, and `p` is caller memory disjoint from the mapping.
            let src = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), p.len()) };
            if p.len() >= STREAM_OUT_MIN {
                copy_streaming(p, src);
            } else {
                p.copy_from_slice(src);
            }
            at += p.len();
        }
        Ok(())
    }
}

/// Receives up to `buf.len()` bytes and at most one file descriptor (SCM_RIGHTS) from the
/// connected Unix socket `sock`.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size from its argument.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    // Of u64s: the cmsghdrs read through pointers below need 8-byte alignment, which a byte
    // buffer does not promise.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is a valid empty header; the pointers set below refer to live
    // buffers that outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: `sock` is a valid socket; MSG_CMSG_CLOEXEC keeps a received fd out of children.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: the kernel filled `msg_control`/`msg_controllen` (8-byte aligned, as cmsghdrs
    // need); CMSG_FIRSTHDR/NXTHDR walk only within them, and an SCM_RIGHTS message carries ints.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh memory file of `len` bytes.
    fn memfd(len: u64) -> OwnedFd {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor it returns is owned
        // by nothing else.
        let fd = unsafe {
            let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
            let fd = libc::memfd_create(c"pool".as_ptr(), flags);
            assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
            OwnedFd::from_raw_fd(fd)
        };
        File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
        fd
    }

    /// `memfd`, sealed at its size as an owner's pool is.
    fn sealed(len: u64) -> OwnedFd {
        let fd = memfd(len);
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid descriptor; valid seal flags.
        assert_eq!(
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) },
            0
        );
        fd
    }

    /// A pool another client could truncate (not sealed) is refused: a copy through its
    /// mapping could die with SIGBUS.
    #[test]
    fn a_pool_that_can_shrink_is_not_mapped() {
        let e = SharedPool::map(memfd(1 << 20), 1 << 20).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(SharedPool::map(sealed(1 << 20), 1 << 20).is_ok());
    }

    #[test]
    fn a_pool_is_mapped_again_only_when_it_is_another_memory_file() {
        let first = sealed(1 << 20);
        let pool = SharedPool::map(first.try_clone().unwrap(), 1 << 20).unwrap();
        // The same file (another descriptor of it, as a new hello sends): the same mapping.
        let again = SharedPool::map_or_reuse(first.try_clone().unwrap(), 1 << 20, Some(&pool));
        assert!(again.unwrap().shares_mapping_with(&pool));
        // A restarted owner's pool is another file: mapped anew.
        let other = SharedPool::map_or_reuse(sealed(1 << 20), 1 << 20, Some(&pool)).unwrap();
        assert!(!other.shares_mapping_with(&pool));
        // The same file announced at another length: mapped anew, at that length.
        let shorter = SharedPool::map_or_reuse(first, 1 << 19, Some(&pool)).unwrap();
        assert!(!shorter.shares_mapping_with(&pool));
        pool.copy_in(0, &[b"abc"]).unwrap();
    }
}
