//! Periodic upkeep and eviction: expiring silent owners and abandoned puts, releasing deferred
//! space, and evicting the least recently used objects when memory runs high or an allocation
//! failed. Leased, hard-pinned and unfinished objects are never evicted; soft-pinned ones only
//! when nothing else is left.

use mooncake_common::ObjectKey;

use super::{
    objects::{Phase, Pin},
    MasterState,
};
use crate::clock::Millis;

impl MasterState {
    /// One round of upkeep; the server calls it periodically.
    pub fn tick(&mut self, now: Millis) {
        self.expire_owners(now);
        self.expire_puts(now);
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
            .filter(|(_, o)| matches!(o.phase, Phase::Processing { started } if started.plus(timeout) <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            let obj = self.objects.remove(&key).expect("listed above");
            tracing::info!(%key, put_id = obj.put_id, "releasing an abandoned put's space");
            self.counters.expired_puts += 1;
            self.free_replicas(obj.replicas);
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

    /// Frees at least `need` bytes, and at least the eviction ratio of total capacity, if that
    /// many evictable bytes exist; least recently used (put or leased) first, soft-pinned last.
    pub(super) fn evict(&mut self, now: Millis, need: u64) {
        self.release_due(now);
        let target = need.max((self.capacity() as f64 * self.policy.eviction_ratio) as u64);
        // (soft-pinned?, last access, key): unpinned objects sort first, then least recently used.
        let mut candidates: Vec<(bool, Millis, ObjectKey)> = self
            .objects
            .iter()
            .filter_map(|(k, o)| {
                if o.phase != Phase::Complete || o.is_leased(now) {
                    return None;
                }
                let soft = match o.pin {
                    Pin::Hard => return None,
                    Pin::Soft { until } => until > now,
                    Pin::None => false,
                };
                Some((soft, o.last_access, k.clone()))
            })
            .collect();
        candidates.sort_unstable();
        let mut freed = 0u64;
        let mut count = 0u64;
        for (_, _, key) in candidates {
            if freed >= target {
                break;
            }
            let obj = self.objects.remove(&key).expect("candidate exists");
            freed += obj
                .replicas
                .iter()
                .map(|r| r.allocation.size())
                .sum::<u64>();
            count += 1;
            self.free_replicas(obj.replicas);
        }
        self.counters.eviction_rounds += 1;
        self.counters.evicted_objects += count;
        self.counters.evicted_bytes += freed;
        if count > 0 {
            tracing::debug!(objects = count, bytes = freed, "evicted");
        }
    }
}
