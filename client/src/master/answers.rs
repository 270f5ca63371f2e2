//! The client's translations between the wire and the domain, shared by both wire adapters: a
//! put's config as sent, and master answers read into `Lookup`, `Grants` and `SegmentUsage`,
//! from the framed RPC's borrowed codec (no `String` per replica) or from gRPC's messages.
//! Segment names are parsed once per
//! distinct name; a name that does not parse makes the whole answer unreadable (the master only
//! ever hands out names it parsed, so that is a broken peer, and a put must not silently skip a
//! granted replica).

use std::{ops::Range, time::Duration};

use mooncake_common::{
    auth::Seal,
    master_api::{Found, Grant, Grants, Lookup, Runs, SegmentUsage},
    replica::SegmentNames,
    ApiError, Code, ReplicaLocation, ReplicaTaskSpec, ReplicaTaskState, ReplicaTaskStatus,
    ReplicaTaskType, ReplicateConfig, SegmentName, Tier,
};
use mooncake_proto::{framed::replicas, master as pb};

fn tier(number: i32) -> Tier {
    if number == pb::ReplicaTier::Disk as i32 {
        Tier::Disk
    } else {
        Tier::Memory
    }
}

fn location(
    r: &replicas::ReplicaRef<'_>,
    names: &mut SegmentNames,
) -> Result<ReplicaLocation, ApiError> {
    Ok(ReplicaLocation {
        segment: names
            .get(r.segment)
            .map_err(|e| ApiError::rpc(format!("master sent a bad segment name: {e}")))?,
        offset: r.offset,
        size: r.size,
        tier: tier(r.tier),
        put_id: r.put_id,
        seal: Seal::from_bytes(r.seal)
            .map_err(|e| ApiError::rpc(format!("master sent a bad seal: {e}")))?,
    })
}

fn borrowed(l: &pb::ReplicaLocation) -> replicas::ReplicaRef<'_> {
    replicas::ReplicaRef {
        segment: &l.segment,
        offset: l.offset,
        size: l.size,
        tier: l.tier,
        put_id: l.put_id,
        seal: &l.seal,
    }
}

/// Appends one key's result: on code 0 its replicas (all parsed, or the answer is unreadable)
/// as the run `ok` is built from, else `err` of the code.
fn push_result<'r, T, E>(
    runs: &mut Runs<T, E>,
    code: i32,
    reps: impl Iterator<Item = replicas::ReplicaRef<'r>>,
    names: &mut SegmentNames,
    ok: impl FnOnce(Range<usize>) -> T,
    err: impl FnOnce(Code) -> E,
) -> Result<(), ApiError> {
    match Code::from_i32(code) {
        Code::Ok => runs.try_push_ok(reps.map(|r| location(&r, names)), ok)?,
        c => runs.push_err(err(c)),
    }
    Ok(())
}

fn push_found<'r>(
    objects: &mut Runs<Found, Code>,
    code: i32,
    size: u64,
    reps: impl Iterator<Item = replicas::ReplicaRef<'r>>,
    names: &mut SegmentNames,
) -> Result<(), ApiError> {
    let found = |replicas| Found { size, replicas };
    push_result(objects, code, reps, names, found, |c| c)
}

fn push_grant<'r>(
    grants: &mut Grants,
    code: i32,
    message: &str,
    put_id: u64,
    reps: impl Iterator<Item = replicas::ReplicaRef<'r>>,
    names: &mut SegmentNames,
) -> Result<(), ApiError> {
    let grant = |replicas| Grant { put_id, replicas };
    push_result(grants, code, reps, names, grant, |c| {
        ApiError::new(c, message)
    })
}

pub fn lookup_from_frame(body: &[u8]) -> Result<Lookup, ApiError> {
    let d = replicas::decode(body)
        .map_err(|e| ApiError::rpc(format!("master sent an undecodable answer: {e}")))?;
    let mut names = SegmentNames::default();
    let mut objects = Runs::with_capacity(d.results.len());
    for f in &d.results {
        let reps = d.replicas.get(f.replicas.clone()).unwrap_or(&[]);
        push_found(
            &mut objects,
            f.code,
            f.size,
            reps.iter().copied(),
            &mut names,
        )?;
    }
    Ok(Lookup {
        objects,
        lease_ttl: Duration::from_millis(d.lease_ttl_ms),
        epoch: d.epoch,
    })
}

pub fn lookup_from_pb(resp: pb::BatchGetReplicasResponse) -> Result<Lookup, ApiError> {
    let mut names = SegmentNames::default();
    let mut objects = Runs::with_capacity(resp.results.len());
    for r in &resp.results {
        push_found(
            &mut objects,
            r.code,
            r.size,
            r.replicas.iter().map(borrowed),
            &mut names,
        )?;
    }
    Ok(Lookup {
        objects,
        lease_ttl: Duration::from_millis(resp.lease_ttl_ms),
        epoch: resp.epoch,
    })
}

pub fn grants_from_frame(body: &[u8]) -> Result<Grants, ApiError> {
    let (starts, reps) = replicas::decode_put_start(body)
        .map_err(|e| ApiError::rpc(format!("master sent an undecodable answer: {e}")))?;
    let mut names = SegmentNames::default();
    let mut grants = Grants::with_capacity(starts.len());
    for s in &starts {
        let run = reps.get(s.replicas.clone()).unwrap_or(&[]);
        push_grant(
            &mut grants,
            s.code,
            s.message,
            s.put_id,
            run.iter().copied(),
            &mut names,
        )?;
    }
    Ok(grants)
}

pub fn grants_from_pb(resp: pb::BatchPutStartResponse) -> Result<Grants, ApiError> {
    let mut names = SegmentNames::default();
    let mut grants = Grants::with_capacity(resp.results.len());
    for r in &resp.results {
        push_grant(
            &mut grants,
            r.code,
            &r.message,
            r.put_id,
            r.replicas.iter().map(borrowed),
            &mut names,
        )?;
    }
    Ok(grants)
}

/// How many a remove-all removed, or the master's code for why not.
pub fn removed(resp: pb::RemoveAllResponse) -> Result<u64, ApiError> {
    match resp.code {
        0 => Ok(resp.removed),
        c => Err(ApiError::new(
            mooncake_common::Code::from_i32(c),
            "remove_all refused",
        )),
    }
}

/// The wire form of a put's config.
pub fn config_pb(c: &ReplicateConfig) -> pb::ReplicateConfig {
    pb::ReplicateConfig {
        replica_num: c.replica_num as u32,
        preferred_segments: c.preferred_segments.iter().map(|s| s.to_string()).collect(),
        soft_pin: c.soft_pin,
        hard_pin: c.hard_pin,
        upsert: c.upsert,
    }
}

/// Segment usage as received, names validated.
pub fn segments_from_pb(segments: Vec<pb::SegmentInfo>) -> Result<Vec<SegmentUsage>, ApiError> {
    segments
        .into_iter()
        .map(|s| {
            Ok(SegmentUsage {
                name: SegmentName::parse(&s.name)
                    .map_err(|e| ApiError::rpc(format!("master sent a bad segment name: {e}")))?,
                capacity: s.capacity,
                allocated: s.allocated,
            })
        })
        .collect()
}

/// The wire form of a replica task's request.
pub fn replica_task_pb(key: &str, spec: ReplicaTaskSpec<'_>) -> pb::CreateReplicaTaskRequest {
    let (targets, source) = match spec {
        ReplicaTaskSpec::Copy { targets } => (targets.iter().map(|t| t.to_string()).collect(), ""),
        ReplicaTaskSpec::Move { source, target } => (vec![target.to_string()], source),
    };
    pb::CreateReplicaTaskRequest {
        key: key.to_string(),
        targets,
        source: source.to_string(),
    }
}

/// A created task's id, or the master's code for why not.
pub fn task_created(resp: pb::CreateReplicaTaskResponse) -> Result<u64, ApiError> {
    match resp.code {
        0 => Ok(resp.task_id),
        c => Err(ApiError::new(Code::from_i32(c), resp.message)),
    }
}

/// A task's state as received.
pub fn task_state(resp: pb::QueryTaskResponse) -> Result<ReplicaTaskState, ApiError> {
    if resp.code != 0 {
        return Err(ApiError::new(Code::from_i32(resp.code), resp.message));
    }
    let status = ReplicaTaskStatus::from_i32(resp.status)
        .ok_or_else(|| ApiError::rpc(format!("master sent unknown task status {}", resp.status)))?;
    let kind = if resp.r#type == pb::ReplicaTaskType::ReplicaTaskMove as i32 {
        ReplicaTaskType::Move
    } else {
        ReplicaTaskType::Copy
    };
    Ok(ReplicaTaskState {
        id: resp.task_id,
        kind,
        status,
        created_at_ms: resp.created_at_ms,
        updated_at_ms: resp.updated_at_ms,
        assigned: resp.assigned,
        detail: resp.detail,
    })
}
