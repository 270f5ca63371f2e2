//! The master's one service, in domain terms: keys as `&str`, validated config and ids in,
//! `Result<_, MasterError>` per key out. It locks the state once per batch, calls the core and
//! counts the batch in the metrics; it makes no decision of its own. Wire adapters (`crate::wire`:
//! gRPC, the framed RPC, in-process) translate to and from it. The lock is a plain mutex never
//! held across an `.await`: every core call is short and synchronous.

mod caller;
mod owners;
#[cfg(test)]
mod tests;

use std::{sync::Arc, time::Duration};

use mooncake_common::{
    auth::{wall_clock_us, Access, Scope, SealKey},
    master_api::Releases,
    replica::{MAX_PREFERRED, MAX_REPLICAS},
    Code, ObjectKey, ReplicaLocation, ReplicateConfig, SegmentName,
};
use parking_lot::Mutex;

pub use caller::Caller;
pub use owners::{Polled, TaskReport};

use crate::{
    clock::Clock,
    core::{MasterState, PutGrant, SegmentStat, TaskInfo, TaskRequest},
    error::MasterError,
    ha::Leadership,
    metrics::{Metrics, Op},
};

/// State shared by the service, the HTTP endpoint and the upkeep loop.
pub struct Shared {
    pub state: Mutex<MasterState>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Metrics,
    /// Wakes owners long-polling for SSD-tier work.
    pub owner_work: tokio::sync::Notify,
    /// Wakes puts waiting for offloads to free memory.
    pub offload_progress: tokio::sync::Notify,
    /// Whether this process may answer (with HA: while its etcd lease is alive).
    pub leadership: Arc<Leadership>,
    /// Removal patterns matched at a time (each may cost up to its backtracking limit per key).
    pub matching: Arc<tokio::sync::Semaphore>,
    /// Set when the server stops: long polls answer at once instead of holding it up.
    pub stopping: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub fn new(state: MasterState, clock: Arc<dyn Clock>, leadership: Arc<Leadership>) -> Shared {
        Shared {
            leadership,
            state: Mutex::new(state),
            clock,
            metrics: Metrics::default(),
            owner_work: tokio::sync::Notify::new(),
            offload_progress: tokio::sync::Notify::new(),
            matching: Arc::new(tokio::sync::Semaphore::new(1)),
            stopping: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The server is stopping (or its term ended): owners' long polls answer now, so they turn
    /// to the next leader at once and the shutdown does not wait for them.
    pub fn stop_polls(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.owner_work.notify_waiters();
    }

    /// Wakes polling owners if the last call under this lock queued work for them.
    pub fn wake_owners(&self, state: &mut MasterState) {
        if state.take_wakeup() {
            self.owner_work.notify_waiters();
        }
    }
}

/// How long a put that found no space waits for offloads under way to free memory.
const OFFLOAD_WAIT: Duration = Duration::from_secs(1);

/// True until dropped: a blocking job stops when the call that started it is gone.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Default for StopOnDrop {
    fn default() -> Self {
        StopOnDrop(Arc::new(std::sync::atomic::AtomicBool::new(true)))
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Keys a lookup handles per hold of the state's lock: a huge batch lets other calls in between
/// runs of this many.
const LOCKED_KEYS: usize = 4096;

pub struct MasterService {
    shared: Arc<Shared>,
    /// Seals every replica a put start or a lookup hands out (a cluster with a secret).
    seals: Option<SealKey>,
}

/// The longest a key regex is matched (`remove_all` with a pattern) before the call gives up.
const MATCH_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// Why `remove_all` is refused while a rebuild lasts.
const REBUILDING: &str = "the master is rebuilding its catalog from the owners' reports, and \
     objects not reported yet cannot be removed: retry shortly";

/// Where a batch of puts short of memory is in its wait for offloads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for offloads under way to free memory.
    Waiting,
    /// The wait is over: free what can go at once, then try once more.
    LastResort,
    /// Tried once more: what is still short fails.
    Done,
}

/// A put that found no space (a full quota is not one: room made elsewhere does not help it).
fn short_of_memory(r: &Result<PutGrant, MasterError>) -> bool {
    r.as_ref()
        .is_err_and(|e| matches!(e, MasterError::NoSpace { .. } | MasterError::NoSegments))
}

impl MasterService {
    /// Whether this master may answer now: every adapter asks before it dispatches a call.
    pub fn leading(&self) -> bool {
        self.shared.leadership.holds(self.shared.clock.now())
    }

    pub fn new(shared: Arc<Shared>, seals: Option<SealKey>) -> Self {
        MasterService { shared, seals }
    }

    /// When seals made now for `life` lapse.
    fn expiry(life: Duration) -> u64 {
        wall_clock_us().saturating_add(life.as_micros() as u64)
    }

    /// Seals each replica for `access` to version `put_id` of `key` until `expiry`.
    fn seal(
        &self,
        access: Access,
        key: &str,
        put_id: u64,
        expiry: u64,
        replicas: &mut [ReplicaLocation],
    ) {
        let Some(seals) = &self.seals else { return };
        for r in replicas {
            let scope = Scope {
                access,
                tenant: mooncake_common::tenant::tenant_of(key),
                key,
                segment: r.segment.as_str(),
                offset: r.offset,
                length: r.size,
                put_id,
            };
            r.seal = seals.seal(&scope, expiry);
        }
    }

    /// Starts every put of (key, size): space on `config.replica_num` segments each, or the
    /// reason why not. A batch short of memory while offloads are on their way waits (briefly)
    /// for their room. `token` (0: none) names the start, should its caller abandon it (see
    /// `abandon_put_start`).
    pub async fn put_start(
        &self,
        caller: &Caller,
        items: &[(&str, u64)],
        config: &ReplicateConfig,
        token: u64,
    ) -> Vec<Result<PutGrant, MasterError>> {
        if config.replica_num > MAX_REPLICAS {
            let e = MasterError::Invalid(format!(
                "replica_num {} is above the limit of {MAX_REPLICAS}",
                config.replica_num
            ));
            return self.refuse_put_start(items.len(), &e);
        }
        if config.preferred_segments.len() > MAX_PREFERRED {
            let e = MasterError::Invalid(format!(
                "{} preferred segments is above the limit of {MAX_PREFERRED}",
                config.preferred_segments.len()
            ));
            return self.refuse_put_start(items.len(), &e);
        }
        let mut results: Vec<Option<Result<PutGrant, MasterError>>> =
            (0..items.len()).map(|_| None).collect();
        let deadline = tokio::time::Instant::now() + OFFLOAD_WAIT;
        // Once the wait for offloads is over (a slow or stuck SSD), what is still short takes
        // memory that can go at once elsewhere, and is tried once more.
        let mut stage = Stage::Waiting;
        // Whether this stage tried again at once already: room that came free at once and
        // still did not fit (in the wrong places) is not worth evicting more for, round after
        // round, until nothing is left.
        let mut retried = false;
        loop {
            // Registered before looking, so progress made in between is not missed.
            let progress = self.shared.offload_progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            let waiting = {
                let now = self.shared.clock.now();
                let mut state = self.shared.state.lock();
                // Abandoned while it waited (or before it arrived): what it granted is revoked
                // already, and it grants nothing more.
                let abandoned = state.start_abandoned(caller.tenant().name(), token);
                for (&(k, size), slot) in items.iter().zip(results.iter_mut()) {
                    if slot.as_ref().is_some_and(|x| !short_of_memory(x)) {
                        continue;
                    }
                    if abandoned {
                        *slot = Some(Err(MasterError::Invalid(
                            "this put start was abandoned by its caller".into(),
                        )));
                        continue;
                    }
                    let granted = caller
                        .object_key(k)
                        .and_then(|k| state.put_start(&k, size, config, now));
                    if let Ok(g) = &granted {
                        state.tag_start(now, g.put_id, token);
                    }
                    *slot = Some(granted);
                }
                // Out of memory while offloads are on their way to disk: their memory comes
                // back when they land, so start room for every item still short at once and
                // wait for it (briefly) instead of failing.
                let short: u64 = items
                    .iter()
                    .zip(&results)
                    .filter(|(_, x)| x.as_ref().is_some_and(short_of_memory))
                    .map(|(&(_, size), _)| size)
                    .fold(0, u64::saturating_add);
                let freed_now = match stage {
                    _ if short == 0 || retried => 0,
                    // Without an SSD tier each put's start evicted what could help already.
                    _ if !state.any_disk_tier() => 0,
                    Stage::Waiting => state.make_room(now, short),
                    Stage::LastResort => {
                        let freed = state.free_at_once(now, short);
                        tracing::info!(
                            short,
                            freed,
                            "offloads did not free memory in time: evicting what can go at once"
                        );
                        stage = Stage::Done;
                        freed
                    }
                    Stage::Done => 0,
                };
                self.shared.wake_owners(&mut state);
                if short > 0 && freed_now > 0 {
                    // Room came free at once (objects with disk copies left memory): try again.
                    retried = true;
                    continue;
                }
                short > 0 && stage == Stage::Waiting && state.offloads_outstanding()
            };
            if !waiting {
                break;
            }
            if tokio::time::timeout_at(deadline, progress).await.is_err() {
                stage = Stage::LastResort;
            }
            retried = false;
        }
        let mut results: Vec<Result<PutGrant, MasterError>> = results
            .into_iter()
            .map(|x| x.expect("every item tried"))
            .collect();
        self.count_put_starts(&results);
        if self.seals.is_some() {
            // A grant lives as long as the master keeps its space for the put.
            let life = self.shared.state.lock().policy().put_discard_timeout;
            let expiry = Self::expiry(life);
            for (&(k, _), r) in items.iter().zip(results.iter_mut()) {
                if let Ok(g) = r {
                    self.seal(Access::Write, k, g.put_id, expiry, &mut g.replicas);
                }
            }
        }
        results
    }

    /// The caller of the start tagged `token` never got its answer: whatever it granted of the
    /// caller's tenant is revoked, and should it arrive later it grants nothing. How many puts
    /// were revoked.
    pub fn abandon_put_start(&self, caller: &Caller, token: u64) -> u32 {
        let now = self.shared.clock.now();
        let revoked = {
            let mut state = self.shared.state.lock();
            let revoked = state.abandon_start(caller.tenant().name(), token, now, |k| {
                caller.key(k).is_ok()
            });
            self.shared.wake_owners(&mut state);
            revoked
        };
        tracing::info!(
            token,
            revoked,
            "a client abandoned a put start it got no answer to"
        );
        self.shared
            .metrics
            .record(Op::AbandonPutStart, (revoked as usize).max(1), 0);
        revoked
    }

    /// A put start whose request could not be used (its config is invalid): every item gets
    /// `e`, and the batch is counted as failed.
    pub fn refuse_put_start(
        &self,
        n: usize,
        e: &MasterError,
    ) -> Vec<Result<PutGrant, MasterError>> {
        let results: Vec<_> = (0..n).map(|_| Err(e.clone())).collect();
        self.count_put_starts(&results);
        results
    }

    fn count_put_starts(&self, results: &[Result<PutGrant, MasterError>]) {
        // An existing key is the normal write-once outcome, not a failure.
        let failed = results
            .iter()
            .filter(|x| {
                x.as_ref()
                    .is_err_and(|e| e.code() != Code::ObjectAlreadyExists)
            })
            .count();
        self.shared
            .metrics
            .record(Op::PutStart, results.len(), failed);
    }

    /// Ends the puts named by (key, put id), under one lock.
    pub fn put_end(&self, caller: &Caller, puts: &[(&str, u64)]) -> Vec<Result<(), MasterError>> {
        let now = self.shared.clock.now();
        self.per_key(caller, Op::PutEnd, puts, |s, k, id| s.put_end(k, id, now))
    }

    /// Revokes the puts named by (key, put id), under one lock.
    pub fn put_revoke(
        &self,
        caller: &Caller,
        puts: &[(&str, u64)],
    ) -> Vec<Result<(), MasterError>> {
        let now = self.shared.clock.now();
        self.per_key(caller, Op::PutRevoke, puts, |s, k, id| {
            s.put_revoke(k, id, now)
        })
    }

    fn per_key(
        &self,
        caller: &Caller,
        op: Op,
        puts: &[(&str, u64)],
        f: impl Fn(&mut MasterState, &str, u64) -> Result<(), MasterError>,
    ) -> Vec<Result<(), MasterError>> {
        let results: Vec<_> = {
            let mut state = self.shared.state.lock();
            let results = puts
                .iter()
                .map(|&(k, id)| caller.key(k).and_then(|k| f(&mut state, k, id)))
                .collect();
            self.shared.wake_owners(&mut state);
            results
        };
        self.record(op, &results);
        results
    }

    /// Hands back the holds in `release` (see `release_leases`), then looks up (and leases)
    /// every key under the same lock and hands each answer to `answer` in order (so an adapter
    /// encodes straight from it); returns the lease every hit got.
    pub fn get_replicas(
        &self,
        caller: &Caller,
        keys: &[&str],
        release: Releases<'_>,
        mut answer: impl FnMut(Result<(u64, Vec<ReplicaLocation>), MasterError>),
    ) -> Leased {
        let now = self.shared.clock.now();
        let mut failed = 0;
        let lease_ttl = {
            let mut state = self.shared.state.lock();
            release_own(&mut state, caller, release, now);
            // A read's seal lives as long as the lease the lookup takes.
            let expiry = Self::expiry(state.policy().lease_ttl);
            for (i, k) in keys.iter().enumerate() {
                if i > 0 && i % LOCKED_KEYS == 0 {
                    // A huge batch lets waiting calls in between runs of keys.
                    parking_lot::MutexGuard::bump(&mut state);
                }
                let mut found = caller.key(k).and_then(|k| state.get_replicas_str(k, now));
                failed += usize::from(found.is_err());
                if let Ok((_, replicas)) = &mut found {
                    for r in replicas.iter_mut() {
                        let put_id = r.put_id;
                        self.seal(Access::Read, k, put_id, expiry, std::slice::from_mut(r));
                    }
                }
                answer(found);
            }
            self.shared.wake_owners(&mut state);
            Leased::by(&state)
        };
        self.shared
            .metrics
            .record(Op::GetReplicaList, keys.len(), failed);
        lease_ttl
    }

    /// Hands back the holds in `release`, then whether each key exists (leasing the hits),
    /// under one lock; and the lease they got.
    pub fn exists(
        &self,
        caller: &Caller,
        keys: &[&str],
        release: Releases<'_>,
    ) -> (Vec<Result<bool, MasterError>>, Leased) {
        let now = self.shared.clock.now();
        let (results, lease_ttl) = {
            let mut state = self.shared.state.lock();
            release_own(&mut state, caller, release, now);
            let rebuilding = state.rebuilding(now);
            let results: Vec<_> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    if i > 0 && i % LOCKED_KEYS == 0 {
                        parking_lot::MutexGuard::bump(&mut state);
                    }
                    caller.key(k).and_then(|k| match state.exists(k, now) {
                        // Not known yet is not "missing" while owners may still report it.
                        false if rebuilding => Err(MasterError::Rebuilding(ObjectKey::new(k)?)),
                        hit => Ok(hit),
                    })
                })
                .collect();
            (results, Leased::by(&state))
        };
        self.record(Op::ExistKey, &results);
        (results, lease_ttl)
    }

    /// Removes every key (leased ones only with `force`), under one lock.
    pub fn remove(
        &self,
        caller: &Caller,
        keys: &[&str],
        force: bool,
    ) -> Vec<Result<(), MasterError>> {
        let now = self.shared.clock.now();
        let results: Vec<_> = {
            let mut state = self.shared.state.lock();
            let results = keys
                .iter()
                .map(|k| {
                    caller
                        .object_key(k)
                        .and_then(|k| state.remove(&k, force, now))
                })
                .collect();
            self.shared.wake_owners(&mut state);
            results
        };
        self.record(Op::Remove, &results);
        results
    }

    /// Removes every object of the caller's tenant, or those whose keys (as the tenant knows
    /// them) `key_regex` matches anywhere (leased ones only with `force`); returns how many.
    pub async fn remove_all(
        &self,
        caller: &Caller,
        force: bool,
        key_regex: Option<&str>,
    ) -> Result<u64, MasterError> {
        let regex = key_regex
            .map(|p| {
                fancy_regex::Regex::new(p)
                    .map_err(|e| MasterError::Invalid(format!("key regex {p:?}: {e}")))
            })
            .transpose();
        let regex = match regex {
            Ok(r) => r,
            Err(e) => {
                self.shared.metrics.record(Op::RemoveAll, 1, 1);
                return Err(e);
            }
        };
        let tenant = caller.tenant();
        // A pattern is matched against a copy of the tenant's keys, on a blocking thread and
        // without the lock: a slow one (backtracking, up to its limit per key) costs its
        // caller's time, not every other call's.
        let matched = match regex {
            Some(r) => {
                // One pattern at a time; a caller that gives up (its deadline, a dropped call)
                // stops its pattern at the next key.
                let _slot = self
                    .shared
                    .matching
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
                let keys = {
                    let state = self.shared.state.lock();
                    if state.rebuilding(self.shared.clock.now()) {
                        // The keys copied now would miss those reported later.
                        drop(state);
                        self.shared.metrics.record(Op::RemoveAll, 1, 1);
                        return Err(MasterError::Busy(REBUILDING.into()));
                    }
                    state.keys_where(|k| tenant.owns(k))
                };
                let scope = tenant.clone();
                let wanted = StopOnDrop::default();
                let go_on = wanted.0.clone();
                let n = keys.len();
                let matching = tokio::task::spawn_blocking(move || {
                    // A framed call is not dropped when its caller leaves: the pattern also
                    // stops at its budget, so one caller's pattern cannot hold the slot (and a
                    // blocking thread) for long after nobody waits for it.
                    let until = std::time::Instant::now() + MATCH_BUDGET;
                    let mut matched = Vec::new();
                    for (i, k) in keys.into_iter().enumerate() {
                        if !go_on.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        if i % 64 == 0 && std::time::Instant::now() >= until {
                            return None;
                        }
                        // A search that gives up (backtracking limit) matches nothing.
                        if scope
                            .unscope(k.as_str())
                            .is_some_and(|k| r.is_match(k).unwrap_or(false))
                        {
                            matched.push(k);
                        }
                    }
                    Some(matched)
                });
                match matching.await {
                    Ok(Some(keys)) => Some(keys),
                    Ok(None) => {
                        self.shared.metrics.record(Op::RemoveAll, 1, 1);
                        // Not "busy": a client would run the same pattern again until its
                        // deadline, holding the slot each time.
                        return Err(MasterError::Invalid(format!(
                            "matching the key regex over {n} keys took longer than {MATCH_BUDGET:?}; nothing was removed: use a simpler pattern (a prefix such as ^tmp/)"
                        )));
                    }
                    Err(e) => {
                        self.shared.metrics.record(Op::RemoveAll, 1, 1);
                        return Err(MasterError::Busy(format!(
                            "matching the key regex did not finish: {e}"
                        )));
                    }
                }
            }
            None => None,
        };
        let now = self.shared.clock.now();
        let removed = {
            let mut state = self.shared.state.lock();
            if state.rebuilding(now) {
                drop(state);
                self.shared.metrics.record(Op::RemoveAll, 1, 1);
                return Err(MasterError::Busy(REBUILDING.into()));
            }
            let removed = match &matched {
                Some(keys) => state.remove_listed(force, keys, now),
                // Never "everything" even where no other tenant has objects now: dropped
                // segments may hold other tenants' (see `core::forgotten`).
                None => state.remove_matching(force, |k| tenant.owns(k), now),
            };
            self.shared.wake_owners(&mut state);
            removed
        };
        self.shared.metrics.record(Op::RemoveAll, 1, 0);
        Ok(removed)
    }

    /// Starts a copy or move of `key` (see `core::replica_tasks`); answers the task id.
    pub fn create_replica_task(
        &self,
        caller: &Caller,
        key: &str,
        request: TaskRequest<'_>,
    ) -> Result<u64, MasterError> {
        let res = caller.object_key(key).and_then(|key| {
            let now = self.shared.clock.now();
            let mut state = self.shared.state.lock();
            let res = state.create_replica_task(&key, request, now);
            self.shared.wake_owners(&mut state);
            res
        });
        self.shared
            .metrics
            .record(Op::CreateReplicaTask, 1, res.is_err() as usize);
        res
    }

    /// A replica task's state, with its instants on the wall clock (ms since the Unix epoch), if
    /// it is one of the caller's tenant's (others' are not found).
    pub fn query_task(&self, caller: &Caller, id: u64) -> Option<(TaskInfo, u64, u64)> {
        let info = self
            .shared
            .state
            .lock()
            .query_task(id)
            .filter(|t| caller.owns(t.key.as_str()));
        self.shared
            .metrics
            .record(Op::QueryTask, 1, info.is_none() as usize);
        let info = info?;
        let now = self.shared.clock.now();
        let wall_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let wall = |t: crate::clock::Millis| wall_now.saturating_sub(now.0.saturating_sub(t.0));
        let (created, updated) = (wall(info.created), wall(info.updated));
        Some((info, created, updated))
    }

    /// Drops `keys`' memory replicas on `segment`, or whole objects without one (see
    /// `MasterState::replica_clear`).
    pub fn replica_clear(
        &self,
        caller: &Caller,
        keys: &[&str],
        segment: Option<&SegmentName>,
    ) -> Vec<Result<(), MasterError>> {
        let now = self.shared.clock.now();
        let mut parsed = Vec::with_capacity(keys.len());
        let mut bad = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match caller.object_key(k) {
                Ok(k) => parsed.push(k),
                Err(e) => bad.push((i, e)),
            }
        }
        let mut cleared = {
            let mut state = self.shared.state.lock();
            let cleared = state.replica_clear(&parsed, segment, now);
            self.shared.wake_owners(&mut state);
            cleared
        };
        for (i, e) in bad {
            cleared.insert(i, Err(e));
        }
        let failed = cleared.iter().filter(|r| r.is_err()).count();
        self.shared
            .metrics
            .record(Op::ReplicaClear, keys.len(), failed);
        cleared
    }

    /// A reader is done with the holds in `release` (a key once per hold it took).
    pub fn release_leases(&self, caller: &Caller, release: Releases<'_>) {
        let now = self.shared.clock.now();
        let ignored = !release_own(&mut self.shared.state.lock(), caller, release, now);
        let n = release.keys.len();
        self.shared
            .metrics
            .record(Op::ReleaseLeases, n, if ignored { n } else { 0 });
    }

    /// The mounted segments and their usage.
    pub fn list_segments(&self) -> Vec<SegmentStat> {
        let segments = self.shared.state.lock().segment_stats();
        self.shared.metrics.record(Op::ListSegments, 1, 0);
        segments
    }

    fn record<T>(&self, op: Op, results: &[Result<T, MasterError>]) {
        let failed = results.iter().filter(|r| r.is_err()).count();
        self.shared.metrics.record(op, results.len(), failed);
    }
}

/// The lease a lookup's hits got, and which master granted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leased {
    pub ttl: Duration,
    /// This master's epoch: the holds come back with it.
    pub epoch: u64,
}

impl Leased {
    fn by(state: &MasterState) -> Leased {
        Leased {
            ttl: state.policy().lease_ttl,
            epoch: state.epoch(),
        }
    }
}

/// Hands back the holds in `release` that lie in the caller's tenant (another tenant's are
/// ignored: no tenant ends another's reads), unless another master granted them (another
/// epoch): they would end holds this master granted. Whether they were taken.
fn release_own(
    state: &mut MasterState,
    caller: &Caller,
    release: Releases<'_>,
    now: crate::clock::Millis,
) -> bool {
    let keys = release.keys;
    if keys.is_empty() {
        return true;
    }
    if release.epoch != 0 && release.epoch != state.epoch() {
        tracing::debug!(
            holds = keys.len(),
            granted_by = release.epoch,
            epoch = state.epoch(),
            "ignored read holds another master granted"
        );
        return false;
    }
    if keys.iter().all(|k| caller.owns(k)) {
        state.release_leases(keys, now);
    } else {
        let own: Vec<&str> = keys.iter().copied().filter(|k| caller.owns(k)).collect();
        state.release_leases(&own, now);
    }
    true
}
