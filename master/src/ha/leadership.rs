//! Whether this process may answer: always without HA; with HA, only while its etcd lease is
//! known to be alive. The election loop moves `valid_until` forward on every acknowledged
//! keepalive (from the moment the keepalive was sent, so the local view never outlives etcd's),
//! and every request checks it: a leader that was paused past its lease, or cut off from etcd,
//! refuses to answer from the instant its lease may have lapsed, before it even notices.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::clock::Millis;

#[derive(Debug)]
pub struct Leadership {
    /// Master-clock milliseconds until which this process leads; u64::MAX: no election.
    valid_until: AtomicU64,
    /// Set once the term answers calls: from then on a lapse is final (see `extend_to`).
    serving: AtomicBool,
}

impl Default for Leadership {
    fn default() -> Self {
        Leadership::always()
    }
}

impl Leadership {
    /// A master without HA: it always answers.
    pub fn always() -> Self {
        Leadership {
            valid_until: AtomicU64::new(u64::MAX),
            serving: AtomicBool::new(true),
        }
    }

    /// A leader whose lease is known alive until `until`.
    pub fn until(until: Millis) -> Self {
        Leadership {
            valid_until: AtomicU64::new(until.0),
            serving: AtomicBool::new(false),
        }
    }

    /// The term starts answering calls.
    pub fn serve(&self) {
        self.serving.store(true, Ordering::SeqCst);
    }

    /// Moves the lease's end to `until` (an acknowledged keepalive), unless it lapsed by `now`
    /// (or was revoked) once the term answers calls: then a lapse is final. The term's answers
    /// stopped at the lapse, and a call refused then as "not the leader" may already be on its
    /// way to be asked again (of this same master, should etcd still name it): revived by a
    /// late acknowledgement, it would run that call twice. Before the term answers (the new
    /// leader's start: etcd reads and writes, a predecessor's lease waited out), nothing was
    /// refused, and the view may lapse and come back. False when it had lapsed for good.
    pub fn extend_to(&self, until: Millis, now: Millis) -> bool {
        let mut current = self.valid_until.load(Ordering::SeqCst);
        loop {
            if current == 0 || (current <= now.0 && self.serving.load(Ordering::SeqCst)) {
                return false;
            }
            if current >= until.0 {
                return true;
            }
            match self.valid_until.compare_exchange(
                current,
                until.0,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// Stops answering at once (the lease was lost or given up).
    pub fn revoke(&self) {
        self.valid_until.store(0, Ordering::SeqCst);
    }

    /// How long the lease is known alive from `now` (zero once it may have lapsed).
    pub fn left(&self, now: Millis) -> std::time::Duration {
        std::time::Duration::from_millis(
            self.valid_until
                .load(Ordering::SeqCst)
                .saturating_sub(now.0),
        )
    }

    pub fn holds(&self, now: Millis) -> bool {
        now.0 < self.valid_until.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_holds_until_it_lapses_or_is_revoked() {
        assert!(Leadership::always().holds(Millis(u64::MAX - 1)));
        let l = Leadership::until(Millis(100));
        assert!(l.holds(Millis(99)) && !l.holds(Millis(100)));
        assert!(l.extend_to(Millis(200), Millis(50)));
        assert!(l.extend_to(Millis(150), Millis(60)));
        assert!(l.holds(Millis(199)));
        l.revoke();
        assert!(!l.holds(Millis(1)));
        assert!(!l.extend_to(Millis(300), Millis(2)), "revoked for good");
    }

    /// A lease that lapsed while the term answered stays lapsed: a late acknowledgement of a
    /// keepalive sent before the lapse does not revive it (calls refused meanwhile as "not the
    /// leader" may be asked again of this master). Before the term answers, it may.
    #[test]
    fn a_lapse_is_final_once_the_term_answers() {
        let l = Leadership::until(Millis(100));
        assert!(l.extend_to(Millis(190), Millis(120)), "not answering yet");
        assert!(l.holds(Millis(150)));
        l.serve();
        assert!(!l.extend_to(Millis(290), Millis(200)));
        assert!(!l.holds(Millis(201)));
    }
}
