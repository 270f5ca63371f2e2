//! Time as the master's core sees it: milliseconds on a monotonic clock, passed into every state
//! transition. The real clock and a manual one for tests implement one trait, so lease, TTL and
//! timeout logic is tested without sleeping.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Milliseconds since the clock's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millis(pub u64);

impl Millis {
    pub fn plus(self, d: Duration) -> Millis {
        Millis(
            self.0
                .saturating_add(d.as_millis().min(u64::MAX as u128) as u64),
        )
    }

    /// Time from `self` until `later`, zero if `later` is not after `self`.
    pub fn until(self, later: Millis) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }
}

pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Millis;
}

/// The process's monotonic clock.
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        Millis(self.origin.elapsed().as_millis() as u64)
    }
}

/// A clock that moves only when told to; for tests.
#[derive(Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(start: Millis) -> Self {
        ManualClock {
            now: AtomicU64::new(start.0),
        }
    }

    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        Millis(self.now.load(Ordering::SeqCst))
    }
}
