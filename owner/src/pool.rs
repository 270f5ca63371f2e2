//! The owner's memory pool: one shared memfd mapping, pre-faulted and locked where permitted, so a
//! later same-host path can hand the fd to local clients. This module owns every raw access to
//! the pool. Accesses go through range guards that keep concurrent accesses from aliasing: any
//! number of readers may share a range, a writer has it alone, and a conflicting access is refused
//! (the master never hands out overlapping live ranges, so a conflict means a stale or misbehaving
//! peer). One exception: writes carry the grant (put id) they were issued under, and the master
//! grants a range again only after its earlier grant ended, so of two writes that meet, the one
//! with the older grant is stale (a transfer abandoned by its client, still draining from a
//! socket). A newer write supersedes it (`write_range_granted`): the older one is told to stop at
//! its next chunk, and the newer one takes the range as soon as it is let go. An older write
//! that meets a newer one is refused. A granted write that meets readers waits for them (up to
//! its patience): the master ends a read lease when the reader says it is done, which can reach
//! it a moment before the owner has finished sending that reader's last bytes.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd},
    ptr::NonNull,
    sync::Arc,
};

use memmap2::{MmapMut, MmapOptions};

use crate::ranges::{ActiveRanges, Holders};
use parking_lot::Mutex;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("range [{offset}, +{len}) is outside the segment of {size} bytes")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("range [{offset}, +{len}) is being accessed by a conflicting transfer")]
    Busy {
        offset: u64,
        len: u64,
        /// The access in the way is a write.
        by_write: bool,
    },
    #[error("range [{offset}, +{len}) was granted again (put {newer}) after this write's grant (put {grant}); the write is stale")]
    Stale {
        offset: u64,
        len: u64,
        grant: u64,
        newer: u64,
    },
}

impl RangeError {
    /// A range outside the segment is the caller's mistake; a busy one is worth retrying.
    pub fn code(&self) -> mooncake_common::Code {
        match self {
            RangeError::OutOfBounds { .. } => mooncake_common::Code::InvalidParams,
            RangeError::Busy { .. } | RangeError::Stale { .. } => {
                mooncake_common::Code::TransferFail
            }
        }
    }
}

pub struct MemoryPool {
    base: NonNull<u8>,
    len: u64,
    locked: bool,
    active: Mutex<ActiveRanges>,
    /// Wakes writes waiting for a range (`write_range_granted`) when any range is released.
    released: tokio::sync::Notify,
    /// Writes waiting in `write_range_granted`: releases notify only while there are some.
    waiting: std::sync::atomic::AtomicUsize,
    /// Wakes writes that were superseded (see `Supersession`).
    superseding: tokio::sync::Notify,
    /// Writes marked superseded so far: while it has not moved, no write has been.
    supersessions: std::sync::atomic::AtomicU64,
    // Keeps the mapping alive; `base` points into it.
    _map: MmapMut,
    file: File,
}

// SAFETY: the pool is a fixed mapping that lives as long as the struct; all access to its bytes
// goes through guards that the `active` mutex keeps from aliasing mutably.
unsafe impl Send for MemoryPool {}
// SAFETY: as above; shared references only hand out guards, never unsynchronised slices.
unsafe impl Sync for MemoryPool {}

impl MemoryPool {
    /// Creates a memfd of `size` bytes, maps it shared and pre-faults it. With `lock`, tries to
    /// mlock it and warns (does not fail) when the limit does not permit.
    pub fn create(size: u64, lock: bool) -> io::Result<MemoryPool> {
        if size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "segment size must be greater than zero",
            ));
        }
        let len = usize::try_from(size).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "segment size does not fit the address space",
            )
        })?;
        let name = c"mooncake-segment";
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)?;
        // Sealed at its size before any client gets it: a same-host client that truncated the
        // file would cut the pages out of every mapping, this one included (SIGBUS on the next
        // access), and clients refuse to map a pool that is not sealed.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid descriptor this function owns; valid seal flags.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the memfd's size is fixed above and sealed: nothing can truncate it while
        // mapped.
        let mut map = unsafe { MmapOptions::new().len(len).populate().map_mut(&file)? };
        let base = NonNull::new(map.as_mut_ptr()).expect("mmap never returns null");
        // MAP_POPULATE maps shared pages read-only; fault them in writable now (Linux 5.14+) so
        // the first write of every page does not fault on the data path.
        // SAFETY: the range is exactly the mapping created above; madvise leaves contents alone.
        unsafe { libc::madvise(base.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
        let mut locked = false;
        if lock {
            // SAFETY: the range is exactly the mapping created above.
            let rc = unsafe { libc::mlock(base.as_ptr().cast(), len) };
            if rc == 0 {
                locked = true;
            } else {
                tracing::warn!(error = %io::Error::last_os_error(), size,
                    "cannot lock the segment in memory (raise `ulimit -l` or grant CAP_IPC_LOCK); it may be swapped");
            }
        }
        Ok(MemoryPool {
            base,
            len: size,
            locked,
            active: Mutex::new(ActiveRanges::default()),
            released: tokio::sync::Notify::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            superseding: tokio::sync::Notify::new(),
            supersessions: std::sync::atomic::AtomicU64::new(0),
            _map: map,
            file,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The memfd behind the pool, for handing to same-host clients.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), RangeError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(RangeError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Exclusive access to `[offset, offset + len)` for a write without a grant.
    pub fn write_range(&self, offset: u64, len: u64) -> Result<WriteGuard<'_>, RangeError> {
        let seen = self.acquire(offset, len, true)?;
        Ok(WriteGuard {
            pool: self,
            offset,
            len,
            grant: 0,
            seen,
        })
    }

    /// Exclusive access to `[offset, offset + len)` for a write under `grant`. Writes of older
    /// grants in the way are superseded and waited for, and reads in the way waited for, up to
    /// `patience` (see the module's doc); a newer write in the way, or an access still there at
    /// the deadline, is a refusal.
    pub async fn write_range_granted(
        &self,
        offset: u64,
        len: u64,
        grant: u64,
        patience: std::time::Duration,
    ) -> Result<WriteGuard<'_>, RangeError> {
        let seen = self.take_for_write(offset, len, grant, patience).await?;
        Ok(WriteGuard {
            pool: self,
            offset,
            len,
            grant,
            seen,
        })
    }

    /// Takes the range for a write under `grant`, waiting as `write_range_granted` says; the
    /// supersession count when it was taken.
    async fn take_for_write(
        &self,
        offset: u64,
        len: u64,
        grant: u64,
        patience: std::time::Duration,
    ) -> Result<u64, RangeError> {
        // The usual case: nothing in the way, nothing to register.
        if let Some(seen) = self.try_write(offset, len, grant)? {
            return Ok(seen);
        }
        let deadline = tokio::time::Instant::now() + patience;
        let _waiting = Waiting::register(&self.waiting);
        loop {
            // Registered before trying, so a release in between is not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            match self.try_write(offset, len, grant) {
                Ok(Some(seen)) => return Ok(seen),
                Ok(None) if tokio::time::Instant::now() < deadline => {
                    let _ = tokio::time::timeout_at(deadline, released).await;
                }
                Ok(None) => {
                    let by_write = self
                        .active
                        .lock()
                        .overlapping(offset, offset + len)
                        .any(|(_, h)| h.is_write());
                    return Err(RangeError::Busy {
                        offset,
                        len,
                        by_write,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the range for a write under `grant` (with the supersession count then, read under
    /// the same lock: a supersession right after it is seen by the write), or marks the older
    /// writes in the way superseded and wakes them (None: wait for their release, and for
    /// readers in the way).
    fn try_write(&self, offset: u64, len: u64, grant: u64) -> Result<Option<u64>, RangeError> {
        self.check_range(offset, len)?;
        let (start, end) = (offset, offset + len);
        let mut active = self.active.lock();
        let (mut older, mut readers) = (false, false);
        for (_, holders) in active.overlapping(start, end) {
            let Holders::Writer { grant: theirs, .. } = holders else {
                readers = true;
                continue;
            };
            if theirs > grant {
                return Err(RangeError::Stale {
                    offset,
                    len,
                    grant,
                    newer: theirs,
                });
            }
            // The same grant twice (or two writes without one) is a conflict, not a supersession.
            if theirs == grant {
                return Err(RangeError::Busy {
                    offset,
                    len,
                    by_write: true,
                });
            }
            older = true;
        }
        if older {
            // Told once: a waiting writer tries again at every release in the pool, and each
            // word wakes every write under way to look.
            if active.supersede(start, end) {
                self.supersessions
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(active);
                self.superseding.notify_waiters();
            }
            return Ok(None);
        }
        if readers {
            return Ok(None);
        }
        active.add_writer(start, end, grant);
        Ok(Some(
            self.supersessions.load(std::sync::atomic::Ordering::SeqCst),
        ))
    }

    /// Shared access to `[offset, offset + len)`.
    pub fn read_range(&self, offset: u64, len: u64) -> Result<ReadGuard<'_>, RangeError> {
        self.acquire(offset, len, false)?;
        Ok(ReadGuard {
            pool: self,
            offset,
            len,
        })
    }

    /// Shared access to `[offset, offset + len)` that owns a handle to the pool, so the bytes can
    /// wait in a queue of replies until they are sent.
    pub fn read_range_owned(
        self: &Arc<Self>,
        offset: u64,
        len: u64,
    ) -> Result<PoolSlice, RangeError> {
        self.acquire(offset, len, false)?;
        Ok(PoolSlice {
            pool: self.clone(),
            offset,
            len,
        })
    }

    /// Holds `[offset, offset + len)` for reading on behalf of a same-host client that copies
    /// through its own mapping: conflicting transfers are refused until the lock is dropped. No
    /// bytes are exposed here.
    pub fn lock_range(self: &Arc<Self>, offset: u64, len: u64) -> Result<RangeLock, RangeError> {
        self.acquire(offset, len, false)?;
        Ok(RangeLock {
            pool: self.clone(),
            offset,
            len,
            write: false,
            grant: 0,
        })
    }

    /// A range held for a write under `grant` on behalf of a same-host client, waiting for
    /// what is in the way as `write_range_granted` does. A newer grant's write waits for this
    /// one (the copy runs in the client and cannot be stopped) and an older one is refused.
    pub async fn lock_range_granted(
        self: &Arc<Self>,
        offset: u64,
        len: u64,
        grant: u64,
        patience: std::time::Duration,
    ) -> Result<RangeLock, RangeError> {
        self.take_for_write(offset, len, grant, patience).await?;
        Ok(RangeLock {
            pool: self.clone(),
            offset,
            len,
            write: true,
            grant,
        })
    }

    /// Takes the range; the supersession count then (see `try_write`).
    fn acquire(&self, offset: u64, len: u64, write: bool) -> Result<u64, RangeError> {
        self.check_range(offset, len)?;
        let (start, end) = (offset, offset + len);
        let mut active = self.active.lock();
        if let Some((_, holders)) = active
            .overlapping(start, end)
            .find(|(_, h)| write || h.is_write())
        {
            return Err(RangeError::Busy {
                offset,
                len,
                by_write: holders.is_write(),
            });
        }
        if write {
            active.add_writer(start, end, 0);
        } else {
            active.add_reader(start, end);
        }
        Ok(self.supersessions.load(std::sync::atomic::Ordering::SeqCst))
    }

    fn release(&self, offset: u64, len: u64, write: bool, grant: u64) {
        self.active
            .lock()
            .remove(offset, offset + len, write, grant);
        // Pairs with the waiter's increment before it tries (both SeqCst): a waiter that tried
        // before this release was counted, so it is woken.
        if self.waiting.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.released.notify_waiters();
        }
    }

    fn ptr(&self, offset: u64) -> *mut u8 {
        // SAFETY: callers pass an offset checked by `check_range`, so it is inside the mapping.
        unsafe { self.base.as_ptr().add(offset as usize) }
    }
}

/// A range held on behalf of a same-host client; released when dropped.
pub struct RangeLock {
    pool: Arc<MemoryPool>,
    offset: u64,
    len: u64,
    write: bool,
    grant: u64,
}

impl Drop for RangeLock {
    fn drop(&mut self) {
        self.pool
            .release(self.offset, self.len, self.write, self.grant);
    }
}

/// Exclusive access to a range of the pool; derefs to a mutable slice.
pub struct WriteGuard<'a> {
    pool: &'a MemoryPool,
    offset: u64,
    len: u64,
    grant: u64,
    /// `MemoryPool::supersessions` when the range was taken.
    seen: u64,
}

impl<'a> WriteGuard<'a> {
    /// What tells this write that a newer grant's write wants its range; it borrows the pool,
    /// not the guard, so the write can go on filling the range while it listens.
    pub fn supersession(&self) -> Supersession<'a> {
        Supersession {
            pool: self.pool,
            start: self.offset,
            end: self.offset + self.len,
            grant: self.grant,
            seen: self.seen,
        }
    }
}

/// Whether a write was superseded: then it must stop writing and let its range go.
#[derive(Clone, Copy)]
pub struct Supersession<'a> {
    pool: &'a MemoryPool,
    start: u64,
    end: u64,
    grant: u64,
    /// `MemoryPool::supersessions` when the write took its range.
    seen: u64,
}

impl Supersession<'_> {
    pub fn is_superseded(&self) -> bool {
        // One atomic load while nothing was superseded anywhere in the pool since the write began.
        if self
            .pool
            .supersessions
            .load(std::sync::atomic::Ordering::SeqCst)
            == self.seen
        {
            return false;
        }
        self.pool
            .active
            .lock()
            .is_superseded(self.start, self.end, self.grant)
    }

    /// Finishes once the write is superseded (never, for a write that is not).
    pub async fn superseded(&self) {
        loop {
            let woken = self.pool.superseding.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.is_superseded() {
                return;
            }
            woken.await;
        }
    }
}

impl std::ops::Deref for WriteGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside the mapping and registered as written by this guard only.
        unsafe { std::slice::from_raw_parts(self.pool.ptr(self.offset), self.len as usize) }
    }
}

impl std::ops::DerefMut for WriteGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; no other guard overlaps an exclusive range, and `&mut self`
        // makes this the only live slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.pool.ptr(self.offset), self.len as usize) }
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.pool.release(self.offset, self.len, true, self.grant);
    }
}

/// Shared access to a range of the pool; derefs to a slice.
pub struct ReadGuard<'a> {
    pool: &'a MemoryPool,
    offset: u64,
    len: u64,
}

impl std::ops::Deref for ReadGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside the mapping and no exclusive guard overlaps it while this
        // guard lives.
        unsafe { std::slice::from_raw_parts(self.pool.ptr(self.offset), self.len as usize) }
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.pool.release(self.offset, self.len, false, 0);
    }
}

/// A range held for reading with its own handle to the pool; derefs to a slice.
pub struct PoolSlice {
    pool: Arc<MemoryPool>,
    offset: u64,
    len: u64,
}

impl std::ops::Deref for PoolSlice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside the mapping (checked at acquire), the mapping lives as long
        // as `pool`, and no exclusive guard overlaps the range while this one is registered.
        unsafe { std::slice::from_raw_parts(self.pool.ptr(self.offset), self.len as usize) }
    }
}

impl Drop for PoolSlice {
    fn drop(&mut self) {
        self.pool.release(self.offset, self.len, false, 0);
    }
}

/// A write counted in `MemoryPool::waiting` until dropped (also when its future is cancelled).
struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Waiting<'a> {
    fn register(count: &'a std::sync::atomic::AtomicUsize) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool's memory file cannot change size: a same-host client holding it cannot cut the
    /// pages out from under the owner's mapping and every other client's.
    #[test]
    fn the_pools_memory_file_is_sealed_at_its_size() {
        let pool = MemoryPool::create(1 << 20, false).unwrap();
        let file = File::from(pool.memfd().try_clone_to_owned().unwrap());
        for len in [0, 4096, 2 << 20] {
            let e = file.set_len(len).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "set_len({len}): {e}");
        }
        let mut w = pool.write_range(0, 4).unwrap();
        w.copy_from_slice(b"live");
    }

    #[test]
    fn ranges_are_checked_and_conflicts_refused() {
        let pool = MemoryPool::create(1 << 20, false).unwrap();
        assert!(pool.check_range(0, 1 << 20).is_ok());
        assert!(pool.check_range(1, 1 << 20).is_err());
        assert!(pool.check_range(u64::MAX, 2).is_err());
        {
            let mut w = pool.write_range(100, 10).unwrap();
            w.copy_from_slice(&[7u8; 10]);
            assert!(matches!(
                pool.read_range(105, 10),
                Err(RangeError::Busy { .. })
            ));
            assert!(
                pool.write_range(110, 10).is_ok(),
                "adjacent ranges do not conflict"
            );
        }
        let r1 = pool.read_range(100, 10).unwrap();
        let r2 = pool.read_range(95, 10).unwrap();
        assert_eq!(&r1[..], &[7u8; 10]);
        assert_eq!(r2[5..], [7u8; 5]);
        assert!(pool.write_range(90, 20).is_err());
        drop((r1, r2));
        assert!(pool.write_range(90, 20).is_ok());
    }

    #[test]
    fn an_owned_read_holds_its_range_until_dropped() {
        let pool = Arc::new(MemoryPool::create(1 << 20, false).unwrap());
        pool.write_range(0, 4).unwrap().copy_from_slice(b"abcd");
        let slice = pool.read_range_owned(0, 4).unwrap();
        assert_eq!(&slice[..], b"abcd");
        assert!(
            pool.write_range(2, 4).is_err(),
            "a writer waits for the reader"
        );
        assert!(pool.read_range(0, 4).is_ok(), "readers share");
        drop(slice);
        assert!(pool.write_range(2, 4).is_ok());
    }

    #[test]
    fn zero_size_is_refused() {
        assert!(MemoryPool::create(0, false).is_err());
    }

    /// A write that asks whether it was superseded only after a newer grant superseded it
    /// (the data plane takes the range, then looks at the catalog, then listens) still learns
    /// it: before, it compared against the count when it asked, and kept writing while the
    /// newer write waited out its patience.
    #[tokio::test]
    async fn a_supersession_before_the_write_listens_is_not_missed() {
        use std::time::Duration;
        let pool = Arc::new(MemoryPool::create(1 << 20, false).unwrap());
        let patience = Duration::from_secs(10);
        let stale = pool
            .write_range_granted(0, 4096, 5, patience)
            .await
            .unwrap();
        let newer = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.write_range_granted(0, 4096, 9, patience)
                    .await
                    .map(drop)
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(stale.supersession().is_superseded());
        drop(stale);
        tokio::time::timeout(Duration::from_secs(5), newer)
            .await
            .expect("the newer write took the range")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_newer_grant_supersedes_an_older_write_and_an_older_one_is_refused() {
        use std::time::{Duration, Instant};
        let pool = Arc::new(MemoryPool::create(1 << 20, false).unwrap());
        let patience = Duration::from_secs(10);
        let stale = pool
            .write_range_granted(0, 4096, 5, patience)
            .await
            .unwrap();
        let told = stale.supersession();
        assert!(!told.is_superseded());
        let newer = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut w = pool
                    .write_range_granted(1024, 4096, 9, patience)
                    .await
                    .unwrap();
                w.copy_from_slice(&[9u8; 4096]);
            })
        };
        // The stale write learns it was superseded, and the newer one waits until it lets go.
        tokio::time::timeout(Duration::from_secs(5), told.superseded())
            .await
            .expect("the older write is told");
        assert!(told.is_superseded());
        assert!(
            !newer.is_finished(),
            "the newer write waits for the release"
        );
        drop(stale);
        tokio::time::timeout(Duration::from_secs(5), newer)
            .await
            .expect("released writes wake the waiter")
            .unwrap();
        assert_eq!(&pool.read_range(1024, 4096).unwrap()[..], &[9u8; 4096]);

        // An older grant meeting a newer write is refused at once, as is the same grant twice.
        let held = pool
            .write_range_granted(0, 100, 20, patience)
            .await
            .unwrap();
        let t = Instant::now();
        assert!(matches!(
            pool.write_range_granted(50, 100, 19, patience).await,
            Err(RangeError::Stale { newer: 20, .. })
        ));
        assert!(matches!(
            pool.write_range_granted(50, 100, 20, patience).await,
            Err(RangeError::Busy { by_write: true, .. })
        ));
        assert!(t.elapsed() < Duration::from_secs(1));
        drop(held);

        // A reader in the way is waited for: the write goes ahead when it is done, or is refused
        // at the deadline; an older writer is waited for only until the deadline too.
        let reader = pool.read_range(0, 10).unwrap();
        let t = Instant::now();
        let refused = pool
            .write_range_granted(0, 10, 29, Duration::from_millis(100))
            .await;
        assert!(matches!(
            refused,
            Err(RangeError::Busy {
                by_write: false,
                ..
            })
        ));
        assert!(t.elapsed() >= Duration::from_millis(100));
        let pool2 = pool.clone();
        let waiting = tokio::spawn(async move {
            pool2
                .write_range_granted(0, 10, 30, patience)
                .await
                .map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "the write waits for the reader");
        drop(reader);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a finished read wakes the writer")
            .unwrap()
            .unwrap();
        let writer = pool.write_range_granted(0, 10, 31, patience).await.unwrap();
        let told = writer.supersession();
        let t = Instant::now();
        let refused = pool
            .write_range_granted(5, 10, 32, Duration::from_millis(100))
            .await;
        assert!(matches!(
            refused,
            Err(RangeError::Busy { by_write: true, .. })
        ));
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(told.is_superseded());
        drop(writer);
    }
}
