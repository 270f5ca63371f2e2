//! Objects and their lifecycle: two-phase put (PROCESSING -> COMPLETE), read leases, pins and
//! removal. Space of a range that a reader or a writer may still touch is never handed out again
//! before that access is over: it waits in the pending-release list.

use std::collections::BTreeMap;

use mooncake_common::{ObjectKey, ReplicaLocation, ReplicateConfig, Tier};

use super::{
    allocator::Allocation,
    placement::{self, Candidate},
    MasterState, PendingRelease, Segment, SegmentId,
};
use crate::{clock::Millis, error::MasterError};

/// Where the writer of a fresh put must write, and the id it must end or revoke the put with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutGrant {
    pub put_id: u64,
    pub replicas: Vec<ReplicaLocation>,
}

/// An object's memory replicas.
pub(super) type Replicas = smallvec::SmallVec<[Replica; 1]>;

pub(super) struct Replica {
    pub segment: SegmentId,
    pub allocation: Allocation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Processing { started: Millis },
    Complete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pin {
    None,
    /// Evicted only when nothing unpinned is left, until the soft-pin TTL runs out.
    Soft {
        until: Millis,
    },
    Hard,
}

/// Where an object stands with its owner's SSD tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Offload {
    Idle,
    /// Queued for (or being written by) the SSD tier of `segment`; with `evict_after`, its
    /// memory is freed once the disk copy is reported.
    Pending {
        segment: SegmentId,
        since: Millis,
        evict_after: bool,
        /// The object's size: memory that comes back when it lands (with `evict_after`).
        bytes: u64,
    },
    /// The SSD tier could not take it at `at`; until the offload timeout has passed since,
    /// eviction treats the object as if its SSD were behind.
    Failed {
        at: Millis,
    },
}

/// Memory reserved for copying a disk-only object back, since `since`.
pub(super) struct Promotion {
    pub replica: Replica,
    pub since: Millis,
}

pub(super) struct Object {
    pub size: u64,
    pub put_id: u64,
    pub phase: Phase,
    /// Memory replicas (the usual single one inline, without an allocation of its own).
    pub replicas: Replicas,
    /// Segments whose SSD tier holds a copy.
    pub disk: Vec<SegmentId>,
    pub offload: Offload,
    /// Reads served from disk since the object was last in memory.
    pub disk_hits: u32,
    /// Memory reserved for a promotion from disk, not readable until the owner reports it.
    pub promoting: Option<Box<Promotion>>,
    /// The object may be read until this instant: no eviction, no non-forced removal.
    pub lease_until: Millis,
    /// Last put or lease grant: eviction takes the least recently used first.
    pub last_access: Millis,
    pub pin: Pin,
}

impl Object {
    /// A new object with no lease, no disk copy and no SSD work, last accessed `now`.
    pub fn new(
        size: u64,
        put_id: u64,
        phase: Phase,
        replicas: Replicas,
        pin: Pin,
        now: Millis,
    ) -> Self {
        Object {
            size,
            put_id,
            phase,
            replicas,
            disk: Vec::new(),
            offload: Offload::Idle,
            disk_hits: 0,
            promoting: None,
            lease_until: Millis(0),
            last_access: now,
            pin,
        }
    }

    pub fn is_leased(&self, now: Millis) -> bool {
        self.lease_until > now
    }
}

impl Pin {
    /// The pin a put asks for: hard, or soft until `soft_until`, or none.
    pub fn asked(hard: bool, soft: bool, soft_until: Millis) -> Pin {
        if hard {
            Pin::Hard
        } else if soft {
            Pin::Soft { until: soft_until }
        } else {
            Pin::None
        }
    }
}

impl MasterState {
    /// Phase one of a put: allocates one range per replica on distinct segments.
    pub fn put_start(
        &mut self,
        key: &ObjectKey,
        size: u64,
        config: &ReplicateConfig,
        now: Millis,
    ) -> Result<PutGrant, MasterError> {
        if size == 0 {
            return Err(MasterError::Invalid(format!("object {key} has size 0")));
        }
        let Some(largest) = self.segments.values().map(|s| s.allocator.capacity()).max() else {
            return Err(MasterError::NoSegments);
        };
        if size > largest {
            return Err(MasterError::TooLarge { size, largest });
        }
        if let Some(old) = self.objects.get(key) {
            match old.phase {
                Phase::Complete => return Err(MasterError::Exists(key.clone())),
                Phase::Processing { started } => {
                    if now < started.plus(self.policy.put_discard_timeout) {
                        return Err(MasterError::PutInFlight(key.clone()));
                    }
                    // Taken over: the abandoned writer may still be writing, so its space
                    // waits for the release timeout before anyone else may get it.
                    let release_at = started.plus(self.policy.put_release_timeout).max(now);
                    let old = self.objects.remove(key).expect("checked above");
                    tracing::info!(%key, put_id = old.put_id, "discarding an abandoned put");
                    self.defer_release(old.replicas, release_at);
                }
            }
        }

        let mut replicas = self.allocate_replicas(size, config);
        if replicas.is_empty() {
            // Make room and try once more; a second round helps when the first one freed space
            // in the wrong places.
            for _ in 0..2 {
                self.evict(now, size);
                replicas = self.allocate_replicas(size, config);
                if !replicas.is_empty() {
                    break;
                }
            }
        }
        if replicas.is_empty() {
            return Err(MasterError::NoSpace { size });
        }
        self.offload_early(now);
        let Some(put_id) = self.grants.next() else {
            self.free_replicas(replicas);
            return Err(MasterError::GrantsExhausted);
        };
        let pin = Pin::asked(
            config.hard_pin,
            config.soft_pin,
            now.plus(self.policy.soft_pin_ttl),
        );
        let views = replicas
            .iter()
            .map(|r| memory_view(&self.segments, r, size, put_id))
            .collect();
        self.objects.insert(
            key.clone(),
            Box::new(Object::new(
                size,
                put_id,
                Phase::Processing { started: now },
                replicas.into_iter().collect(),
                pin,
                now,
            )),
        );
        Ok(PutGrant {
            put_id,
            replicas: views,
        })
    }

    fn allocate_replicas(&mut self, size: u64, config: &ReplicateConfig) -> Vec<Replica> {
        let want = config.replica_num.max(1);
        if want == 1 {
            // The usual case, without building the placement order: the first preferred segment
            // with room, or the only segment there is. Both are what the order starts with.
            for name in &config.preferred_segments {
                if let Some(r) = self
                    .segment_id(name)
                    .and_then(|id| self.allocate_on(id, size))
                {
                    return vec![r];
                }
            }
            if self.segments.len() == 1 {
                let only = *self.segments.keys().next().expect("one segment");
                return self.allocate_on(only, size).into_iter().collect();
            }
        }
        let candidates: Vec<Candidate> = self
            .segments
            .iter()
            .map(|(id, s)| Candidate {
                id: *id,
                capacity: s.allocator.capacity(),
                free: s.allocator.free_bytes(),
            })
            .collect();
        let preferred: Vec<SegmentId> = config
            .preferred_segments
            .iter()
            .filter_map(|n| self.segment_id(n))
            .collect();
        let order = placement::order(self.policy.strategy, &candidates, &preferred, &mut self.rng);
        let mut out = Vec::with_capacity(want);
        for id in order {
            if out.len() == want {
                break;
            }
            out.extend(self.allocate_on(id, size));
        }
        out
    }

    /// `size` bytes on segment `id`, if it has room.
    fn allocate_on(&mut self, id: SegmentId, size: u64) -> Option<Replica> {
        let seg = self.segments.get_mut(&id).expect("segment ids are live");
        if seg.allocator.free_bytes() < size || seg.report.is_some() {
            return None;
        }
        let allocation = seg.allocator.allocate(size)?;
        Some(Replica {
            segment: id,
            allocation,
        })
    }

    /// Phase two: the bytes landed on every replica; the object becomes readable.
    pub fn put_end(&mut self, key: &str, put_id: u64, now: Millis) -> Result<(), MasterError> {
        let obj = self.current_put(key, put_id)?;
        obj.phase = Phase::Complete;
        if self.policy.eager_offload {
            let key = self.stored_key(key);
            self.eager_offload(&key, now);
        }
        Ok(())
    }

    /// The writer gave up: the space is free at once. A write of the revoked put that still
    /// lands later cannot be mistaken for another key's bytes, because owners check on every
    /// read that the range was last written under the key being read.
    pub fn put_revoke(&mut self, key: &str, put_id: u64) -> Result<(), MasterError> {
        let obj = self.current_put(key, put_id)?;
        if obj.phase == Phase::Complete {
            return Err(MasterError::Exists(self.stored_key(key)));
        }
        let obj = self.objects.remove(key).expect("checked above");
        self.free_replicas(obj.replicas);
        Ok(())
    }

    fn current_put(
        &mut self,
        key: &str,
        put_id: u64,
    ) -> Result<&mut super::objects::Object, MasterError> {
        let first = self.first_grant;
        match self.objects.get_mut(key) {
            Some(obj) if obj.put_id == put_id => Ok(obj),
            // Started under an earlier master process or leader: this one never heard of it.
            _ if put_id < first => Err(MasterError::EarlierMaster {
                key: ObjectKey::new(key)?,
                put_id,
            }),
            _ => Err(MasterError::StalePut {
                key: ObjectKey::new(key)?,
                put_id,
            }),
        }
    }

    /// The map's own key for a stored object (a shared string, no copy).
    fn stored_key(&self, key: &str) -> ObjectKey {
        let (k, _) = self
            .objects
            .get_key_value(key)
            .expect("the object is stored");
        k.clone()
    }

    /// Looks up a readable object and leases it to the caller for the lease TTL.
    pub fn get_replicas(
        &mut self,
        key: &ObjectKey,
        now: Millis,
    ) -> Result<(u64, Vec<ReplicaLocation>), MasterError> {
        self.get_replicas_str(key.as_str(), now)
    }

    /// `get_replicas` by a key not yet made an `ObjectKey` (valid or not: an invalid one is
    /// simply not found), for callers that hold it borrowed.
    pub fn get_replicas_str(
        &mut self,
        key: &str,
        now: Millis,
    ) -> Result<(u64, Vec<ReplicaLocation>), MasterError> {
        let lease = now.plus(self.policy.lease_ttl);
        let owned = || ObjectKey::new(key).map_err(MasterError::from);
        let Some(obj) = self.objects.get_mut(key) else {
            if self.rebuilding(now) {
                return Err(MasterError::Rebuilding(owned()?));
            }
            return Err(MasterError::NotFound(owned()?));
        };
        if obj.phase != Phase::Complete {
            return Err(MasterError::NotReady(owned()?));
        }
        obj.lease_until = obj.lease_until.max(lease);
        obj.last_access = obj.last_access.max(now);
        if !obj.replicas.is_empty() {
            // The usual case: one lookup of the key (the segments are a different field).
            return Ok((obj.size, views_of(&self.segments, obj)));
        }
        obj.disk_hits = obj.disk_hits.saturating_add(1);
        self.counters.disk_hits += 1;
        self.maybe_promote(&owned()?, now);
        let obj = &self.objects[key];
        Ok((obj.size, views_of(&self.segments, obj)))
    }

    /// Whether a readable object exists; a hit is leased, as a prefix lookup is usually followed
    /// by a get of the same keys.
    pub fn exists<Q>(&mut self, key: &Q, now: Millis) -> bool
    where
        ObjectKey: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let lease = now.plus(self.policy.lease_ttl);
        match self.objects.get_mut(key) {
            Some(obj) if obj.phase == Phase::Complete => {
                obj.lease_until = obj.lease_until.max(lease);
                obj.last_access = obj.last_access.max(now);
                true
            }
            _ => false,
        }
    }

    /// Removes an object. Without `force`, a leased object or an unfinished put is refused. With
    /// it the space is free at once: a reader still inside its lease cannot get another key's
    /// bytes, because owners refuse a read of a range being rewritten or no longer holding the
    /// key (the reader gets an error instead).
    pub fn remove(&mut self, key: &ObjectKey, force: bool, now: Millis) -> Result<(), MasterError> {
        let obj = self
            .objects
            .get(key)
            .ok_or_else(|| MasterError::NotFound(key.clone()))?;
        if !force {
            if obj.phase != Phase::Complete {
                return Err(MasterError::NotReady(key.clone()));
            }
            if obj.is_leased(now) {
                return Err(MasterError::HasLease(key.clone()));
            }
        }
        let obj = self.objects.remove(key).expect("checked above");
        self.discard(key, *obj, now);
        Ok(())
    }

    /// Removes every object that `remove` would; returns how many went.
    pub fn remove_all(&mut self, force: bool, now: Millis) -> u64 {
        let keys: Vec<ObjectKey> = self
            .objects
            .iter()
            .filter(|(_, o)| force || (o.phase == Phase::Complete && !o.is_leased(now)))
            .map(|(k, _)| k.clone())
            .collect();
        let mut removed = 0;
        for key in keys {
            if self.remove(&key, force, now).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    pub(super) fn free_replicas(&mut self, replicas: impl IntoIterator<Item = Replica>) {
        for r in replicas {
            if let Some(seg) = self.segments.get_mut(&r.segment) {
                seg.allocator.free(r.allocation);
            }
        }
    }

    pub(super) fn defer_release(
        &mut self,
        replicas: impl IntoIterator<Item = Replica>,
        at: Millis,
    ) {
        for r in replicas {
            self.pending.push(PendingRelease {
                at,
                segment: r.segment,
                allocation: r.allocation,
            });
        }
    }
}

/// Where `obj` can be read: its memory replicas, then its disk copies.
fn views_of(segments: &BTreeMap<SegmentId, Segment>, obj: &Object) -> Vec<ReplicaLocation> {
    let (size, put_id) = (obj.size, obj.put_id);
    let mut views = Vec::with_capacity(obj.replicas.len() + obj.disk.len());
    views.extend(
        obj.replicas
            .iter()
            .map(|r| memory_view(segments, r, size, put_id)),
    );
    views.extend(obj.disk.iter().map(|d| ReplicaLocation {
        segment: segments[d].name.clone(),
        offset: 0,
        size,
        tier: Tier::Disk,
        put_id,
    }));
    views
}

/// Where a memory replica of an object of `size` bytes lies.
fn memory_view(
    segments: &BTreeMap<SegmentId, Segment>,
    r: &Replica,
    size: u64,
    put_id: u64,
) -> ReplicaLocation {
    ReplicaLocation {
        segment: segments[&r.segment].name.clone(),
        offset: r.allocation.offset(),
        size,
        tier: Tier::Memory,
        put_id,
    }
}
