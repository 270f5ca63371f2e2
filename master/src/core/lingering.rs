//! Read holds of objects that left the table while being read: taken out by an upsert or a
//! forced removal, or gone with their segment. Their readers still hand the holds back, by key
//! alone (a lease counts its holds without naming them), and a key put again meanwhile is a new
//! object with a lease of its own: those releases would end its readers' holds, and eviction
//! could take it while they read. So a release of such a key goes here first, while the old
//! lease lasts. The new object's count then falls no faster than its own readers release:
//! should a new reader's release be taken here instead of an old one's, the old one's later
//! reaches the new object, or never comes and only keeps the new one leased until its TTL.

use std::collections::HashMap;

use mooncake_common::ObjectKey;

use super::objects::Lease;
use crate::clock::Millis;

/// Entries kept at most: beyond, the one found first goes (its releases then reach a new
/// object of the key, as before this table). Only forced removals and upserts of objects being
/// read add entries, each for the rest of a lease.
const MAX: usize = 1 << 16;

#[derive(Default)]
pub(super) struct LingeringHolds {
    by_key: HashMap<ObjectKey, Lease>,
}

impl LingeringHolds {
    /// An object of `key` left with `lease`: its holds still to come back are kept, added to
    /// those of an earlier version still lingering.
    pub fn keep(&mut self, key: &ObjectKey, lease: Lease, now: Millis) {
        if !lease.is_active(now) || lease.holds() == 0 {
            return;
        }
        if self.by_key.len() >= MAX && !self.by_key.contains_key(key) {
            self.prune(now);
            if self.by_key.len() >= MAX {
                let any = self.by_key.keys().next().cloned();
                if let Some(k) = any {
                    self.by_key.remove(&k);
                }
            }
        }
        let entry = self.by_key.entry(key.clone()).or_insert(Lease::NONE);
        *entry = entry.joined(lease, now);
    }

    /// A hold of `key` came back: whether it was a lingering one (taken here).
    pub fn take_release(&mut self, key: &str, now: Millis) -> bool {
        if self.by_key.is_empty() {
            return false; // the usual case, without hashing the key
        }
        let Some(lease) = self.by_key.get_mut(key) else {
            return false;
        };
        let taken = lease.is_active(now);
        if taken {
            lease.release(now);
        }
        if !lease.is_active(now) {
            self.by_key.remove(key);
        }
        taken
    }

    /// Forgets leases that ended: their readers no longer hand holds back.
    pub fn prune(&mut self, now: Millis) {
        if !self.by_key.is_empty() {
            self.by_key.retain(|_, l| l.is_active(now));
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(s: &str) -> ObjectKey {
        ObjectKey::new(s).unwrap()
    }

    fn leased(holds: u64, now: Millis) -> Lease {
        let mut l = Lease::NONE;
        for _ in 0..holds {
            l.grant(now, Duration::from_secs(10));
        }
        l
    }

    #[test]
    fn releases_go_to_the_old_lease_until_its_holds_are_back() {
        let mut h = LingeringHolds::default();
        let now = Millis(1_000);
        h.keep(&key("k"), leased(2, now), now);
        assert!(h.take_release("k", now));
        assert!(h.take_release("k", now));
        assert!(!h.take_release("k", now), "both holds came back");
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn nothing_lingers_past_the_lease_or_without_holds() {
        let mut h = LingeringHolds::default();
        let now = Millis(1_000);
        h.keep(&key("idle"), Lease::NONE, now);
        h.keep(&key("k"), leased(1, now), now);
        assert_eq!(h.len(), 1);
        let later = now.plus(Duration::from_secs(11));
        assert!(!h.take_release("k", later), "the lease ran out");
        h.keep(&key("k"), leased(1, now), now);
        h.prune(later);
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn a_second_version_adds_its_holds() {
        let mut h = LingeringHolds::default();
        let now = Millis(1_000);
        h.keep(&key("k"), leased(1, now), now);
        h.keep(&key("k"), leased(2, now), now);
        for _ in 0..3 {
            assert!(h.take_release("k", now));
        }
        assert!(!h.take_release("k", now));
    }
}
