//! The master's core: a synchronous state machine over segments, objects, leases and owners.
//! Every transition takes `now` as an argument and performs no I/O, so the gRPC layer only
//! decodes, locks, calls one method and encodes, and every race is a plain unit test.

mod abandoned;
pub mod allocator;
mod backlog;
mod evict;
#[cfg(test)]
mod evict_tests;
mod forgotten;
mod ghosts;
mod lingering;
mod objects;
mod order;
pub mod placement;
mod rebuild;
#[cfg(test)]
mod rebuild_tests;
mod replica_tasks;
#[cfg(test)]
mod replica_tasks_tests;
mod segments;
mod table;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
mod tiers;
mod tombstones;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use mooncake_common::{ClientId, ObjectKey, SegmentName};
use rand::{rngs::StdRng, SeedableRng};

use crate::{clock::Millis, error::MasterError};
use allocator::OffsetAllocator;
pub use objects::{LeaseMode, PutGrant};
pub use order::{EvictionPolicy, OrderStats};
pub use placement::AllocationStrategy;
pub use rebuild::{ReportOutcome, Reported};
pub use replica_tasks::{TaskInfo, TaskRequest};
pub use segments::{HeartbeatReply, MountReport, Mounted};
pub use table::TenantUsage;
pub use tiers::{CopyFrom, DiskStats, OwnerTask, TaskKind, WhenDiskBehind};

/// A mounted segment's identity for this master's lifetime. A remount gets a new id, so a
/// replica can never point at a different incarnation of a segment with the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u64);

/// The knobs of the state machine (the master's config, minus networking).
#[derive(Debug, Clone)]
pub struct Policy {
    pub lease_ttl: Duration,
    /// What ends a read lease: its readers being done, or the TTL alone.
    pub lease_mode: LeaseMode,
    pub soft_pin_ttl: Duration,
    pub eviction_high_watermark: f64,
    pub eviction_ratio: f64,
    /// Which objects eviction takes first.
    pub eviction_policy: EvictionPolicy,
    pub client_ttl: Duration,
    pub put_discard_timeout: Duration,
    pub put_release_timeout: Duration,
    pub strategy: AllocationStrategy,
    /// Offload every object to its owner's SSD tier as soon as its put ends, not only on eviction.
    pub eager_offload: bool,
    /// Offloads queued or in flight per segment, at most; beyond it the SSD counts as behind.
    pub offload_queue_limit: usize,
    /// What eviction does with an object whose owner's SSD is behind.
    pub when_disk_behind: WhenDiskBehind,
    /// An offload not reported done within this is given up (the object may be offloaded again).
    pub offload_timeout: Duration,
    /// A disk-only object read this many times is copied back to memory; 0: never.
    pub promote_after_hits: u32,
    /// After the master starts, unknown keys are "not known yet" (retryable) for this long, so
    /// owners can remount and report what they hold; longer while reports are coming in.
    pub rebuild_grace: Duration,
    /// The longest the rebuild may make unknown keys wait, reports or not.
    pub rebuild_window: Duration,
    /// Bytes each tenant may store at most (by name; "" is the default tenant). Tenants not
    /// named here have no quota.
    pub quotas: std::collections::HashMap<String, u64>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            lease_ttl: Duration::from_secs(10),
            lease_mode: LeaseMode::Reads,
            soft_pin_ttl: Duration::from_secs(30 * 60),
            eviction_high_watermark: 0.90,
            eviction_ratio: 0.05,
            eviction_policy: EvictionPolicy::Car,
            client_ttl: Duration::from_secs(10),
            put_discard_timeout: Duration::from_secs(30),
            put_release_timeout: Duration::from_secs(600),
            strategy: AllocationStrategy::Random,
            eager_offload: false,
            offload_queue_limit: 256,
            when_disk_behind: WhenDiskBehind::Drop,
            offload_timeout: Duration::from_secs(30),
            promote_after_hits: 2,
            rebuild_grace: Duration::from_secs(2),
            rebuild_window: Duration::from_secs(30),
            quotas: Default::default(),
        }
    }
}

struct Segment {
    name: SegmentName,
    owner: ClientId,
    allocator: OffsetAllocator,
    /// The owner's SSD tier, if it has one.
    disk: Option<DiskTier>,
    /// The catalog report under way: no allocation here until it ends.
    report: Option<Box<rebuild::Report>>,
    /// Work waiting for the owner's poll (SSD-tier work, copies).
    tasks: VecDeque<OwnerTask>,
}

/// A segment's SSD tier as the master sees it: capacity, what the owner last reported, and the
/// work waiting for the owner.
struct DiskTier {
    capacity: u64,
    stats: DiskStats,
    /// Offloads queued or taken by the owner and not yet reported.
    offloads: usize,
    /// Objects with a disk copy here, kept as copies come and go so that stats never walk
    /// the object table.
    objects: u64,
    /// The owner is registering the records it found at its mount (see `rebuilding`).
    registering: bool,
}

/// Counts a disk copy on `segment` that appeared (`added`) or went. Copies sit only on
/// segments with an SSD tier (an invariant), and go with their segment when it unmounts.
fn count_disk_copy(segments: &mut BTreeMap<SegmentId, Segment>, segment: SegmentId, added: bool) {
    if let Some(d) = segments.get_mut(&segment).and_then(|s| s.disk.as_mut()) {
        if added {
            d.objects += 1;
        } else {
            d.objects = d.objects.saturating_sub(1);
        }
    }
}

struct Owner {
    last_seen: Millis,
    segments: Vec<SegmentId>,
    /// Ranges whose objects are gone, for the owner to forget: handed out at each heartbeat
    /// until one says they were applied (an answer lost on its way loses none).
    freed: VecDeque<Freed>,
}

/// A memory range of an owner's segment whose object (version `put_id`) is gone: the owner
/// forgets it, so that a catalog report to a later master does not bring the object back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    pub offset: u64,
    pub put_id: u64,
    /// Every grant of the range issued before the note is older than this; a copy of the same
    /// version written there later (a replica task, a promotion) has a newer grant and stays.
    pub granted_before: u64,
    /// Increasing over this master's notes (to all owners): a heartbeat says the largest it
    /// applied, and the notes up to it go.
    pub seq: u64,
}

/// Freed ranges kept per owner until it says it applied them, at most (32 bytes each); the
/// oldest go first beyond it (counted, and logged), and those objects may come back after a
/// master restart. An owner heartbeats again at once while notes wait (see `freed_waiting`),
/// so only one that stops applying them falls this far behind.
const MAX_FREED_NOTES: usize = 1 << 16;
/// Second notes of puts that went unfinished (see `MasterState::note_again_later`), at most; the
/// oldest go first beyond it.
const MAX_LATE_NOTES: usize = 1 << 16;

/// A freed-range note to send again at `at` (see `MasterState::note_again_later`).
struct LateNote {
    at: Millis,
    segment: SegmentId,
    offset: u64,
    put_id: u64,
    /// The grants' floor when the put went: copies written into the range since (a replica
    /// task, a promotion, under newer grants) stay.
    granted_before: u64,
}

/// The most notes one heartbeat's answer carries (about 0.5 MiB); the rest go with the next.
const MAX_FREED_PER_REPLY: usize = 1 << 14;

/// Put ids (an object's version, and the grant its writes are fenced by): increasing for the
/// master's lifetime and, through `MasterState::raise_grants`, beyond every id an earlier master
/// process issued, so owners can tell a stale write from a current one by comparing ids.
struct Grants {
    next: u64,
    /// Ids from here on are not reserved (with HA: not yet published to etcd, so a successor
    /// might issue them too); u64::MAX without HA.
    ceiling: u64,
}

/// No put id is issued at or above this: an owner reporting one has a corrupt catalog. Ids
/// start at the wall clock in microseconds, so this is thousands of centuries away.
const GRANT_LIMIT: u64 = 1 << 62;

impl Grants {
    /// The next id, or None when the reservation is used up (until the next one is published).
    fn next(&mut self) -> Option<u64> {
        if self.exhausted() {
            return None;
        }
        let id = self.next;
        self.next += 1;
        Some(id)
    }

    fn exhausted(&self) -> bool {
        self.next >= self.ceiling
    }

    /// Whether `id` could have been issued by this cluster (see `GRANT_LIMIT`).
    fn plausible(id: u64) -> bool {
        id < GRANT_LIMIT
    }

    /// An owner saw `id` (a plausible one): later ids are above it.
    fn saw(&mut self, id: u64) {
        self.next = self.next.max(id + 1);
    }
}

/// Space that must not be reused before `at`: a force-removed object still leased by a reader,
/// or a discarded put whose writer may still be writing.
struct PendingRelease {
    at: Millis,
    replica: objects::Replica,
    /// The version its owner forgets when the range goes (see `note_freed`): readers leased on
    /// it keep reading until then. None for a write that never ended.
    version: Option<u64>,
}

// Ordered by `at` alone, the earliest first in `MasterState::pending` (a max-heap).
impl PartialEq for PendingRelease {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for PendingRelease {}

impl PartialOrd for PendingRelease {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for PendingRelease {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.at.cmp(&self.at)
    }
}

/// Counters the metrics endpoint reads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub eviction_rounds: u64,
    pub evicted_objects: u64,
    pub evicted_bytes: u64,
    pub expired_puts: u64,
    pub expired_owners: u64,
    pub offloads_started: u64,
    pub offloads_done: u64,
    pub offloads_failed: u64,
    /// Evictions that dropped an object because its owner's SSD was behind.
    pub dropped_disk_behind: u64,
    /// Evictions that kept an object in memory because its owner's SSD was behind.
    pub kept_disk_behind: u64,
    pub disk_hits: u64,
    pub promotions: u64,
    pub disk_dropped: u64,
    pub disk_registered: u64,
    /// Freed-range notes dropped because an owner was `MAX_FREED_NOTES` behind, or second notes
    /// of unfinished puts beyond `MAX_LATE_NOTES`.
    pub freed_notes_dropped: u64,
}

/// A snapshot of one segment, for listings and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentStat {
    pub name: SegmentName,
    pub capacity: u64,
    pub allocated: u64,
    /// The SSD tier's capacity and the owner's last report; None without one.
    pub disk: Option<DiskStats>,
    /// Objects with a disk replica on this segment.
    pub disk_objects: u64,
}

/// A put not ended yet: its key, and the token its caller's start named (0: none).
struct Unfinished {
    key: ObjectKey,
    token: u64,
}

pub struct MasterState {
    policy: Policy,
    segments: BTreeMap<SegmentId, Segment>,
    by_name: HashMap<SegmentName, SegmentId>,
    owners: HashMap<ClientId, Owner>,
    objects: table::ObjectTable,
    /// Space to free later, the earliest due on top: each release costs O(log n) as it comes
    /// due (a list walked whole for each was O(n²) over a burst of them).
    pending: std::collections::BinaryHeap<PendingRelease>,
    /// Freed-range notes to send again, in the order they are due.
    late_notes: std::collections::VecDeque<LateNote>,
    next_segment: u64,
    grants: Grants,
    rng: StdRng,
    counters: Counters,
    /// Set when owner work was queued; the server wakes long-polling owners.
    tasks_queued: bool,
    /// The earliest an offload or promotion under way may time out (see `expire_offloads`).
    ssd_work_expiry: Option<Millis>,
    /// Bytes of offloads under way that free memory when they land.
    offload_freeing: u64,
    /// Eager offloads waiting for room in their SSD tier's queue.
    eager_backlog: backlog::EagerBacklog,
    /// Puts not ended yet, by (start, put id): upkeep expires abandoned ones from the front
    /// instead of looking at every object. An entry whose put ended another way (revoked,
    /// taken over, removed) is skipped when reached.
    unfinished: BTreeMap<(Millis, u64), Unfinished>,
    /// Put starts their callers gave up on (see `abandoned`).
    abandoned: abandoned::AbandonedStarts,
    last_early_offload: Millis,
    /// Versions removed while an owner (by segment name) still held them on disk.
    tombstones: tombstones::Tombstones,
    /// The sequence number of the next freed-range note.
    next_freed: u64,
    /// When upkeep last ran (see `tick`): a long gap means the master itself was away.
    last_tick: Option<Millis>,
    /// Whether unknown keys may still be reported by owners (see `rebuild`).
    rebuild: rebuild::Rebuild,
    /// When the server started this state machine.
    born: Option<Millis>,
    /// Segments a previous leader had mounted that have not reported yet (see `rebuild`).
    awaited: Vec<SegmentName>,
    /// The first put id this process issued (`started`): smaller ones are an earlier master's.
    first_grant: u64,
    replica_tasks: replica_tasks::ReplicaTasks,
    /// Set by an eviction round that found nothing it could free or offload: another round
    /// before this instant (the earliest a lease it passed over ends, 5 s at most) finds
    /// nothing either, unless something changes what may be evicted first (see
    /// `evictable_changed`). A full store of objects being read costs one walk of the order,
    /// not one per put of a batch.
    barren_until: Option<Millis>,
    /// Read holds of objects that left while being read, still to come back (see `lingering`).
    lingering: lingering::LingeringHolds,
    /// What dropped segments held, should their owners come back (see `forgotten`).
    forgotten: forgotten::ForgottenSegments,
    /// Keys removed while an owner's catalog report was open (after the rebuild, an owner that
    /// mounted late): that report must not bring back any version of them, as everything it
    /// lists was there before they went (see `rebuild::merge_report`). Emptied once no report
    /// is open.
    removed_while_reporting: std::collections::HashSet<ObjectKey>,
}

impl MasterState {
    pub fn new(policy: Policy) -> Self {
        Self::with_seed(policy, rand::random())
    }

    /// Issues no put id below `floor` from now on. The server raises it to the wall clock in
    /// microseconds at start (above every id of an earlier process on this host that issued
    /// fewer than a million per second on average), and every mount raises it above the newest
    /// grant the owner has seen.
    pub fn raise_grants(&mut self, floor: u64) {
        self.grants.next = self.grants.next.max(floor);
    }

    /// The next put id to be issued.
    pub fn next_grant(&self) -> u64 {
        self.grants.next
    }

    /// Issues no put id at or above `ceiling` (with HA: the reservation published to etcd).
    pub fn reserve_grants(&mut self, ceiling: u64) {
        self.grants.ceiling = ceiling;
    }

    /// Deterministic placement for tests.
    pub fn with_seed(policy: Policy, seed: u64) -> Self {
        let rng = StdRng::seed_from_u64(seed);
        let eviction_policy = policy.eviction_policy;
        MasterState {
            policy,
            segments: BTreeMap::new(),
            by_name: HashMap::new(),
            owners: HashMap::new(),
            objects: table::ObjectTable::new(eviction_policy),
            pending: std::collections::BinaryHeap::new(),
            late_notes: Default::default(),
            next_segment: 1,
            grants: Grants {
                next: 1,
                ceiling: u64::MAX,
            },
            rng,
            counters: Counters::default(),
            tasks_queued: false,
            ssd_work_expiry: None,
            offload_freeing: 0,
            eager_backlog: backlog::EagerBacklog::default(),
            unfinished: BTreeMap::new(),
            abandoned: Default::default(),
            last_early_offload: Millis(0),
            tombstones: Default::default(),
            next_freed: 1,
            last_tick: None,
            rebuild: rebuild::Rebuild::Over,
            born: None,
            awaited: Vec::new(),
            first_grant: 0,
            replica_tasks: Default::default(),
            barren_until: None,
            lingering: Default::default(),
            forgotten: Default::default(),
            removed_while_reporting: Default::default(),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn key_count(&self) -> usize {
        self.objects.len()
    }

    /// Keys and bytes per tenant ("" is the default tenant).
    pub fn tenant_usage(&self) -> Vec<(String, TenantUsage)> {
        let mut u: Vec<_> = self
            .objects
            .usage()
            .map(|(t, u)| (t.to_string(), u))
            .collect();
        u.sort_by(|a, b| a.0.cmp(&b.0));
        u
    }

    /// A put of `size` bytes to `key`, replacing `replaced` bytes of it, fits its tenant's quota.
    fn check_quota(&self, key: &str, size: u64, replaced: u64) -> Result<(), MasterError> {
        if self.policy.quotas.is_empty() {
            return Ok(());
        }
        let tenant = mooncake_common::tenant::tenant_of(key);
        let Some(&quota) = self.policy.quotas.get(tenant) else {
            return Ok(());
        };
        let used = self.objects.usage_of(tenant).bytes;
        if used.saturating_sub(replaced).saturating_add(size) > quota {
            return Err(MasterError::QuotaFull {
                tenant: if tenant.is_empty() { "default" } else { tenant }.to_string(),
                quota,
                used,
                size,
            });
        }
        Ok(())
    }

    /// The eviction order's lists and adaptation.
    pub fn eviction_stats(&self) -> OrderStats {
        self.objects.order_stats()
    }

    /// Bytes the eviction order holds beyond the objects (its queues and remembered keys).
    pub fn eviction_order_bytes(&self) -> usize {
        self.objects.order_bytes()
    }

    /// Puts started and not yet ended, revoked or discarded.
    pub fn puts_in_flight(&self) -> usize {
        self.unfinished.len()
    }

    pub fn active_owners(&self) -> usize {
        self.owners.len()
    }

    pub fn capacity(&self) -> u64 {
        self.segments.values().map(|s| s.allocator.capacity()).sum()
    }

    pub fn allocated(&self) -> u64 {
        self.segments
            .values()
            .map(|s| s.allocator.allocated())
            .sum()
    }

    pub fn segment_stats(&self) -> Vec<SegmentStat> {
        self.segments
            .values()
            .map(|s| SegmentStat {
                name: s.name.clone(),
                capacity: s.allocator.capacity(),
                allocated: s.allocator.allocated(),
                disk: s.disk.as_ref().map(|d| DiskStats {
                    capacity: d.capacity,
                    ..d.stats
                }),
                disk_objects: s.disk.as_ref().map_or(0, |d| d.objects),
            })
            .collect()
    }

    /// Everything the master must never violate, checked in tests after each step: allocator
    /// usage equals the live replicas plus pending releases, replicas of one object sit on
    /// distinct live segments, and no two live ranges overlap.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut per_segment: HashMap<SegmentId, Vec<(u64, u64)>> = HashMap::new();
        let mut disk_copies: HashMap<SegmentId, u64> = HashMap::new();
        for obj in self.objects.iter() {
            let key = obj.key();
            if let Some(started) = obj.phase.started() {
                if self.unfinished.get(&(started, obj.put_id)).map(|u| &u.key) != Some(key) {
                    return Err(format!("{key}: an unfinished put upkeep does not know of"));
                }
            }
            let mut seen = Vec::new();
            for r in &obj.replicas {
                if !self.segments.contains_key(&r.segment) {
                    return Err(format!(
                        "{key}: replica on unmounted segment {:?}",
                        r.segment
                    ));
                }
                if seen.contains(&r.segment) {
                    return Err(format!("{key}: two replicas on segment {:?}", r.segment));
                }
                if self.reserved(r) < obj.size {
                    return Err(format!("{key}: replica smaller than the object"));
                }
                seen.push(r.segment);
                per_segment
                    .entry(r.segment)
                    .or_default()
                    .push((r.allocation.offset(), self.reserved(r)));
            }
            if let Some(p) = obj.promoting() {
                per_segment
                    .entry(p.replica.segment)
                    .or_default()
                    .push((p.replica.allocation.offset(), self.reserved(&p.replica)));
            }
            for d in obj.disk() {
                match self.segments.get(d) {
                    Some(s) if s.disk.is_some() => *disk_copies.entry(*d).or_default() += 1,
                    _ => return Err(format!("{key}: disk replica on a segment without SSD tier")),
                }
            }
            if obj.replicas.is_empty() && obj.disk().is_empty() {
                return Err(format!("{key}: object without any replica"));
            }
        }
        for (id, s) in &self.segments {
            let counted = s.disk.as_ref().map_or(0, |d| d.objects);
            let held = disk_copies.get(id).copied().unwrap_or(0);
            if counted != held {
                return Err(format!(
                    "segment {}: {counted} disk copies counted, {held} held by objects",
                    s.name
                ));
            }
        }
        self.replica_tasks.check_open()?;
        for (segment, allocation) in self.replica_tasks.reserved() {
            let size = self
                .segments
                .get(&segment)
                .map_or(0, |s| s.allocator.size_of(allocation));
            per_segment
                .entry(segment)
                .or_default()
                .push((allocation.offset(), size));
        }
        for p in &self.pending {
            let r = &p.replica;
            let size = self
                .segments
                .get(&r.segment)
                .map_or(0, |s| s.allocator.size_of(&r.allocation));
            per_segment
                .entry(r.segment)
                .or_default()
                .push((r.allocation.offset(), size));
        }
        for (id, seg) in &self.segments {
            let mut ranges = per_segment.remove(id).unwrap_or_default();
            let sum: u64 = ranges.iter().map(|r| r.1).sum();
            if sum != seg.allocator.allocated() {
                return Err(format!(
                    "segment {}: allocator says {} allocated, replicas and pending hold {sum}",
                    seg.name,
                    seg.allocator.allocated()
                ));
            }
            ranges.sort();
            for w in ranges.windows(2) {
                if w[0].0 + w[0].1 > w[1].0 {
                    return Err(format!("segment {}: overlapping ranges {w:?}", seg.name));
                }
            }
        }
        self.objects.check_order()?;
        if let Some((id, _)) = per_segment.into_iter().next() {
            return Err(format!("ranges on unknown segment {id:?}"));
        }
        let freeing: u64 = self
            .objects
            .iter()
            .map(|o| match o.offload() {
                objects::Offload::Pending {
                    evict_after: true,
                    bytes,
                    ..
                } => bytes,
                _ => 0,
            })
            .sum();
        if freeing != self.offload_freeing {
            return Err(format!(
                "{} bytes counted as freeing, offloads under way hold {freeing}",
                self.offload_freeing
            ));
        }
        for (id, seg) in &self.segments {
            let Some(d) = &seg.disk else { continue };
            let pending = self
                .objects
                .iter()
                .filter(|o| matches!(o.offload(), objects::Offload::Pending { segment, .. } if segment == *id))
                .count();
            if pending != d.offloads {
                return Err(format!(
                    "segment {}: {} offloads counted, {pending} objects wait for one",
                    seg.name, d.offloads
                ));
            }
        }
        Ok(())
    }
}
