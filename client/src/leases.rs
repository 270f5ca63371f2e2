//! The read leases this client holds, handed back as soon as its reads are done, so a finished
//! read pins nothing in the cache (with the master's lease mode "reads"; with "ttl" the master
//! ignores them). A get's holds go back when its transfers end; the holds of an existence check
//! or a descriptor lookup, which a get of the same keys usually follows, go back when this
//! client's next call ends. Releases ride on this client's next lookup or existence check (no
//! call of their own); when none comes within a moment, a background task sends them. A
//! release that fails is only logged, never sent again (a hold handed back twice would take
//! another reader's): the lease then ends at its TTL, as it would have without.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use mooncake_common::{master_api::Lookup, ApiError, Code, MasterApi};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::client::Client;

/// Keys released in one call at most.
const BATCH: usize = 4096;
/// How long the sender lets releases gather before it sends them: a lease ends this much later
/// at most, and a client doing back-to-back gets sends one release per several of them.
const LINGER: std::time::Duration = std::time::Duration::from_millis(2);

#[derive(Default)]
pub(crate) struct Leases {
    /// Holds to hand back: a key once per hold.
    queue: Mutex<Vec<String>>,
    /// Holds of existence checks and descriptor lookups, queued when the next call ends.
    held: Mutex<Vec<String>>,
    wake: Notify,
    closed: AtomicBool,
}

impl Leases {
    /// Starts the task that sends releases to `master`; it ends after `close`.
    pub fn start(master: Arc<dyn MasterApi>) -> Arc<Leases> {
        let leases = Arc::new(Leases::default());
        tokio::spawn(leases.clone().run(master));
        leases
    }

    /// The reads of `keys` are done: their holds go back.
    pub fn done<K: Into<String>>(&self, keys: impl IntoIterator<Item = K>) {
        let mut q = self.queue.lock();
        let before = q.len();
        q.extend(keys.into_iter().map(Into::into));
        if q.len() > before {
            drop(q);
            self.wake.notify_one();
        }
    }

    /// A call ended: the holds kept for it (see `keep`) go back.
    pub fn call_ended(&self) {
        let held = std::mem::take(&mut *self.held.lock());
        if !held.is_empty() {
            self.queue.lock().extend(held);
            self.wake.notify_one();
        }
    }

    /// Holds a get of the same keys usually follows: kept until the next call ends.
    pub fn keep<'k>(&self, keys: impl IntoIterator<Item = &'k str>) {
        self.held.lock().extend(keys.into_iter().map(str::to_owned));
    }

    /// The holds waiting to go back, for the caller to send with its own call (at most `BATCH`).
    pub fn take(&self) -> Vec<String> {
        let mut q = self.queue.lock();
        let n = q.len().min(BATCH);
        q.drain(..n).collect()
    }

    /// Stops the sender once it has sent what is queued now (and what is held).
    pub fn close(&self) {
        self.call_ended();
        self.closed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    async fn run(self: Arc<Self>, master: Arc<dyn MasterApi>) {
        loop {
            let batch = self.take();
            if batch.is_empty() {
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                self.wake.notified().await;
                if !self.closed.load(Ordering::Acquire) && self.queue.lock().len() < BATCH {
                    tokio::time::sleep(LINGER).await;
                }
                continue;
            }
            let keys: Vec<&str> = batch.iter().map(String::as_str).collect();
            if let Err(e) = master.release_leases(&keys).await {
                tracing::debug!(keys = keys.len(), error = %e, "releasing read leases failed; they end at their TTL");
            }
        }
    }
}

/// The keys a lookup found (each of which it leased), in order.
pub(crate) fn found<'a, 'k>(
    keys: &'a [&'k str],
    lookup: &'a Lookup,
) -> impl Iterator<Item = &'k str> + 'a {
    keys.iter()
        .zip(lookup.results())
        .filter(|(_, r)| r.is_ok())
        .map(|(k, _)| *k)
}

impl Client {
    /// A lookup of `keys` that hands back this client's pending holds with it.
    pub(crate) async fn lookup(&self, keys: &[&str]) -> Result<Lookup, ApiError> {
        let release = self.leases.take();
        let release: Vec<&str> = release.iter().map(String::as_str).collect();
        self.master.get_replicas(keys, &release).await
    }

    /// An existence check of `keys` that hands back this client's pending holds with it.
    pub(crate) async fn check(&self, keys: &[&str]) -> Result<Vec<Result<bool, Code>>, ApiError> {
        let release = self.leases.take();
        let release: Vec<&str> = release.iter().map(String::as_str).collect();
        self.master.exists(keys, &release).await
    }
}
