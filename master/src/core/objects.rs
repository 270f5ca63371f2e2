//! Objects and their lifecycle: two-phase put (PROCESSING -> COMPLETE), read leases, pins and
//! removal. Space of a range that a reader or a writer may still touch is never handed out again
//! before that access is over: it waits in the pending-release list.

use std::collections::BTreeMap;

use mooncake_common::{ObjectKey, ReplicaLocation, ReplicateConfig, SegmentName, Tier};

use super::{
    allocator::Allocation,
    order::Place,
    placement::{self, Candidate},
    LateNote, MasterState, PendingRelease, Segment, SegmentId, Unfinished, MAX_LATE_NOTES,
};
use crate::{clock::Millis, error::MasterError};

/// Where the writer of a fresh put must write, and the id it must end or revoke the put with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutGrant {
    pub put_id: u64,
    pub replicas: Vec<ReplicaLocation>,
}

/// An object's memory replicas (the usual single one inline, without an allocation of its own).
pub(super) type Replicas = smallvec::SmallVec<[Replica; 1]>;

pub(super) struct Replica {
    pub segment: SegmentId,
    pub allocation: Allocation,
}

impl Replica {
    pub fn is_at(&self, segment: SegmentId, offset: u64) -> bool {
        self.segment == segment && self.allocation.offset() == offset
    }
}

/// PROCESSING since an instant, or COMPLETE; a word, not an enum's two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Phase(u64);

impl Phase {
    pub const COMPLETE: Phase = Phase(u64::MAX);

    pub fn processing(started: Millis) -> Phase {
        Phase(started.0.min(u64::MAX - 1))
    }

    pub fn is_complete(self) -> bool {
        self == Self::COMPLETE
    }

    /// When the put started, while it is PROCESSING.
    pub fn started(self) -> Option<Millis> {
        (!self.is_complete()).then_some(Millis(self.0))
    }
}

/// Unpinned, hard-pinned, or soft-pinned until an instant (evicted only when nothing unpinned
/// is left, until then); a word, not an enum's two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pin(u64);

impl Pin {
    pub const NONE: Pin = Pin(0);
    pub const HARD: Pin = Pin(u64::MAX);

    /// The pin a put asks for: hard, or soft until `soft_until`, or none.
    pub fn asked(hard: bool, soft: bool, soft_until: Millis) -> Pin {
        if hard {
            Pin::HARD
        } else if soft {
            Pin(soft_until.0.clamp(1, u64::MAX - 1))
        } else {
            Pin::NONE
        }
    }

    pub fn is_hard(self) -> bool {
        self == Self::HARD
    }

    /// The stronger of two pins: hard over soft, the later soft deadline, soft over none.
    pub fn stronger(self, other: Pin) -> Pin {
        Pin(self.0.max(other.0))
    }

    /// Whether a soft pin still holds at `now`.
    pub fn is_soft_at(self, now: Millis) -> bool {
        !self.is_hard() && self.0 > now.0
    }
}

/// A read lease, one word: the instant it ends at the latest (milliseconds, low 40 bits: 34
/// years) and how many reads hold it (high 24 bits). A reader that is done releases its hold;
/// with `LeaseMode::Reads` the lease ends when the last hold goes, so a finished read pins
/// nothing. The instant still ends it for a reader that never says (it died).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lease(u64);

impl Lease {
    const UNTIL_BITS: u32 = 40;
    const UNTIL_MASK: u64 = (1 << Self::UNTIL_BITS) - 1;
    const MAX_HOLDS: u64 = (1 << (64 - Self::UNTIL_BITS)) - 1;

    pub const NONE: Lease = Lease(0);

    pub fn until(self) -> Millis {
        Millis(self.0 & Self::UNTIL_MASK)
    }

    pub fn holds(self) -> u64 {
        self.0 >> Self::UNTIL_BITS
    }

    fn new(holds: u64, until: Millis) -> Lease {
        Lease(holds.min(Self::MAX_HOLDS) << Self::UNTIL_BITS | until.0.min(Self::UNTIL_MASK))
    }

    pub fn is_active(self, now: Millis) -> bool {
        self.until() > now
    }

    /// One more read holds the lease, which lasts at least `ttl` from `now`.
    pub fn grant(&mut self, now: Millis, ttl: std::time::Duration) {
        let holds = if self.is_active(now) { self.holds() } else { 0 };
        *self = Lease::new(holds + 1, self.until().max(now.plus(ttl)));
    }

    /// One lease with the holds of both still active at `now`, lasting as long as the longer.
    pub fn joined(self, other: Lease, now: Millis) -> Lease {
        let active = |l: Lease| if l.is_active(now) { l.holds() } else { 0 };
        Lease::new(
            active(self) + active(other),
            self.until().max(other.until()),
        )
    }

    /// A read that held the lease is done; the last one ends it at `now` (true then). A
    /// release after the lease ran out changes nothing.
    pub fn release(&mut self, now: Millis) -> bool {
        if !self.is_active(now) || self.holds() == 0 {
            return false;
        }
        let holds = self.holds() - 1;
        let until = if holds == 0 { now } else { self.until() };
        *self = Lease::new(holds, until);
        holds == 0
    }
}

/// What ends a read lease.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseMode {
    /// Its readers being done (each releases its hold after its transfer), or the TTL for a
    /// reader that never says: eviction skips only objects being read.
    #[default]
    Reads,
    /// The TTL alone, as Mooncake: every lookup keeps the object for `lease_ttl`.
    Ttl,
}

impl std::str::FromStr for LeaseMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reads" => Ok(LeaseMode::Reads),
            "ttl" => Ok(LeaseMode::Ttl),
            _ => Err(format!("expected reads or ttl, got {s:?}")),
        }
    }
}

/// Where an object stands with its owner's SSD tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Offload {
    #[default]
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
    Failed { at: Millis },
}

/// Memory reserved for copying a disk-only object back, since `since`.
pub(super) struct Promotion {
    pub replica: Replica,
    pub since: Millis,
}

/// An object's state with the SSD tiers. Boxed apart from the object: most objects never have
/// any, and a master holds millions of objects.
#[derive(Default)]
pub(super) struct TierState {
    /// Segments whose SSD tier holds a copy.
    pub disk: Vec<SegmentId>,
    pub offload: Offload,
    /// Reads served from disk since the object was last in memory.
    pub disk_hits: u32,
    /// Memory reserved for a promotion from disk, not readable until the owner reports it.
    pub promoting: Option<Promotion>,
    /// Segments, by name, whose disk copy the master forgot when it dropped the segment (its
    /// owner expired or restarted): the owner may still hold the record and register it again.
    /// Should the object go first, their tombstones keep the record from coming back.
    pub forgotten_disk: Vec<SegmentName>,
}

/// One object: 104 bytes (a 112-byte heap block) plus its key, so that a master holds a
/// million objects in under 250 MB.
pub(super) struct Object {
    /// Never changes: the table finds the object by it.
    key: ObjectKey,
    pub size: u64,
    pub put_id: u64,
    pub phase: Phase,
    pub pin: Pin,
    pub replicas: Replicas,
    /// Reads in progress (or until an instant): no eviction, no non-forced removal.
    pub lease: Lease,
    /// Where the object stands in the eviction order (kept by the object table).
    place: Place,
    tier: Option<Box<TierState>>,
}

// The memory budget above, held at compile time.
const _: () = assert!(std::mem::size_of::<Object>() <= 104);

impl Object {
    /// A new object with no lease, no disk copy and no SSD work (the object table places it in
    /// the eviction order).
    pub fn new(
        key: ObjectKey,
        size: u64,
        put_id: u64,
        phase: Phase,
        replicas: Replicas,
        pin: Pin,
    ) -> Box<Self> {
        Box::new(Object {
            key,
            size,
            put_id,
            phase,
            pin,
            replicas,
            lease: Lease::NONE,
            place: Place::UNLINKED,
            tier: None,
        })
    }

    pub fn key(&self) -> &ObjectKey {
        &self.key
    }

    pub fn place(&self) -> Place {
        self.place
    }

    /// Only the object table moves an object in the eviction order.
    pub(super) fn set_place(&mut self, place: Place) {
        self.place = place;
    }

    /// A read lease was granted: eviction gives the object a second chance.
    fn read(&mut self, now: Millis, ttl: std::time::Duration) {
        self.lease.grant(now, ttl);
        self.place.touch();
    }

    pub fn is_leased(&self, now: Millis) -> bool {
        self.lease.is_active(now)
    }

    /// Segments whose SSD tier holds a copy.
    pub fn disk(&self) -> &[SegmentId] {
        self.tier.as_ref().map_or(&[], |t| &t.disk)
    }

    pub fn offload(&self) -> Offload {
        self.tier.as_ref().map_or(Offload::Idle, |t| t.offload)
    }

    pub fn disk_hits(&self) -> u32 {
        self.tier.as_ref().map_or(0, |t| t.disk_hits)
    }

    pub fn promoting(&self) -> Option<&Promotion> {
        self.tier.as_ref().and_then(|t| t.promoting.as_ref())
    }

    /// The SSD-tier state to change, made if the object had none.
    pub fn tier_mut(&mut self) -> &mut TierState {
        self.tier.get_or_insert_with(Default::default)
    }

    /// Gives back the SSD-tier state's memory once there is nothing left in it.
    pub fn tidy_tier(&mut self) {
        let empty = self.tier.as_ref().is_some_and(|t| {
            t.disk.is_empty()
                && t.offload == Offload::Idle
                && t.disk_hits == 0
                && t.promoting.is_none()
                && t.forgotten_disk.is_empty()
        });
        if empty {
            self.tier = None;
        }
    }

    /// An offload is on its way that frees this object's memory when it lands.
    pub fn offload_on_its_way(&self) -> bool {
        matches!(
            self.offload(),
            Offload::Pending {
                evict_after: true,
                ..
            }
        )
    }

    pub fn has_tier_state(&self) -> bool {
        self.tier.is_some()
    }

    /// Takes the whole SSD-tier state out (the object is being discarded).
    pub fn take_tier(&mut self) -> TierState {
        self.tier.take().map(|t| *t).unwrap_or_default()
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
        // Before anything is evicted, or an upsert's stored value retired, for a put that
        // could not start.
        if self.grants.exhausted() {
            return Err(MasterError::GrantsExhausted);
        }
        if self.rebuilding(now) && self.objects.get(key).is_none() {
            // An owner yet to report may hold it: a put now would take a written-once key
            // (its value replaced when the report's older version is refused), or lose it
            // should the put then fail. "Not known yet", as for a lookup.
            return Err(MasterError::Rebuilding(key.clone()));
        }
        if let Some(old) = self.objects.get(key) {
            let Some(started) = old.phase.started() else {
                if !config.upsert {
                    return Err(MasterError::Exists(key.clone()));
                }
                self.check_quota(key.as_str(), size, old.size)?;
                if let Some(grant) = self.upsert_in_place(key, size, config, now)? {
                    return Ok(grant);
                }
                // New space first: an upsert that finds none leaves the stored value as it was,
                // unless the eviction that made room took it (as any put's eviction may take
                // an object nobody holds).
                let replicas = self.allocate_making_room(size, config, now)?;
                if self.objects.get(key).is_some() {
                    // (Unless the room made was its own: then it was evicted.)
                    self.retire_for_upsert(key, now);
                }
                return self.start_on(key, size, config, replicas, now);
            };
            if now < started.plus(self.policy.put_discard_timeout) {
                return Err(MasterError::PutInFlight(key.clone()));
            }
            // Taken over: the abandoned writer may still be writing, so its space waits for
            // the release timeout before anyone else may get it.
            let release_at = started.plus(self.policy.put_release_timeout).max(now);
            let old = self.objects.remove(key).expect("checked above");
            tracing::info!(%key, put_id = old.put_id, "discarding an abandoned put");
            // Its owners forget that version now (nobody reads a version never ended), and
            // again when the space is released (a write of it that lands late): kept, it would
            // come back as the object when a restarted master hears the owners' reports, even
            // after the key was removed.
            for r in &old.replicas {
                self.note_freed(r, old.put_id);
            }
            self.defer_drop(old.replicas, old.put_id, release_at);
        }
        self.check_quota(key.as_str(), size, 0)?;
        let replicas = self.allocate_making_room(size, config, now)?;
        self.start_on(key, size, config, replicas, now)
    }

    /// The replicas of a put of `size`, evicting to make room when there is none; NoSpace when
    /// no room could be made.
    fn allocate_making_room(
        &mut self,
        size: u64,
        config: &ReplicateConfig,
        now: Millis,
    ) -> Result<Vec<Replica>, MasterError> {
        let mut replicas = self.allocate_replicas(size, config);
        // A segment reporting its catalog (after a master restart or a leader change) takes no
        // allocation until it is done: that is a wait, not a full store, and evicting elsewhere
        // would not help a put only it can hold.
        let reporting = |s: &MasterState, settled: bool| {
            s.segments
                .values()
                .find(|g| g.report.is_none() == settled && g.allocator.capacity() >= size)
                .map(|g| g.name.clone())
        };
        let busy = |name: SegmentName| {
            MasterError::Busy(format!(
                "segment {name} is reporting its catalog to a new master; retry shortly"
            ))
        };
        if replicas.is_empty() && reporting(self, true).is_none() {
            if let Some(name) = reporting(self, false) {
                return Err(busy(name));
            }
        }
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
            return Err(match reporting(self, false) {
                Some(name) => busy(name),
                None => MasterError::NoSpace { size },
            });
        }
        Ok(replicas)
    }

    /// Starts the put of `key` on `replicas`, allocated for it: the object is PROCESSING.
    fn start_on(
        &mut self,
        key: &ObjectKey,
        size: u64,
        config: &ReplicateConfig,
        replicas: Vec<Replica>,
        now: Millis,
    ) -> Result<PutGrant, MasterError> {
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
        self.unfinished.insert(
            (now, put_id),
            Unfinished {
                key: key.clone(),
                token: 0,
            },
        );
        self.objects.insert(Object::new(
            key.clone(),
            size,
            put_id,
            Phase::processing(now),
            replicas.into_iter().collect(),
            pin,
        ));
        Ok(PutGrant {
            put_id,
            replicas: views,
        })
    }

    /// An upsert over a COMPLETE object whose memory no reader holds (no lease), that has the
    /// replicas asked for, each large enough, and no SSD-tier state: the same ranges under a
    /// new put id, the object PROCESSING again. None when those do not all hold.
    fn upsert_in_place(
        &mut self,
        key: &ObjectKey,
        size: u64,
        config: &ReplicateConfig,
        now: Millis,
    ) -> Result<Option<PutGrant>, MasterError> {
        let obj = &self.objects[key];
        let fits = !obj.is_leased(now)
            && !obj.has_tier_state()
            && obj.replicas.len() == config.replica_num.max(1)
            && obj.replicas.iter().all(|r| self.reserved(r) >= size);
        if !fits {
            return Ok(None);
        }
        let put_id = self.grants.next().ok_or(MasterError::GrantsExhausted)?;
        let pin = Pin::asked(
            config.hard_pin,
            config.soft_pin,
            now.plus(self.policy.soft_pin_ttl),
        );
        self.objects.resize(key.as_str(), size);
        let obj = self.objects.get_mut(key).expect("checked above");
        obj.put_id = put_id;
        obj.phase = Phase::processing(now);
        obj.pin = pin;
        self.unfinished.insert(
            (now, put_id),
            Unfinished {
                key: key.clone(),
                token: 0,
            },
        );
        let obj = &self.objects[key];
        let replicas = obj
            .replicas
            .iter()
            .map(|r| memory_view(&self.segments, r, size, put_id))
            .collect();
        Ok(Some(PutGrant { put_id, replicas }))
    }

    /// Takes a COMPLETE object out for an upsert that needs new space: readers holding a lease
    /// keep its memory (and its owners keep it) until the lease ends, and disk copies go as on
    /// a removal.
    fn retire_for_upsert(&mut self, key: &ObjectKey, now: Millis) {
        let mut old = self.objects.remove(key).expect("the object is stored");
        let replicas = std::mem::take(&mut old.replicas);
        self.defer_drop(replicas, old.put_id, old.lease.until().max(now));
        self.discard(*old, now);
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
        let eager = self.policy.eager_offload;
        let obj = self.current_put(key, put_id)?;
        let started = obj.phase.started();
        obj.phase = Phase::COMPLETE;
        let key = eager.then(|| obj.key().clone());
        self.evictable_changed();
        if let Some(started) = started {
            self.unfinished.remove(&(started, put_id));
        }
        if let Some(key) = key {
            self.eager_offload(&key, now);
        }
        Ok(())
    }

    /// The writer gave up: the space is free at once. A write of the revoked put that still
    /// lands later cannot be mistaken for another key's bytes, because owners check on every
    /// read that the range was last written under the key being read; its owner is told to
    /// forget that version again later (see `note_again_later`).
    pub fn put_revoke(&mut self, key: &str, put_id: u64, now: Millis) -> Result<(), MasterError> {
        let obj = self.current_put(key, put_id)?;
        if obj.phase.is_complete() {
            return Err(MasterError::Exists(obj.key().clone()));
        }
        if let Some(started) = obj.phase.started() {
            self.unfinished.remove(&(started, put_id));
        }
        let obj = self.objects.remove(key).expect("checked above");
        self.note_again_later(&obj.replicas, put_id, now);
        self.drop_replicas(obj.replicas, put_id);
        self.evictable_changed();
        Ok(())
    }

    /// A put that never ended went (revoked, or removed by force) and its space is free at
    /// once: a write of it already on its way (its bytes in the owner's socket) may land after
    /// the owner applied the note that it is gone, and would then stay in the owner's catalog
    /// for a later master to adopt, as a put its writer was told had failed (or a key removed
    /// since). The owner is told again once any such write has surely landed: in a cluster
    /// with a secret, owners record a write only while its seal lives (it lapses a put discard
    /// timeout after the put started; owners allow a second for clock skew).
    pub(super) fn note_again_later(&mut self, replicas: &[Replica], put_id: u64, now: Millis) {
        const SLACK: std::time::Duration = std::time::Duration::from_secs(3);
        let at = now.plus(self.policy.put_discard_timeout + SLACK);
        let granted_before = self.grants.next;
        for r in replicas {
            if self.late_notes.len() >= MAX_LATE_NOTES {
                self.late_notes.pop_front();
                self.counters.freed_notes_dropped += 1;
            }
            self.late_notes.push_back(LateNote {
                at,
                segment: r.segment,
                offset: r.allocation.offset(),
                put_id,
                granted_before,
            });
        }
    }

    /// Sends the late notes that are due (see `note_again_later`).
    pub(super) fn late_notes_due(&mut self, now: Millis) {
        while self.late_notes.front().is_some_and(|n| n.at <= now) {
            let n = self.late_notes.pop_front().expect("checked above");
            self.note_freed_at(n.segment, n.offset, n.put_id, n.granted_before);
        }
    }

    /// Names `token`, the token of its caller's start, on the put `put_id` granted at `now`
    /// (see `abandoned`). Token 0 names nothing.
    pub fn tag_start(&mut self, now: Millis, put_id: u64, token: u64) {
        if token == 0 {
            return;
        }
        if let Some(u) = self.unfinished.get_mut(&(now, put_id)) {
            u.token = token;
        }
    }

    /// Whether tenant `tenant`'s start tagged `token` was abandoned by its caller: it grants
    /// nothing more.
    pub fn start_abandoned(&self, tenant: &str, token: u64) -> bool {
        token != 0 && self.abandoned.contains(tenant, token)
    }

    /// The caller (of tenant `tenant`) of the start tagged `token` gave up on it without its
    /// answer: every put it granted that has not ended is revoked (those whose keys `may`
    /// revoke: the caller's tenant), and it grants nothing should it arrive later. How many
    /// puts were revoked. Looks at every put in flight; abandonments are rare.
    pub fn abandon_start(
        &mut self,
        tenant: &str,
        token: u64,
        now: Millis,
        may: impl Fn(&str) -> bool,
    ) -> u32 {
        if token == 0 {
            return 0;
        }
        self.abandoned
            .add(tenant, token, now, self.policy.put_discard_timeout);
        let granted: Vec<(ObjectKey, u64)> = self
            .unfinished
            .iter()
            .filter(|(_, u)| u.token == token && may(u.key.as_str()))
            .map(|(&(_, put_id), u)| (u.key.clone(), put_id))
            .collect();
        let mut revoked = 0;
        for (key, put_id) in granted {
            if self.put_revoke(key.as_str(), put_id, now).is_ok() {
                revoked += 1;
            }
        }
        revoked
    }

    fn current_put(&mut self, key: &str, put_id: u64) -> Result<&mut Object, MasterError> {
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
        let ttl = self.policy.lease_ttl;
        let owned = || ObjectKey::new(key).map_err(MasterError::from);
        let Some(obj) = self.objects.get_mut(key) else {
            if self.rebuilding(now) {
                return Err(MasterError::Rebuilding(owned()?));
            }
            return Err(MasterError::NotFound(owned()?));
        };
        if !obj.phase.is_complete() {
            return Err(MasterError::NotReady(owned()?));
        }
        obj.read(now, ttl);
        if !obj.replicas.is_empty() {
            // The usual case: one lookup of the key (the segments are a different field).
            return Ok((obj.size, views_of(&self.segments, obj)));
        }
        let hits = &mut obj.tier_mut().disk_hits;
        *hits = hits.saturating_add(1);
        self.counters.disk_hits += 1;
        let key = obj.key().clone();
        self.maybe_promote(&key, now);
        let obj = &self.objects[&key];
        Ok((obj.size, views_of(&self.segments, obj)))
    }

    /// Whether a readable object exists; a hit is leased, as a prefix lookup is usually followed
    /// by a get of the same keys.
    pub fn exists<K: std::borrow::Borrow<str> + ?Sized>(&mut self, key: &K, now: Millis) -> bool {
        let ttl = self.policy.lease_ttl;
        match self.objects.get_mut(key) {
            Some(obj) if obj.phase.is_complete() => {
                obj.read(now, ttl);
                true
            }
            _ => false,
        }
    }

    /// Readers of `keys` are done: each releases the hold its lookup (or existence check) took.
    /// With `LeaseMode::Reads` a lease whose last hold goes ends now; with `Ttl` nothing
    /// changes. Unknown keys are skipped (removed meanwhile, or never leased).
    pub fn release_leases<K: std::borrow::Borrow<str>>(&mut self, keys: &[K], now: Millis) {
        if self.policy.lease_mode == LeaseMode::Ttl {
            return;
        }
        let mut ended = false;
        for k in keys {
            let k = k.borrow();
            if self.lingering.take_release(k, now) {
                continue;
            }
            if let Some(obj) = self.objects.get_mut(k) {
                ended |= obj.lease.release(now);
            }
        }
        // Only a lease that ended can make a barren eviction round's answer change.
        if ended {
            self.evictable_changed();
        }
    }

    /// Removes an object. Without `force`, a leased object or an unfinished put is refused. With
    /// it the space is free at once: a reader still inside its lease cannot get another key's
    /// bytes, because owners refuse a read of a range being rewritten or no longer holding the
    /// key (the reader gets an error instead).
    /// While owners may still report (a rebuild), every removal is "not known yet", as a lookup
    /// of an unknown key is: an unknown key answered "not found" would be taken as gone and come
    /// back with the report, and a known one removed now would come back with a later report
    /// that holds it too (a second replica, a disk record). Clients ask again.
    pub fn remove(&mut self, key: &ObjectKey, force: bool, now: Millis) -> Result<(), MasterError> {
        let known = self.objects.get(key).is_some();
        if !known {
            // Gone with a dropped segment: its owner's copy must not come back either.
            self.removed_from_dropped(key);
        }
        if self.rebuilding(now) {
            // Not known yet, or known from one owner's report and yet to come in another's (a
            // second replica, a disk record), which would bring it back: asked again once the
            // owners reported.
            return Err(MasterError::Rebuilding(key.clone()));
        }
        let Some(obj) = self.objects.get(key) else {
            // An open report (an owner that mounted late) may still hold it.
            if !self.remember_removal(key) {
                return Err(MasterError::Rebuilding(key.clone()));
            }
            return Err(MasterError::NotFound(key.clone()));
        };
        if !force {
            if !obj.phase.is_complete() {
                return Err(MasterError::NotReady(key.clone()));
            }
            if obj.is_leased(now) {
                return Err(MasterError::HasLease(key.clone()));
            }
        }
        if !self.remember_removal(key) {
            return Err(MasterError::Rebuilding(key.clone()));
        }
        let obj = self.objects.remove(key).expect("checked above");
        self.discard(*obj, now);
        Ok(())
    }

    /// Removes every object that `remove` would; returns how many went.
    #[cfg(test)]
    pub fn remove_all(&mut self, force: bool, now: Millis) -> u64 {
        self.remove_matching(force, |_| true, now)
    }

    /// The keys `owned` accepts, copied out (to be matched without holding the state).
    /// Keys of dropped segments' objects (see `forgotten`) are among them: removing them keeps
    /// those copies from coming back.
    pub fn keys_where(&self, owned: impl Fn(&str) -> bool) -> Vec<ObjectKey> {
        self.objects
            .iter()
            .map(|o| o.key())
            .chain(self.forgotten.keys())
            .filter(|k| owned(k.as_str()))
            .cloned()
            .collect()
    }

    /// Removes the listed keys that are still there and removable (leased or unfinished ones
    /// only with `force`); returns how many went.
    pub fn remove_listed(&mut self, force: bool, keys: &[ObjectKey], now: Millis) -> u64 {
        let mut removed = 0;
        for key in keys {
            self.removed_from_dropped(key);
            let removable = self
                .objects
                .get(key)
                .is_some_and(|o| force || (o.phase.is_complete() && !o.is_leased(now)));
            if removable && self.remove(key, force, now).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// `remove_all` of the objects whose keys `matches`.
    pub fn remove_matching(
        &mut self,
        force: bool,
        matches: impl Fn(&str) -> bool,
        now: Millis,
    ) -> u64 {
        let keys = self.keys_where(matches);
        self.remove_listed(force, &keys, now)
    }

    /// Frees the memory replicas of version `put_id` of an object that is gone, and tells their
    /// owners to forget them.
    pub(super) fn drop_replicas(
        &mut self,
        replicas: impl IntoIterator<Item = Replica>,
        put_id: u64,
    ) {
        for r in replicas {
            self.note_freed(&r, put_id);
            if let Some(seg) = self.segments.get_mut(&r.segment) {
                seg.allocator.free(r.allocation);
            }
        }
    }

    pub(super) fn free_replicas(&mut self, replicas: impl IntoIterator<Item = Replica>) {
        for r in replicas {
            if let Some(seg) = self.segments.get_mut(&r.segment) {
                seg.allocator.free(r.allocation);
            }
        }
    }

    /// Whether version `put_id` of `key` has a replica at `offset` of `segment`.
    pub(super) fn lists_replica(
        &self,
        key: &ObjectKey,
        put_id: u64,
        segment: SegmentId,
        offset: u64,
    ) -> bool {
        self.objects.get(key).is_some_and(|o| {
            o.put_id == put_id && o.replicas.iter().any(|r| r.is_at(segment, offset))
        })
    }

    /// Ranges an owner was told to write version `put_id` into (a copy, a promotion) whose
    /// report did not come: their owner may have recorded the version there, or may yet, and
    /// must forget it, or a later master would adopt it from the owner's report (a removed key
    /// coming back). It is told at once, again once such a write has surely ended, and once more
    /// as the ranges are freed at `at` (the longest a writer may take).
    pub(super) fn abandon_write(
        &mut self,
        replicas: Vec<Replica>,
        put_id: u64,
        now: Millis,
        at: Millis,
    ) {
        for r in &replicas {
            self.note_freed(r, put_id);
        }
        self.note_again_later(&replicas, put_id, now);
        self.defer_drop(replicas, put_id, at);
    }

    /// Frees the ranges of `replicas` at `at` (a write that may still be under way).
    pub(super) fn defer_release(
        &mut self,
        replicas: impl IntoIterator<Item = Replica>,
        at: Millis,
    ) {
        self.defer(replicas, at, None);
    }

    /// Frees the replicas of version `put_id` at `at`, when their owners are told to forget
    /// them: readers leased on them keep reading until then.
    pub(super) fn defer_drop(
        &mut self,
        replicas: impl IntoIterator<Item = Replica>,
        put_id: u64,
        at: Millis,
    ) {
        self.defer(replicas, at, Some(put_id));
    }

    fn defer(
        &mut self,
        replicas: impl IntoIterator<Item = Replica>,
        at: Millis,
        version: Option<u64>,
    ) {
        self.pending
            .extend(replicas.into_iter().map(|replica| PendingRelease {
                at,
                replica,
                version,
            }));
    }
}

/// Where `obj` can be read: its memory replicas, then its disk copies.
fn views_of(segments: &BTreeMap<SegmentId, Segment>, obj: &Object) -> Vec<ReplicaLocation> {
    let (size, put_id) = (obj.size, obj.put_id);
    let mut views = Vec::with_capacity(obj.replicas.len() + obj.disk().len());
    views.extend(
        obj.replicas
            .iter()
            .map(|r| memory_view(segments, r, size, put_id)),
    );
    views.extend(obj.disk().iter().map(|d| ReplicaLocation {
        segment: segments[d].name.clone(),
        offset: 0,
        size,
        tier: Tier::Disk,
        put_id,
        seal: Default::default(),
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
        seal: Default::default(),
    }
}
