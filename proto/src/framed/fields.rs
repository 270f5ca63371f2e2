//! Field numbers of `master.proto`'s messages that the hand-written codecs write and read. They
//! must match the `.proto` file; the codecs' property tests compare their bytes with prost's for
//! the generated types, so a drift fails there.

/// `BatchGetReplicasRequest`, `BatchExistsRequest`, `BatchRemoveRequest`: `repeated string keys`.
pub const KEYS: u32 = 1;

/// `BatchGetReplicasRequest`, `BatchExistsRequest`: `repeated string release`.
pub const RELEASE: u32 = 2;

/// `BatchGetReplicasRequest`, `BatchExistsRequest`: `uint64 release_epoch`.
pub const RELEASE_EPOCH: u32 = 3;

/// `BatchPutStartRequest`.
pub mod put_start_request {
    /// `repeated PutStartItem items`.
    pub const ITEMS: u32 = 1;
    /// `ReplicateConfig config`.
    pub const CONFIG: u32 = 2;
    /// `uint64 token`.
    pub const TOKEN: u32 = 3;
}

/// `BatchPutEndRequest`, `BatchPutRevokeRequest`: `repeated PutRef items`.
pub const PUT_REFS: u32 = 1;

/// `PutStartItem` and `PutRef`: a key and a number (the size, or the put id).
pub mod keyed {
    pub const KEY: u32 = 1;
    pub const NUMBER: u32 = 2;
}

/// `ReplicaLocation`.
pub mod replica_location {
    pub const SEGMENT: u32 = 1;
    pub const OFFSET: u32 = 2;
    pub const SIZE: u32 = 3;
    pub const TIER: u32 = 4;
    pub const PUT_ID: u32 = 5;
    pub const SEAL: u32 = 6;
}

/// `BatchGetReplicasResponse`.
pub mod get_replicas_response {
    /// `repeated GetReplicasResult results`.
    pub const RESULTS: u32 = 1;
    pub const LEASE_TTL_MS: u32 = 2;
    pub const EPOCH: u32 = 3;
}

/// `GetReplicasResult`.
pub mod get_replicas_result {
    pub const CODE: u32 = 1;
    pub const SIZE: u32 = 2;
    /// `repeated ReplicaLocation replicas`.
    pub const REPLICAS: u32 = 3;
}

/// `BatchPutStartResponse`.
pub mod put_start_response {
    /// `repeated PutStartResult results`.
    pub const RESULTS: u32 = 1;
}

/// `PutStartResult`.
pub mod put_start_result {
    pub const CODE: u32 = 1;
    pub const MESSAGE: u32 = 2;
    pub const PUT_ID: u32 = 3;
    /// `repeated ReplicaLocation replicas`.
    pub const REPLICAS: u32 = 4;
}
