//! What the master knew a segment held when it dropped it (its owner missed heartbeats for the
//! client TTL). Should that owner come back to this master (a partition healed), it reports its
//! pool, and the report is adopted only where it still agrees with what was known then: a key
//! removed meanwhile must not come back with it. That covers a removal whose note the owner
//! never got (notes go with the dropped owner) and one made after the drop (the object, with no
//! replica left, was already gone: there was nothing to note). A restarted or newly elected
//! master knows nothing of the kind and adopts what owners report.

use std::collections::HashMap;

use mooncake_common::{ObjectKey, SegmentName};

use crate::clock::Millis;

/// How long a dropped segment's contents are remembered; an owner back later than this is
/// adopted as by a restarted master.
const KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

struct Dropped {
    at: Millis,
    /// The complete objects it held a memory replica of: key and version.
    held: HashMap<ObjectKey, u64>,
}

#[derive(Default)]
pub(super) struct ForgottenSegments {
    by_name: HashMap<SegmentName, Dropped>,
}

impl ForgottenSegments {
    /// Segment `name` was dropped at `now` holding `held`. Dropped again before its report was
    /// taken in (it remounted, then went silent mid-report), it held nothing new on the master,
    /// but its pool still holds what it held at the first drop: that is kept, not replaced.
    pub fn remember(&mut self, name: SegmentName, held: HashMap<ObjectKey, u64>, now: Millis) {
        match self.by_name.get_mut(&name) {
            Some(earlier) => {
                earlier.at = now;
                earlier.held.extend(held);
            }
            None => {
                self.by_name.insert(name, Dropped { at: now, held });
            }
        }
    }

    /// What segment `name` held when it was dropped, if it was (and forgets it).
    pub fn take(&mut self, name: &SegmentName) -> Option<HashMap<ObjectKey, u64>> {
        self.by_name.remove(name).map(|d| d.held)
    }

    /// `key` was removed: no dropped segment's copy of it may come back.
    pub fn removed(&mut self, key: &str) {
        for d in self.by_name.values_mut() {
            d.held.remove(key);
        }
    }

    /// The keys dropped segments held (a removal by pattern must see them too).
    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.by_name.values().flat_map(|d| d.held.keys())
    }

    pub fn prune(&mut self, now: Millis) {
        if !self.by_name.is_empty() {
            self.by_name.retain(|_, d| now < d.at.plus(KEPT_FOR));
        }
    }
}
