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
/// The most versions kept per (segment, key), the oldest forgotten first.
const MAX_VERSIONS: usize = 16;

#[derive(Default)]
pub(super) struct Tombstones {
    /// The versions removed per (segment, key): a second removal's tombstone must not take the
    /// place of the first's while that record may still be on disk too.
    live: HashMap<Id, Vec<u64>>,
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
        match self.live.get_mut(&id) {
            Some(versions) => {
                if !versions.contains(&put_id) {
                    if versions.len() >= MAX_VERSIONS {
                        versions.remove(0);
                    }
                    versions.push(put_id);
                }
            }
            None => {
                self.live.insert(id.clone(), vec![put_id]);
                self.order.push_back(id);
                if self.order.len() > 2 * self.live.len() + 1024 {
                    self.compact();
                }
            }
        }
    }

    /// Clears the tombstone of version `put_id` of `id`; whether there was one.
    /// Whether version `put_id` of `id` was removed while its owner may still hold it.
    pub fn contains(&self, id: &Id, put_id: u64) -> bool {
        self.live.get(id).is_some_and(|v| v.contains(&put_id))
    }

    pub fn clear(&mut self, id: &Id, put_id: u64) -> bool {
        let Some(versions) = self.live.get_mut(id) else {
            return false;
        };
        let Some(i) = versions.iter().position(|v| *v == put_id) else {
            return false;
        };
        versions.remove(i);
        if versions.is_empty() {
            self.live.remove(id);
        }
        true
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

    /// Two removals of one key on one segment whose drops both failed: each version keeps its
    /// tombstone. Before, the second replaced the first, and once the second's drop was
    /// confirmed, the first version's record could be registered again.
    #[test]
    fn each_removed_version_keeps_its_tombstone() {
        let mut t = Tombstones::default();
        t.add(id(1, 1), 5);
        t.add(id(1, 1), 6);
        assert!(t.clear(&id(1, 1), 6));
        assert!(t.clear(&id(1, 1), 5), "the first version is still refused");
        assert!(!t.clear(&id(1, 1), 5));
        assert_eq!(t.len(), 0);
    }
}
