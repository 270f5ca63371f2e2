//! The read leases this client holds, handed back as soon as its reads are done, so a finished
//! read pins nothing in the cache (with the master's lease mode "reads"; with "ttl" the master
//! ignores them). A get's holds go back when its transfers end, or when its caller drops the get
//! before (a timeout, a `select!`); the holds of an existence check
//! or a descriptor lookup, which a get of the same keys usually follows, go back when this
//! client's next call ends, or a quarter of their TTL after they were asked for if no call
//! ends by then (a check followed by no call for a while is usual: kept longer, such holds
//! would pass half their TTL and be dropped, and a dropped hold keeps its key leased for as
//! long as other readers keep leasing it, their holds added to it). Releases ride on this client's next lookup or existence check (no
//! call of their own); when none comes within a moment, a background sender sends them (a task
//! of the client's runtime, or a thread of its own where nothing drives that runtime between
//! calls). A
//! release that fails is only logged, never sent again (a hold handed back twice would take
//! another reader's): the lease then ends at its TTL, as it would have without.
//!
//! The master counts a lease's holds; it does not name them. A release that reaches it after
//! the lease ran out (and another reader leased the key anew) would end that reader's lease, and
//! eviction could then take the object while it is being read. So a hold goes back only within
//! the first half of its TTL, counted from when the lookup that took it was sent (the lease
//! started no earlier); after that it is dropped and its lease ends at its TTL. For the same
//! reason a hold goes back
//! only to the master that granted it: releases name that master's epoch, a master of another
//! epoch (restarted, or a new leader) ignores them, and once a newer master has answered, the
//! holds of older ones are dropped here.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use mooncake_common::{
    master_api::{Existence, Lookup, Releases},
    ApiError, MasterApi,
};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::client::Client;

/// Keys released in one call at most.
const BATCH: usize = 4096;
/// How long the sender lets releases gather before it sends them: a lease ends this much later
/// at most, and a client doing back-to-back gets sends one release per several of them.
const LINGER: std::time::Duration = std::time::Duration::from_millis(2);

/// The lease a lookup's (or an existence check's) hits got: asked for at `asked`, lasting `ttl`
/// from the answer of the master of `epoch`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Granted {
    pub asked: Instant,
    pub ttl: Duration,
    pub epoch: u64,
}

impl Granted {
    /// The lease the hits of `lookup`, asked for at `asked`, got.
    pub fn by_lookup(asked: Instant, lookup: &Lookup) -> Granted {
        Granted {
            asked,
            ttl: lookup.lease_ttl,
            epoch: lookup.epoch,
        }
    }

    /// The lease the hits of an existence check, asked for at `asked`, got.
    pub fn by_check(asked: Instant, check: &Existence) -> Granted {
        Granted {
            asked,
            ttl: check.lease_ttl,
            epoch: check.epoch,
        }
    }

    /// The earliest the lease can end: it started no earlier than it was asked for.
    pub fn deadline(self) -> Instant {
        self.asked + self.ttl
    }

    /// The last instant a release of one of its holds is sent.
    pub fn send_by(self) -> Instant {
        self.asked + self.ttl / 2
    }
}

/// A hold to hand back: its key, the master that granted it, and the instant after which it is
/// dropped instead.
struct Hold {
    key: String,
    epoch: u64,
    send_by: Instant,
    /// When a kept hold (see `Leases::keep`) goes back if no call ended before.
    due: Instant,
}

/// Holds to hand back now, all granted by the master of `epoch`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Taken {
    pub keys: Vec<String>,
    pub epoch: u64,
    /// The earliest of their holds' `send_by`.
    pub send_by: Option<Instant>,
}

impl Taken {
    /// The borrowed form the master calls take, given the keys as `&str`s.
    pub fn releases<'a>(&self, keys: &'a [&'a str]) -> Releases<'a> {
        Releases {
            keys,
            epoch: self.epoch,
            send_by: self.send_by,
        }
    }

    pub fn key_refs(&self) -> Vec<&str> {
        self.keys.iter().map(String::as_str).collect()
    }
}

/// The holds of a get's reads, handed back when dropped (see `Leases::reading`).
#[must_use = "the holds go back when this is dropped"]
pub(crate) struct Reading<'a> {
    leases: &'a Leases,
    holds: Vec<Hold>,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.leases.hand_back(std::mem::take(&mut self.holds));
        self.leases.call_ended();
    }
}

#[derive(Default)]
pub(crate) struct Leases {
    /// Holds to hand back: a key once per hold.
    queue: Mutex<Vec<Hold>>,
    /// Holds of existence checks and descriptor lookups, queued when the next call ends.
    held: Mutex<Vec<Hold>>,
    /// Holds dropped for being too late to hand back, or granted by a master gone since.
    dropped: AtomicU64,
    /// The newest master epoch a grant came from.
    newest: AtomicU64,
    wake: Notify,
    closed: AtomicBool,
    /// What sends releases (see `finish`).
    sender: Mutex<Option<Sender>>,
}

/// The sender of releases: a task of the client's runtime, or a thread of its own.
enum Sender {
    Task(tokio::task::JoinHandle<()>),
    /// Tells when the thread's sender ended.
    Thread(tokio::sync::oneshot::Receiver<()>),
}

impl Leases {
    /// Starts the task that sends releases to `master`; it ends after `close`.
    pub fn start(master: Arc<dyn MasterApi>) -> Arc<Leases> {
        let leases = Arc::new(Leases::default());
        *leases.sender.lock() = Some(Sender::Task(tokio::spawn(leases.clone().run(master))));
        leases
    }

    /// Starts the sender on a thread of its own, with a master connection of its own from
    /// `connect`, for a client whose calls run on a current-thread runtime nothing drives
    /// between them (the Python binding's): a task there would send nothing until the next
    /// call, leaving finished reads leased (unremovable, unevictable) while the caller is idle.
    /// Falls back to `start` on `master` if the thread cannot start.
    pub fn start_on_thread(
        connect: impl FnOnce() -> Result<Arc<dyn MasterApi>, crate::error::ClientError> + Send + 'static,
        master: Arc<dyn MasterApi>,
    ) -> Arc<Leases> {
        let leases = Arc::new(Leases::default());
        let (done, ended) = tokio::sync::oneshot::channel();
        let on_thread = leases.clone();
        let started = std::thread::Builder::new()
            .name("mooncake-releases".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot start the read-lease sender; leases end with the next call or at their TTL");
                        return;
                    }
                };
                rt.block_on(async {
                    match connect() {
                        Ok(master) => on_thread.run(master).await,
                        Err(e) => {
                            tracing::warn!(error = %e, "the read-lease sender cannot reach the master; leases end with the next call or at their TTL")
                        }
                    }
                });
                let _ = done.send(());
            });
        match started {
            Ok(_) => *leases.sender.lock() = Some(Sender::Thread(ended)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a thread for the read-lease sender; it runs on the client's runtime");
                *leases.sender.lock() =
                    Some(Sender::Task(tokio::spawn(leases.clone().run(master))));
            }
        }
        leases
    }

    /// Closes, and waits up to `within` for the sender to hand back what is held: a runtime
    /// about to stop would otherwise drop the last releases, leaving those objects leased
    /// (unremovable, unevictable) until their TTL.
    pub async fn finish(&self, within: std::time::Duration) {
        self.close();
        let sender = self.sender.lock().take();
        if let Some(sender) = sender {
            let ended = async {
                match sender {
                    Sender::Task(t) => drop(t.await),
                    Sender::Thread(ended) => drop(ended.await),
                }
            };
            if tokio::time::timeout(within, ended).await.is_err() {
                tracing::debug!(
                    "read holds not handed back within {within:?}; they end at their TTL"
                );
            }
        }
    }

    /// A get is about to read `keys` under the lease `granted`: their holds go back when the
    /// guard is dropped, at the end of the get's reads or with the get itself when its caller
    /// drops it first (a timeout, a `select!`), which would otherwise leave them to end at
    /// their TTL. The holds kept for the call (see `keep`) go back then too.
    pub fn reading<K: Into<String>>(
        &self,
        keys: impl IntoIterator<Item = K>,
        granted: Granted,
    ) -> Reading<'_> {
        Reading {
            leases: self,
            holds: self.holds(keys, granted).collect(),
        }
    }

    fn hand_back(&self, holds: impl IntoIterator<Item = Hold>) {
        let mut q = self.queue.lock();
        let before = q.len();
        q.extend(holds);
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

    /// Holds (of the lease `granted`) a get of the same keys usually follows: kept until the
    /// next call ends.
    pub fn keep<'k>(&self, keys: impl IntoIterator<Item = &'k str>, granted: Granted) {
        let holds = self.holds(keys, granted);
        let mut held = self.held.lock();
        let first = held.is_empty();
        held.extend(holds);
        if first && !held.is_empty() {
            // The sender learns when they are due (later ones are due after the first).
            drop(held);
            self.wake.notify_one();
        }
    }

    /// The holds of `keys` under the lease `granted` (whose master is now the newest known, if
    /// it is newer).
    fn holds<K: Into<String>>(
        &self,
        keys: impl IntoIterator<Item = K>,
        granted: Granted,
    ) -> impl Iterator<Item = Hold> {
        let (send_by, epoch) = (granted.send_by(), granted.epoch);
        let due = granted.asked + granted.ttl / 4;
        self.newest.fetch_max(epoch, Ordering::Relaxed);
        keys.into_iter().map(move |k| Hold {
            key: k.into(),
            epoch,
            send_by,
            due,
        })
    }

    /// Kept holds due by `now` go back though no call ended (queued: true if any was); also
    /// when the next one is due, if any is kept.
    fn queue_due(&self, now: Instant) -> (bool, Option<Instant>) {
        let mut held = self.held.lock();
        let due: Vec<Hold> = held.extract_if(.., |h| h.due <= now).collect();
        let next = held.iter().map(|h| h.due).min();
        drop(held);
        let queued = !due.is_empty();
        if queued {
            self.queue.lock().extend(due);
        }
        (queued, next)
    }

    /// The holds waiting to go back, for the caller to send with its own call (at most `BATCH`);
    /// those too late to go back, or granted by a master older than the newest that answered,
    /// are dropped.
    pub fn take(&self) -> Taken {
        let now = Instant::now();
        let epoch = self.newest.load(Ordering::Relaxed);
        let mut dropped = 0;
        let mut send_by: Option<Instant> = None;
        let keys: Vec<String> = {
            let mut q = self.queue.lock();
            let n = q.len().min(BATCH);
            q.drain(..n)
                .filter_map(|h| {
                    let goes = now < h.send_by && h.epoch == epoch;
                    dropped += u64::from(!goes);
                    if goes {
                        send_by = Some(send_by.map_or(h.send_by, |t| t.min(h.send_by)));
                    }
                    goes.then_some(h.key)
                })
                .collect()
        };
        if dropped > 0 {
            let total = self.dropped.fetch_add(dropped, Ordering::Relaxed) + dropped;
            tracing::debug!(
                dropped,
                total,
                "read holds past half their lease, or granted by a master gone since, not handed back; they end at their TTL"
            );
        }
        Taken {
            keys,
            epoch,
            send_by,
        }
    }

    /// Holds dropped so far for being too late to hand back.
    #[cfg(test)]
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
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
            if batch.keys.is_empty() {
                if !self.queue.lock().is_empty() {
                    // Every hold taken was too late to go back; there are more.
                    continue;
                }
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                match self.queue_due(Instant::now()) {
                    (true, _) => continue,
                    (false, Some(due)) => {
                        tokio::select! {
                            _ = self.wake.notified() => {}
                            _ = tokio::time::sleep_until(due.into()) => continue,
                        }
                    }
                    (false, None) => self.wake.notified().await,
                }
                if !self.closed.load(Ordering::Acquire) && self.queue.lock().len() < BATCH {
                    tokio::time::sleep(LINGER).await;
                }
                continue;
            }
            let keys = batch.key_refs();
            if let Err(e) = master.release_leases(batch.releases(&keys)).await {
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
        let refs = release.key_refs();
        self.master
            .get_replicas(keys, release.releases(&refs))
            .await
    }

    /// An existence check of `keys` that hands back this client's pending holds with it.
    pub(crate) async fn check(&self, keys: &[&str]) -> Result<Existence, ApiError> {
        let release = self.leases.take();
        let refs = release.key_refs();
        self.master.exists(keys, release.releases(&refs)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked_ago(secs: u64, ttl: Duration, epoch: u64) -> Granted {
        let asked = Instant::now()
            .checked_sub(Duration::from_secs(secs))
            .expect("the clock has run that long");
        Granted { asked, ttl, epoch }
    }

    /// What `take` answered, less when its holds must go out by (checked on its own).
    fn taken(keys: &[&str], epoch: u64) -> (Vec<String>, u64) {
        (keys.iter().map(|k| k.to_string()).collect(), epoch)
    }

    fn take(leases: &Leases) -> (Vec<String>, u64) {
        let t = leases.take();
        (t.keys, t.epoch)
    }

    #[test]
    fn holds_go_back_only_within_the_first_half_of_their_lease() {
        let leases = Leases::default();
        let ttl = Duration::from_secs(10);
        drop(leases.reading(["fresh"], asked_ago(0, ttl, 7)));
        drop(leases.reading(["late"], asked_ago(6, ttl, 7)));
        leases.keep(["kept-too-long"], asked_ago(5, ttl, 7));
        leases.keep(["kept"], asked_ago(4, ttl, 7));
        leases.call_ended();
        let t = leases.take();
        assert_eq!((t.keys, t.epoch), taken(&["fresh", "kept"], 7));
        // The request must go out by the earliest of theirs: kept's, asked 4 s ago.
        let left = t.send_by.unwrap() - Instant::now();
        assert!(left <= Duration::from_secs(1), "{left:?}");
        assert_eq!(leases.dropped(), 2);
        assert_eq!(take(&leases), taken(&[], 7));
    }

    #[test]
    fn holds_go_back_only_to_the_master_that_granted_them() {
        let leases = Leases::default();
        let ttl = Duration::from_secs(10);
        drop(leases.reading(["a"], asked_ago(0, ttl, 7)));
        // Before any newer master answered, the old one's holds go, naming it.
        assert_eq!(take(&leases), taken(&["a"], 7));
        drop(leases.reading(["b"], asked_ago(0, ttl, 7)));
        leases.keep(["c"], asked_ago(0, ttl, 7));
        // A newer master answered (a restart, a new leader): the older holds are dropped.
        drop(leases.reading(["d"], asked_ago(0, ttl, 9)));
        leases.call_ended();
        assert_eq!(take(&leases), taken(&["d"], 9));
        assert_eq!(leases.dropped(), 2);
    }
}
