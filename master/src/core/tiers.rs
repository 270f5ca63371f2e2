//! The SSD tier as the master sees it: which objects have a disk copy on which segment, the work
//! queued for each owner (offload, drop, promote), and what the owners report back. The master
//! never waits on an owner here: work is queued, owners poll it, and every report is checked
//! against the object's current version, so a late or repeated report cannot resurrect or
//! misattribute bytes.

pub use mooncake_common::DiskStats;
use mooncake_common::ObjectKey;
use serde::{Deserialize, Serialize};

use super::{
    count_disk_copy,
    objects::{Object, Offload, Phase, Pin, Promotion, Replica, Replicas},
    DiskTier, Grants, LeaseMode, MasterState, SegmentId,
};

/// Removed objects whose owners may still hold a disk record, at most (oldest forgotten first).
/// Eager offloads waiting for queue room, at most; beyond it a fresh object is offloaded when it
/// is evicted instead (the backlog stays bounded when puts outrun the SSD for good).
use crate::{clock::Millis, error::MasterError};

/// The complete object `key` at version `put_id`, which an owner reports a task on; StalePut
/// when it is gone or was rewritten (the owner drops what it produced).
fn reported_version<'t>(
    objects: &'t mut super::table::ObjectTable,
    key: &ObjectKey,
    put_id: u64,
) -> Result<&'t mut Object, MasterError> {
    match objects.get_mut(key) {
        Some(obj) if obj.put_id == put_id && obj.phase.is_complete() => Ok(obj),
        _ => Err(stale_put(key, put_id)),
    }
}

fn stale_put(key: &ObjectKey, put_id: u64) -> MasterError {
    MasterError::StalePut {
        key: key.clone(),
        put_id,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    /// Copy the memory range `offset..offset+size` (holding the key) to the SSD tier.
    Offload,
    /// Forget the disk record of this version of the key.
    Drop,
    /// Fill the memory range from the disk record.
    Promote,
    /// Fill the memory range with a copy of a replica on another owner (a replica task).
    Copy,
}

/// Where a copy reads the object: a memory replica at `offset` of `segment`, or the disk copy
/// of `segment`'s SSD tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyFrom {
    pub segment: mooncake_common::SegmentName,
    pub offset: u64,
    pub tier: mooncake_common::Tier,
}

/// Work for an owner, taken by its long poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerTask {
    pub kind: TaskKind,
    pub key: ObjectKey,
    pub put_id: u64,
    pub offset: u64,
    pub size: u64,
    /// Promote, Copy: the grant of the memory range written (0 for other kinds).
    pub grant: u64,
    /// Copy: the replica task (0 for other kinds).
    pub task_id: u64,
    /// Copy: the replica to read.
    pub copy_from: Option<CopyFrom>,
}

/// What eviction does with an object whose owner's SSD tier has a full offload queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WhenDiskBehind {
    /// Leave it in memory; a put that needs the space may fail with no space.
    Keep,
    /// Evict it without a disk copy, as without an SSD tier.
    #[default]
    Drop,
}

impl std::str::FromStr for WhenDiskBehind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(WhenDiskBehind::Keep),
            "drop" => Ok(WhenDiskBehind::Drop),
            _ => Err(format!("expected keep or drop, got {s:?}")),
        }
    }
}

impl MasterState {
    /// Frees everything a removed object held: memory replicas, its place in an offload queue;
    /// memory reserved for a promotion waits (the owner may still be writing it); owners holding
    /// a disk copy are told to drop it, and until they confirm, a tombstone keeps that record
    /// from being registered again after a restart.
    pub(super) fn discard(&mut self, mut obj: Object, now: Millis) {
        if let Some(started) = obj.phase.started() {
            // No longer in flight (see `puts_in_flight`); its space is handled below.
            self.unfinished.remove(&(started, obj.put_id));
        }
        let tier = obj.take_tier();
        let key = obj.key();
        self.removed_from_dropped(key);
        if self.policy.lease_mode == LeaseMode::Reads {
            self.lingering.keep(key, obj.lease, now);
        }
        self.forget_offload(&tier.offload);
        // An offload under way may still land its record (its report then answered stale, or
        // lost with its owner): a tombstone keeps it from coming back at a restart.
        if let Offload::Pending { segment, .. } = tier.offload {
            if !tier.disk.contains(&segment) {
                if let Some(seg) = self.segments.get(&segment) {
                    let name = seg.name.clone();
                    self.add_tombstone(name, key.clone(), obj.put_id);
                }
            }
        }
        for seg in &tier.disk {
            count_disk_copy(&mut self.segments, *seg, false);
            self.queue_task(
                *seg,
                OwnerTask {
                    kind: TaskKind::Drop,
                    key: key.clone(),
                    put_id: obj.put_id,
                    offset: 0,
                    size: obj.size,
                    grant: 0,
                    task_id: 0,
                    copy_from: None,
                },
            );
            let name = self.segment_name(*seg).clone();
            self.add_tombstone(name, key.clone(), obj.put_id);
        }
        // Copies on segments dropped meanwhile get no drop (nobody to tell), only a tombstone:
        // their owner, back on its directory, registers the record and is refused.
        for name in tier.forgotten_disk {
            self.add_tombstone(name, key.clone(), obj.put_id);
        }
        if let Some(p) = tier.promoting {
            self.abandon_promotion(p, obj.put_id, now);
        }
        if !obj.phase.is_complete() {
            // Removed by force, or abandoned: a write of it may still land.
            self.note_again_later(&obj.replicas, obj.put_id, now);
        }
        self.drop_replicas(std::mem::take(&mut obj.replicas), obj.put_id);
    }

    /// `key` was removed: what dropped segments held of it must not come back, neither from
    /// their pools (see `forgotten`) nor from their disks (a tombstone each).
    pub(super) fn removed_from_dropped(&mut self, key: &ObjectKey) {
        for (name, put_id) in self.forgotten.removed(key.as_str()) {
            self.add_tombstone(name, key.clone(), put_id);
        }
    }

    /// A promotion of version `put_id` is given up: its memory is given back only after the
    /// longest a writer may take, and its owner is told to forget what it may have written
    /// there (see `abandon_write`).
    pub(super) fn abandon_promotion(&mut self, p: Promotion, put_id: u64, now: Millis) {
        let at = p.since.plus(self.policy.put_release_timeout).max(now);
        self.abandon_write(vec![p.replica], put_id, now, at);
    }

    fn add_tombstone(
        &mut self,
        segment: mooncake_common::SegmentName,
        key: ObjectKey,
        put_id: u64,
    ) {
        self.tombstones.add((segment, key), put_id);
    }

    fn clear_tombstone(&mut self, segment: SegmentId, key: &ObjectKey, put_id: u64) {
        let id = (self.segment_name(segment).clone(), key.clone());
        self.tombstones.clear(&id, put_id);
    }

    pub(super) fn forget_offload(&mut self, offload: &Offload) {
        if let Offload::Pending {
            segment,
            evict_after,
            bytes,
            ..
        } = offload
        {
            if *evict_after {
                self.offload_freeing -= bytes;
            }
            if let Some(d) = self.segments.get_mut(segment).and_then(|s| s.disk.as_mut()) {
                d.offloads = d.offloads.saturating_sub(1);
            }
        }
    }

    /// With SSD tiers, memory above the high watermark starts going to disk as puts fill it, not
    /// only at the next upkeep round: offloads take a while, and the room they make must be
    /// there before the next batch of puts asks for it.
    pub(super) fn offload_early(&mut self, now: Millis) {
        if !self.segments.values().any(|s| s.disk.is_some()) {
            return;
        }
        // Scanning for victims costs O(objects): at most one round per couple of milliseconds
        // (a batch of puts shares one; the upkeep loop and `make_room` cover the rest).
        if now
            < self
                .last_early_offload
                .plus(std::time::Duration::from_millis(2))
        {
            return;
        }
        let high = (self.capacity() as f64 * self.policy.eviction_high_watermark) as u64;
        let allocated = self.allocated();
        if allocated > high + self.offload_freeing {
            self.last_early_offload = now;
            self.evict(now, allocated - high);
        }
    }

    pub(super) fn queue_task(&mut self, segment: SegmentId, task: OwnerTask) {
        if let Some(s) = self.segments.get_mut(&segment) {
            s.tasks.push_back(task);
            self.tasks_queued = true;
        }
    }

    /// Whether work was queued since the last call: the server then wakes polling owners.
    pub fn take_wakeup(&mut self) -> bool {
        std::mem::take(&mut self.tasks_queued)
    }

    /// Whether some offload is queued, in flight, or waiting in the eager backlog.
    /// Whether any segment has an SSD tier.
    pub fn any_disk_tier(&self) -> bool {
        self.segments.values().any(|s| s.disk.is_some())
    }

    pub fn offloads_outstanding(&self) -> bool {
        !self.eager_backlog.is_empty()
            || self
                .segments
                .values()
                .any(|s| s.disk.as_ref().is_some_and(|d| d.offloads > 0))
    }

    /// The segment `name` of `owner`, which must have an SSD tier.
    pub fn disk_segment(
        &self,
        owner: mooncake_common::ClientId,
        name: &mooncake_common::SegmentName,
    ) -> Result<SegmentId, MasterError> {
        let id = self.owned_segment(owner, name)?;
        if self.segments[&id].disk.is_none() {
            return Err(MasterError::Invalid(format!(
                "segment {name} was mounted without an SSD tier"
            )));
        }
        Ok(id)
    }

    /// The segment `name`, checked to belong to `owner`.
    pub fn owned_segment(
        &self,
        owner: mooncake_common::ClientId,
        name: &mooncake_common::SegmentName,
    ) -> Result<SegmentId, MasterError> {
        let id = self
            .segment_id(name)
            .ok_or_else(|| MasterError::SegmentNotFound(name.clone()))?;
        let seg = &self.segments[&id];
        if seg.owner != owner {
            return Err(MasterError::NotSegmentOwner {
                segment: name.clone(),
            });
        }
        Ok(id)
    }

    /// Up to `max` tasks for the owner of `segment`, oldest first.
    pub fn take_tasks(&mut self, segment: SegmentId, max: usize, now: Millis) -> Vec<OwnerTask> {
        let Some(s) = self.segments.get_mut(&segment) else {
            return Vec::new();
        };
        let n = s.tasks.len().min(max);
        let tasks: Vec<OwnerTask> = s.tasks.drain(..n).collect();
        for t in tasks.iter().filter(|t| t.kind == TaskKind::Copy) {
            self.replica_tasks.taken(t.task_id, segment, now);
        }
        tasks
    }

    pub fn set_disk_stats(&mut self, owner: mooncake_common::ClientId, stats: DiskStats) {
        let Some(o) = self.owners.get(&owner) else {
            return;
        };
        for id in o.segments.clone() {
            if let Some(d) = self.segments.get_mut(&id).and_then(|s| s.disk.as_mut()) {
                d.stats = stats;
            }
        }
    }

    /// Queues an offload of `key` to the SSD tier of one of its memory replicas' segments.
    /// Returns false when there is no such tier, it is behind, or an offload is under way.
    pub(super) fn start_offload(
        &mut self,
        key: &ObjectKey,
        evict_after: bool,
        now: Millis,
    ) -> bool {
        let limit = self.policy.offload_queue_limit;
        let Some(obj) = self.objects.get_mut(key) else {
            return false;
        };
        let ready = matches!(obj.offload(), Offload::Idle | Offload::Failed { .. });
        if !ready || !obj.disk().is_empty() {
            return false;
        }
        let target = obj.replicas.iter().find(|r| {
            self.segments
                .get(&r.segment)
                .is_some_and(|s| s.disk.as_ref().is_some_and(|d| d.offloads < limit))
        });
        let Some(r) = target else {
            return false;
        };
        let (segment, offset) = (r.segment, r.allocation.offset());
        obj.tier_mut().offload = Offload::Pending {
            segment,
            since: now,
            evict_after,
            bytes: obj.size,
        };
        if evict_after {
            self.offload_freeing += obj.size;
        }
        let task = OwnerTask {
            kind: TaskKind::Offload,
            key: key.clone(),
            put_id: obj.put_id,
            offset,
            size: obj.size,
            grant: 0,
            task_id: 0,
            copy_from: None,
        };
        let d = self
            .segments
            .get_mut(&segment)
            .and_then(|s| s.disk.as_mut());
        let d: &mut DiskTier = d.expect("checked above");
        d.offloads += 1;
        self.counters.offloads_started += 1;
        self.ssd_work_started(now);
        self.queue_task(segment, task);
        true
    }

    /// Offloads a fresh object eagerly; when its SSD tier's queue is full it waits in a backlog
    /// that drains as offloads land (nothing is skipped, nothing waits unbounded in a queue).
    pub(super) fn eager_offload(&mut self, key: &ObjectKey, now: Millis) {
        if !self.start_offload(key, false, now) {
            let tier = self.objects.get(key).and_then(|o| {
                (o.offload() == Offload::Idle && o.disk().is_empty())
                    .then(|| self.tiered_segment(o))
                    .flatten()
            });
            if let Some(segment) = tier {
                self.eager_backlog.push(segment, key.clone());
            }
        }
    }

    /// Starts backlogged eager offloads on the SSD tiers that have room; the others keep their
    /// place (one slow tier does not hold back another's, nor cost it a scan).
    pub(super) fn drain_eager_backlog(&mut self, now: Millis) {
        let limit = self.policy.offload_queue_limit;
        for segment in self.eager_backlog.segments() {
            loop {
                let room = match self.segments.get(&segment).map(|s| s.disk.as_ref()) {
                    None | Some(None) => {
                        self.eager_backlog.drop_segment(segment);
                        break;
                    }
                    Some(Some(d)) => d.offloads < limit,
                };
                if !room {
                    break;
                }
                let Some(key) = self.eager_backlog.pop(segment) else {
                    break;
                };
                let eligible = self.objects.get(&key).is_some_and(|o| {
                    o.phase.is_complete() && o.offload() == Offload::Idle && o.disk().is_empty()
                });
                if eligible && !self.start_offload(&key, false, now) {
                    // Its tiered replica is elsewhere now (moved): it waits there.
                    let elsewhere = self
                        .objects
                        .get(&key)
                        .and_then(|o| self.tiered_segment(o))
                        .filter(|s| *s != segment);
                    if let Some(s) = elsewhere {
                        self.eager_backlog.push(s, key);
                    }
                }
            }
        }
    }

    /// The segment of `obj`'s first memory replica that has an SSD tier.
    fn tiered_segment(&self, obj: &Object) -> Option<SegmentId> {
        obj.replicas
            .iter()
            .map(|r| r.segment)
            .find(|id| self.segments.get(id).is_some_and(|s| s.disk.is_some()))
    }

    /// Whether any memory replica of `obj` sits on a segment with an SSD tier.
    pub(super) fn has_disk_tier(&self, obj: &Object) -> bool {
        obj.replicas.iter().any(|r| {
            self.segments
                .get(&r.segment)
                .is_some_and(|s| s.disk.is_some())
        })
    }

    /// Copies a disk-only object read often enough back to memory on the owner holding it,
    /// when that owner has free memory (promotion never evicts).
    pub(super) fn maybe_promote(&mut self, key: &ObjectKey, now: Millis) {
        let after = self.policy.promote_after_hits;
        let Some(obj) = self.objects.get_mut(key) else {
            return;
        };
        if after == 0 || obj.disk_hits() < after || obj.promoting().is_some() {
            return;
        }
        let Some(&segment) = obj.disk().first() else {
            return;
        };
        let Some(seg) = self.segments.get_mut(&segment) else {
            return;
        };
        if seg.allocator.free_bytes() < obj.size || seg.report.is_some() {
            return;
        }
        if self.grants.next >= self.grants.ceiling {
            return;
        }
        let Some(allocation) = seg.allocator.allocate(obj.size) else {
            return;
        };
        let grant = self
            .grants
            .next()
            .expect("below the ceiling, checked above");
        let task = OwnerTask {
            kind: TaskKind::Promote,
            key: key.clone(),
            put_id: obj.put_id,
            offset: allocation.offset(),
            size: obj.size,
            grant,
            task_id: 0,
            copy_from: None,
        };
        obj.tier_mut().promoting = Some(Promotion {
            replica: Replica {
                segment,
                allocation,
            },
            since: now,
        });
        self.ssd_work_started(now);
        self.queue_task(segment, task);
    }

    /// An owner's report on a promotion of version `put_id` of `key` into the range at
    /// `offset` (as its task named it). Only the promotion reserved there counts: the report of
    /// one given up after its timeout, arriving once another took its place, must not make the
    /// other's range (not written yet) a replica, nor free it under its write.
    pub fn report_promotion(
        &mut self,
        segment: SegmentId,
        key: &ObjectKey,
        put_id: u64,
        offset: u64,
        ok: bool,
    ) -> Result<(), MasterError> {
        self.evictable_changed();
        let obj = reported_version(&mut self.objects, key, put_id)?;
        let reserved = match obj.promoting() {
            Some(p) if p.replica.segment == segment && p.replica.allocation.offset() == offset => {
                obj.tier_mut().promoting.take()
            }
            // One of an earlier master, reported late, whose range this master adopted from the
            // owner's report when it mounted: the owner keeps it.
            _ if ok && obj.replicas.iter().any(|r| r.is_at(segment, offset)) => return Ok(()),
            _ => return Err(stale_put(key, put_id)),
        };
        let reserved = reserved.expect("matched above").replica;
        // A copy to the same segment may have landed meanwhile: one replica there.
        let held = obj.replicas.iter().any(|r| r.segment == segment);
        if ok && !held {
            obj.replicas.push(reserved);
            obj.tier_mut().disk_hits = 0;
            obj.tidy_tier();
            self.counters.promotions += 1;
            self.objects.link(key);
        } else if ok {
            // The bytes landed but are not needed: the owner forgets them too.
            obj.tidy_tier();
            self.drop_replicas(vec![reserved], put_id);
        } else {
            // The owner is done with the range (it reports after its attempt ended).
            self.free_replicas(vec![reserved]);
        }
        Ok(())
    }

    /// An owner's report on one task. An error means the master no longer wants what the
    /// owner produced (the object is gone or was rewritten): the owner drops it.
    pub fn report_task(
        &mut self,
        segment: SegmentId,
        kind: TaskKind,
        key: &ObjectKey,
        put_id: u64,
        ok: bool,
        now: Millis,
    ) -> Result<(), MasterError> {
        let Some(seg) = self.segments.get(&segment) else {
            return Err(MasterError::Invalid(format!(
                "segment {segment:?} is no longer mounted"
            )));
        };
        if seg.disk.is_none() {
            return Err(MasterError::Invalid(format!(
                "segment {} was mounted without an SSD tier",
                seg.name
            )));
        }
        if kind == TaskKind::Drop {
            if ok {
                self.clear_tombstone(segment, key, put_id);
            }
            return Ok(());
        }
        if kind == TaskKind::Offload && !ok {
            // No record of it stays there (a failed write's header is zeroed): a tombstone laid
            // while it was under way (its object removed) has nothing left to guard.
            self.clear_tombstone(segment, key, put_id);
        }
        // An offload landed or failed: its queue has room, its object may go now.
        self.evictable_changed();
        let obj = reported_version(&mut self.objects, key, put_id)?;
        match kind {
            TaskKind::Offload => {
                let pending = obj.offload();
                let (matched, evict_after) = match pending {
                    Offload::Pending {
                        segment: s,
                        evict_after,
                        ..
                    } if s == segment => (true, evict_after),
                    _ => (false, false),
                };
                if matched {
                    obj.tier_mut().offload = if ok {
                        Offload::Idle
                    } else {
                        Offload::Failed { at: now }
                    };
                }
                if !ok {
                    obj.tidy_tier();
                    self.counters.offloads_failed += 1;
                    if matched {
                        self.forget_offload(&pending);
                    }
                    return Ok(());
                }
                let tier = obj.tier_mut();
                if !tier.disk.contains(&segment) {
                    tier.disk.push(segment);
                    count_disk_copy(&mut self.segments, segment, true);
                }
                let free_now = evict_after && !obj.is_leased(now) && !obj.pin.is_hard();
                let freed = if free_now {
                    std::mem::take(&mut obj.replicas)
                } else {
                    Replicas::new()
                };
                self.counters.offloads_done += 1;
                if matched {
                    self.forget_offload(&pending);
                }
                self.drop_replicas(freed, put_id);
                self.drain_eager_backlog(now);
                Ok(())
            }
            TaskKind::Promote => Err(MasterError::Invalid(
                "a promotion is reported with its range (report_promotion)".into(),
            )),
            TaskKind::Drop => unreachable!("handled above"),
            TaskKind::Copy => Err(MasterError::Invalid(
                "a copy is reported with its task (report_copy)".into(),
            )),
        }
    }

    /// The owner of `segment` is about to overwrite its disk record of `key` (SSD eviction):
    /// the disk replica goes, and with it the object if nothing else holds it.
    pub fn disk_dropped(&mut self, segment: SegmentId, key: &ObjectKey, put_id: u64, now: Millis) {
        // Gone from that disk: a tombstone of it has done its work.
        self.clear_tombstone(segment, key, put_id);
        let Some(obj) = self.objects.get_mut(key) else {
            return;
        };
        if obj.put_id != put_id || !obj.disk().contains(&segment) {
            return;
        }
        obj.tier_mut().disk.retain(|s| *s != segment);
        obj.tidy_tier();
        count_disk_copy(&mut self.segments, segment, false);
        self.counters.disk_dropped += 1;
        if obj.replicas.is_empty() && obj.disk().is_empty() {
            let obj = self.objects.remove(key).expect("checked above");
            // Nothing is left on disk to drop; only a reserved promotion may need releasing.
            self.discard(*obj, now);
        }
    }

    /// The owner of `segment` registered every record it found at its mount: a rebuild waits
    /// for it no longer.
    pub fn disk_registered(&mut self, segment: SegmentId) {
        if let Some(d) = self
            .segments
            .get_mut(&segment)
            .and_then(|s| s.disk.as_mut())
        {
            d.registering = false;
        }
    }

    /// An owner restarted on its SSD directory found version `put_id` of `key` there: the
    /// object becomes readable from disk again, under that same version (versions are unique
    /// across master processes, so the record's header stays the truth). Refused when the key
    /// exists with a newer version or one being written, or when this version was removed while
    /// the owner could not drop it (a tombstone). An older version the catalog has (adopted
    /// from a report, or registered from another disk first) goes: as in a rebuild, the newer
    /// one wins whichever order they come in.
    pub fn register_disk(
        &mut self,
        segment: SegmentId,
        key: &ObjectKey,
        size: u64,
        put_id: u64,
        now: Millis,
    ) -> Result<u64, MasterError> {
        if size == 0 {
            return Err(MasterError::Invalid(format!("object {key} has size 0")));
        }
        let disk = self.segments[&segment]
            .disk
            .as_ref()
            .map_or(0, |d| d.capacity);
        if size > disk || !Grants::plausible(put_id) {
            return Err(MasterError::Invalid(format!(
                "the record of {key} (put {put_id}, {size} bytes) cannot be on a disk tier of {disk} bytes of this cluster: its file is corrupt"
            )));
        }
        let id = (self.segment_name(segment).clone(), key.clone());
        // Kept until the owner says the record is gone (`disk_dropped`): a refusal whose answer
        // is lost, or a drop that fails there, must be refused again at the next registration.
        if self.tombstones.contains(&id, put_id) {
            return Err(MasterError::StalePut {
                key: key.clone(),
                put_id,
            });
        }
        // Ids issued from here on are above it, as above the grants owners report at mounts.
        self.grants.saw(put_id);
        // Tracked again from here on, whichever way it goes below.
        self.forgotten.registered(&id.0, key.as_str(), put_id);
        if let Some(obj) = self.objects.get_mut(key) {
            if obj.put_id == put_id && obj.size == size && obj.phase.is_complete() {
                let name = self.segments[&segment].name.clone();
                let tier = obj.tier_mut();
                tier.forgotten_disk.retain(|n| *n != name);
                if !tier.disk.contains(&segment) {
                    tier.disk.push(segment);
                    count_disk_copy(&mut self.segments, segment, true);
                }
                return Ok(put_id);
            }
            if obj.put_id > put_id || !obj.phase.is_complete() {
                return Err(MasterError::Exists(key.clone()));
            }
            tracing::info!(%key, older = obj.put_id, newer = put_id,
                "a newer version was found on disk: the older one in the catalog goes");
            let older = self.objects.remove(key).expect("found above");
            self.discard(*older, now);
        }
        let mut obj = Object::new(
            key.clone(),
            size,
            put_id,
            Phase::COMPLETE,
            Replicas::new(),
            Pin::NONE,
        );
        obj.tier_mut().disk.push(segment);
        count_disk_copy(&mut self.segments, segment, true);
        self.objects.insert(obj);
        self.counters.disk_registered += 1;
        Ok(put_id)
    }

    /// An offload or a promotion started at `now`: upkeep looks for it once it may have timed
    /// out (an earlier one, if any, times out first).
    fn ssd_work_started(&mut self, now: Millis) {
        let at = now.plus(self.policy.offload_timeout);
        self.ssd_work_expiry = Some(self.ssd_work_expiry.map_or(at, |e| e.min(at)));
    }

    /// Offloads and promotions not reported within the timeout are given up, so the object may
    /// be offloaded (or evicted) again; a promotion's memory waits out the longest a writer may
    /// take. The object table is scanned only once the earliest of them may have timed out (it
    /// holds a million objects in a large store).
    pub(super) fn expire_offloads(&mut self, now: Millis) {
        if self.ssd_work_expiry.is_none_or(|at| now < at) {
            return;
        }
        let timeout = self.policy.offload_timeout;
        let mut expired = Vec::new();
        let mut promotions = Vec::new();
        // The earliest that work still under way may time out.
        let mut next: Option<Millis> = None;
        let mut under_way = |since: Millis| {
            let at = since.plus(timeout);
            next = Some(next.map_or(at, |n| n.min(at)));
        };
        for obj in self.objects.iter_mut() {
            if let Offload::Pending { since, .. } = obj.offload() {
                if since.plus(timeout) <= now {
                    expired.push((obj.key().clone(), obj.offload()));
                    obj.tier_mut().offload = Offload::Idle;
                } else {
                    under_way(since);
                }
            }
            match obj.promoting() {
                Some(p) if p.since.plus(timeout) <= now => {
                    let put_id = obj.put_id;
                    promotions.push((obj.tier_mut().promoting.take().expect("checked"), put_id));
                }
                Some(p) => under_way(p.since),
                None => {}
            }
            obj.tidy_tier();
        }
        self.ssd_work_expiry = next;
        if !expired.is_empty() || !promotions.is_empty() {
            self.evictable_changed();
        }
        for (key, pending) in expired {
            tracing::warn!(%key, "offload not reported in time; giving it up");
            self.counters.offloads_failed += 1;
            self.forget_offload(&pending);
        }
        for (p, put_id) in promotions {
            self.abandon_promotion(p, put_id, now);
        }
    }
}
