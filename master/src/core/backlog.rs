//! Eager offloads waiting for room in their SSD tier's queue: one queue per segment, oldest
//! first, so a drain looks only at the segments that have room, and keys waiting for a slow tier
//! are not rescanned on every report another tier sends.

use std::collections::{BTreeMap, VecDeque};

use mooncake_common::ObjectKey;

use super::SegmentId;

/// Keys waiting at most, over all segments.
pub const MAX_EAGER_BACKLOG: usize = 1 << 20;

#[derive(Debug, Default)]
pub struct EagerBacklog {
    queues: BTreeMap<SegmentId, VecDeque<ObjectKey>>,
    len: usize,
}

impl EagerBacklog {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues `key` for `segment`'s tier; false when the backlog is full.
    pub fn push(&mut self, segment: SegmentId, key: ObjectKey) -> bool {
        if self.len >= MAX_EAGER_BACKLOG {
            return false;
        }
        self.queues.entry(segment).or_default().push_back(key);
        self.len += 1;
        true
    }

    /// The segments with keys waiting.
    pub fn segments(&self) -> Vec<SegmentId> {
        self.queues.keys().copied().collect()
    }

    /// The oldest key waiting for `segment`.
    pub fn pop(&mut self, segment: SegmentId) -> Option<ObjectKey> {
        let queue = self.queues.get_mut(&segment)?;
        let key = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(&segment);
        }
        self.len -= usize::from(key.is_some());
        key
    }

    /// Forgets what waits for a segment that is gone.
    pub fn drop_segment(&mut self, segment: SegmentId) {
        if let Some(q) = self.queues.remove(&segment) {
            self.len -= q.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_per_segment_keep_their_order_and_count() {
        let k = |s: &str| ObjectKey::new(s).unwrap();
        let mut b = EagerBacklog::default();
        assert!(b.push(SegmentId(2), k("a")));
        assert!(b.push(SegmentId(1), k("b")));
        assert!(b.push(SegmentId(2), k("c")));
        assert_eq!(b.segments(), vec![SegmentId(1), SegmentId(2)]);
        assert_eq!(b.pop(SegmentId(2)), Some(k("a")));
        b.drop_segment(SegmentId(1));
        assert_eq!(b.pop(SegmentId(2)), Some(k("c")));
        assert_eq!(b.pop(SegmentId(2)), None);
        assert!(b.is_empty());
    }
}
