//! The gRPC adapter: the tonic service over `MasterService`. Each handler decodes and validates
//! the request (a malformed id or name is INVALID_ARGUMENT), calls one service method, and
//! encodes its answer; the framed RPC reuses these handlers for its cold calls.

use std::{sync::Arc, time::Duration};

use mooncake_common::{master_api::Releases, ObjectKey, Stamp};
use mooncake_proto::master as pb;
use tonic::{Request, Response, Status};

use super::{
    batch_size, client_id, code, code_and_message, replica_pb, replicate_config, segment,
    tier_number, BadRequest,
};
use crate::{
    core::{HeartbeatReply, MountReport, Mounted, OwnerTask, Reported, TaskKind, TaskRequest},
    error::MasterError,
    service::{Caller, MasterService, TaskReport},
};

/// The caller a request comes from: the connection's interceptor (or the framed adapter)
/// puts it in the request's extensions.
pub fn caller_of<T>(req: &Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::internal("the request carries no caller (a bug in the adapter)"))
}

/// The caller of an owner's call: it must hold the cluster's secret.
fn owner_of<T>(req: &Request<T>) -> Result<(), Status> {
    caller_of(req)?
        .owner_call()
        .map_err(|e| Status::permission_denied(e.to_string()))
}

pub type Reply<T> = Result<Response<T>, Status>;

/// The largest message either way (tonic's limits, set by the server).
pub const MAX_MESSAGE: usize = 256 << 20;

/// Refuses an answer too big to go out (tonic would fail the call after the work was done),
/// as the framed protocol does; the caller undoes what the answer would have handed over.
fn too_big(answer: &impl prost::Message) -> Option<Status> {
    let len = answer.encoded_len();
    (len > MAX_MESSAGE).then(|| {
        Status::invalid_argument(format!(
            "the answer of {len} bytes exceeds the message limit of {MAX_MESSAGE}: ask for fewer keys per call"
        ))
    })
}

impl From<BadRequest> for Status {
    fn from(e: BadRequest) -> Status {
        Status::invalid_argument(e.0)
    }
}

/// The tonic service: a handle on the one `MasterService`.
#[derive(Clone)]
pub struct GrpcMaster(pub Arc<MasterService>);

fn kind_to_pb(k: TaskKind) -> pb::TaskKind {
    match k {
        TaskKind::Offload => pb::TaskKind::Offload,
        TaskKind::Drop => pb::TaskKind::Drop,
        TaskKind::Promote => pb::TaskKind::Promote,
        TaskKind::Copy => pb::TaskKind::Copy,
    }
}

fn kind_from_pb(k: i32) -> Result<TaskKind, Status> {
    match pb::TaskKind::try_from(k) {
        Ok(pb::TaskKind::Offload) => Ok(TaskKind::Offload),
        Ok(pb::TaskKind::Drop) => Ok(TaskKind::Drop),
        Ok(pb::TaskKind::Promote) => Ok(TaskKind::Promote),
        Ok(pb::TaskKind::Copy) => Ok(TaskKind::Copy),
        Err(_) => Err(Status::invalid_argument(format!("unknown task kind {k}"))),
    }
}

fn task_to_pb(t: OwnerTask) -> pb::OwnerTask {
    pb::OwnerTask {
        kind: kind_to_pb(t.kind) as i32,
        key: t.key.to_string(),
        put_id: t.put_id,
        offset: t.offset,
        size: t.size,
        grant: t.grant,
        task_id: t.task_id,
        source: t
            .copy_from
            .as_ref()
            .map(|c| c.segment.to_string())
            .unwrap_or_default(),
        source_offset: t.copy_from.as_ref().map_or(0, |c| c.offset),
        source_tier: t.copy_from.as_ref().map_or(0, |c| tier_number(c.tier)),
    }
}

/// Segment names as a request carries them; one that does not parse is the caller's error.
fn segment_names(names: &[String]) -> Result<Vec<mooncake_common::SegmentName>, MasterError> {
    names
        .iter()
        .map(|n| segment(n).map_err(|e| MasterError::Invalid(e.0)))
        .collect()
}

/// A call on the puts named by (key, put id), answered with a code per put.
fn by_refs(
    items: &[pb::PutRef],
    call: impl FnOnce(&[(&str, u64)]) -> Vec<Result<(), crate::error::MasterError>>,
) -> Vec<i32> {
    let puts: Vec<(&str, u64)> = items.iter().map(|i| (i.key.as_str(), i.put_id)).collect();
    call(&puts).iter().map(code).collect()
}

/// A segment the owner may not use for SSD work.
fn not_usable(e: crate::error::MasterError) -> Status {
    Status::failed_precondition(e.to_string())
}

#[tonic::async_trait]
impl pb::master_server::Master for GrpcMaster {
    async fn mount_segment(
        &self,
        req: Request<pb::MountSegmentRequest>,
    ) -> Reply<pb::MountSegmentResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let report = MountReport {
            newest_grant: r.newest_grant,
            objects: r.catalog_objects,
            disk_records: r.disk_records,
        };
        let mounted = self
            .0
            .mount_segment(owner, name, r.size, r.disk_capacity, report);
        let (code, message) = code_and_message(&mounted);
        Ok(Response::new(pb::MountSegmentResponse {
            code,
            message,
            epoch: self.0.epoch(),
            report_catalog: mounted == Ok(Mounted::AwaitingReport),
        }))
    }

    async fn unmount_segment(
        &self,
        req: Request<pb::UnmountSegmentRequest>,
    ) -> Reply<pb::UnmountSegmentResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let (code, message) = code_and_message(&self.0.unmount_segment(owner, &name));
        Ok(Response::new(pb::UnmountSegmentResponse { code, message }))
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Reply<pb::HeartbeatResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let owner = client_id(&r.client_id)?;
        let applied = (r.freed_epoch, r.freed_applied);
        let (reply, freed, more_freed) =
            self.0
                .heartbeat(owner, r.disk.as_ref().map(Into::into), applied);
        Ok(Response::new(pb::HeartbeatResponse {
            code: 0,
            remount: reply == HeartbeatReply::Remount,
            epoch: self.0.epoch(),
            freed: freed
                .into_iter()
                .map(|f| pb::FreedRange {
                    offset: f.offset,
                    put_id: f.put_id,
                    granted_before: f.granted_before,
                    seq: f.seq,
                })
                .collect(),
            more_freed,
        }))
    }

    async fn batch_put_start(
        &self,
        req: Request<pb::BatchPutStartRequest>,
    ) -> Reply<pb::BatchPutStartResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.items.len(), "puts")?;
        let items: Vec<(&str, u64)> = r.items.iter().map(|i| (i.key.as_str(), i.size)).collect();
        let results = match replicate_config(r.config) {
            Ok(config) => self.0.put_start(&caller, &items, &config, r.token).await,
            Err(e) => self.0.refuse_put_start(items.len(), &e),
        };
        let results = results
            .into_iter()
            .map(|r| {
                let (code, message) = code_and_message(&r);
                let (put_id, replicas) = match r {
                    Ok(g) => (g.put_id, g.replicas.into_iter().map(replica_pb).collect()),
                    Err(_) => (0, Vec::new()),
                };
                pb::PutStartResult {
                    code,
                    message,
                    put_id,
                    replicas,
                }
            })
            .collect();
        let answer = pb::BatchPutStartResponse { results };
        if let Some(refused) = too_big(&answer) {
            // Nobody would write or end these puts: given up now, not left in flight.
            let granted: Vec<(&str, u64)> = items
                .iter()
                .zip(&answer.results)
                .filter(|(_, r)| r.code == 0)
                .map(|(&(k, _), r)| (k, r.put_id))
                .collect();
            self.0.put_revoke(&caller, &granted);
            return Err(refused);
        }
        Ok(Response::new(answer))
    }

    async fn batch_put_end(
        &self,
        req: Request<pb::BatchPutEndRequest>,
    ) -> Reply<pb::BatchPutEndResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.items.len(), "puts")?;
        let codes = by_refs(&r.items, |puts| self.0.put_end(&caller, puts));
        Ok(Response::new(pb::BatchPutEndResponse { codes }))
    }

    async fn batch_put_revoke(
        &self,
        req: Request<pb::BatchPutRevokeRequest>,
    ) -> Reply<pb::BatchPutRevokeResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.items.len(), "puts")?;
        let codes = by_refs(&r.items, |puts| self.0.put_revoke(&caller, puts));
        Ok(Response::new(pb::BatchPutRevokeResponse { codes }))
    }

    async fn batch_get_replicas(
        &self,
        req: Request<pb::BatchGetReplicasRequest>,
    ) -> Reply<pb::BatchGetReplicasResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.keys.len(), "keys")?;
        batch_size(r.release.len(), "holds handed back")?;
        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
        let release: Vec<&str> = r.release.iter().map(String::as_str).collect();
        let release = Releases::of(&release, r.release_epoch);
        let mut results = Vec::with_capacity(keys.len());
        let leased = self.0.get_replicas(&caller, &keys, release, |found| {
            let code = code(&found);
            let (size, replicas) = found.unwrap_or_default();
            results.push(pb::GetReplicasResult {
                code,
                size,
                replicas: replicas.into_iter().map(replica_pb).collect(),
            })
        });
        let answer = pb::BatchGetReplicasResponse {
            results,
            lease_ttl_ms: millis(leased.ttl),
            epoch: leased.epoch,
        };
        if let Some(refused) = too_big(&answer) {
            // Nobody reads these keys: their holds go back.
            let found: Vec<&str> = keys
                .iter()
                .zip(&answer.results)
                .filter(|(_, r)| r.code == 0)
                .map(|(&k, _)| k)
                .collect();
            self.0
                .release_leases(&caller, Releases::of(&found, leased.epoch));
            return Err(refused);
        }
        Ok(Response::new(answer))
    }

    async fn batch_exists(
        &self,
        req: Request<pb::BatchExistsRequest>,
    ) -> Reply<pb::BatchExistsResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.keys.len(), "keys")?;
        batch_size(r.release.len(), "holds handed back")?;
        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
        let release: Vec<&str> = r.release.iter().map(String::as_str).collect();
        let release = Releases::of(&release, r.release_epoch);
        Ok(Response::new(exists(&self.0, &caller, &keys, release)))
    }

    async fn batch_remove(
        &self,
        req: Request<pb::BatchRemoveRequest>,
    ) -> Reply<pb::BatchRemoveResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.keys.len(), "keys")?;
        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
        let codes = self
            .0
            .remove(&caller, &keys, r.force)
            .iter()
            .map(code)
            .collect();
        Ok(Response::new(pb::BatchRemoveResponse { codes }))
    }

    async fn remove_all(&self, req: Request<pb::RemoveAllRequest>) -> Reply<pb::RemoveAllResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let regex = Some(r.key_regex.as_str()).filter(|p| !p.is_empty());
        let res = self.0.remove_all(&caller, r.force, regex).await;
        let (code, _) = code_and_message(&res);
        Ok(Response::new(pb::RemoveAllResponse {
            code,
            removed: res.unwrap_or(0),
        }))
    }

    async fn create_replica_task(
        &self,
        req: Request<pb::CreateReplicaTaskRequest>,
    ) -> Reply<pb::CreateReplicaTaskResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let res = segment_names(&r.targets).and_then(|targets| {
            if r.source.is_empty() {
                return self.0.create_replica_task(
                    &caller,
                    &r.key,
                    TaskRequest::Copy { targets: &targets },
                );
            }
            let source = segment(&r.source).map_err(|e| MasterError::Invalid(e.0))?;
            match targets.as_slice() {
                [target] => self.0.create_replica_task(
                    &caller,
                    &r.key,
                    TaskRequest::Move {
                        source: &source,
                        target,
                    },
                ),
                _ => Err(MasterError::Invalid(format!(
                    "a move names one target, not {}",
                    targets.len()
                ))),
            }
        });
        let (code, message) = code_and_message(&res);
        Ok(Response::new(pb::CreateReplicaTaskResponse {
            code,
            message,
            task_id: res.unwrap_or(0),
        }))
    }

    async fn query_task(&self, req: Request<pb::QueryTaskRequest>) -> Reply<pb::QueryTaskResponse> {
        let caller = caller_of(&req)?;
        let id = req.into_inner().task_id;
        let Some((info, created_at_ms, updated_at_ms)) = self.0.query_task(&caller, id) else {
            // Task ids come from the grant counter, which every later master starts above its
            // predecessors' (its epoch): a smaller id was another master's.
            let epoch = self.0.epoch();
            let message = if id < epoch {
                format!("no task {id}: an earlier master made it, and its tasks ended with it (a restart or a leader change; this master's start at {epoch}); it may not have finished: check the key's replicas and create it again if needed")
            } else {
                format!("no task {id} (never made, or finished long ago)")
            };
            return Ok(Response::new(pb::QueryTaskResponse {
                code: mooncake_common::Code::ObjectNotFound.as_i32(),
                message,
                task_id: id,
                ..Default::default()
            }));
        };
        Ok(Response::new(pb::QueryTaskResponse {
            code: 0,
            message: String::new(),
            task_id: info.id,
            r#type: info.kind as i32,
            status: info.status as i32,
            created_at_ms,
            updated_at_ms,
            assigned: info.assigned.iter().map(|s| s.to_string()).collect(),
            detail: info.detail,
        }))
    }

    async fn batch_replica_clear(
        &self,
        req: Request<pb::BatchReplicaClearRequest>,
    ) -> Reply<pb::BatchReplicaClearResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.keys.len(), "keys")?;
        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
        let name = match r.segment.as_str() {
            "" => None,
            s => match segment(s) {
                Ok(n) => Some(n),
                Err(e) => {
                    let c = MasterError::Invalid(e.0).code().as_i32();
                    return Ok(Response::new(pb::BatchReplicaClearResponse {
                        codes: vec![c; keys.len()],
                    }));
                }
            },
        };
        let results = self.0.replica_clear(&caller, &keys, name.as_ref());
        Ok(Response::new(pb::BatchReplicaClearResponse {
            codes: results.iter().map(code).collect(),
        }))
    }

    async fn abandon_put_start(
        &self,
        req: Request<pb::AbandonPutStartRequest>,
    ) -> Reply<pb::AbandonPutStartResponse> {
        let caller = caller_of(&req)?;
        let revoked = self.0.abandon_put_start(&caller, req.into_inner().token);
        Ok(Response::new(pb::AbandonPutStartResponse { revoked }))
    }

    async fn batch_release_leases(
        &self,
        req: Request<pb::BatchReleaseLeasesRequest>,
    ) -> Reply<pb::BatchReleaseLeasesResponse> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        batch_size(r.keys.len(), "holds handed back")?;
        let keys: Vec<&str> = r.keys.iter().map(String::as_str).collect();
        let release = Releases::of(&keys, r.epoch);
        self.0.release_leases(&caller, release);
        Ok(Response::new(pb::BatchReleaseLeasesResponse {}))
    }

    async fn list_segments(
        &self,
        _req: Request<pb::ListSegmentsRequest>,
    ) -> Reply<pb::ListSegmentsResponse> {
        let segments = self
            .0
            .list_segments()
            .into_iter()
            .map(|s| pb::SegmentInfo {
                name: s.name.to_string(),
                capacity: s.capacity,
                allocated: s.allocated,
            })
            .collect();
        Ok(Response::new(pb::ListSegmentsResponse { segments }))
    }

    async fn poll_tasks(&self, req: Request<pb::PollTasksRequest>) -> Reply<pb::PollTasksResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let wait = Duration::from_millis(r.wait_ms);
        let polled = self
            .0
            .poll_tasks(owner, &name, r.epoch, r.max_tasks as usize, wait)
            .await;
        Ok(Response::new(pb::PollTasksResponse {
            tasks: polled.tasks.into_iter().map(task_to_pb).collect(),
            remount: polled.remount,
            epoch: self.0.epoch(),
        }))
    }

    async fn report_tasks(
        &self,
        req: Request<pb::ReportTasksRequest>,
    ) -> Reply<pb::ReportTasksResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let reports = r
            .results
            .iter()
            .map(|t| {
                Ok(TaskReport {
                    kind: kind_from_pb(t.kind)?,
                    key: &t.key,
                    put_id: t.put_id,
                    done: t.code == 0,
                    task_id: t.task_id,
                    message: &t.message,
                    offset: t.offset,
                })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let results = self
            .0
            .report_tasks(owner, &name, &reports)
            .map_err(not_usable)?;
        Ok(Response::new(pb::ReportTasksResponse {
            codes: results.iter().map(code).collect(),
        }))
    }

    async fn disk_dropped(
        &self,
        req: Request<pb::DiskDroppedRequest>,
    ) -> Reply<pb::DiskDroppedResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let records: Vec<(&str, u64)> =
            r.items.iter().map(|i| (i.key.as_str(), i.put_id)).collect();
        self.0
            .disk_dropped(owner, &name, &records)
            .map_err(not_usable)?;
        Ok(Response::new(pb::DiskDroppedResponse { code: 0 }))
    }

    async fn register_disk(
        &self,
        req: Request<pb::RegisterDiskRequest>,
    ) -> Reply<pb::RegisterDiskResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        let records: Vec<(&str, u64, u64)> = r
            .items
            .iter()
            .map(|i| (i.key.as_str(), i.size, i.put_id))
            .collect();
        let results = self
            .0
            .register_disk(owner, &name, &records, r.done)
            .map_err(not_usable)?;
        Ok(Response::new(pb::RegisterDiskResponse {
            codes: results.iter().map(code).collect(),
            put_ids: results.iter().map(|r| *r.as_ref().unwrap_or(&0)).collect(),
        }))
    }

    async fn report_catalog(
        &self,
        req: Request<pb::ReportCatalogRequest>,
    ) -> Reply<pb::ReportCatalogResponse> {
        owner_of(&req)?;
        let r = req.into_inner();
        let (owner, name) = (client_id(&r.client_id)?, segment(&r.segment)?);
        // An entry with a malformed key is left out here and counted as refused.
        let mut bad_keys = 0;
        let items = r
            .items
            .into_iter()
            .filter_map(|i| match ObjectKey::new(&i.key) {
                Ok(key) => Some(Reported {
                    key,
                    offset: i.offset,
                    size: i.size,
                    stamp: Stamp::from_flags(i.put_id, i.flags as u16),
                }),
                Err(_) => {
                    bad_keys += 1;
                    None
                }
            })
            .collect();
        let res = self.0.report_catalog(owner, &name, items, r.done);
        let (code, message) = code_and_message(&res);
        let outcome = res.ok().flatten().unwrap_or_default();
        Ok(Response::new(pb::ReportCatalogResponse {
            code,
            message,
            registered: outcome.registered,
            refused: outcome.refused + bad_keys,
        }))
    }
}

/// A batch exists answer: 1 exists, 0 missing, negative an error code.
pub(super) fn exists(
    svc: &MasterService,
    caller: &Caller,
    keys: &[&str],
    release: Releases<'_>,
) -> pb::BatchExistsResponse {
    let (results, leased) = svc.exists(caller, keys, release);
    pb::BatchExistsResponse {
        codes: results
            .iter()
            .map(|r| match r {
                Ok(hit) => i32::from(*hit),
                Err(e) => e.code().as_i32(),
            })
            .collect(),
        lease_ttl_ms: millis(leased.ttl),
        epoch: leased.epoch,
    }
}

pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}
