//! Which key each written range of the pool holds, as named by the writes. Reads are checked
//! against it, so stale metadata can never return another key's bytes, and a restarted master can
//! later rebuild its object map from what owners report.

use std::collections::BTreeMap;

use mooncake_common::ObjectKey;
use parking_lot::Mutex;

#[derive(Default)]
pub struct KeyIndex {
    ranges: Mutex<BTreeMap<u64, (ObjectKey, u64)>>,
}

impl KeyIndex {
    /// Records that `[offset, offset + len)` now holds `key`, forgetting every range it overlaps.
    pub fn record(&self, offset: u64, len: u64, key: ObjectKey) {
        let mut ranges = self.ranges.lock();
        // Usually the range was last written as one object starting at the same offset (the
        // master reuses freed space as it was carved): the last range starting before the end
        // then starts at `offset`, nothing else overlaps (earlier ranges end at or before it),
        // and the entry is replaced where it lies, one lookup instead of three.
        if let Some((&start, slot)) = ranges.range_mut(..offset + len).next_back() {
            if start == offset {
                let old = std::mem::replace(slot, (key, len));
                drop(ranges);
                drop(old);
                return;
            }
        }
        Self::remove_overlapping(&mut ranges, offset, len);
        ranges.insert(offset, (key, len));
    }

    /// Forgets every recorded range overlapping `[offset, offset + len)`.
    pub fn forget(&self, offset: u64, len: u64) {
        Self::remove_overlapping(&mut self.ranges.lock(), offset, len);
    }

    fn remove_overlapping(ranges: &mut BTreeMap<u64, (ObjectKey, u64)>, offset: u64, len: u64) {
        let end = offset + len;
        // Recorded ranges never overlap, so the last one starting before `end` either overlaps
        // or ends at or before `offset`, and then so does every earlier one. Usually there is
        // none, and this is one lookup.
        while let Some((&start, _)) = ranges
            .range(..end)
            .next_back()
            .filter(|(start, (_, l))| **start + *l > offset)
        {
            ranges.remove(&start);
        }
    }

    /// Whether the range starting at `offset` was last written as `key` with at least `len` bytes.
    pub fn holds(&self, offset: u64, len: u64, key: &ObjectKey) -> bool {
        matches!(self.ranges.lock().get(&offset), Some((k, l)) if k == key && *l >= len)
    }

    /// Every recorded (offset, len, key), in offset order.
    pub fn snapshot(&self) -> Vec<(u64, u64, ObjectKey)> {
        self.ranges
            .lock()
            .iter()
            .map(|(o, (k, l))| (*o, *l, k.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> ObjectKey {
        ObjectKey::new(s).unwrap()
    }

    #[test]
    fn overlapping_writes_replace_older_ranges() {
        let idx = KeyIndex::default();
        idx.record(0, 100, k("a"));
        idx.record(100, 100, k("b"));
        idx.record(300, 50, k("c"));
        assert!(idx.holds(0, 100, &k("a")));
        assert!(!idx.holds(0, 101, &k("a")));
        assert!(!idx.holds(0, 10, &k("b")));
        idx.record(50, 100, k("d")); // overlaps the end of a and the start of b
        assert!(!idx.holds(0, 1, &k("a")));
        assert!(!idx.holds(100, 1, &k("b")));
        assert!(idx.holds(50, 100, &k("d")));
        assert!(idx.holds(300, 50, &k("c")));
        idx.record(200, 100, k("e")); // touches c's start but does not overlap
        assert_eq!(idx.snapshot().len(), 3);
        idx.forget(250, 60);
        assert!(!idx.holds(200, 100, &k("e")) && !idx.holds(300, 50, &k("c")));
        assert!(idx.holds(50, 100, &k("d")));
    }
}
