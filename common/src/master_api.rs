//! What a client asks of the master, in domain types: the `MasterApi` trait and its answers. The
//! framed and gRPC implementations live in the client (they are wire adapters); the in-process
//! one lives in the master (it calls the service directly). The trait sits here, below both
//! roles, because roles never import each other. Every implementation passes the same
//! conformance suite (`tests/tests/master_conformance.rs`).

use std::{future::Future, ops::Range, pin::Pin, time::Duration};

use crate::{replica::ReplicaLocation, Code, ReplicateConfig, SegmentName};

/// A failed call, or a key the master refused: the code callers branch on and a text for people.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: Code,
    pub message: String,
}

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// The master could not be reached or answered something unreadable.
    pub fn rpc(message: impl Into<String>) -> Self {
        ApiError::new(Code::RpcFail, message)
    }
}

/// A master call in flight.
pub type Call<'a, T> = Pin<Box<dyn Future<Output = Result<T, ApiError>> + Send + 'a>>;

/// The master's client-facing API. Every batch method answers one result per input item, in
/// order; the outer `Result` is the call itself (unreachable master, deadline, malformed batch).
pub trait MasterApi: Send + Sync {
    /// Starts puts of (key, size): space on `config.replica_num` segments each, or why not
    /// (OBJECT_ALREADY_EXISTS for a committed key or another writer's put in flight). `token`
    /// (random; 0: none) names the start for `abandon_put_start`.
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants>;

    /// Gives up the start tagged `token`, whose answer never came (its deadline passed, its
    /// connection broke): whatever it granted is revoked, and should it reach the master later
    /// it grants nothing. How many puts were revoked.
    fn abandon_put_start(&self, token: u64) -> Call<'_, u32>;

    /// Commits the puts named by (key, put id) once every replica is written.
    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>>;

    /// Gives up the puts named by (key, put id): their space is freed, the keys stay absent.
    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>>;

    /// Where each key's replicas are; every hit is leased for `Lookup::lease_ttl`. The holds in
    /// `release` are handed back first, in the same call (see `release_leases`).
    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup>;

    /// Whether each key exists (hits are leased for `Existence::lease_ttl`, like a lookup's);
    /// `release` as in `get_replicas`.
    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence>;

    /// Removes each key; leased ones only with `force`.
    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>>;

    /// Removes every object (leased ones only with `force`); answers how many.
    /// With `key_regex`, only the keys it matches anywhere (ECMAScript-style syntax, look-around
    /// and back-references included, as Mooncake's `std::regex` search); a pattern
    /// that does not compile answers INVALID_PARAMS.
    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64>;

    /// The mounted segments and their usage.
    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>>;

    /// This reader is done with the holds in `release` (a key once per hold its lookups and
    /// existence checks took): with the master's lease mode "reads", a lease whose last hold
    /// goes ends at once.
    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()>;

    /// Starts a copy of `key` to more segments, or a move of its replica to another one;
    /// answers the task's id. Refusals (no such object, unknown segment, no room) are errors
    /// with Mooncake's codes.
    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64>;

    /// A replica task's state; OBJECT_NOT_FOUND for an unknown (or long finished) task.
    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState>;

    /// Drops each key's memory replica on `segment` (the object goes when nothing else holds
    /// it), or whole objects without a segment; leased objects are refused (OBJECT_HAS_LEASE).
    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>>;
}

/// What a replica task does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaTaskSpec<'a> {
    /// Add a memory replica on each target segment.
    Copy { targets: &'a [&'a str] },
    /// Add one on `target`, then drop the one on `source`.
    Move { source: &'a str, target: &'a str },
}

/// Mooncake's task types and states, with its numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaTaskType {
    Copy = 0,
    Move = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaTaskStatus {
    Pending = 0,
    Processing = 1,
    Failed = 2,
    Success = 3,
}

/// A replica task as the master last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaTaskState {
    pub id: u64,
    pub kind: ReplicaTaskType,
    pub status: ReplicaTaskStatus,
    /// Wall-clock milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// The segments whose owners do the copies.
    pub assigned: Vec<String>,
    /// Why it failed, or what is left.
    pub detail: String,
}

impl ReplicaTaskStatus {
    pub fn from_i32(v: i32) -> Option<Self> {
        Some(match v {
            0 => Self::Pending,
            1 => Self::Processing,
            2 => Self::Failed,
            3 => Self::Success,
            _ => return None,
        })
    }

    pub fn is_finished(self) -> bool {
        matches!(self, Self::Failed | Self::Success)
    }
}

/// A mounted segment's capacity and allocated bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentUsage {
    pub name: SegmentName,
    pub capacity: u64,
    pub allocated: u64,
}

/// Per-key results that each own a run of replica locations, kept in one vector for the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runs<T, E> {
    pub results: Vec<Result<T, E>>,
    replicas: Vec<ReplicaLocation>,
}

impl<T, E> Runs<T, E> {
    pub fn with_capacity(keys: usize) -> Self {
        Runs {
            results: Vec::with_capacity(keys),
            replicas: Vec::with_capacity(keys),
        }
    }

    /// Appends a key's success built by `make` from the run of `replicas` it owns.
    pub fn push_ok(
        &mut self,
        replicas: impl IntoIterator<Item = ReplicaLocation>,
        make: impl FnOnce(Range<usize>) -> T,
    ) {
        let start = self.replicas.len();
        self.replicas.extend(replicas);
        self.results.push(Ok(make(start..self.replicas.len())));
    }

    /// `push_ok` from replicas that may fail to convert; on the first failure nothing is
    /// appended and that error is returned.
    pub fn try_push_ok<X>(
        &mut self,
        replicas: impl IntoIterator<Item = Result<ReplicaLocation, X>>,
        make: impl FnOnce(Range<usize>) -> T,
    ) -> Result<(), X> {
        let start = self.replicas.len();
        for r in replicas {
            match r {
                Ok(r) => self.replicas.push(r),
                Err(e) => {
                    self.replicas.truncate(start);
                    return Err(e);
                }
            }
        }
        self.results.push(Ok(make(start..self.replicas.len())));
        Ok(())
    }

    pub fn push_err(&mut self, e: E) {
        self.results.push(Err(e));
    }

    /// The replicas of the run `range` (a `Found`'s or a `Grant`'s).
    pub fn run(&self, range: &Range<usize>) -> &[ReplicaLocation] {
        self.replicas.get(range.clone()).unwrap_or(&[])
    }
}

/// A batch lookup's answer: per key its size and replicas, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    pub objects: Runs<Found, Code>,
    /// Every hit is leased for this long from the moment the master answered.
    pub lease_ttl: Duration,
    /// The answering master's epoch: the hits' holds go back with it (see `Releases`).
    pub epoch: u64,
}

/// An existence check's answer: per key whether it exists, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Existence {
    pub found: Vec<Result<bool, Code>>,
    /// Every hit is leased for this long from the moment the master answered.
    pub lease_ttl: Duration,
    /// The answering master's epoch: the hits' holds go back with it (see `Releases`).
    pub epoch: u64,
}

/// Read holds handed back (a key once per hold), all granted by the master of `epoch`. A master
/// counts a lease's holds without naming them, so a hold it never granted would end another
/// reader's: a master of another epoch (restarted, or a new leader) ignores them. Epoch 0 (not
/// known) is taken as the receiving master's.
///
/// A release that reaches the master after the lease it belongs to ran out would take a hold of
/// the next reader's lease: `send_by` is the last instant its request may go out (an adapter
/// leaves the keys out of a request written later, after a wait for a connection, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Releases<'a> {
    pub keys: &'a [&'a str],
    pub epoch: u64,
    /// None: no limit (the master's side, which decoded them from a request).
    pub send_by: Option<std::time::Instant>,
}

impl<'a> Releases<'a> {
    /// Nothing to hand back.
    pub const NONE: Releases<'static> = Releases {
        keys: &[],
        epoch: 0,
        send_by: None,
    };

    /// Holds of the master of `epoch` that a request may carry whenever it goes out.
    pub fn of(keys: &'a [&'a str], epoch: u64) -> Releases<'a> {
        Releases {
            keys,
            epoch,
            send_by: None,
        }
    }

    /// What a request going out now carries: these holds, or none once past `send_by`.
    pub fn now(self) -> Releases<'a> {
        match self.send_by {
            Some(t) if std::time::Instant::now() >= t => Releases::NONE,
            _ => self,
        }
    }
}

/// A key that was found: its size, and its replicas in `Lookup::replicas`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub size: u64,
    pub replicas: Range<usize>,
}

impl Lookup {
    pub fn replicas(&self, found: &Found) -> &[ReplicaLocation] {
        self.objects.run(&found.replicas)
    }

    pub fn results(&self) -> &[Result<Found, Code>] {
        &self.objects.results
    }
}

/// A batch put start's answer: per key a grant, or why not.
pub type Grants = Runs<Grant, ApiError>;

/// Space granted to a put: write every replica, then end (or revoke) the put with `put_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub put_id: u64,
    pub replicas: Range<usize>,
}
