//! Rebuilding the catalog from the owners: the owners are the source of truth for what they
//! hold, so a master that lost its catalog (restarted, or newly elected) asks nothing of a log.
//! An owner that mounts with objects in its pool reports them (key, range, size, version, replica
//! count and pins, as its writes carried them); until its report is complete the segment takes no
//! new allocations, and then its allocator is rebuilt in one pass with exactly the reported
//! ranges in use.
//!
//! Right after its start a master cannot tell whether it follows another one: until the first
//! owner mounts (at most the rebuild grace), a get of a key not known yet is answered with a
//! retryable code instead of "not found". An owner that has seen no grant says the cluster is
//! fresh, and the master answers normally from then on. An owner that served an earlier master
//! (it has seen grants) confirms a rebuild: until the grace has passed again and every reporting
//! owner is done (at most until the rebuild window closes), keys not known yet stay "not known
//! yet", and the client asks again within its deadline.

use mooncake_common::{ClientId, ObjectKey, SegmentName, Stamp};

use super::{
    allocator::{Allocation, OffsetAllocator, GRANULE},
    objects::{Object, Phase, Pin, Replica, Replicas},
    Grants, MasterState, SegmentId,
};
use crate::{clock::Millis, error::MasterError};

/// One object an owner reports holding in its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported {
    pub key: ObjectKey,
    pub offset: u64,
    pub size: u64,
    pub stamp: Stamp,
}

/// What a finished report did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportOutcome {
    /// Replicas now in the catalog.
    pub registered: u64,
    /// Entries not taken: malformed, overlapping, or a version the catalog already has a
    /// different (newer, or in-flight) one of.
    pub refused: u64,
}

/// Where the master stands with a rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rebuild {
    /// Just started; no owner has said whether it served an earlier master.
    Unknown { since: Millis },
    /// An owner of an earlier master mounted at `since`.
    Confirmed { since: Millis },
    /// Nothing (more) to wait for.
    Over,
}

/// A segment's report while it comes in.
#[derive(Debug, Default)]
pub(super) struct Report {
    items: Vec<Reported>,
}

/// The most removals remembered for open reports (see `MasterState::remember_removal`).
const MAX_REMOVED_WHILE_REPORTING: usize = 1 << 20;

impl MasterState {
    /// The master starts: it may follow another one until an owner says otherwise.
    pub fn started(&mut self, now: Millis) {
        self.born = Some(now);
        self.first_grant = self.grants.next;
        if !self.policy.rebuild_grace.is_zero() {
            self.rebuild = Rebuild::Unknown { since: now };
        }
    }

    /// A new leader's start: `names` are the segments the previous leader had mounted (as it
    /// published them in etcd); until each has remounted and reported, or the window closes,
    /// keys not known yet stay "not known yet".
    pub fn expect_segments(&mut self, names: Vec<SegmentName>, now: Millis) {
        if names.is_empty() || self.policy.rebuild_grace.is_zero() {
            return;
        }
        tracing::info!(
            segments = names.len(),
            "rebuilding the catalog from the owners the previous leader had"
        );
        self.awaited = names;
        self.rebuild = Rebuild::Confirmed { since: now };
    }

    /// Segment `name` has nothing (more) to report.
    pub(super) fn reported(&mut self, name: &SegmentName) {
        self.awaited.retain(|n| n != name);
    }

    /// This master's epoch: its first put id, larger for every later master process or leader
    /// (the wall-clock floor and the etcd reservation see to it). Owners refuse work of any
    /// other epoch than the one they mounted under.
    pub fn epoch(&self) -> u64 {
        self.first_grant
    }

    /// Names of the mounted segments.
    pub fn segment_names(&self) -> Vec<SegmentName> {
        self.segments.values().map(|s| s.name.clone()).collect()
    }

    /// An owner mounts; `returning`: it served an earlier master.
    pub(super) fn owner_mounted(&mut self, returning: bool, now: Millis) {
        let soon = self
            .born
            .is_some_and(|b| now < b.plus(self.policy.rebuild_window));
        self.rebuild = match (self.rebuild, returning) {
            (Rebuild::Unknown { .. }, false) => Rebuild::Over,
            (Rebuild::Unknown { .. } | Rebuild::Over, true)
                if soon && !self.policy.rebuild_grace.is_zero() =>
            {
                tracing::info!("an owner of an earlier master mounted: rebuilding the catalog from the owners' reports");
                Rebuild::Confirmed { since: now }
            }
            (state, _) => state,
        };
    }

    /// Whether a key this master does not know may still be reported by an owner.
    pub fn rebuilding(&self, now: Millis) -> bool {
        match self.rebuild {
            Rebuild::Over => false,
            Rebuild::Unknown { since } => now < since.plus(self.policy.rebuild_grace),
            Rebuild::Confirmed { since } => {
                now < since.plus(self.policy.rebuild_window)
                    && (now < since.plus(self.policy.rebuild_grace)
                        || !self.awaited.is_empty()
                        || self.segments.values().any(|s| {
                            s.report.is_some() || s.disk.as_ref().is_some_and(|d| d.registering)
                        }))
            }
        }
    }

    /// Whether an owner's catalog report is open.
    pub(super) fn reports_open(&self) -> bool {
        self.segments.values().any(|s| s.report.is_some())
    }

    /// `key` is removed while a report may be open: that report must not bring back any
    /// version of it (a newer one than this master knew included). False when too many are
    /// remembered already (the caller asks the client to try again once the reports are in).
    pub(super) fn remember_removal(&mut self, key: &ObjectKey) -> bool {
        if !self.reports_open() {
            return true;
        }
        if self.removed_while_reporting.len() >= MAX_REMOVED_WHILE_REPORTING
            && !self.removed_while_reporting.contains(key)
        {
            return false;
        }
        self.removed_while_reporting.insert(key.clone());
        true
    }

    /// Forgets the removals remembered for reports once none is open.
    pub(super) fn reports_closed(&mut self) {
        if !self.removed_while_reporting.is_empty() && !self.reports_open() {
            self.removed_while_reporting = Default::default();
        }
    }

    /// Marks a segment as reporting its catalog: it takes no allocation until the report ends.
    pub(super) fn expect_report(&mut self, segment: SegmentId) {
        if let Some(seg) = self.segments.get_mut(&segment) {
            seg.report = Some(Box::default());
        }
    }

    /// Takes a chunk of a segment's report; with `done`, merges the whole report into the
    /// catalog and rebuilds the segment's allocator.
    pub fn catalog_reported(
        &mut self,
        owner: ClientId,
        name: &SegmentName,
        items: Vec<Reported>,
        done: bool,
        now: Millis,
    ) -> Result<Option<ReportOutcome>, MasterError> {
        let segment = self
            .segment_id(name)
            .ok_or_else(|| MasterError::SegmentNotFound(name.clone()))?;
        let seg = self.segments.get_mut(&segment).expect("ids are live");
        if seg.owner != owner {
            return Err(MasterError::NotSegmentOwner {
                segment: name.clone(),
            });
        }
        if seg.report.is_none() {
            return Err(MasterError::Invalid(format!(
                "segment {} is not reporting a catalog (mount it again to report)",
                seg.name
            )));
        }
        self.touch(owner, now);
        let mut items = items;
        items.retain(|it| {
            let plausible = Grants::plausible(it.stamp.put_id);
            if !plausible {
                tracing::warn!(key = %it.key, put_id = it.stamp.put_id, segment = %name, "an owner reported an object with a put id beyond any this cluster issues (a corrupt catalog): not adopted");
            }
            plausible
        });
        for it in &items {
            self.grants.saw(it.stamp.put_id);
        }
        let seg = self.segments.get_mut(&segment).expect("ids are live");
        let report = seg.report.as_mut().expect("checked above");
        report.items.extend(items);
        if !done {
            return Ok(None);
        }
        let report = seg.report.take().expect("checked above");
        Ok(Some(self.merge_report(segment, report.items, now)))
    }

    pub(super) fn merge_report(
        &mut self,
        segment: SegmentId,
        mut items: Vec<Reported>,
        now: Millis,
    ) -> ReportOutcome {
        items.sort_unstable_by_key(|r| r.offset);
        let seg = self
            .segments
            .get_mut(&segment)
            .expect("checked by the caller");
        let capacity = seg.allocator.capacity();
        // Keep what can be laid out: aligned, inside the segment, apart from its predecessor.
        let mut outcome = ReportOutcome::default();
        let mut end = 0;
        items.retain(|r| {
            let fits = r.size > 0
                && r.offset % GRANULE == 0
                && r.offset >= end
                && r.offset.checked_add(r.size).is_some_and(|e| e <= capacity);
            if fits {
                end = r.offset + r.size.div_ceil(GRANULE) * GRANULE;
            } else {
                outcome.refused += 1;
            }
            fits
        });
        let ranges: Vec<(u64, u64)> = items.iter().map(|r| (r.offset, r.size)).collect();
        let (allocator, allocations) = OffsetAllocator::with_used(capacity, &ranges)
            .expect("ranges were checked to be sorted, aligned, apart and inside");
        seg.allocator = allocator;
        // An owner back at the master that dropped its segment: only what it was known to hold
        // then, and still may, comes back (see `forgotten`).
        let name = seg.name.clone();
        let known = self.forgotten.take(&name);
        for (item, allocation) in items.into_iter().zip(allocations) {
            let put_id = item.stamp.put_id;
            let agrees = known
                .as_ref()
                .is_none_or(|k| k.get(&item.key) == Some(&put_id))
                && !self.removed_while_reporting.contains(&item.key);
            let adopted = if agrees {
                self.adopt(segment, item, allocation, now)
            } else {
                Err(allocation)
            };
            match adopted {
                Ok(()) => outcome.registered += 1,
                Err(allocation) => {
                    // The owner forgets it too, as when a newer version replaces an adopted one:
                    // kept there, it would come back at the next rebuild once the version that
                    // won is gone.
                    let replica = Replica {
                        segment,
                        allocation,
                    };
                    self.note_freed(&replica, put_id);
                    self.segments
                        .get_mut(&segment)
                        .expect("still mounted")
                        .allocator
                        .free(replica.allocation);
                    outcome.refused += 1;
                }
            }
        }
        self.reported(&name);
        self.reports_closed();
        tracing::info!(segment = %name, registered = outcome.registered, refused = outcome.refused,
            "catalog rebuilt from the owner's report");
        outcome
    }

    /// Adds a reported replica to the catalog, or hands its allocation back when the catalog
    /// already has a newer version of the key, or another of this one or this one on the same
    /// segment. A newer version than the adopted one wins: owners keep an upsert's old range
    /// while its readers' lease lasts, so both versions may be reported, in any order.
    fn adopt(
        &mut self,
        segment: SegmentId,
        r: Reported,
        allocation: Allocation,
        now: Millis,
    ) -> Result<(), Allocation> {
        let replica = Replica {
            segment,
            allocation,
        };
        let pin = Pin::asked(
            r.stamp.hard_pin,
            r.stamp.soft_pin,
            now.plus(self.policy.soft_pin_ttl),
        );
        if let Some(obj) = self.objects.get_mut(&r.key) {
            if r.stamp.put_id <= obj.put_id {
                let same = obj.put_id == r.stamp.put_id
                    && obj.size == r.size
                    && obj.phase.is_complete()
                    && !obj.replicas.iter().any(|x| x.segment == segment);
                if !same {
                    return Err(replica.allocation);
                }
                // Copies (a replica task's, a disk record's) carry no pin: whichever copy
                // reports first, the object keeps the strongest pin any reports.
                obj.pin = obj.pin.stronger(pin);
                obj.replicas.push(replica);
                self.objects.link(&r.key);
                return Ok(());
            }
            tracing::info!(key = %r.key, older = obj.put_id, newer = r.stamp.put_id,
                "a newer version was reported: the older one adopted before goes");
            let older = self.objects.remove(&r.key).expect("found above");
            self.discard(*older, now);
        }
        let mut replicas = Replicas::new();
        replicas.push(replica);
        self.evictable_changed();
        self.objects.insert(Object::new(
            r.key,
            r.size,
            r.stamp.put_id,
            Phase::COMPLETE,
            replicas,
            pin,
        ));
        Ok(())
    }
}
