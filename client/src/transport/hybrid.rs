//! The transport clients use: the same-host path for owners on this host that offer it (unless
//! `MOONCAKE_SHM` turns it off), TCP for every other owner, decided per owner without the caller
//! being told (a TCP verdict is probed again after a while: the owner may be back). A same-host
//! connection that fails is forgotten, so the next call probes again (an owner restart, for
//! instance), and a batch that finds none (the owner's socket gone or taken by a restarted owner)
//! goes over TCP instead of failing; the pool's mapping is kept for that probe, which takes it
//! back when the owner's pool is the same.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use mooncake_common::{
    local::socket_path,
    transport::{DataTransport, ReadItem, TransferError, TransferStats, WriteItem},
    SegmentName,
};
use parking_lot::Mutex;

use super::{
    local::{Deadlines, LocalOwner, SharedPool},
    tcp::TcpConfig,
    TcpTransport,
};

/// How long the mapping of a forgotten same-host route waits for the route to be made again.
const RETIRED_FOR: Duration = Duration::from_secs(60);
/// How often calls look for mappings held for nothing (see `HybridTransport::tidy`).
const TIDY_EVERY: Duration = Duration::from_secs(10);
/// How long an owner found unreachable by the same-host path goes over TCP before the path is
/// probed again (`HybridConfig::probe_again_after`): a same-host owner stopped (its socket
/// gone, or refusing) may come back.
pub const PROBE_AGAIN_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct HybridConfig {
    pub tcp: TcpConfig,
    /// Try the same-host path at all.
    pub shared_memory: bool,
    /// Where owners' sockets live.
    pub socket_dir: PathBuf,
    /// Threads a large same-host batch's copies may use (1: the calling thread only).
    pub copy_threads: usize,
    /// How long an owner the same-host path did not reach goes over TCP before it is probed
    /// again (`PROBE_AGAIN_AFTER`).
    pub probe_again_after: Duration,
}

#[derive(Clone)]
enum Route {
    Local(Arc<LocalOwner>),
    Tcp,
}

/// What `HybridTransport::cached` found.
enum Cached {
    Route(Route),
    /// A route due to be probed again, by this caller.
    Due(Route),
    None,
}

pub struct HybridTransport {
    config: HybridConfig,
    tcp: TcpTransport,
    /// Each owner's route, and when to probe it again (a TCP verdict the owner may outlive).
    routes: Mutex<HashMap<SegmentName, (Route, Option<Instant>)>>,
    /// One probe per owner at a time (its gate is held until its connect returns, even past
    /// the probe's timeout): callers of an owner being probed wait for its verdict instead of
    /// each connecting and mapping its whole pool, and a probe again is skipped while one is
    /// under way. A gate per owner ever probed (a few bytes each).
    probing: Mutex<HashMap<SegmentName, Arc<tokio::sync::Mutex<()>>>>,
    /// The mappings of same-host routes forgotten after a broken connection, with when: the
    /// next probe of the owner takes its mapping back if the pool is the same (see `probe`).
    /// Kept a minute at most, so the pool of an owner gone for good is not held.
    retired: Mutex<HashMap<SegmentName, (Instant, SharedPool)>>,
    /// When this transport was made, and (in ms from then) when the next call tidies.
    born: Instant,
    next_tidy: AtomicU64,
    local_bytes: AtomicU64,
    tcp_bytes: AtomicU64,
}

impl HybridTransport {
    pub fn new(config: HybridConfig) -> Self {
        HybridTransport {
            tcp: TcpTransport::new(config.tcp.clone()),
            config,
            routes: Mutex::new(HashMap::new()),
            probing: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashMap::new()),
            born: Instant::now(),
            next_tidy: AtomicU64::new(0),
            local_bytes: AtomicU64::new(0),
            tcp_bytes: AtomicU64::new(0),
        }
    }

    async fn route(&self, target: &SegmentName) -> Route {
        self.tidy();
        let stale = match self.cached(target) {
            Cached::Route(r) => return r,
            Cached::Due(r) => Some(r),
            Cached::None => None,
        };
        let gate = self
            .probing
            .lock()
            .entry(target.clone())
            .or_default()
            .clone();
        let probing = match &stale {
            // Probed again by this caller, unless a probe is under way (or still stuck in its
            // connect): the route stands meanwhile.
            Some(r) => match gate.try_lock_owned() {
                Ok(g) => g,
                Err(_) => return r.clone(),
            },
            // The first probe: callers wait for its verdict, up to the connect timeout (a probe
            // stuck in its connect holds the gate); this call goes over TCP after that.
            None => {
                let timeout = self.config.tcp.connect_timeout;
                match tokio::time::timeout(timeout, gate.lock_owned()).await {
                    Ok(g) => g,
                    Err(_) => return Route::Tcp,
                }
            }
        };
        if stale.is_none() {
            if let Cached::Route(r) = self.cached(target) {
                return r;
            }
        }
        let (route, again) = self.probe(target, probing).await;
        let mut routes = self.routes.lock();
        // A new owner is often an old one restarted under another name (port 0): drop the
        // mappings of owners that are gone, which nothing would call again.
        routes.retain(|_, (r, _)| !matches!(r, Route::Local(o) if o.is_gone()));
        routes.insert(target.clone(), (route.clone(), again));
        route
    }

    /// The route to `target`; `Due` (with the route as it stands) to the one caller that is to
    /// probe it again (the time of the next probe moves on at once, so the others keep the
    /// route meanwhile).
    fn cached(&self, target: &SegmentName) -> Cached {
        let mut routes = self.routes.lock();
        let Some((route, again)) = routes.get_mut(target) else {
            return Cached::None;
        };
        let now = Instant::now();
        if again.is_some_and(|at| now >= at) {
            *again = Some(now + self.config.probe_again_after);
            return Cached::Due(route.clone());
        }
        Cached::Route(route.clone())
    }

    /// Every `TIDY_EVERY` at most (one atomic load otherwise): lets go of the mappings of
    /// forgotten routes past `RETIRED_FOR`, and of routes to owners that are surely gone. A
    /// same-host owner's whole pool stays allocated while a client maps it: an owner gone for
    /// good (a scale-down) whose segment nothing calls again would otherwise stay mapped for
    /// the client's life.
    fn tidy(&self) {
        let now = self.born.elapsed().as_millis() as u64;
        let due = self.next_tidy.load(Ordering::Relaxed);
        if now < due
            || self
                .next_tidy
                .compare_exchange(
                    due,
                    now + TIDY_EVERY.as_millis() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        // Unmapped (a large pool takes a while) once the locks are let go.
        let expired: Vec<_> = self
            .retired
            .lock()
            .extract_if(|_, (at, _)| at.elapsed() >= RETIRED_FOR)
            .collect();
        let gone: Vec<_> = self
            .routes
            .lock()
            .extract_if(|_, (r, _)| matches!(r, Route::Local(o) if o.is_gone()))
            .collect();
        drop((expired, gone));
    }

    /// The route to `target`, and when to probe again: never for the same-host path, nor with
    /// it turned off, nor for an owner whose pool this client cannot use; after
    /// `PROBE_AGAIN_AFTER` for TCP otherwise (the owner may come back, or be remote).
    async fn probe(
        &self,
        target: &SegmentName,
        gate: tokio::sync::OwnedMutexGuard<()>,
    ) -> (Route, Option<Instant>) {
        if !self.config.shared_memory {
            return (Route::Tcp, None);
        }
        let again = Some(Instant::now() + self.config.probe_again_after);
        let path = socket_path(&self.config.socket_dir, target);
        if !path.exists() {
            return (Route::Tcp, again);
        }
        let timeout = self.config.tcp.connect_timeout;
        let deadlines = Deadlines {
            connect: timeout,
            transfer: self.config.tcp.transfer_timeout,
        };
        let (seg, conns, threads, credential) = (
            target.clone(),
            self.config.tcp.connections_per_owner,
            self.config.copy_threads,
            self.config.tcp.credential.clone(),
        );
        let mapped = {
            let mut retired = self.retired.lock();
            retired.retain(|_, (at, _)| at.elapsed() < RETIRED_FOR);
            retired.remove(target).map(|(_, pool)| pool)
        };
        // Connecting to a socket whose owner accepts nothing (wedged, its backlog full) blocks
        // past any socket timeout: the probe gives up after the connect timeout (its thread
        // ends when the connect does).
        let connecting = tokio::task::spawn_blocking(move || {
            let _gate = gate;
            LocalOwner::connect_mapped(&path, &seg, deadlines, conns, threads, credential, mapped)
        });
        let Ok(connected) = tokio::time::timeout(timeout, connecting).await else {
            tracing::warn!(segment = %target, ?timeout, "the same-host owner did not answer a connection in time; using TCP");
            return (Route::Tcp, again);
        };
        match connected {
            Ok(Ok(owner)) => {
                tracing::debug!(segment = %target, "using the same-host path");
                (Route::Local(Arc::new(owner)), None)
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                // A socket at the owner's path that cannot prove the secret (not the owner), or
                // an owner that does not share its pool with this client (another tenant's, or
                // one without the token): so it stays, no use asking again.
                tracing::warn!(segment = %target, error = %e, "refused the same-host path; using TCP");
                (Route::Tcp, None)
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                // An owner that answered what this client cannot use: a pool it cannot map
                // safely (not sealed: an older build), no pool, a malformed hello.
                tracing::warn!(segment = %target, error = %e, "refused the same-host pool; using TCP");
                (Route::Tcp, None)
            }
            Ok(Err(e)) => {
                tracing::debug!(segment = %target, error = %e, "same-host path unavailable; using TCP");
                (Route::Tcp, again)
            }
            Err(e) => {
                tracing::warn!(segment = %target, error = %e, "same-host probe failed; using TCP");
                (Route::Tcp, again)
            }
        }
    }

    /// A same-host batch found no connection (`e`; nothing was sent): the route is forgotten.
    /// None when the batch should go over TCP at once: the owner's socket is gone or was taken
    /// by a restarted owner, which TCP reaches all the same. Not after a timeout (an owner that
    /// does not answer here would not over TCP either): the batch fails with it.
    fn unconnected(&self, target: &SegmentName, e: TransferError) -> Option<Failed> {
        self.forget(target);
        match e {
            TransferError::Timeout { .. } => Some(Failed(e)),
            e => {
                tracing::debug!(segment = %target, error = %e, "no same-host connection; this batch goes over TCP");
                None
            }
        }
    }

    /// Forgets a same-host route after a connection-level failure.
    fn forget_if_broken(&self, target: &SegmentName, results: &[Result<(), TransferError>]) {
        let broken = results.iter().any(|r| {
            matches!(
                r,
                Err(TransferError::Io { .. }
                    | TransferError::Timeout { .. }
                    | TransferError::Connect { .. })
            )
        });
        if broken {
            self.forget(target);
        }
    }

    /// Forgets the same-host route to `target` (the next call probes again), keeping its
    /// mapping for a while.
    fn forget(&self, target: &SegmentName) {
        if let Some((Route::Local(owner), _)) = self.routes.lock().remove(target) {
            let pool = owner.pool().clone();
            self.retired
                .lock()
                .insert(target.clone(), (Instant::now(), pool));
        }
    }

    fn count(&self, local: bool, bytes: u64) {
        let c = if local {
            &self.local_bytes
        } else {
            &self.tcp_bytes
        };
        c.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// A batch's one error, for each of its items.
struct Failed(TransferError);

impl Failed {
    fn of(self, n: usize) -> Vec<Result<(), TransferError>> {
        (0..n).map(|_| Err(self.0.duplicate())).collect()
    }
}

fn ok_bytes(results: &[Result<(), TransferError>], lens: impl Iterator<Item = u64>) -> u64 {
    results
        .iter()
        .zip(lens)
        .filter(|(r, _)| r.is_ok())
        .map(|(_, l)| l)
        .sum()
}

impl DataTransport for HybridTransport {
    fn write<'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a WriteItem<'a>,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            self.write_batch(target, std::slice::from_ref(item))
                .await
                .pop()
                .expect("one result")
        })
    }

    fn read<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a mut ReadItem<'k, 'b>,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            self.read_batch(target, std::slice::from_mut(item))
                .await
                .pop()
                .expect("one result")
        })
    }

    fn write_batch<'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a [WriteItem<'a>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(async move {
            let lens = || items.iter().map(|i| i.len());
            match self.route(target).await {
                Route::Local(owner) => match owner.try_write_batch(items).await {
                    Ok(res) => {
                        self.forget_if_broken(target, &res);
                        self.count(true, ok_bytes(&res, lens()));
                        res
                    }
                    Err(e) => match self.unconnected(target, e) {
                        Some(res) => res.of(items.len()),
                        None => {
                            let res = self.tcp.write_batch(target, items).await;
                            self.count(false, ok_bytes(&res, lens()));
                            res
                        }
                    },
                },
                Route::Tcp => {
                    let res = self.tcp.write_batch(target, items).await;
                    self.count(false, ok_bytes(&res, lens()));
                    res
                }
            }
        })
    }

    fn read_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(async move {
            let lens: Vec<u64> = items.iter().map(|i| i.len()).collect();
            let (res, local) = match self.route(target).await {
                Route::Local(owner) => match owner.try_read_batch(items).await {
                    Ok(res) => {
                        self.forget_if_broken(target, &res);
                        (res, true)
                    }
                    Err(e) => match self.unconnected(target, e) {
                        Some(failed) => (failed.of(items.len()), true),
                        None => (self.tcp.read_batch(target, items).await, false),
                    },
                },
                Route::Tcp => (self.tcp.read_batch(target, items).await, false),
            };
            self.count(local, ok_bytes(&res, lens.into_iter()));
            res
        })
    }

    /// Disk reads always go to the owner over TCP: it reads its SSD and streams the bytes.
    fn read_disk_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(async move {
            let lens: Vec<u64> = items.iter().map(|i| i.len()).collect();
            let res = self.tcp.read_disk_batch(target, items).await;
            self.count(false, ok_bytes(&res, lens.into_iter()));
            res
        })
    }

    fn stats(&self) -> TransferStats {
        TransferStats {
            local_bytes: self.local_bytes.load(Ordering::Relaxed),
            tcp_bytes: self.tcp_bytes.load(Ordering::Relaxed),
            ..TransferStats::default()
        }
    }
}
