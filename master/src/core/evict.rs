//! Periodic upkeep and eviction: expiring silent owners and abandoned puts, releasing deferred
//! space, and evicting objects in the order of the eviction policy (`order`) when memory runs
//! high or an allocation failed. Leased, hard-pinned and unfinished objects are never evicted;
//! soft-pinned ones only when nothing else is left. An object whose owner has an SSD tier goes to disk first: its
//! memory is freed once the disk copy is reported (at once when it has one already).

use mooncake_common::ObjectKey;

use super::{objects::Offload, tiers::WhenDiskBehind, MasterState};
use crate::clock::Millis;

/// How long a barren eviction round's answer stands at most (see `MasterState::barren_until`).
const BARREN_AT_MOST: std::time::Duration = std::time::Duration::from_secs(5);

impl MasterState {
    /// One round of upkeep; the server calls it periodically.
    pub fn tick(&mut self, now: Millis) {
        self.forgive_own_absence(now);
        self.expire_owners(now);
        self.expire_puts(now);
        self.expire_offloads(now);
        self.expire_replica_tasks(now);
        self.drain_eager_backlog(now);
        self.release_due(now);
        self.late_notes_due(now);
        self.lingering.prune(now);
        self.forgotten.prune(now);
        // A report may have ended with its segment.
        self.reports_closed();
        let capacity = self.capacity();
        let high = (capacity as f64 * self.policy.eviction_high_watermark) as u64;
        let allocated = self.allocated();
        if capacity > 0 && allocated > high {
            self.evict(now, allocated - high);
        }
    }

    /// Puts still unfinished after the release timeout: the writer is gone, the space returns.
    /// Only the expired front of the unfinished index is looked at.
    fn expire_puts(&mut self, now: Millis) {
        let timeout = self.policy.put_release_timeout;
        while let Some(entry) = self.unfinished.first_entry() {
            let (started, put_id) = *entry.key();
            if started.plus(timeout) > now {
                break;
            }
            let key = entry.remove().key;
            let abandoned = self
                .objects
                .get(&key)
                .is_some_and(|o| o.put_id == put_id && o.phase.started() == Some(started));
            if !abandoned {
                continue; // ended another way
            }
            let obj = self.objects.remove(&key).expect("checked above");
            tracing::info!(%key, put_id = obj.put_id, "releasing an abandoned put's space");
            self.counters.expired_puts += 1;
            self.discard(*obj, now);
        }
    }

    /// Releases what is due. Called at every eviction round: the earliest release is on top
    /// of the heap, so a round with nothing due costs one look.
    fn release_due(&mut self, now: Millis) {
        while self.pending.peek().is_some_and(|p| p.at <= now) {
            let p = self.pending.pop().expect("peeked");
            match p.version {
                Some(put_id) => self.drop_replicas([p.replica], put_id),
                None => self.free_replicas([p.replica]),
            }
        }
    }

    /// Starts freeing `need` bytes at once (a batch of puts that found no space): objects with a
    /// disk copy leave memory now, others start their offload, so the whole batch's room is on
    /// its way in one round instead of one eviction ratio at a time.
    /// Returns the bytes freed at once.
    pub fn make_room(&mut self, now: Millis, need: u64) -> u64 {
        self.evict(now, need)
    }

    /// Frees at least `need` bytes that can go at once, if that many exist: objects with a disk
    /// copy or without an SSD tier, in the order of the eviction policy. The last resort of a
    /// batch of puts that waited for offloads in vain (a slow or stuck SSD): room on its way to
    /// disk does not count, and objects that would need an offload first are passed over.
    /// Returns the bytes freed.
    pub fn free_at_once(&mut self, now: Millis, need: u64) -> u64 {
        self.evict_with(now, need, Room::AtOnce)
    }

    /// Frees at least `need` bytes, and at least the eviction ratio of total capacity, if that
    /// many evictable bytes exist, in the order of the eviction policy (see `order`); objects
    /// being read or written, hard-pinned ones and those on their way to disk are passed over,
    /// soft-pinned ones are taken only when nothing else is left. Each object is looked at once
    /// per round. Bytes of offloads under way that free memory when they land count as freed
    /// already. Returns the bytes freed at once.
    pub(super) fn evict(&mut self, now: Millis, need: u64) -> u64 {
        let target = need.max((self.capacity() as f64 * self.policy.eviction_ratio) as u64);
        self.evict_with(now, target, Room::Coming)
    }

    /// One eviction round towards `target` bytes; `room` says whether memory that offloads
    /// under way free when they land counts (see `Room`).
    fn evict_with(&mut self, now: Millis, target: u64, room: Room) -> u64 {
        self.release_due(now);
        if self.barren_until.is_some_and(|until| now < until) {
            return 0;
        }
        let mut round = Round {
            freed: 0,
            count: 0,
            target,
            coming: match room {
                Room::Coming => self.offload_freeing,
                Room::AtOnce => 0,
            },
            room,
        };
        if round.done() {
            return 0;
        }
        let coming_before = round.coming;
        // The earliest a lease passed over ends: then this round's answer may change by itself.
        let mut leased_until = now.plus(BARREN_AT_MOST);
        let mut soft = Vec::new();
        // Objects passed over in a row per list: once a whole list was, it is done this round.
        let mut passed = [0usize; 2];
        let mut exhausted = [false; 2];
        // Lists that objects moved to from the other one this round: walked again once both
        // are done, for those (walking one again for each that joins costs a whole list each).
        let mut moved = [false; 2];
        let budget = 2 * self.objects.order_len();
        for _ in 0..budget {
            if round.done() {
                break;
            }
            let mut joins = super::table::Joins::default();
            let next = self.objects.next_candidate(exhausted, &mut joins);
            for l in 0..2 {
                moved[l] |= joins.moved[l];
                // Back of the list being walked, read since: met again on this walk.
                if joins.own[l] {
                    passed[l] = 0;
                    exhausted[l] = false;
                }
            }
            let Some(c) = next else {
                if moved == [false; 2] {
                    break;
                }
                for l in 0..2 {
                    if std::mem::take(&mut moved[l]) {
                        passed[l] = 0;
                        exhausted[l] = false;
                    }
                }
                continue;
            };
            let l = c.list as usize;
            let o = self.objects.candidate(c);
            if o.replicas.is_empty() {
                // On disk only: nothing to free until it is read back.
                self.objects.unlink(c);
                continue;
            }
            passed[l] += 1;
            exhausted[l] = passed[l] >= self.objects.order_live(c.list);
            if o.is_leased(now) {
                leased_until = leased_until.min(o.lease.until());
            }
            if o.offload_on_its_way()
                || !o.phase.is_complete()
                || o.is_leased(now)
                || o.pin.is_hard()
            {
                self.objects.keep(c);
                continue;
            }
            let key = o.key().clone();
            if o.pin.is_soft_at(now) {
                soft.push(key);
                self.objects.keep(c);
                continue;
            }
            if room == Room::AtOnce && self.needs_offload(o) {
                // Its memory could only go by an offload: not what this round is for.
                self.objects.keep(c);
                continue;
            }
            if self.kept_while_disk_behind(o, now) {
                // Passed over where it stands, like a leased one: it is no more recent or
                // frequent for it, and the round looks at each such object once.
                self.counters.kept_disk_behind += 1;
                self.objects.keep(c);
                continue;
            }
            passed[l] = 0;
            exhausted[l] = false;
            self.objects.evicted(c);
            self.free_memory(key, now, &mut round);
        }
        // Soft-pinned objects, only when nothing else was left.
        for key in soft {
            if round.done() {
                break;
            }
            let Some(o) = self.objects.get(&key) else {
                continue;
            };
            // Met twice when the order cycled: the first visit may have started its offload.
            if o.is_leased(now) || o.replicas.is_empty() || o.offload_on_its_way() {
                continue;
            }
            if room == Room::AtOnce && self.needs_offload(o) {
                continue;
            }
            self.objects.unlink_key(&key);
            self.free_memory(key, now, &mut round);
        }
        let barren = round.count == 0 && round.freed == 0 && round.coming == coming_before;
        if barren && room == Room::Coming {
            self.barren_until = Some(leased_until);
        }
        self.counters.eviction_rounds += 1;
        self.counters.evicted_objects += round.count;
        self.counters.evicted_bytes += round.freed;
        if round.count > 0 || self.offload_freeing > 0 {
            tracing::debug!(
                objects = round.count,
                bytes = round.freed,
                offloading = self.offload_freeing,
                "evicted"
            );
        }
        round.freed
    }

    /// Whether `o`'s memory can go only once an offload gave it a disk copy.
    fn needs_offload(&self, o: &super::objects::Object) -> bool {
        o.disk().is_empty() && self.has_disk_tier(o)
    }

    /// Whether eviction keeps `o` for now: its memory can go only by an offload, none can
    /// start (its last one failed lately, or the queues of its replicas' tiers are full), and
    /// the policy keeps such objects rather than drop them.
    fn kept_while_disk_behind(&self, o: &super::objects::Object, now: Millis) -> bool {
        if self.policy.when_disk_behind != WhenDiskBehind::Keep || !self.needs_offload(o) {
            return false;
        }
        match o.offload() {
            Offload::Failed { at } if now < at.plus(self.policy.offload_timeout) => true,
            Offload::Idle | Offload::Failed { .. } => !o.replicas.iter().any(|r| {
                self.segments.get(&r.segment).is_some_and(|s| {
                    s.disk
                        .as_ref()
                        .is_some_and(|d| d.offloads < self.policy.offload_queue_limit)
                })
            }),
            Offload::Pending { .. } => false,
        }
    }

    /// Something that may make an object evictable happened (a put ended, a hold went back, an
    /// offload landed or was given up, memory or objects came or went): the next eviction round
    /// walks the order again even if the last one found nothing.
    pub(super) fn evictable_changed(&mut self) {
        self.barren_until = None;
    }

    /// Frees the memory of `key`, out of the eviction order already: at once when a disk copy
    /// exists or there is no SSD tier (the object goes), else by offloading it first. An object
    /// whose memory stays for now goes back in the order.
    fn free_memory(&mut self, key: ObjectKey, now: Millis, round: &mut Round) {
        let obj = self
            .objects
            .get_mut(&key)
            .expect("an evicted candidate exists");
        if obj.offload_on_its_way() {
            // Its memory goes when the copy lands, counted already.
            self.objects.link(&key);
            return;
        }
        if let Offload::Pending {
            evict_after: false,
            bytes,
            segment,
            since,
        } = obj.offload()
        {
            // An eager offload is on its way already: its memory goes when it lands.
            obj.tier_mut().offload = Offload::Pending {
                evict_after: true,
                bytes,
                segment,
                since,
            };
            self.offload_freeing += bytes;
            round.coming_more(bytes);
            self.objects.link(&key);
            return;
        }
        let obj = &self.objects[&key];
        let size: u64 = obj.replicas.iter().map(|r| self.reserved(r)).sum();
        if !obj.disk().is_empty() {
            // A disk copy exists: the memory goes, the object stays readable from disk.
            let obj = self.objects.get_mut(&key).expect("checked above");
            let (replicas, put_id) = (std::mem::take(&mut obj.replicas), obj.put_id);
            self.drop_replicas(replicas, put_id);
            round.freed += size;
            round.count += 1;
            return;
        }
        if self.has_disk_tier(obj) {
            let failed_lately = matches!(obj.offload(), Offload::Failed { at }
                if now < at.plus(self.policy.offload_timeout));
            let before = self.offload_freeing;
            if !failed_lately && self.start_offload(&key, true, now) {
                round.coming_more(self.offload_freeing - before);
                self.objects.link(&key);
                return;
            }
            if self.policy.when_disk_behind == WhenDiskBehind::Keep {
                self.counters.kept_disk_behind += 1;
                self.objects.link(&key);
                return;
            }
            self.counters.dropped_disk_behind += 1;
        }
        let obj = self.objects.remove(&key).expect("checked above");
        round.freed += size;
        round.count += 1;
        self.discard(*obj, now);
    }
}

/// What an eviction round counts towards its target.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Room {
    /// Memory freed at once and that of offloads under way, which free it when they land.
    Coming,
    /// Only memory freed at once.
    AtOnce,
}

/// One eviction round's progress.
struct Round {
    freed: u64,
    count: u64,
    target: u64,
    /// Bytes of offloads under way that count (see `Room`).
    coming: u64,
    room: Room,
}

impl Round {
    /// Whether the bytes freed, with those on their way that count, reach the target.
    fn done(&self) -> bool {
        self.freed + self.coming >= self.target
    }

    /// An offload this round started or turned into an eviction frees `bytes` when it lands.
    fn coming_more(&mut self, bytes: u64) {
        if self.room == Room::Coming {
            self.coming += bytes;
        }
    }
}
