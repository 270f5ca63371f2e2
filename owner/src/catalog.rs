//! What each written range of the pool holds, as named by the writes: key, length and stamp
//! (put id, replica count, pins). Reads are checked against it, so stale metadata can never
//! return another key's or another version's bytes; writes are fenced by it, so a write of an
//! older grant never lands over a newer one; and a master that lost its catalog rebuilds it from
//! what owners report from here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_common::{ObjectKey, Stamp};
use parking_lot::Mutex;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: ObjectKey,
    pub len: u64,
    /// The version and attributes reads and reports see.
    pub stamp: Stamp,
    /// The grant the bytes were written under: the put id for a put's write, a fresh one for a
    /// promotion's copy (which keeps the object's older put id as its version).
    pub grant: u64,
}

#[derive(Default)]
pub struct Catalog {
    ranges: Mutex<BTreeMap<u64, Entry>>,
    /// The largest grant any write brought here (landed or not): a master must issue larger ones.
    newest_grant: AtomicU64,
}

impl Catalog {
    /// Records that `[offset, offset + len)` now holds `key` as written under `grant`,
    /// forgetting every range it overlaps. An empty range holds nothing and is not recorded
    /// (the walks below rely on every recorded range having bytes).
    pub fn record(&self, offset: u64, len: u64, key: ObjectKey, stamp: Stamp, grant: u64) {
        if len == 0 {
            return;
        }
        let entry = Entry {
            key,
            len,
            stamp,
            grant,
        };
        let mut ranges = self.ranges.lock();
        // Usually the range was last written as one object starting at the same offset (the
        // master reuses freed space as it was carved): the last range starting before the end
        // then starts at `offset`, nothing else overlaps (earlier ranges end at or before it),
        // and the entry is replaced where it lies, one lookup instead of three.
        if let Some((&start, slot)) = ranges.range_mut(..offset + len).next_back() {
            if start == offset {
                let old = std::mem::replace(slot, entry);
                drop(ranges);
                drop(old);
                return;
            }
        }
        Self::remove_overlapping(&mut ranges, offset, len);
        ranges.insert(offset, entry);
    }

    /// Forgets every recorded range overlapping `[offset, offset + len)`.
    pub fn forget(&self, offset: u64, len: u64) {
        Self::remove_overlapping(&mut self.ranges.lock(), offset, len);
    }

    /// Forgets the range at `offset` if it still holds version `put_id` or an older one (the
    /// master says that object is gone, and with it any version the range held before: an
    /// upsert in place whose writer never came leaves the previous one here) under a grant
    /// older than `granted_before`; a newer write there, or a copy written since, stays.
    pub fn forget_version(&self, offset: u64, put_id: u64, granted_before: u64) -> bool {
        let mut ranges = self.ranges.lock();
        let held = matches!(ranges.get(&offset),
            Some(e) if e.stamp.put_id <= put_id && e.grant < granted_before);
        if held {
            ranges.remove(&offset);
        }
        held
    }

    fn remove_overlapping(ranges: &mut BTreeMap<u64, Entry>, offset: u64, len: u64) {
        loop {
            let Some(start) = Self::overlapping(ranges, offset, len).next() else {
                return;
            };
            ranges.remove(&start);
        }
    }

    /// Starts of the recorded ranges overlapping `[offset, offset + len)`, last first.
    fn overlapping(
        ranges: &BTreeMap<u64, Entry>,
        offset: u64,
        len: u64,
    ) -> impl Iterator<Item = u64> + '_ {
        // Recorded ranges never overlap, so walking back from the last one starting before the
        // end stops at the first that ends at or before `offset`. Usually there is none, and
        // this is one lookup. An empty range overlaps nothing (not the range it lies inside).
        ranges
            .range(..offset + len)
            .rev()
            .take_while(move |(start, e)| len > 0 && **start + e.len > offset)
            .map(|(start, _)| *start)
    }

    /// Whether the range starting at `offset` holds version `put_id` of `key` with at least
    /// `len` bytes.
    pub fn holds(&self, offset: u64, len: u64, key: &ObjectKey, put_id: u64) -> bool {
        matches!(self.ranges.lock().get(&offset),
            Some(e) if e.key == *key && e.len >= len && e.stamp.put_id == put_id)
    }

    /// Forgets the range at `offset` if it holds `key` at version `put_id` (as `holds` says),
    /// written under `grant`, under one lock: a write recorded there in between, even a later
    /// copy of the same version, is never forgotten instead.
    pub fn forget_if_holds(
        &self,
        offset: u64,
        len: u64,
        key: &ObjectKey,
        put_id: u64,
        grant: u64,
    ) -> bool {
        let mut ranges = self.ranges.lock();
        let held = matches!(ranges.get(&offset),
            Some(e) if e.key == *key && e.len >= len && e.stamp.put_id == put_id && e.grant == grant);
        if held {
            ranges.remove(&offset);
        }
        held
    }

    /// The newest grant recorded over `[offset, offset + len)` if it is newer than `grant`: a
    /// write under `grant` is stale and must not land.
    pub fn newer_than(&self, offset: u64, len: u64, grant: u64) -> Option<u64> {
        let ranges = self.ranges.lock();
        Self::overlapping(&ranges, offset, len)
            .map(|start| ranges[&start].grant)
            .max()
            .filter(|newest| *newest > grant)
    }

    /// Claims `[offset, offset + len)` for a write under `grant` whose range is already held
    /// (so nobody else records over it meanwhile): forgets what it held, or, when a newer grant's
    /// bytes are there, leaves it alone and returns that grant (the write is stale). One lock.
    pub fn claim(&self, offset: u64, len: u64, grant: u64) -> Option<u64> {
        let mut ranges = self.ranges.lock();
        let newest = Self::overlapping(&ranges, offset, len)
            .map(|start| ranges[&start].grant)
            .max();
        if let Some(newer) = newest.filter(|n| *n > grant) {
            return Some(newer);
        }
        Self::remove_overlapping(&mut ranges, offset, len);
        None
    }

    /// Notes a grant a write arrived with. Every write does, before it may record (the data
    /// plane relies on it to skip `newer_than` while no newer grant was ever seen).
    pub fn saw_grant(&self, grant: u64) {
        self.newest_grant.fetch_max(grant, Ordering::Relaxed);
    }

    /// The largest grant seen so far.
    pub fn newest_grant(&self) -> u64 {
        self.newest_grant.load(Ordering::Relaxed)
    }

    /// Every recorded (offset, entry), in offset order.
    pub fn snapshot(&self) -> Vec<(u64, Entry)> {
        self.ranges
            .lock()
            .iter()
            .map(|(o, e)| (*o, e.clone()))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.ranges.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> ObjectKey {
        ObjectKey::new(s).unwrap()
    }

    fn v(put_id: u64) -> Stamp {
        Stamp {
            put_id,
            replica_num: 1,
            ..Stamp::default()
        }
    }

    /// An empty range claims nothing: before, a zero-length write inside a recorded range
    /// (an ungated same-host client) forgot the object there.
    #[test]
    fn an_empty_range_overlaps_nothing() {
        let c = Catalog::default();
        c.record(0, 100, k("a"), v(7), 7);
        assert_eq!(c.claim(50, 0, 9), None);
        assert_eq!(c.newer_than(50, 0, 1), None);
        assert!(c.holds(0, 100, &k("a"), 7));
    }

    #[test]
    fn overlapping_writes_replace_older_ranges() {
        let c = Catalog::default();
        c.record(0, 100, k("a"), v(1), 1);
        c.record(100, 100, k("b"), v(2), 2);
        c.record(300, 50, k("c"), v(3), 3);
        assert!(c.holds(0, 100, &k("a"), 1));
        assert!(!c.holds(0, 100, &k("a"), 2), "another version");
        assert!(!c.holds(0, 101, &k("a"), 1));
        assert!(!c.holds(0, 10, &k("b"), 2));
        c.record(50, 100, k("d"), v(4), 4); // overlaps the end of a and the start of b
        assert!(!c.holds(0, 1, &k("a"), 1));
        assert!(!c.holds(100, 1, &k("b"), 2));
        assert!(c.holds(50, 100, &k("d"), 4));
        assert!(c.holds(300, 50, &k("c"), 3));
        c.record(200, 100, k("e"), v(5), 5); // touches c's start but does not overlap
        assert_eq!(c.snapshot().len(), 3);
        c.forget(250, 60);
        assert!(!c.holds(200, 100, &k("e"), 5) && !c.holds(300, 50, &k("c"), 3));
        assert!(c.holds(50, 100, &k("d"), 4));
    }

    #[test]
    fn a_write_older_than_what_a_range_holds_is_stale() {
        let c = Catalog::default();
        c.record(0, 100, k("a"), v(7), 7);
        c.record(100, 100, k("b"), v(9), 9);
        assert_eq!(c.newer_than(0, 100, 8), None);
        assert_eq!(c.newer_than(50, 100, 8), Some(9), "overlaps b");
        assert_eq!(c.newer_than(0, 100, 3), Some(7));
        assert_eq!(c.newer_than(200, 10, 1), None);
        c.saw_grant(12);
        c.saw_grant(4);
        assert_eq!(c.newest_grant(), 12);
    }

    #[test]
    fn a_freed_range_is_forgotten_only_while_it_holds_that_version_or_an_older_one() {
        let c = Catalog::default();
        c.record(0, 100, k("a"), v(7), 7);
        assert!(!c.forget_version(0, 6, 8), "another version");
        assert!(!c.forget_version(64, 7, 8), "another offset");
        assert!(c.holds(0, 100, &k("a"), 7));
        assert!(c.forget_version(0, 7, 8));
        assert!(c.snapshot().is_empty());
        // Rewritten by a newer put before the note arrived: the newer object stays.
        c.record(0, 100, k("b"), v(9), 9);
        assert!(!c.forget_version(0, 7, 8));
        assert!(c.holds(0, 100, &k("b"), 9));
        // A copy of the same version written under a grant issued after the note: it stays.
        c.record(200, 100, k("a"), v(7), 12);
        assert!(!c.forget_version(200, 7, 10));
        assert!(c.holds(200, 100, &k("a"), 7));
        // An upsert in place (version 11) revoked before its writer came: the range still
        // holds version 9, which went with it.
        assert!(c.forget_version(0, 11, 12));
        assert!(!c.holds(0, 100, &k("b"), 9));
    }

    #[test]
    fn a_range_is_forgotten_only_while_it_holds_that_key_and_version() {
        let c = Catalog::default();
        c.record(0, 100, k("a"), v(7), 12);
        assert!(!c.forget_if_holds(0, 100, &k("b"), 7, 12), "another key");
        assert!(
            !c.forget_if_holds(0, 100, &k("a"), 8, 12),
            "another version"
        );
        assert!(
            !c.forget_if_holds(0, 100, &k("a"), 7, 10),
            "a later copy of the version"
        );
        assert!(c.holds(0, 100, &k("a"), 7));
        assert!(c.forget_if_holds(0, 100, &k("a"), 7, 12));
        assert!(c.snapshot().is_empty());
    }
}
