//! The gRPC face of the master: decode and validate, lock the state once per batch, call the
//! core, encode. No decision is made here. The lock is a plain mutex never held across an
//! `.await`: every core call is short and synchronous.

use std::sync::Arc;

use mooncake_common::{pbreplicas, ClientId, Code, ObjectKey, SegmentName};
use mooncake_proto::master as pb;
use parking_lot::Mutex;
use tonic::{Request, Response, Status};

use crate::{
    clock::Clock,
    core::{HeartbeatReply, MasterState, PutGrant, ReplicaView, ReplicateConfig, Tier},
    error::MasterError,
    metrics::{Metrics, Op},
};

/// State shared by the gRPC service, the HTTP endpoint and the upkeep loop.
pub struct Shared {
    pub state: Mutex<MasterState>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Metrics,
    /// Wakes owners long-polling for SSD-tier work.
    pub owner_work: tokio::sync::Notify,
    /// Wakes puts waiting for offloads to free memory.
    pub offload_progress: tokio::sync::Notify,
}

impl Shared {
    pub fn new(state: MasterState, clock: Arc<dyn Clock>) -> Shared {
        Shared {
            state: Mutex::new(state),
            clock,
            metrics: Metrics::default(),
            owner_work: tokio::sync::Notify::new(),
            offload_progress: tokio::sync::Notify::new(),
        }
    }

    /// Wakes polling owners if the last call under this lock queued work for them.
    pub fn wake_owners(&self, state: &mut MasterState) {
        if state.take_wakeup() {
            self.owner_work.notify_waiters();
        }
    }
}

/// How long a put that found no space waits for offloads under way to free memory.
const OFFLOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

pub struct MasterService {
    shared: Arc<Shared>,
}

impl MasterService {
    pub fn new(shared: Arc<Shared>) -> Self {
        MasterService { shared }
    }
}

fn code_of(r: &Result<(), MasterError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.code().as_i32(),
    }
}

pub(crate) fn key(s: &str) -> Result<ObjectKey, MasterError> {
    Ok(ObjectKey::new(s)?)
}

pub(crate) fn client_id(s: &str) -> Result<ClientId, Status> {
    ClientId::parse(s).map_err(|e| Status::invalid_argument(e.to_string()))
}

pub(crate) fn segment(s: &str) -> Result<SegmentName, Status> {
    SegmentName::parse(s).map_err(|e| Status::invalid_argument(e.to_string()))
}

fn short_of_memory(r: &Result<PutGrant, MasterError>) -> bool {
    r.as_ref()
        .is_err_and(|e| e.code() == Code::NoAvailableHandle)
}

fn replica_ref(v: &ReplicaView) -> pbreplicas::ReplicaRef<'_> {
    pbreplicas::ReplicaRef {
        segment: v.segment.as_str(),
        offset: v.offset,
        size: v.size,
        tier: tier_number(v.tier),
        put_id: v.put_id,
    }
}

fn tier_number(t: Tier) -> i32 {
    match t {
        Tier::Memory => pb::ReplicaTier::Memory as i32,
        Tier::Disk => pb::ReplicaTier::Disk as i32,
    }
}

fn location(v: ReplicaView) -> pb::ReplicaLocation {
    pb::ReplicaLocation {
        segment: v.segment.to_string(),
        offset: v.offset,
        size: v.size,
        tier: tier_number(v.tier),
        put_id: v.put_id,
    }
}

fn replicate_config(c: Option<pb::ReplicateConfig>) -> Result<ReplicateConfig, MasterError> {
    let c = c.unwrap_or_default();
    let preferred_segments = c
        .preferred_segments
        .iter()
        .map(|s| SegmentName::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    if c.replica_num > 64 {
        return Err(MasterError::Invalid(format!(
            "replica_num {} is above the limit of 64",
            c.replica_num
        )));
    }
    Ok(ReplicateConfig {
        replica_num: c.replica_num.max(1) as usize,
        preferred_segments,
        soft_pin: c.soft_pin,
        hard_pin: c.hard_pin,
    })
}

pub(crate) type Reply<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::master_server::Master for MasterService {
    async fn mount_segment(
        &self,
        req: Request<pb::MountSegmentRequest>,
    ) -> Reply<pb::MountSegmentResponse> {
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let now = self.shared.clock.now();
        let res = self
            .shared
            .state
            .lock()
            .mount_segment(owner, name, r.size, r.disk_capacity, now);
        self.shared
            .metrics
            .record(Op::MountSegment, 1, res.is_err() as usize);
        Ok(Response::new(pb::MountSegmentResponse {
            code: code_of(&res),
            message: res.err().map(|e| e.to_string()).unwrap_or_default(),
        }))
    }

    async fn unmount_segment(
        &self,
        req: Request<pb::UnmountSegmentRequest>,
    ) -> Reply<pb::UnmountSegmentResponse> {
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let res = self.shared.state.lock().unmount_segment(owner, &name);
        self.shared
            .metrics
            .record(Op::UnmountSegment, 1, res.is_err() as usize);
        Ok(Response::new(pb::UnmountSegmentResponse {
            code: code_of(&res),
            message: res.err().map(|e| e.to_string()).unwrap_or_default(),
        }))
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Reply<pb::HeartbeatResponse> {
        let r = req.into_inner();
        let owner = client_id(&r.client_id)?;
        let now = self.shared.clock.now();
        let reply = {
            let mut state = self.shared.state.lock();
            let reply = state.heartbeat(owner, now);
            if let Some(d) = r.disk {
                state.set_disk_stats(owner, (&d).into());
            }
            reply
        };
        self.shared.metrics.record(Op::Heartbeat, 1, 0);
        Ok(Response::new(pb::HeartbeatResponse {
            code: 0,
            remount: reply == HeartbeatReply::Remount,
        }))
    }

    async fn batch_put_start(
        &self,
        req: Request<pb::BatchPutStartRequest>,
    ) -> Reply<pb::BatchPutStartResponse> {
        let r = req.into_inner();
        let items: Vec<(&str, u64)> = r.items.iter().map(|i| (i.key.as_str(), i.size)).collect();
        let results = self.put_start_items(&items, r.config).await;
        Ok(Response::new(pb::BatchPutStartResponse {
            results: results
                .into_iter()
                .map(|r| match r {
                    Ok(grant) => pb::PutStartResult {
                        code: 0,
                        message: String::new(),
                        put_id: grant.put_id,
                        replicas: grant.replicas.into_iter().map(location).collect(),
                    },
                    Err(e) => pb::PutStartResult {
                        code: e.code().as_i32(),
                        message: e.to_string(),
                        put_id: 0,
                        replicas: Vec::new(),
                    },
                })
                .collect(),
        }))
    }

    async fn batch_put_end(
        &self,
        req: Request<pb::BatchPutEndRequest>,
    ) -> Reply<pb::BatchPutEndResponse> {
        let items = req.into_inner().items;
        let refs: Vec<(&str, u64)> = items.iter().map(|i| (i.key.as_str(), i.put_id)).collect();
        Ok(Response::new(pb::BatchPutEndResponse {
            codes: self.put_end_refs(&refs),
        }))
    }

    async fn batch_put_revoke(
        &self,
        req: Request<pb::BatchPutRevokeRequest>,
    ) -> Reply<pb::BatchPutRevokeResponse> {
        let items = req.into_inner().items;
        let refs: Vec<(&str, u64)> = items.iter().map(|i| (i.key.as_str(), i.put_id)).collect();
        Ok(Response::new(pb::BatchPutRevokeResponse {
            codes: self.put_revoke_refs(&refs),
        }))
    }

    async fn batch_get_replicas(
        &self,
        req: Request<pb::BatchGetReplicasRequest>,
    ) -> Reply<pb::BatchGetReplicasResponse> {
        let keys = req.into_inner().keys;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut results = Vec::with_capacity(keys.len());
        let lease_ttl_ms = self.look_up(&refs, |found| {
            results.push(match found {
                Ok((size, replicas)) => pb::GetReplicasResult {
                    code: 0,
                    size,
                    replicas: replicas.into_iter().map(location).collect(),
                },
                Err(e) => pb::GetReplicasResult {
                    code: e.code().as_i32(),
                    size: 0,
                    replicas: Vec::new(),
                },
            })
        });
        Ok(Response::new(pb::BatchGetReplicasResponse {
            results,
            lease_ttl_ms,
        }))
    }

    async fn batch_exists(
        &self,
        req: Request<pb::BatchExistsRequest>,
    ) -> Reply<pb::BatchExistsResponse> {
        let keys = req.into_inner().keys;
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        Ok(Response::new(self.exists_strs(&refs)))
    }

    async fn batch_remove(
        &self,
        req: Request<pb::BatchRemoveRequest>,
    ) -> Reply<pb::BatchRemoveResponse> {
        let r = req.into_inner();
        let now = self.shared.clock.now();
        let codes: Vec<i32> = {
            let mut state = self.shared.state.lock();
            let codes = r
                .keys
                .iter()
                .map(|k| code_of(&key(k).and_then(|k| state.remove(&k, r.force, now))))
                .collect();
            self.shared.wake_owners(&mut state);
            codes
        };
        self.record(Op::Remove, &codes);
        Ok(Response::new(pb::BatchRemoveResponse { codes }))
    }

    async fn remove_all(&self, req: Request<pb::RemoveAllRequest>) -> Reply<pb::RemoveAllResponse> {
        let force = req.into_inner().force;
        let now = self.shared.clock.now();
        let removed = {
            let mut state = self.shared.state.lock();
            let removed = state.remove_all(force, now);
            self.shared.wake_owners(&mut state);
            removed
        };
        self.shared.metrics.record(Op::RemoveAll, 1, 0);
        Ok(Response::new(pb::RemoveAllResponse { code: 0, removed }))
    }

    async fn list_segments(
        &self,
        _req: Request<pb::ListSegmentsRequest>,
    ) -> Reply<pb::ListSegmentsResponse> {
        let segments = self
            .shared
            .state
            .lock()
            .segment_stats()
            .into_iter()
            .map(|s| pb::SegmentInfo {
                name: s.name.to_string(),
                capacity: s.capacity,
                allocated: s.allocated,
            })
            .collect();
        self.shared.metrics.record(Op::ListSegments, 1, 0);
        Ok(Response::new(pb::ListSegmentsResponse { segments }))
    }

    async fn poll_tasks(&self, req: Request<pb::PollTasksRequest>) -> Reply<pb::PollTasksResponse> {
        crate::tiers::poll_tasks(&self.shared, req.into_inner()).await
    }

    async fn report_tasks(
        &self,
        req: Request<pb::ReportTasksRequest>,
    ) -> Reply<pb::ReportTasksResponse> {
        crate::tiers::report_tasks(&self.shared, req.into_inner())
    }

    async fn disk_dropped(
        &self,
        req: Request<pb::DiskDroppedRequest>,
    ) -> Reply<pb::DiskDroppedResponse> {
        crate::tiers::disk_dropped(&self.shared, req.into_inner())
    }

    async fn register_disk(
        &self,
        req: Request<pb::RegisterDiskRequest>,
    ) -> Reply<pb::RegisterDiskResponse> {
        crate::tiers::register_disk(&self.shared, req.into_inner())
    }
}

impl MasterService {
    /// Batch exists over borrowed keys: the framed RPC decodes them straight from the request
    /// frame, so a batch of 10k keys allocates nothing per key on either path.
    /// Starts every put of `r`: space on `replica_num` segments each, or the reason why not. A
    /// batch short of memory while offloads are on their way waits (briefly) for their room.
    pub async fn put_start_items(
        &self,
        items: &[(&str, u64)],
        config: Option<pb::ReplicateConfig>,
    ) -> Vec<Result<PutGrant, MasterError>> {
        let config = replicate_config(config);
        let mut results: Vec<Option<Result<PutGrant, MasterError>>> =
            (0..items.len()).map(|_| None).collect();
        let deadline = tokio::time::Instant::now() + OFFLOAD_WAIT;
        loop {
            // Registered before looking, so progress made in between is not missed.
            let progress = self.shared.offload_progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            let waiting = {
                let now = self.shared.clock.now();
                let mut state = self.shared.state.lock();
                for (&(k, size), slot) in items.iter().zip(results.iter_mut()) {
                    if slot.as_ref().is_some_and(|x| !short_of_memory(x)) {
                        continue;
                    }
                    *slot = Some(
                        config
                            .as_ref()
                            .map_err(Clone::clone)
                            .and_then(|c| state.put_start(&key(k)?, size, c, now)),
                    );
                }
                // Out of memory while offloads are on their way to disk: their memory comes
                // back when they land, so start room for every item still short at once and
                // wait for it (briefly) instead of failing.
                let short: u64 = items
                    .iter()
                    .zip(&results)
                    .filter(|(_, x)| x.as_ref().is_some_and(short_of_memory))
                    .map(|(&(_, size), _)| size)
                    .sum();
                let freed_now = if short > 0 {
                    state.make_room(now, short)
                } else {
                    0
                };
                self.shared.wake_owners(&mut state);
                if short > 0 && freed_now > 0 {
                    // Room came free at once (objects with disk copies left memory): try again.
                    continue;
                }
                short > 0 && state.offloads_outstanding()
            };
            if !waiting || tokio::time::timeout_at(deadline, progress).await.is_err() {
                break;
            }
        }
        let results: Vec<Result<PutGrant, MasterError>> = results
            .into_iter()
            .map(|x| x.expect("every item tried"))
            .collect();
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
        results
    }

    /// `batch_put_start` for the framed RPC: the answer encoded straight from the grants.
    pub async fn put_start_encoded(
        &self,
        items: &[(&str, u64)],
        config: Option<pb::ReplicateConfig>,
    ) -> Vec<u8> {
        let results = self.put_start_items(items, config).await;
        let mut enc = pbreplicas::Encoder::with_capacity(results.len() * 48);
        for r in &results {
            match r {
                Ok(g) => enc.put_start_result(0, "", g.put_id, g.replicas.iter().map(replica_ref)),
                Err(e) => {
                    enc.put_start_result(e.code().as_i32(), &e.to_string(), 0, std::iter::empty())
                }
            }
        }
        enc.finish(0)
    }

    /// `batch_get_replicas` for the framed RPC: keys borrowed from the request, the answer
    /// encoded straight from the state (no message structs, no `String` per replica).
    pub fn get_replicas_encoded(&self, keys: &[&str]) -> Vec<u8> {
        let mut enc = pbreplicas::Encoder::with_capacity(keys.len() * 48);
        let lease_ttl_ms = self.look_up(keys, |found| match found {
            Ok((size, views)) => enc.result(0, size, views.iter().map(replica_ref)),
            Err(e) => enc.result(e.code().as_i32(), 0, std::iter::empty()),
        });
        enc.finish(lease_ttl_ms)
    }

    /// Looks up (and leases) every key under one lock, hands each answer to `answer` in order,
    /// counts the batch in the metrics, and returns the lease TTL the hits got.
    fn look_up(
        &self,
        keys: &[&str],
        mut answer: impl FnMut(Result<(u64, Vec<ReplicaView>), MasterError>),
    ) -> u64 {
        let now = self.shared.clock.now();
        let mut failed = 0;
        let lease_ttl_ms;
        {
            let mut state = self.shared.state.lock();
            lease_ttl_ms = state.policy().lease_ttl.as_millis() as u64;
            for k in keys {
                let found = ObjectKey::validate(k)
                    .map_err(MasterError::from)
                    .and_then(|()| state.get_replicas_str(k, now));
                failed += usize::from(found.is_err());
                answer(found);
            }
            self.shared.wake_owners(&mut state);
        }
        self.shared
            .metrics
            .record(Op::GetReplicaList, keys.len(), failed);
        lease_ttl_ms
    }

    pub fn exists_strs(&self, keys: &[&str]) -> pb::BatchExistsResponse {
        let now = self.shared.clock.now();
        let mut codes = Vec::with_capacity(keys.len());
        let lease_ttl_ms;
        {
            let mut state = self.shared.state.lock();
            lease_ttl_ms = state.policy().lease_ttl.as_millis() as u64;
            for k in keys {
                codes.push(match ObjectKey::validate(k) {
                    Ok(()) => state.exists(*k, now) as i32,
                    Err(_) => Code::InvalidParams.as_i32(),
                });
            }
        }
        let failed = codes.iter().filter(|c| **c < 0).count();
        self.shared
            .metrics
            .record(Op::ExistKey, codes.len(), failed);
        pb::BatchExistsResponse {
            codes,
            lease_ttl_ms,
        }
    }

    /// Ends the puts named by (key, put id), under one lock; a code per put.
    pub fn put_end_refs(&self, refs: &[(&str, u64)]) -> Vec<i32> {
        let now = self.shared.clock.now();
        let codes = self.per_key(refs, |s, k, id| s.put_end(k, id, now));
        self.record(Op::PutEnd, &codes);
        codes
    }

    /// Revokes the puts named by (key, put id), under one lock; a code per put.
    pub fn put_revoke_refs(&self, refs: &[(&str, u64)]) -> Vec<i32> {
        let codes = self.per_key(refs, |s, k, id| s.put_revoke(k, id));
        self.record(Op::PutRevoke, &codes);
        codes
    }

    fn per_key(
        &self,
        refs: &[(&str, u64)],
        f: impl Fn(&mut MasterState, &str, u64) -> Result<(), MasterError>,
    ) -> Vec<i32> {
        let mut state = self.shared.state.lock();
        let codes = refs
            .iter()
            .map(|&(k, id)| {
                let r = ObjectKey::validate(k)
                    .map_err(MasterError::from)
                    .and_then(|()| f(&mut state, k, id));
                code_of(&r)
            })
            .collect();
        self.shared.wake_owners(&mut state);
        codes
    }

    fn record(&self, op: Op, codes: &[i32]) {
        let failed = codes.iter().filter(|c| **c != 0).count();
        self.shared.metrics.record(op, codes.len(), failed);
    }
}
