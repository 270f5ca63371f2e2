//! The regions a process registered, and the uses that keep them registered: a transfer takes a
//! `Use` of every range it touches (on the caller for its buffers, on the target for the peer's
//! request) and unregistering waits until the region has none.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use mooncake_client::device::DeviceMemory;
use parking_lot::RwLock;
use tokio::sync::Notify;

use crate::EngineError;

struct Region {
    addr: u64,
    len: u64,
    /// Its place in the order of registration (as Mooncake lists a segment's buffers).
    seq: u64,
    /// The device whose memory this is (a GPU's): its bytes move only through the device's own
    /// copies and host staging, never as host memory.
    device: Option<Arc<dyn DeviceMemory>>,
    /// A managed buffer in a memory file, which a peer on this host may map.
    file: Option<MemoryFile>,
    users: AtomicUsize,
    idle: Notify,
    /// Unregisters under way: while any is, new uses are refused and the range still counts as
    /// taken. A count, so that one giving up does not let uses in under another still waiting.
    withdrawing: AtomicUsize,
}

/// The memory file behind a region: the descriptor this process holds it by, and a number no
/// other region of this process gets (a later buffer may reuse the descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryFile {
    pub fd: i32,
    pub id: u64,
}

/// Where a granted range lies in a memory file: what a peer on this host needs to map it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileRange {
    pub file: MemoryFile,
    /// The whole file's length (the region's).
    pub file_len: u64,
    /// The range's offset in the file.
    pub offset: u64,
}

/// An unregister under way: if it ends without removing the region (it gave up, or its caller
/// stopped waiting) and no other is under way, the region takes new uses again.
struct Withdrawal<'a> {
    region: &'a Region,
}

impl Drop for Withdrawal<'_> {
    fn drop(&mut self) {
        self.region.withdrawing.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A transfer's hold on the range `addr..addr + len` of a registered region.
pub struct Use {
    region: Arc<Region>,
    addr: u64,
    len: u64,
}

impl Use {
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr + len <= self.addr + self.len
    }

    /// The device the range belongs to; None for host memory.
    pub fn device(&self) -> Option<&Arc<dyn DeviceMemory>> {
        self.region.device.as_ref()
    }

    /// Where the range lies in its region's memory file, if the region is in one.
    pub fn file_range(&self) -> Option<FileRange> {
        self.region.file.map(|file| FileRange {
            file,
            file_len: self.region.len,
            offset: self.addr - self.region.addr,
        })
    }
}

impl Clone for Use {
    /// Another hold on the same range (for work that may outlive its caller's wait).
    fn clone(&self) -> Self {
        self.region.users.fetch_add(1, Ordering::AcqRel);
        Use {
            region: self.region.clone(),
            addr: self.addr,
            len: self.len,
        }
    }
}

impl Drop for Use {
    fn drop(&mut self) {
        if self.region.users.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.region.idle.notify_waiters();
        }
    }
}

#[derive(Default)]
pub struct Regions {
    by_addr: RwLock<BTreeMap<u64, Arc<Region>>>,
    /// Regions in memory files removed so far: a peer that sees it change drops the mappings
    /// it holds of this process's files that it no longer needs.
    files_removed: AtomicU64,
    /// The last `MemoryFile::id` given.
    last_file_id: AtomicU64,
    /// Regions registered so far (each region's `seq`).
    registered: AtomicU64,
}

impl Regions {
    /// Registers `addr..addr + len` of host memory, or of `device`'s; refused when empty,
    /// wrapping, or overlapping another.
    pub fn register(
        &self,
        addr: u64,
        len: u64,
        device: Option<Arc<dyn DeviceMemory>>,
    ) -> Result<(), EngineError> {
        self.insert(addr, len, device, None)
    }

    /// Registers a managed buffer that lies in the memory file `fd` (the whole file).
    pub fn register_file(&self, addr: u64, len: u64, fd: i32) -> Result<(), EngineError> {
        let id = self.last_file_id.fetch_add(1, Ordering::Relaxed) + 1;
        self.insert(addr, len, None, Some(MemoryFile { fd, id }))
    }

    /// How many regions in memory files were removed so far.
    pub fn files_removed(&self) -> u64 {
        self.files_removed.load(Ordering::Acquire)
    }

    fn insert(
        &self,
        addr: u64,
        len: u64,
        device: Option<Arc<dyn DeviceMemory>>,
        file: Option<MemoryFile>,
    ) -> Result<(), EngineError> {
        let end = addr
            .checked_add(len)
            .filter(|_| len > 0 && addr > 0)
            .ok_or_else(|| EngineError::Invalid(format!("region {addr:#x} of {len} bytes")))?;
        let mut map = self.by_addr.write();
        let before = map.range(..end).next_back();
        if before.is_some_and(|(_, r)| r.addr + r.len > addr) {
            return Err(EngineError::Overlapped { addr, len });
        }
        let seq = self.registered.fetch_add(1, Ordering::Relaxed);
        map.insert(
            addr,
            Arc::new(Region {
                addr,
                len,
                seq,
                device,
                file,
                users: AtomicUsize::new(0),
                withdrawing: AtomicUsize::new(0),
                idle: Notify::new(),
            }),
        );
        Ok(())
    }

    /// A use of `addr..addr + len`, which must lie inside one registered region.
    pub fn lookup(&self, addr: u64, len: u64) -> Result<Use, EngineError> {
        let refused = || EngineError::NotRegistered { addr, len };
        let end = addr.checked_add(len).ok_or_else(refused)?;
        let map = self.by_addr.read();
        let (_, r) = map.range(..=addr).next_back().ok_or_else(refused)?;
        if end > r.addr + r.len || r.withdrawing.load(Ordering::Acquire) > 0 {
            return Err(refused());
        }
        r.users.fetch_add(1, Ordering::AcqRel);
        Ok(Use {
            region: r.clone(),
            addr,
            len,
        })
    }

    /// Unregisters the region starting at `addr`: new transfers are refused at once, and this
    /// returns once the transfers using it are done. If they are not within `patience` (they
    /// have deadlines of their own, so only a longer-than-deadline wait gets here), the region
    /// stays registered and the caller must not free it.
    pub async fn unregister(&self, addr: u64, patience: Duration) -> Result<(), EngineError> {
        // Marked under the write lock: a lookup either came before (and is waited for) or sees
        // the mark. The region stays in the map meanwhile, so the range is still taken and a
        // second unregister finds it.
        let region = {
            let map = self.by_addr.write();
            let r = map
                .get(&addr)
                .cloned()
                .ok_or(EngineError::NotRegistered { addr, len: 0 })?;
            r.withdrawing.fetch_add(1, Ordering::AcqRel);
            r
        };
        // If this call is dropped before the end (its caller gave up), the region is usable
        // again rather than stuck half-withdrawn, unless another unregister still waits.
        let _withdrawal = Withdrawal { region: &region };
        let withdrawn = async {
            loop {
                let notified = region.idle.notified();
                if region.users.load(Ordering::Acquire) != 0 {
                    notified.await;
                    continue;
                }
                // Removed only if still idle under the write lock, which every lookup takes
                // the read side of.
                let mut map = self.by_addr.write();
                if region.users.load(Ordering::Acquire) != 0 {
                    continue;
                }
                if map.get(&addr).is_some_and(|r| Arc::ptr_eq(r, &region)) {
                    self.removed(&region);
                    map.remove(&addr);
                }
                return;
            }
        };
        tokio::time::timeout(patience, withdrawn)
            .await
            .map_err(|_| EngineError::Busy {
                addr,
                after: patience,
            })
    }

    /// Unregisters the region at `addr` at once if no transfer uses it: whether nothing uses
    /// it now (also when it was not registered); false (and left as it is) otherwise.
    pub fn remove_if_idle(&self, addr: u64) -> bool {
        let mut map = self.by_addr.write();
        match map.get(&addr) {
            Some(r) if r.users.load(Ordering::Acquire) == 0 => {
                self.removed(r);
                map.remove(&addr);
                true
            }
            Some(_) => false,
            None => true,
        }
    }

    /// The start of a registered region that overlaps `addr..addr + len`, if any (also one
    /// being unregistered: its transfers may still run).
    pub fn overlapping(&self, addr: u64, len: u64) -> Option<u64> {
        let end = addr.saturating_add(len);
        let map = self.by_addr.read();
        // Regions do not overlap each other: if the last one starting before `end` ends at or
        // before `addr`, so does every earlier one.
        let (_, r) = map.range(..end).next_back()?;
        (r.addr + r.len > addr).then_some(r.addr)
    }

    fn removed(&self, region: &Region) {
        if region.file.is_some() {
            self.files_removed.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Every region, (address, length), in the order they were registered: a peer's first
    /// buffer is the first of its live regions it registered, as with Mooncake.
    pub fn list(&self) -> Vec<(u64, u64)> {
        let mut regions: Vec<(u64, u64, u64)> = self
            .by_addr
            .read()
            .values()
            .map(|r| (r.seq, r.addr, r.len))
            .collect();
        regions.sort_unstable();
        regions.into_iter().map(|(_, a, l)| (a, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_and_ranges_outside_are_refused() {
        let r = Regions::default();
        r.register(0x1000, 0x1000, None).unwrap();
        r.register(0x3000, 0x1000, None).unwrap();
        for (a, l) in [
            (0x1800, 0x10),
            (0x0800, 0x1000),
            (0x2fff, 2),
            (0x1000, 0x3000),
        ] {
            assert!(
                matches!(r.register(a, l, None), Err(EngineError::Overlapped { .. })),
                "{a:#x}+{l:#x}"
            );
        }
        r.register(0x2000, 0x1000, None).unwrap(); // exactly between
        assert!(matches!(
            r.register(0, 10, None),
            Err(EngineError::Invalid(_))
        ));
        assert!(matches!(
            r.register(5, 0, None),
            Err(EngineError::Invalid(_))
        ));
        assert!(matches!(
            r.register(u64::MAX, 2, None),
            Err(EngineError::Invalid(_))
        ));
        assert!(r.lookup(0x1000, 0x1000).is_ok());
        assert!(r.lookup(0x1fff, 1).is_ok());
        // Inside the union of two regions but not of one: refused.
        assert!(r.lookup(0x1fff, 2).is_err());
        assert!(r.lookup(0x4000, 1).is_err());
        assert!(r.lookup(0x500, 1).is_err());
        assert!(r.lookup(u64::MAX - 1, 4).is_err());
        assert_eq!(r.list().len(), 3);
    }

    #[tokio::test]
    async fn unregister_waits_for_uses_and_refuses_new_ones() {
        let r = Arc::new(Regions::default());
        r.register(0x1000, 0x1000, None).unwrap();
        let held = r.lookup(0x1100, 0x10).unwrap();
        let r2 = r.clone();
        let waiter =
            tokio::spawn(async move { r2.unregister(0x1000, Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "waits while a transfer uses the region"
        );
        assert!(
            r.lookup(0x1100, 0x10).is_err(),
            "no new use once unregistering"
        );
        drop(held);
        waiter.await.unwrap().unwrap();
        assert!(r.list().is_empty());
        assert!(matches!(
            r.unregister(0x1000, Duration::from_secs(1)).await,
            Err(EngineError::NotRegistered { .. })
        ));
    }

    #[tokio::test]
    async fn while_unregistering_the_range_stays_taken_and_a_cancelled_unregister_undoes_itself() {
        let r = Arc::new(Regions::default());
        r.register(0x1000, 0x1000, None).unwrap();
        let held = r.lookup(0x1000, 0x10).unwrap();
        let (r1, r2) = (r.clone(), r.clone());
        let first =
            tokio::spawn(async move { r1.unregister(0x1000, Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Still taken: registering over it is refused, not a second region on the same bytes.
        assert!(matches!(
            r.register(0x1800, 0x10, None),
            Err(EngineError::Overlapped { .. })
        ));
        // A second unregister waits for the same uses.
        let second =
            tokio::spawn(async move { r2.unregister(0x1000, Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!first.is_finished() && !second.is_finished());
        drop(held);
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
        assert!(r.list().is_empty());
        // A caller that stops waiting leaves the region as it was: usable.
        r.register(0x1000, 0x1000, None).unwrap();
        let held = r.lookup(0x1000, 0x10).unwrap();
        let gave_up = tokio::time::timeout(
            Duration::from_millis(20),
            r.unregister(0x1000, Duration::from_secs(5)),
        )
        .await;
        assert!(gave_up.is_err());
        assert!(r.lookup(0x1000, 0x10).is_ok(), "usable again");
        drop(held);
    }

    #[tokio::test]
    async fn a_use_outlasting_patience_keeps_the_region_registered() {
        let r = Regions::default();
        r.register(0x1000, 0x1000, None).unwrap();
        let _held = r.lookup(0x1000, 1).unwrap();
        let e = r
            .unregister(0x1000, Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(e, EngineError::Busy { .. }));
        assert_eq!(e.code(), -4);
        assert_eq!(r.list(), vec![(0x1000, 0x1000)]);
    }

    /// Of two unregisters waiting on one use, the first giving up does not let new uses in
    /// under the second: that one would then remove a region a transfer still uses.
    #[tokio::test]
    async fn an_unregister_giving_up_leaves_the_region_closed_while_another_waits() {
        let r = Arc::new(Regions::default());
        r.register(0x1000, 0x1000, None).unwrap();
        let held = r.lookup(0x1000, 0x10).unwrap();
        let (r1, r2) = (r.clone(), r.clone());
        let impatient =
            tokio::spawn(async move { r1.unregister(0x1000, Duration::from_millis(100)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let patient =
            tokio::spawn(async move { r2.unregister(0x1000, Duration::from_secs(10)).await });
        let gave_up = impatient.await.unwrap();
        assert!(
            matches!(gave_up, Err(EngineError::Busy { .. })),
            "{gave_up:?}"
        );
        assert!(
            r.lookup(0x1000, 0x10).is_err(),
            "a new use while an unregister still waits"
        );
        assert!(!patient.is_finished());
        drop(held);
        patient.await.unwrap().unwrap();
        assert!(r.list().is_empty());
    }

    /// Listed in the order of registration, not of address: a peer's first buffer is the one
    /// it registered first (large mappings often lie below earlier ones).
    #[test]
    fn regions_are_listed_in_the_order_they_were_registered() {
        let r = Regions::default();
        r.register(0x9000, 0x100, None).unwrap();
        r.register(0x1000, 0x100, None).unwrap();
        r.register(0x5000, 0x100, None).unwrap();
        assert_eq!(
            r.list(),
            vec![(0x9000, 0x100), (0x1000, 0x100), (0x5000, 0x100)]
        );
        assert!(r.remove_if_idle(0x9000));
        r.register(0x9000, 0x100, None).unwrap();
        assert_eq!(
            r.list(),
            vec![(0x1000, 0x100), (0x5000, 0x100), (0x9000, 0x100)]
        );
    }
}
