//! The numeric result codes users branch on. The values are Mooncake's: connectors compare against
//! them, so they are part of the public contract and never renumbered.

use std::fmt;

/// A Mooncake-compatible result code. `Ok` is 0, every error is negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    Ok = 0,
    InternalError = -1,
    SegmentNotFound = -101,
    /// No space: every candidate segment is full even after eviction.
    NoAvailableHandle = -200,
    /// Bad argument, including "destination buffer too small".
    InvalidParams = -600,
    ReplicaIsNotReady = -703,
    ObjectNotFound = -704,
    ObjectAlreadyExists = -705,
    ObjectHasLease = -706,
    LeaseExpired = -707,
    TransferFail = -800,
    ChecksumMismatch = -801,
    RpcFail = -900,
    RpcTimeout = -901,
    /// The master cannot answer this yet: it is rebuilding its catalog from the owners' reports
    /// (just restarted or just elected), or it is not the leader. Retry shortly.
    UnavailableInCurrentStatus = -1010,
    /// The peer did not prove it holds the cluster's (or its tenant's) secret: configure
    /// `auth_token_file` with the right token. Not a Mooncake code (Mooncake has no auth).
    Unauthenticated = -1500,
    /// Authenticated, but the access is not covered by what the master granted (a forged,
    /// expired or widened grant, or another tenant's key). Not a Mooncake code.
    PermissionDenied = -1501,
}

impl Code {
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::InternalError,
        Code::SegmentNotFound,
        Code::NoAvailableHandle,
        Code::InvalidParams,
        Code::ReplicaIsNotReady,
        Code::ObjectNotFound,
        Code::ObjectAlreadyExists,
        Code::ObjectHasLease,
        Code::LeaseExpired,
        Code::TransferFail,
        Code::ChecksumMismatch,
        Code::RpcFail,
        Code::RpcTimeout,
        Code::UnavailableInCurrentStatus,
        Code::Unauthenticated,
        Code::PermissionDenied,
    ];

    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// Decodes a code received from a peer. A value this build does not know is reported as an
    /// internal error rather than silently treated as success.
    pub fn from_i32(value: i32) -> Code {
        Code::ALL
            .into_iter()
            .find(|c| c.as_i32() == value)
            .unwrap_or(Code::InternalError)
    }

    pub fn is_ok(self) -> bool {
        self == Code::Ok
    }

    /// Mooncake's name of the code, as it appears in its logs.
    pub fn name(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::InternalError => "INTERNAL_ERROR",
            Code::SegmentNotFound => "SEGMENT_NOT_FOUND",
            Code::NoAvailableHandle => "NO_AVAILABLE_HANDLE",
            Code::InvalidParams => "INVALID_PARAMS",
            Code::ReplicaIsNotReady => "REPLICA_IS_NOT_READY",
            Code::ObjectNotFound => "OBJECT_NOT_FOUND",
            Code::ObjectAlreadyExists => "OBJECT_ALREADY_EXISTS",
            Code::ObjectHasLease => "OBJECT_HAS_LEASE",
            Code::LeaseExpired => "LEASE_EXPIRED",
            Code::TransferFail => "TRANSFER_FAIL",
            Code::ChecksumMismatch => "CHECKSUM_MISMATCH",
            Code::RpcFail => "RPC_FAIL",
            Code::RpcTimeout => "RPC_TIMEOUT",
            Code::UnavailableInCurrentStatus => "UNAVAILABLE_IN_CURRENT_STATUS",
            Code::Unauthenticated => "UNAUTHENTICATED",
            Code::PermissionDenied => "PERMISSION_DENIED",
        }
    }

    /// Whether the same call may succeed if simply tried again later (pressure, a lease that will
    /// lapse, a transient network failure), as opposed to a caller mistake or a definite answer.
    pub fn is_retryable(self) -> bool {
        match self {
            Code::NoAvailableHandle
            | Code::ReplicaIsNotReady
            | Code::ObjectHasLease
            | Code::LeaseExpired
            | Code::TransferFail
            | Code::RpcFail
            | Code::RpcTimeout
            | Code::UnavailableInCurrentStatus => true,
            Code::Ok
            | Code::InternalError
            | Code::SegmentNotFound
            | Code::InvalidParams
            | Code::ObjectNotFound
            | Code::ObjectAlreadyExists
            | Code::ChecksumMismatch
            | Code::Unauthenticated
            | Code::PermissionDenied => false,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_i32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_mooncake() {
        assert_eq!(Code::NoAvailableHandle.as_i32(), -200);
        assert_eq!(Code::InvalidParams.as_i32(), -600);
        assert_eq!(Code::ObjectNotFound.as_i32(), -704);
        assert_eq!(Code::ObjectAlreadyExists.as_i32(), -705);
        assert_eq!(Code::ObjectHasLease.as_i32(), -706);
        assert_eq!(Code::LeaseExpired.as_i32(), -707);
        assert_eq!(Code::ReplicaIsNotReady.as_i32(), -703);
        assert_eq!(Code::TransferFail.as_i32(), -800);
        assert_eq!(Code::ChecksumMismatch.as_i32(), -801);
        assert_eq!(Code::RpcFail.as_i32(), -900);
        assert_eq!(Code::RpcTimeout.as_i32(), -901);
        assert_eq!(Code::SegmentNotFound.as_i32(), -101);
        assert_eq!(Code::InternalError.as_i32(), -1);
    }

    #[test]
    fn round_trips_and_unknown_is_internal() {
        for c in Code::ALL {
            assert_eq!(Code::from_i32(c.as_i32()), c);
        }
        assert_eq!(Code::from_i32(-12345), Code::InternalError);
        assert_eq!(Code::from_i32(7), Code::InternalError);
        assert_eq!(Code::ObjectNotFound.to_string(), "OBJECT_NOT_FOUND (-704)");
    }
}
