//! What the master knew a segment held when it dropped it (its owner missed heartbeats for the
//! client TTL). Should that owner come back to this master (a partition healed), it reports its
//! pool, and the report is adopted only where it still agrees with what was known then: a key
//! removed meanwhile must not come back with it. That covers a removal whose note the owner
//! never got (notes go with the dropped owner) and one made after the drop (the object, with no
//! replica left, was already gone: there was nothing to note). A restarted or newly elected
//! master knows nothing of the kind and adopts what owners report.
//!
//! Disk records are registered one by one after the report (even after the pool's report is
//! in), against tombstones: a dropped segment's records of objects that went with the drop are
//! remembered apart, until registered, so that removing such a key lays a tombstone for its
//! record (before, the record came back as the object).

use std::collections::HashMap;

use mooncake_common::{ObjectKey, SegmentName};

use crate::clock::Millis;

/// How long a dropped segment's contents are remembered; an owner back later than this is
/// adopted as by a restarted master.
const KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

/// Versions by key, as remembered at `at`.
struct Known {
    at: Millis,
    versions: HashMap<ObjectKey, u64>,
}

impl Known {
    fn new(at: Millis) -> Known {
        Known {
            at,
            versions: HashMap::new(),
        }
    }
}

#[derive(Default)]
pub(super) struct ForgottenSegments {
    /// The complete objects each dropped segment held a memory replica of, until its pool's
    /// report is taken in.
    pools: HashMap<SegmentName, Known>,
    /// The disk records each dropped segment held of objects gone with the drop, until
    /// registered.
    records: HashMap<SegmentName, Known>,
}

impl ForgottenSegments {
    /// Segment `name` was dropped at `now` holding `held` in its pool and `on_disk` on its disk.
    /// Dropped again before its report was taken in (it remounted, then went silent
    /// mid-report), it held nothing new on the master, but its pool still holds what it held at
    /// the first drop: that is kept, not replaced.
    pub fn remember(
        &mut self,
        name: SegmentName,
        held: HashMap<ObjectKey, u64>,
        on_disk: HashMap<ObjectKey, u64>,
        now: Millis,
    ) {
        for (map, versions) in [(&mut self.pools, held), (&mut self.records, on_disk)] {
            let known = map.entry(name.clone()).or_insert_with(|| Known::new(now));
            known.at = now;
            known.versions.extend(versions);
        }
    }

    /// A record of `key` (version `put_id`) on segment `name`, dropped earlier, lost its object
    /// (the object's last copy went with another segment): kept while `name` is remembered.
    pub fn also_on_disk(&mut self, name: &SegmentName, key: &ObjectKey, put_id: u64) {
        if let Some(known) = self.records.get_mut(name) {
            known.versions.insert(key.clone(), put_id);
        }
    }

    /// The record of `key` (version `put_id`) on segment `name` was registered: tracked again.
    pub fn registered(&mut self, name: &SegmentName, key: &str, put_id: u64) {
        if let Some(known) = self.records.get_mut(name) {
            if known.versions.get(key) == Some(&put_id) {
                known.versions.remove(key);
            }
        }
    }

    /// What segment `name`'s pool held when it was dropped, if it was (and forgets it).
    pub fn take(&mut self, name: &SegmentName) -> Option<HashMap<ObjectKey, u64>> {
        self.pools.remove(name).map(|k| k.versions)
    }

    /// `key` was removed: no dropped segment's copy of it may come back. Answers the disk
    /// records of it that dropped segments hold (segment and version), each to be refused by a
    /// tombstone when registered.
    pub fn removed(&mut self, key: &str) -> Vec<(SegmentName, u64)> {
        for known in self.pools.values_mut() {
            known.versions.remove(key);
        }
        let mut records = Vec::new();
        for (name, known) in &mut self.records {
            if let Some(put_id) = known.versions.remove(key) {
                records.push((name.clone(), put_id));
            }
        }
        records
    }

    /// The keys dropped segments held (a removal by pattern must see them too).
    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.pools
            .values()
            .chain(self.records.values())
            .flat_map(|k| k.versions.keys())
    }

    /// Forgets what was dropped longer ago than `KEPT_FOR`. (Kept though empty meanwhile: a
    /// pool that held nothing still answers its report, everything in it removed since; a
    /// segment whose records all lived on still takes those of objects that go later, with
    /// another segment, through `also_on_disk`.)
    pub fn prune(&mut self, now: Millis) {
        for map in [&mut self.pools, &mut self.records] {
            if !map.is_empty() {
                map.retain(|_, k| now < k.at.plus(KEPT_FOR));
            }
        }
    }
}
