//! The SSD-tier RPCs owners call: a long poll for work, reports of its outcome, disk records
//! about to disappear, and records found on disk after a restart. Decode, lock, call the core,
//! encode; the poll waits on a notification, never while holding the lock.

use std::time::Duration;

use mooncake_proto::master as pb;
use tonic::{Response, Status};

use crate::{
    core::{OwnerTask, TaskKind},
    service::{client_id, key, segment, Reply, Shared},
};

/// The longest an owner's poll is held open.
const MAX_POLL_WAIT: Duration = Duration::from_secs(5);
/// The most tasks one poll hands out.
const MAX_POLL_TASKS: usize = 1024;

fn kind_to_pb(k: TaskKind) -> pb::TaskKind {
    match k {
        TaskKind::Offload => pb::TaskKind::Offload,
        TaskKind::Drop => pb::TaskKind::Drop,
        TaskKind::Promote => pb::TaskKind::Promote,
    }
}

fn kind_from_pb(k: i32) -> Result<TaskKind, Status> {
    match pb::TaskKind::try_from(k) {
        Ok(pb::TaskKind::Offload) => Ok(TaskKind::Offload),
        Ok(pb::TaskKind::Drop) => Ok(TaskKind::Drop),
        Ok(pb::TaskKind::Promote) => Ok(TaskKind::Promote),
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
    }
}

/// The segment the request names, checked to belong to the caller and to have an SSD tier.
/// The outer error is a malformed request, the inner one a segment this owner may not use.
fn resolve(
    shared: &Shared,
    client: &str,
    name: &str,
) -> Result<Result<crate::core::SegmentId, crate::error::MasterError>, Status> {
    let (owner, name) = (client_id(client)?, segment(name)?);
    Ok(shared.state.lock().disk_segment(owner, &name))
}

/// `resolve`, with a segment this owner may not use refused as a failed precondition.
fn resolve_mounted(
    shared: &Shared,
    client: &str,
    name: &str,
) -> Result<crate::core::SegmentId, Status> {
    resolve(shared, client, name)?.map_err(|e| Status::failed_precondition(e.to_string()))
}

pub(crate) async fn poll_tasks(
    shared: &Shared,
    r: pb::PollTasksRequest,
) -> Reply<pb::PollTasksResponse> {
    let wait = Duration::from_millis(r.wait_ms).min(MAX_POLL_WAIT);
    let max = (r.max_tasks as usize).clamp(1, MAX_POLL_TASKS);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let work = shared.owner_work.notified();
        tokio::pin!(work);
        work.as_mut().enable();
        let id = match resolve(shared, &r.client_id, &r.segment)? {
            Ok(id) => id,
            Err(_) => {
                return Ok(Response::new(pb::PollTasksResponse {
                    tasks: Vec::new(),
                    remount: true,
                }))
            }
        };
        let tasks = shared.state.lock().take_tasks(id, max);
        if !tasks.is_empty() {
            return Ok(Response::new(pb::PollTasksResponse {
                tasks: tasks.into_iter().map(task_to_pb).collect(),
                remount: false,
            }));
        }
        if tokio::time::timeout_at(deadline, work).await.is_err() {
            return Ok(Response::new(pb::PollTasksResponse {
                tasks: Vec::new(),
                remount: false,
            }));
        }
    }
}

pub(crate) fn report_tasks(
    shared: &Shared,
    r: pb::ReportTasksRequest,
) -> Reply<pb::ReportTasksResponse> {
    let id = resolve_mounted(shared, &r.client_id, &r.segment)?;
    let now = shared.clock.now();
    let mut codes = Vec::with_capacity(r.results.len());
    {
        let mut state = shared.state.lock();
        for t in &r.results {
            let kind = kind_from_pb(t.kind)?;
            let res = key(&t.key)
                .and_then(|k| state.report_task(id, kind, &k, t.put_id, t.code == 0, now));
            codes.push(match res {
                Ok(()) => 0,
                Err(e) => e.code().as_i32(),
            });
        }
        shared.wake_owners(&mut state);
    }
    shared.offload_progress.notify_waiters();
    Ok(Response::new(pb::ReportTasksResponse { codes }))
}

pub(crate) fn disk_dropped(
    shared: &Shared,
    r: pb::DiskDroppedRequest,
) -> Reply<pb::DiskDroppedResponse> {
    let id = resolve_mounted(shared, &r.client_id, &r.segment)?;
    let now = shared.clock.now();
    let mut state = shared.state.lock();
    for item in &r.items {
        if let Ok(k) = key(&item.key) {
            state.disk_dropped(id, &k, item.put_id, now);
        }
    }
    shared.wake_owners(&mut state);
    Ok(Response::new(pb::DiskDroppedResponse { code: 0 }))
}

pub(crate) fn register_disk(
    shared: &Shared,
    r: pb::RegisterDiskRequest,
) -> Reply<pb::RegisterDiskResponse> {
    let id = resolve_mounted(shared, &r.client_id, &r.segment)?;
    let now = shared.clock.now();
    let mut codes = Vec::with_capacity(r.items.len());
    let mut put_ids = Vec::with_capacity(r.items.len());
    let mut state = shared.state.lock();
    for item in &r.items {
        match key(&item.key).and_then(|k| state.register_disk(id, &k, item.size, item.put_id, now))
        {
            Ok(put_id) => {
                codes.push(0);
                put_ids.push(put_id);
            }
            Err(e) => {
                codes.push(e.code().as_i32());
                put_ids.push(0);
            }
        }
    }
    Ok(Response::new(pb::RegisterDiskResponse { codes, put_ids }))
}
