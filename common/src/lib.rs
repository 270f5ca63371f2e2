//! Vocabulary shared by every role: validated ids, the Mooncake-compatible numeric codes, config
//! primitives (human sizes and durations), and the data plane's wire format and transport trait.
//! Nothing here performs I/O on its own (except `leader`, which reads the elected master's address
//! from etcd for clients and owners alike, and `auth`, which runs the connection handshake on a
//! stream it is given) or knows about a particular role.
// `unsafe` only in `memcopy` (streaming stores); nowhere else. I/O only in `leader` (one etcd read)
// and `auth` (the handshake on a stream it is given, and reading a secret file).
#![deny(unsafe_code)]

pub mod auth;
pub mod body;
pub mod code;
pub mod config;
pub mod data_socket;
pub mod disk_stats;
pub mod host_memory;
pub mod ids;
pub mod leader;
pub mod local;
pub mod master_api;
pub mod memcopy;
pub mod replica;
pub mod size;
pub mod stamp;
pub mod tenant;
pub mod tls;
pub mod transport;
pub mod wire;

pub use code::Code;
pub use disk_stats::DiskStats;
pub use ids::{ClientId, IdError, ObjectKey, SegmentName};
pub use master_api::{
    ApiError, MasterApi, ReplicaTaskSpec, ReplicaTaskState, ReplicaTaskStatus, ReplicaTaskType,
};
pub use replica::{ReplicaLocation, ReplicateConfig, Tier};
pub use size::ByteSize;
pub use stamp::Stamp;
