//! The master's errors, and their one mapping to Mooncake-compatible codes.

use mooncake_common::{Code, IdError, ObjectKey, SegmentName};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MasterError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error(transparent)]
    BadId(#[from] IdError),
    #[error("object of {size} bytes is larger than the largest mounted segment ({largest} bytes): split it or mount larger segments")]
    TooLarge { size: u64, largest: u64 },
    #[error("no segment has {size} free bytes even after eviction: retry later or add owners")]
    NoSpace { size: u64 },
    #[error("no segment is mounted: start an owner (or wait for it to mount) and retry")]
    NoSegments,
    #[error("object {0} not found")]
    NotFound(ObjectKey),
    #[error("object {0} already exists")]
    Exists(ObjectKey),
    #[error("object {0} is being written by another put; retry after it ends")]
    PutInFlight(ObjectKey),
    #[error("object {0} is not readable yet (its put has not ended)")]
    NotReady(ObjectKey),
    #[error("object {0} is leased by a reader; retry after the lease ends or remove with force")]
    HasLease(ObjectKey),
    #[error("put {put_id} of {key} is no longer current (discarded after its timeout, removed, or its owners died)")]
    StalePut { key: ObjectKey, put_id: u64 },
    #[error("segment {0} is not mounted")]
    SegmentNotFound(SegmentName),
    #[error("segment {segment} is mounted by another owner")]
    NotSegmentOwner { segment: SegmentName },
    #[error("object {0} is not known yet: the master is rebuilding its catalog from the owners' reports; retry shortly")]
    Rebuilding(ObjectKey),
    #[error("put {put_id} of {key} was started under an earlier master (it restarted or the leader changed): put again; it succeeds, or finds the object the owners reported already stored")]
    EarlierMaster { key: ObjectKey, put_id: u64 },
    #[error("this master's reserved put ids are used up until its next reservation reaches etcd; retry shortly")]
    GrantsExhausted,
    #[error("{0}")]
    Busy(String),
    #[error("tenant {tenant}'s quota of {quota} bytes is full ({used} bytes stored; this put needs {size} more): remove some of its objects or raise its quota")]
    QuotaFull {
        tenant: String,
        quota: u64,
        used: u64,
        size: u64,
    },
    #[error("permission denied: {0}")]
    Denied(String),
}

impl MasterError {
    pub fn code(&self) -> Code {
        match self {
            MasterError::Invalid(_) | MasterError::BadId(_) | MasterError::TooLarge { .. } => {
                Code::InvalidParams
            }
            MasterError::NoSpace { .. }
            | MasterError::NoSegments
            | MasterError::QuotaFull { .. } => Code::NoAvailableHandle,
            MasterError::Denied(_) => Code::PermissionDenied,
            MasterError::NotFound(_) | MasterError::StalePut { .. } => Code::ObjectNotFound,
            MasterError::Exists(_) | MasterError::PutInFlight(_) => Code::ObjectAlreadyExists,
            MasterError::NotReady(_) => Code::ReplicaIsNotReady,
            MasterError::HasLease(_) => Code::ObjectHasLease,
            MasterError::SegmentNotFound(_) | MasterError::NotSegmentOwner { .. } => {
                Code::SegmentNotFound
            }
            MasterError::Rebuilding(_)
            | MasterError::GrantsExhausted
            | MasterError::Busy(_)
            | MasterError::EarlierMaster { .. } => Code::UnavailableInCurrentStatus,
        }
    }
}
