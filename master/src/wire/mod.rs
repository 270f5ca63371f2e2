//! The service's wire adapters: gRPC (`grpc`), the framed RPC on the same port (`framed`), and
//! the in-process `MasterApi` (`in_process`). Each only translates; the one mapping of a
//! `MasterError` to the wire (a Mooncake code and a text) and of wire values to validated domain
//! types lives here.

pub mod admitted;
pub mod framed;
pub mod grpc;
pub mod in_process;
pub mod leading;

use mooncake_common::{ClientId, ReplicaLocation, ReplicateConfig, SegmentName, Tier};
use mooncake_proto::{framed::replicas::ReplicaRef, master as pb};

use crate::error::MasterError;

/// A per-key outcome as the wire carries it: 0, or the error's code.
pub fn code<T>(r: &Result<T, MasterError>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.code().as_i32(),
    }
}

/// A per-key outcome as the wire carries it with a text: (0, ""), or the code and the message.
pub fn code_and_message<T>(r: &Result<T, MasterError>) -> (i32, String) {
    match r {
        Ok(_) => (0, String::new()),
        Err(e) => (e.code().as_i32(), e.to_string()),
    }
}

/// Why a request is malformed (an id or a name that does not parse), before the service is
/// asked: the adapters answer it as a bad request.
#[derive(Debug)]
pub struct BadRequest(pub String);

/// Keys one call may name, in its batch and in the holds it hands back: far above what a
/// serving engine's connector sends (a request's blocks), and low enough that a call's answer
/// and the master's work under its lock stay bounded (a request of tiny keys otherwise asks
/// for an answer twenty times its size, and all of it is built before it can be refused).
pub const MAX_BATCH_KEYS: usize = 1 << 20;

/// Refuses a call naming more than `MAX_BATCH_KEYS` keys (`what` says which list).
pub fn batch_size(n: usize, what: &str) -> Result<(), BadRequest> {
    if n > MAX_BATCH_KEYS {
        return Err(BadRequest(format!(
            "{n} {what} in one call, above the limit of {MAX_BATCH_KEYS}: split the batch"
        )));
    }
    Ok(())
}

pub fn client_id(s: &str) -> Result<ClientId, BadRequest> {
    ClientId::parse(s).map_err(|e| BadRequest(e.to_string()))
}

pub fn segment(s: &str) -> Result<SegmentName, BadRequest> {
    SegmentName::parse(s).map_err(|e| BadRequest(e.to_string()))
}

/// A put's config as received; absent is the default. Refused when it asks for more replicas
/// than the limit or names a segment that does not parse.
pub fn replicate_config(c: Option<pb::ReplicateConfig>) -> Result<ReplicateConfig, MasterError> {
    let c = c.unwrap_or_default();
    let replica_num =
        ReplicateConfig::replica_count(u64::from(c.replica_num)).map_err(MasterError::Invalid)?;
    Ok(ReplicateConfig {
        replica_num,
        preferred_segments: c
            .preferred_segments
            .iter()
            .map(|s| SegmentName::parse(s))
            .collect::<Result<_, _>>()?,
        soft_pin: c.soft_pin,
        hard_pin: c.hard_pin,
        upsert: c.upsert,
    })
}

pub fn tier_number(t: Tier) -> i32 {
    match t {
        Tier::Memory => pb::ReplicaTier::Memory as i32,
        Tier::Disk => pb::ReplicaTier::Disk as i32,
    }
}

/// A replica for the borrowed encoder.
pub fn replica_ref(r: &ReplicaLocation) -> ReplicaRef<'_> {
    ReplicaRef {
        segment: r.segment.as_str(),
        offset: r.offset,
        size: r.size,
        tier: tier_number(r.tier),
        put_id: r.put_id,
        seal: r.seal.wire_bytes(),
    }
}

pub fn replica_pb(r: ReplicaLocation) -> pb::ReplicaLocation {
    pb::ReplicaLocation {
        segment: r.segment.to_string(),
        offset: r.offset,
        size: r.size,
        tier: tier_number(r.tier),
        put_id: r.put_id,
        seal: r.seal.wire_bytes().to_vec(),
    }
}
