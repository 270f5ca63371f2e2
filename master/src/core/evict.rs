//! Periodic upkeep and eviction: expiring silent owners and abandoned puts, releasing deferred
//! space, and evicting the least recently used objects when memory runs high or an allocation
//! failed. Leased, hard-pinned and unfinished objects are never evicted; soft-pinned ones only
//! when nothing else is left. An object whose owner has an SSD tier goes to disk first: its
//! memory is freed once the disk copy is reported (at once when it has one already).

use mooncake_common::ObjectKey;

use super::{objects::Offload, tiers::WhenDiskBehind, MasterState};
use crate::clock::Millis;

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
        let capacity = self.capacity();
        let high = (capacity as f64 * self.policy.eviction_high_watermark) as u64;
        let allocated = self.allocated();
        if capacity > 0 && allocated > high {
            self.evict(now, allocated - high);
        }
    }

    /// Puts still unfinished after the release timeout: the writer is gone, the space returns.
    fn expire_puts(&mut self, now: Millis) {
        let timeout = self.policy.put_release_timeout;
        let stale: Vec<ObjectKey> = self
            .objects
            .iter()
            .filter(|o| o.phase.started().is_some_and(|s| s.plus(timeout) <= now))
            .map(|o| o.key().clone())
            .collect();
        for key in stale {
            let obj = self.objects.remove(&key).expect("listed above");
            tracing::info!(%key, put_id = obj.put_id, "releasing an abandoned put's space");
            self.counters.expired_puts += 1;
            self.discard(*obj, now);
        }
    }

    fn release_due(&mut self, now: Millis) {
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.at <= now);
        self.pending = keep;
        for p in due {
            if let Some(seg) = self.segments.get_mut(&p.segment) {
                seg.allocator.free(p.allocation);
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

    /// Frees at least `need` bytes, and at least the eviction ratio of total capacity, if that
    /// many evictable bytes exist; least recently used (put or leased) first, soft-pinned last.
    /// Bytes of offloads under way that free memory when they land count as freed already.
    /// Returns the bytes freed at once.
    pub(super) fn evict(&mut self, now: Millis, need: u64) -> u64 {
        self.release_due(now);
        let target = need.max((self.capacity() as f64 * self.policy.eviction_ratio) as u64);
        // Offloads under way free their memory when they land: that room is coming already.
        let mut pending = self.offload_freeing;
        if pending >= target {
            return 0;
        }
        // (soft-pinned?, last access, key): unpinned objects sort first, then least recently used.
        let mut candidates: Vec<(bool, Millis, ObjectKey)> = Vec::new();
        for o in self.objects.iter() {
            if matches!(
                o.offload(),
                Offload::Pending {
                    evict_after: true,
                    ..
                }
            ) {
                continue;
            }
            if !o.phase.is_complete() || o.is_leased(now) || o.replicas.is_empty() {
                continue;
            }
            if o.pin.is_hard() {
                continue;
            }
            candidates.push((o.pin.is_soft_at(now), o.last_access, o.key().clone()));
        }
        candidates.sort_unstable();
        let mut freed = 0u64;
        let mut count = 0u64;
        for (_, _, key) in candidates {
            if freed + pending >= target {
                break;
            }
            let obj = self.objects.get_mut(&key).expect("candidate exists");
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
                pending = self.offload_freeing;
                continue;
            }
            let obj = &self.objects[&key];
            let size: u64 = obj.replicas.iter().map(|r| self.reserved(r)).sum();
            if !obj.disk().is_empty() {
                // A disk copy exists: the memory goes, the object stays readable from disk.
                let obj = self.objects.get_mut(&key).expect("candidate exists");
                let (replicas, put_id) = (std::mem::take(&mut obj.replicas), obj.put_id);
                self.drop_replicas(replicas, put_id);
                freed += size;
                count += 1;
                continue;
            }
            if self.has_disk_tier(obj) {
                let failed_lately = matches!(obj.offload(), Offload::Failed { at }
                    if now < at.plus(self.policy.offload_timeout));
                if !failed_lately && self.start_offload(&key, true, now) {
                    pending = self.offload_freeing;
                    continue;
                }
                if self.policy.when_disk_behind == WhenDiskBehind::Keep {
                    self.counters.kept_disk_behind += 1;
                    continue;
                }
                self.counters.dropped_disk_behind += 1;
            }
            let obj = self.objects.remove(&key).expect("candidate exists");
            freed += size;
            count += 1;
            self.discard(*obj, now);
        }
        self.counters.eviction_rounds += 1;
        self.counters.evicted_objects += count;
        self.counters.evicted_bytes += freed;
        if count > 0 || pending > 0 {
            tracing::debug!(
                objects = count,
                bytes = freed,
                offloading = pending,
                "evicted"
            );
        }
        freed
    }
}
