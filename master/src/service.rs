//! The gRPC face of the master: decode and validate, lock the state once per batch, call the
//! core, encode. No decision is made here. The lock is a plain mutex never held across an
//! `.await`: every core call is short and synchronous.

use std::sync::Arc;

use mooncake_common::{ClientId, Code, ObjectKey, SegmentName};
use mooncake_proto::master as pb;
use parking_lot::Mutex;
use tonic::{Request, Response, Status};

use crate::{
    clock::Clock,
    core::{HeartbeatReply, MasterState, ReplicaView, ReplicateConfig},
    error::MasterError,
    metrics::{Metrics, Op},
};

/// State shared by the gRPC service, the HTTP endpoint and the upkeep loop.
pub struct Shared {
    pub state: Mutex<MasterState>,
    pub clock: Arc<dyn Clock>,
    pub metrics: Metrics,
}

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

fn key(s: &str) -> Result<ObjectKey, MasterError> {
    Ok(ObjectKey::new(s)?)
}

fn client_id(s: &str) -> Result<ClientId, Status> {
    ClientId::parse(s).map_err(|e| Status::invalid_argument(e.to_string()))
}

fn segment(s: &str) -> Result<SegmentName, Status> {
    SegmentName::parse(s).map_err(|e| Status::invalid_argument(e.to_string()))
}

fn location(v: ReplicaView) -> pb::ReplicaLocation {
    pb::ReplicaLocation {
        segment: v.segment.to_string(),
        offset: v.offset,
        size: v.size,
        tier: pb::ReplicaTier::Memory as i32,
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

type Reply<T> = Result<Response<T>, Status>;

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
            .mount_segment(owner, name, r.size, now);
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
        let owner = client_id(&req.into_inner().client_id)?;
        let now = self.shared.clock.now();
        let reply = self.shared.state.lock().heartbeat(owner, now);
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
        let config = replicate_config(r.config);
        let now = self.shared.clock.now();
        let mut results = Vec::with_capacity(r.items.len());
        {
            let mut state = self.shared.state.lock();
            for item in &r.items {
                let res = config
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|c| state.put_start(&key(&item.key)?, item.size, c, now));
                results.push(match res {
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
                });
            }
        }
        // An existing key is the normal write-once outcome, not a failure.
        let failed = results
            .iter()
            .filter(|x| x.code != 0 && x.code != Code::ObjectAlreadyExists.as_i32())
            .count();
        self.shared
            .metrics
            .record(Op::PutStart, results.len(), failed);
        Ok(Response::new(pb::BatchPutStartResponse { results }))
    }

    async fn batch_put_end(
        &self,
        req: Request<pb::BatchPutEndRequest>,
    ) -> Reply<pb::BatchPutEndResponse> {
        let items = req.into_inner().items;
        let codes = self.per_key(&items, |s, k, id| s.put_end(k, id));
        self.record(Op::PutEnd, &codes);
        Ok(Response::new(pb::BatchPutEndResponse { codes }))
    }

    async fn batch_put_revoke(
        &self,
        req: Request<pb::BatchPutRevokeRequest>,
    ) -> Reply<pb::BatchPutRevokeResponse> {
        let items = req.into_inner().items;
        let codes = self.per_key(&items, |s, k, id| s.put_revoke(k, id));
        self.record(Op::PutRevoke, &codes);
        Ok(Response::new(pb::BatchPutRevokeResponse { codes }))
    }

    async fn batch_get_replicas(
        &self,
        req: Request<pb::BatchGetReplicasRequest>,
    ) -> Reply<pb::BatchGetReplicasResponse> {
        let keys = req.into_inner().keys;
        let now = self.shared.clock.now();
        let mut results = Vec::with_capacity(keys.len());
        let lease_ttl_ms;
        {
            let mut state = self.shared.state.lock();
            lease_ttl_ms = state.policy().lease_ttl.as_millis() as u64;
            for k in &keys {
                results.push(match key(k).and_then(|k| state.get_replicas(&k, now)) {
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
                });
            }
        }
        let failed = results.iter().filter(|r| r.code != 0).count();
        self.shared
            .metrics
            .record(Op::GetReplicaList, results.len(), failed);
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
        let now = self.shared.clock.now();
        let mut codes = Vec::with_capacity(keys.len());
        let lease_ttl_ms;
        {
            let mut state = self.shared.state.lock();
            lease_ttl_ms = state.policy().lease_ttl.as_millis() as u64;
            // Looked up by &str: a batch of 10k keys allocates nothing per key.
            for k in &keys {
                codes.push(match ObjectKey::validate(k) {
                    Ok(()) => state.exists(k.as_str(), now) as i32,
                    Err(_) => Code::InvalidParams.as_i32(),
                });
            }
        }
        let failed = codes.iter().filter(|c| **c < 0).count();
        self.shared
            .metrics
            .record(Op::ExistKey, codes.len(), failed);
        Ok(Response::new(pb::BatchExistsResponse {
            codes,
            lease_ttl_ms,
        }))
    }

    async fn batch_remove(
        &self,
        req: Request<pb::BatchRemoveRequest>,
    ) -> Reply<pb::BatchRemoveResponse> {
        let r = req.into_inner();
        let now = self.shared.clock.now();
        let codes: Vec<i32> = {
            let mut state = self.shared.state.lock();
            r.keys
                .iter()
                .map(|k| code_of(&key(k).and_then(|k| state.remove(&k, r.force, now))))
                .collect()
        };
        self.record(Op::Remove, &codes);
        Ok(Response::new(pb::BatchRemoveResponse { codes }))
    }

    async fn remove_all(&self, req: Request<pb::RemoveAllRequest>) -> Reply<pb::RemoveAllResponse> {
        let force = req.into_inner().force;
        let now = self.shared.clock.now();
        let removed = self.shared.state.lock().remove_all(force, now);
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
}

impl MasterService {
    fn per_key(
        &self,
        items: &[pb::PutRef],
        f: impl Fn(&mut MasterState, &ObjectKey, u64) -> Result<(), MasterError>,
    ) -> Vec<i32> {
        let mut state = self.shared.state.lock();
        items
            .iter()
            .map(|i| code_of(&key(&i.key).and_then(|k| f(&mut state, &k, i.put_id))))
            .collect()
    }

    fn record(&self, op: Op, codes: &[i32]) {
        let failed = codes.iter().filter(|c| **c != 0).count();
        self.shared.metrics.record(op, codes.len(), failed);
    }
}
