//! Versions removed while an owner still held them on disk, by (segment, key): until the owner
//! confirms it dropped the record, a tombstone keeps that record from being registered again
//! (after an owner restart). At most `MAX` are kept, the oldest forgotten first; the order they
//! were laid in is compacted as tombstones are cleared, so it never outgrows the live ones by more
//! than a constant factor (it used to keep every cleared one: a slow leak under removals).

use std::collections::{HashMap, HashSet, VecDeque};

use mooncake_common::{ObjectKey, SegmentName};

type Id = (SegmentName, ObjectKey);

/// The most tombstones kept.
const MAX: usize = 1 << 20;

#[derive(Default)]
pub(super) struct Tombstones {
    live: HashMap<Id, u64>,
    /// Ids in the order they were laid, oldest first; may hold cleared or repeated ids, at most
    /// twice the live ones plus a small constant.
    order: VecDeque<Id>,
}

impl Tombstones {
    pub fn add(&mut self, id: Id, put_id: u64) {
        while self.live.len() >= MAX {
            match self.order.pop_front() {
                Some(old) => {
                    self.live.remove(&old);
                }
                None => break,
            }
        }
        if self.live.insert(id.clone(), put_id).is_none() {
            self.order.push_back(id);
            if self.order.len() > 2 * self.live.len() + 1024 {
                self.compact();
            }
        }
    }

    /// Clears the tombstone of `id` if it is for `put_id`; whether it was.
    pub fn clear(&mut self, id: &Id, put_id: u64) -> bool {
        if self.live.get(id) == Some(&put_id) {
            self.live.remove(id);
            true
        } else {
            false
        }
    }

    /// Keeps in `order` only the first entry of each live id.
    fn compact(&mut self) {
        let mut seen = HashSet::with_capacity(self.live.len());
        let live = &self.live;
        self.order
            .retain(|id| live.contains_key(id) && seen.insert(id.clone()));
    }

    #[cfg(test)]
    fn order_len(&self) -> usize {
        self.order.len()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seg: u16, k: u32) -> Id {
        (
            SegmentName::parse(&format!("127.0.0.1:{seg}")).unwrap(),
            ObjectKey::new(&format!("k{k}")).unwrap(),
        )
    }

    #[test]
    fn cleared_tombstones_do_not_pile_up() {
        let mut t = Tombstones::default();
        for k in 0..200_000 {
            t.add(id(1, k), 7);
            assert!(t.clear(&id(1, k), 7));
            // Cleared and laid again under a new version, as an upsert-then-remove cycle does.
            t.add(id(1, k % 100), u64::from(k));
            assert!(t.clear(&id(1, k % 100), u64::from(k)));
        }
        assert_eq!(t.len(), 0);
        assert!(t.order_len() <= 1024 + 2, "order kept {}", t.order_len());
    }

    #[test]
    fn only_the_right_version_clears_and_the_oldest_goes_first() {
        let mut t = Tombstones::default();
        t.add(id(1, 1), 5);
        assert!(!t.clear(&id(1, 1), 6));
        assert!(!t.clear(&id(2, 1), 5));
        assert!(t.clear(&id(1, 1), 5));
        for k in 0..3000 {
            t.add(id(1, k), 1);
        }
        assert_eq!(t.len(), 3000);
        assert!(t.clear(&id(1, 0), 1));
    }
}
