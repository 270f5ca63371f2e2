//! Segment and owner bookkeeping: mount, unmount, heartbeats, and dropping an owner that went
//! silent together with every replica it held.

use mooncake_common::{ClientId, SegmentName};

use std::collections::{HashMap, VecDeque};

use super::{
    allocator::GRANULE, objects::Offload, DiskStats, DiskTier, Freed, Grants, LeaseMode,
    MasterState, Owner, Segment, SegmentId, MAX_FREED_NOTES, MAX_FREED_PER_REPLY,
};
use crate::{clock::Millis, error::MasterError};

/// What a heartbeat tells the owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatReply {
    Ok,
    /// The master does not know this owner (it restarted, or the owner's TTL ran out).
    Remount,
}

/// What an owner says about its pool when it mounts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountReport {
    /// The newest grant its writes brought (landed or not).
    pub newest_grant: u64,
    /// Objects it holds and will report (`catalog_reported`); 0: an empty pool.
    pub objects: u64,
    /// Records on its SSD it will register (`register_disk`, then `disk_registered`).
    pub disk_records: u64,
}

/// What a mount asks of its owner next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mounted {
    /// Report the pool's catalog (`catalog_reported`); the segment takes no allocation until
    /// the report is in.
    AwaitingReport,
    /// Nothing to report: an empty pool, or a retried mount whose report was merged already.
    Ready,
}

/// The largest memory or disk tier a segment may have (64 PiB): the cluster's totals, summed
/// over thousands of segments, stay far below `u64::MAX`.
const MAX_CAPACITY: u64 = 1 << 56;

impl MasterState {
    /// Mounts `name` for `owner`, with an SSD tier of `disk_capacity` bytes (0: none). Mounting a
    /// name already held by another owner replaces it: the new owner is bound to that host:port,
    /// so the old incarnation is gone and so are its bytes (an owner restarted on its SSD
    /// directory registers what it finds there again).
    pub fn mount_segment(
        &mut self,
        owner: ClientId,
        name: SegmentName,
        size: u64,
        disk_capacity: u64,
        report: MountReport,
        now: Millis,
    ) -> Result<Mounted, MasterError> {
        if !Grants::plausible(report.newest_grant) {
            return Err(MasterError::Invalid(format!(
                "the owner of {name} reports put id {}, beyond any this cluster issues: its pool's catalog is corrupt; restart the owner with an empty pool",
                report.newest_grant
            )));
        }
        // Above every grant the owner has seen, so none of its ranges' writes looks newer.
        self.grants.saw(report.newest_grant);
        // An owner back on its SSD directory alone (its memory pool empty) served an earlier
        // master too: its records are waited for.
        self.owner_mounted(report.newest_grant > 0 || report.disk_records > 0, now);
        if size < GRANULE {
            return Err(MasterError::Invalid(format!(
                "segment {name} has {size} bytes; at least {GRANULE} are needed"
            )));
        }
        if size > MAX_CAPACITY || disk_capacity > MAX_CAPACITY {
            return Err(MasterError::Invalid(format!(
                "segment {name} has {size} bytes of memory and {disk_capacity} of disk; at most {MAX_CAPACITY} each (the cluster's totals must stay countable)"
            )));
        }
        if let Some(&id) = self.by_name.get(&name) {
            let seg = &self.segments[&id];
            if seg.owner == owner
                && seg.allocator.capacity() == size / GRANULE * GRANULE
                && seg.disk.as_ref().map_or(0, |d| d.capacity) == disk_capacity
            {
                // A retried mount (its answer was lost): a report may start over while the one
                // the first mount opened is still open (nothing was laid out yet). Once one was
                // merged, there is nothing to report, and the owner is told so, even when all it
                // adopted went since (its removals' notes are waiting for the owner): a second
                // report would bring those keys back, or be refused, and the owner, taking that
                // as a failed mount, would remount at every heartbeat.
                let restart_report = report.objects > 0
                    && seg.report.is_some()
                    && seg.allocator.live_allocations() == 0;
                if let Some(d) = self.segments.get_mut(&id).and_then(|s| s.disk.as_mut()) {
                    d.registering |= report.disk_records > 0;
                }
                self.touch(owner, now);
                if !restart_report {
                    if self.segments[&id].report.is_some() {
                        // The report the lost mount opened has nothing to come (the pool holds
                        // nothing now): it ends, or the segment would take no put until the
                        // rebuild window closed.
                        self.segments.get_mut(&id).expect("ids are live").report = None;
                        self.merge_report(id, Vec::new(), now);
                    }
                    return Ok(Mounted::Ready);
                }
                self.expect_report(id);
                return Ok(Mounted::AwaitingReport);
            }
            tracing::warn!(segment = %name, old_owner = %seg.owner, new_owner = %owner,
                "segment remounted by a new owner incarnation; dropping the old one's replicas");
            self.drop_segment(id);
        }
        let id = SegmentId(self.next_segment);
        self.next_segment += 1;
        self.segments.insert(
            id,
            Segment {
                name: name.clone(),
                owner,
                allocator: super::OffsetAllocator::new(size),
                disk: (disk_capacity > 0).then(|| DiskTier {
                    capacity: disk_capacity,
                    stats: DiskStats {
                        capacity: disk_capacity,
                        ..DiskStats::default()
                    },
                    offloads: 0,
                    objects: 0,
                    registering: report.disk_records > 0,
                }),
                report: None,
                tasks: VecDeque::new(),
            },
        );
        let mounted = if report.objects > 0 {
            self.expect_report(id);
            Mounted::AwaitingReport
        } else {
            self.reported(&name);
            Mounted::Ready
        };
        self.by_name.insert(name.clone(), id);
        self.owners
            .entry(owner)
            .or_insert(Owner {
                last_seen: now,
                segments: Vec::new(),
                freed: VecDeque::new(),
            })
            .segments
            .push(id);
        self.touch(owner, now);
        tracing::info!(segment = %name, %owner, size, disk_capacity, "segment mounted");
        Ok(mounted)
    }

    pub fn unmount_segment(
        &mut self,
        owner: ClientId,
        name: &SegmentName,
    ) -> Result<(), MasterError> {
        let id = *self
            .by_name
            .get(name)
            .ok_or_else(|| MasterError::SegmentNotFound(name.clone()))?;
        if self.segments[&id].owner != owner {
            return Err(MasterError::NotSegmentOwner {
                segment: name.clone(),
            });
        }
        self.drop_segment(id);
        tracing::info!(segment = %name, %owner, "segment unmounted");
        Ok(())
    }

    pub fn heartbeat(&mut self, owner: ClientId, now: Millis) -> HeartbeatReply {
        if self.touch(owner, now) {
            HeartbeatReply::Ok
        } else {
            HeartbeatReply::Remount
        }
    }

    /// The ranges `owner` should forget (see `Freed`), oldest first, at most
    /// `MAX_FREED_PER_REPLY`: those it said it applied (`seq` up to `applied`) go first, the
    /// others are handed out again until it says so.
    pub fn freed_notes(&mut self, owner: ClientId, applied: u64) -> Vec<Freed> {
        let Some(o) = self.owners.get_mut(&owner) else {
            return Vec::new();
        };
        while o.freed.front().is_some_and(|f| f.seq <= applied) {
            o.freed.pop_front();
        }
        o.freed.iter().take(MAX_FREED_PER_REPLY).copied().collect()
    }

    /// How many freed-range notes wait for `owner` (a heartbeat's answer carries the first
    /// `MAX_FREED_PER_REPLY`).
    pub fn freed_waiting(&self, owner: ClientId) -> usize {
        self.owners.get(&owner).map_or(0, |o| o.freed.len())
    }

    /// The ranges `owner` should forget, as if it applied them at once.
    #[cfg(test)]
    pub fn take_freed(&mut self, owner: ClientId) -> Vec<Freed> {
        let notes = self.freed_notes(owner, 0);
        self.freed_notes(owner, notes.last().map_or(0, |f| f.seq));
        notes
    }

    /// Notes that the range `r` held version `put_id` of an object that is gone.
    pub(super) fn note_freed(&mut self, r: &super::objects::Replica, put_id: u64) {
        let granted_before = self.grants.next;
        self.note_freed_at(r.segment, r.allocation.offset(), put_id, granted_before);
    }

    /// Notes that the range at `offset` of `segment` held version `put_id` of an object that
    /// is gone, as written under a grant older than `granted_before`.
    pub(super) fn note_freed_at(
        &mut self,
        segment: SegmentId,
        offset: u64,
        put_id: u64,
        granted_before: u64,
    ) {
        let Some(seg) = self.segments.get(&segment) else {
            return;
        };
        if let Some(o) = self.owners.get_mut(&seg.owner) {
            if o.freed.len() >= MAX_FREED_NOTES {
                o.freed.pop_front();
                if self
                    .counters
                    .freed_notes_dropped
                    .is_multiple_of(MAX_FREED_NOTES as u64)
                {
                    tracing::warn!(segment = %seg.name, "an owner is {MAX_FREED_NOTES} freed-range notes behind; the oldest go (their objects may come back after a master restart)");
                }
                self.counters.freed_notes_dropped += 1;
            }
            o.freed.push_back(Freed {
                offset,
                put_id,
                granted_before,
                seq: self.next_freed,
            });
            self.next_freed += 1;
        }
    }

    /// `owner` was heard from; whether it is known. Any call of it (a heartbeat, a report, a
    /// registration, a poll) shows it alive: a long mount report or disk registration, during
    /// which the owner sends no heartbeat, must not get it expired half-way (and start over at
    /// its remount).
    pub fn touch(&mut self, owner: ClientId, now: Millis) -> bool {
        match self.owners.get_mut(&owner) {
            Some(o) => {
                o.last_seen = o.last_seen.max(now);
                true
            }
            None => false,
        }
    }

    /// Upkeep runs every fraction of a second; a gap of more than half the client TTL since the
    /// last run means the master itself was not running (stopped, paused by its VM, starved),
    /// and the owners' heartbeats of that time went unheard through no fault of theirs. Every
    /// owner then gets one full TTL from now to be heard from, instead of being dropped at once
    /// with everything it holds.
    pub(super) fn forgive_own_absence(&mut self, now: Millis) {
        let threshold = self.policy.client_ttl / 2;
        if let Some(last) = self.last_tick.replace(now) {
            if last.plus(threshold) < now {
                tracing::warn!(
                    gap_ms = now.0 - last.0,
                    owners = self.owners.len(),
                    "upkeep did not run for longer than half the client TTL (was the master \
                     stopped?); every owner gets one TTL from now to send a heartbeat"
                );
                for o in self.owners.values_mut() {
                    o.last_seen = o.last_seen.max(now);
                }
            }
        }
    }

    /// Drops owners not heard from within the client TTL, with their segments and replicas.
    pub(super) fn expire_owners(&mut self, now: Millis) {
        let ttl = self.policy.client_ttl;
        let dead: Vec<ClientId> = self
            .owners
            .iter()
            .filter(|(_, o)| o.last_seen.plus(ttl) < now)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            let owner = self.owners.remove(&id).expect("listed above");
            tracing::warn!(owner = %id, segments = owner.segments.len(),
                "owner missed heartbeats for longer than the client TTL; dropping its segments");
            self.counters.expired_owners += 1;
            for seg in owner.segments {
                self.drop_segment(seg);
            }
        }
    }

    pub(super) fn segment_id(&self, name: &SegmentName) -> Option<SegmentId> {
        self.by_name.get(name).copied()
    }

    pub(super) fn segment_name(&self, id: SegmentId) -> &SegmentName {
        &self.segments[&id].name
    }

    /// Bytes a memory replica reserves in its segment (its object's size rounded up).
    pub(super) fn reserved(&self, r: &super::objects::Replica) -> u64 {
        self.segments
            .get(&r.segment)
            .map_or(0, |s| s.allocator.size_of(&r.allocation))
    }

    /// Removes a segment and every replica, disk copy and pending release on it; objects left
    /// without a replica are gone.
    fn drop_segment(&mut self, id: SegmentId) {
        let Some(seg) = self.segments.remove(&id) else {
            return;
        };
        self.by_name.remove(&seg.name);
        if let Some(o) = self.owners.get_mut(&seg.owner) {
            o.segments.retain(|s| *s != id);
            if o.segments.is_empty() {
                self.owners.remove(&seg.owner);
            }
        }
        self.pending.retain(|p| p.replica.segment != id);
        let mut forgotten = Vec::new();
        let mut abandoned = Vec::new();
        let name = &seg.name;
        let now = self.last_tick.unwrap_or_default();
        let reads = self.policy.lease_mode == LeaseMode::Reads;
        let lingering = &mut self.lingering;
        let mut held = HashMap::new();
        let mut on_disk = HashMap::new();
        let mut elsewhere = Vec::new();
        let mut unfinished_gone = Vec::new();
        self.objects.retain(|obj| {
            let before = obj.replicas.len();
            obj.replicas.retain(|r| r.segment != id);
            if obj.replicas.len() < before && obj.phase.is_complete() {
                held.insert(obj.key().clone(), obj.put_id);
            }
            // A record of an offload under way there may land before the owner went: it counts
            // as a disk copy that may come back.
            let offloading_here =
                matches!(obj.offload(), Offload::Pending { segment, .. } if segment == id);
            let had_disk = obj.disk().contains(&id) || offloading_here;
            if had_disk {
                let tier = obj.tier_mut();
                tier.disk.retain(|s| *s != id);
                // Kept (another copy stays) or not, the record may come back with its owner;
                // an object that stays remembers where, for a tombstone should it go first.
                if !tier.forgotten_disk.contains(name) {
                    tier.forgotten_disk.push(name.clone());
                }
            }
            if obj.promoting().is_some_and(|p| p.replica.segment == id) {
                obj.tier_mut().promoting = None;
            }
            let keep = !obj.replicas.is_empty() || !obj.disk().is_empty();
            let offload = obj.offload();
            let on_dropped = matches!(offload, Offload::Pending { segment, .. } if segment == id);
            if on_dropped || (!keep && matches!(offload, Offload::Pending { .. })) {
                forgotten.push(std::mem::replace(
                    &mut obj.tier_mut().offload,
                    Offload::Idle,
                ));
            }
            if !keep && reads {
                // Its readers still hand their holds back.
                lingering.keep(obj.key(), obj.lease, now);
            }
            if !keep {
                // Gone with the segment: its record coming back is the object coming back,
                // unless the key is removed meanwhile (then it gets a tombstone).
                if had_disk {
                    on_disk.insert(obj.key().clone(), obj.put_id);
                }
                let (key, put_id) = (obj.key().clone(), obj.put_id);
                for other in std::mem::take(&mut obj.tier_mut().forgotten_disk) {
                    if other != *name {
                        elsewhere.push((other, key.clone(), put_id));
                    }
                }
            }
            if !keep && obj.promoting().is_some() {
                // A promotion lives on the segment of the disk copy, so an object without one
                // has none; should one remain, its space waits like any abandoned writer's.
                abandoned.extend(obj.tier_mut().promoting.take());
            }
            if let (false, Some(started)) = (keep, obj.phase.started()) {
                unfinished_gone.push((started, obj.put_id));
            }
            obj.tidy_tier();
            keep
        });
        // Puts gone with the segment are no longer in flight.
        for entry in unfinished_gone {
            self.unfinished.remove(&entry);
        }
        self.forgotten
            .remember(seg.name.clone(), held, on_disk, now);
        for (other, key, put_id) in elsewhere {
            self.forgotten.also_on_disk(&other, &key, put_id);
        }
        for offload in forgotten {
            self.forget_offload(&offload);
        }
        for p in abandoned {
            let at = p.since.plus(self.policy.put_release_timeout);
            self.defer_release(vec![p.replica], at);
        }
        self.replica_tasks_lose_segment(id, now);
    }
}
