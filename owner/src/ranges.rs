//! The accesses under way to a pool's ranges, indexed so that each check and change costs a
//! map lookup plus the accesses near the range, however many are under way: one begin frame
//! of a same-host client may hold a million ranges, and every other transfer checks against
//! them. Readers of one range share one entry with a count. Zero-length ranges touch no byte
//! and are not recorded.

use std::collections::BTreeMap;

/// Who holds one range: any number of readers, or one writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holders {
    Readers(u32),
    /// `grant` is 0 for a write without one; a superseded writer is waited on by a newer one.
    Writer {
        grant: u64,
        superseded: bool,
    },
}

impl Holders {
    pub fn is_write(&self) -> bool {
        matches!(self, Holders::Writer { .. })
    }
}

#[derive(Debug, Default)]
pub struct ActiveRanges {
    by_range: BTreeMap<(u64, u64), Holders>,
    /// The lengths of the ranges held, each with how many: the longest bounds how far before a
    /// range another range that overlaps it can start.
    lengths: BTreeMap<u64, u32>,
}

impl ActiveRanges {
    /// The held ranges `[s, e)` that share a byte with `[start, end)`, with their holders.
    pub fn overlapping(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = ((u64, u64), Holders)> + '_ {
        let longest = self.lengths.last_key_value().map_or(0, |(len, _)| *len);
        // A range starting before `start - longest` ends before `start`.
        let from = start.saturating_sub(longest);
        let upto = if start < end { end } else { from };
        self.by_range
            .range((from, 0)..(upto, 0))
            .filter(move |((s, e), _)| *s < end && start < *e)
            .map(|(r, h)| (*r, *h))
    }

    /// Records one more reader of `[start, end)`; the caller checked that no writer overlaps.
    pub fn add_reader(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        match self.by_range.get_mut(&(start, end)) {
            Some(Holders::Readers(n)) => *n += 1,
            Some(w) => debug_assert!(false, "a reader recorded over writer {w:?}"),
            None => self.insert(start, end, Holders::Readers(1)),
        }
    }

    /// Records the writer of `[start, end)`; the caller checked that nothing overlaps.
    pub fn add_writer(&mut self, start: u64, end: u64, grant: u64) {
        if start >= end {
            return;
        }
        debug_assert!(!self.by_range.contains_key(&(start, end)));
        let writer = Holders::Writer {
            grant,
            superseded: false,
        };
        self.insert(start, end, writer);
    }

    /// Forgets one reader (`write` false) or the writer under `grant` of `[start, end)`.
    pub fn remove(&mut self, start: u64, end: u64, write: bool, grant: u64) {
        let key = (start, end);
        let gone = match self.by_range.get_mut(&key) {
            Some(Holders::Readers(n)) if !write => {
                *n -= 1;
                *n == 0
            }
            Some(Holders::Writer { grant: g, .. }) if write && *g == grant => true,
            _ => false,
        };
        if gone {
            self.by_range.remove(&key);
            let len = end - start;
            if let Some(n) = self.lengths.get_mut(&len) {
                *n -= 1;
                if *n == 0 {
                    self.lengths.remove(&len);
                }
            }
        }
    }

    /// Marks every writer overlapping `[start, end)` superseded; whether one was newly marked
    /// (one marked already needs no second word).
    pub fn supersede(&mut self, start: u64, end: u64) -> bool {
        let writers: Vec<(u64, u64)> = self
            .overlapping(start, end)
            .filter(|(_, h)| h.is_write())
            .map(|(r, _)| r)
            .collect();
        let mut newly = false;
        for r in writers {
            if let Some(Holders::Writer { superseded, .. }) = self.by_range.get_mut(&r) {
                newly |= !*superseded;
                *superseded = true;
            }
        }
        newly
    }

    /// Whether the writer of exactly `[start, end)` under `grant` was superseded.
    pub fn is_superseded(&self, start: u64, end: u64, grant: u64) -> bool {
        matches!(
            self.by_range.get(&(start, end)),
            Some(Holders::Writer { grant: g, superseded: true }) if *g == grant
        )
    }

    fn insert(&mut self, start: u64, end: u64, holders: Holders) {
        self.by_range.insert((start, end), holders);
        *self.lengths.entry(end - start).or_default() += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every overlap is found, whatever the lengths around it: checked against a scan of all
    /// held ranges over a grid of ranges of mixed lengths (an empty range overlaps nothing).
    #[test]
    fn overlaps_are_found_as_a_scan_of_every_range_would() {
        let mut a = ActiveRanges::default();
        let held = [
            (0, 8),
            (3, 4),
            (10, 40),
            (12, 13),
            (41, 42),
            (100, 164),
            (170, 171),
        ];
        for (s, e) in held {
            a.add_reader(s, e);
        }
        for start in 0..180 {
            for len in [0, 1, 2, 5, 30, 70] {
                let end = start + len;
                let mut found: Vec<_> = a.overlapping(start, end).map(|(r, _)| r).collect();
                found.sort();
                let want: Vec<_> = held
                    .iter()
                    .copied()
                    .filter(|&(s, e)| start < end && s < end && start < e)
                    .collect();
                assert_eq!(found, want, "[{start}, {end})");
            }
        }
    }

    #[test]
    fn readers_of_one_range_share_an_entry_and_the_longest_length_follows_what_is_held() {
        let mut a = ActiveRanges::default();
        for _ in 0..3 {
            a.add_reader(0, 4096);
        }
        a.add_writer(1 << 20, 2 << 20, 7);
        assert_eq!(a.by_range.len(), 2);
        assert_eq!(a.overlapping(1000, 1001).count(), 1);
        a.remove(1 << 20, 2 << 20, true, 6);
        assert_eq!(a.by_range.len(), 2, "another grant's writer stays");
        a.remove(1 << 20, 2 << 20, true, 7);
        assert_eq!(a.lengths.keys().copied().collect::<Vec<_>>(), vec![4096]);
        for left in [2, 1, 0] {
            a.remove(0, 4096, false, 0);
            assert_eq!(a.overlapping(0, 1).count(), usize::from(left > 0));
        }
        assert!(a.lengths.is_empty() && a.by_range.is_empty());
    }

    #[test]
    fn supersession_marks_only_overlapping_writers() {
        let mut a = ActiveRanges::default();
        a.add_writer(0, 100, 3);
        a.add_writer(200, 300, 4);
        a.add_reader(100, 150);
        a.supersede(50, 120);
        assert!(a.is_superseded(0, 100, 3));
        assert!(!a.is_superseded(0, 100, 4), "another grant");
        assert!(!a.is_superseded(200, 300, 4));
        assert_eq!(a.by_range[&(100, 150)], Holders::Readers(1));
    }
}
