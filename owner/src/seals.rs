//! The owner's check of the master's seals (see `mooncake_common::auth::seal`): in a cluster
//! with a secret, every write must carry the master's seal on its grant and every read the seal
//! on its lease, for exactly this owner, key, range and version, before a byte moves.

use mooncake_common::{
    auth::{wall_clock_us, Access, Scope, Seal, SealKey},
    Code, ObjectKey, SegmentName,
};

/// How far this owner's clock may run ahead of the master's before fresh seals look lapsed.
pub const CLOCK_SKEW_US: u64 = 1_000_000;

pub struct Seals {
    key: SealKey,
    segment: SegmentName,
}

/// An access the seal does not allow: the code and what to tell the peer.
pub struct Denied(pub Code, pub String);

impl Seals {
    pub fn new(key: SealKey, segment: SegmentName) -> Seals {
        Seals { key, segment }
    }

    /// The time seals are checked against: now, less the allowance for clock skew. Read once
    /// per batch of requests (a few milliseconds stale at most).
    pub fn now() -> u64 {
        wall_clock_us().saturating_sub(CLOCK_SKEW_US)
    }

    /// Whether `seal` allows `access` to `length` bytes at `offset` of version `put_id` of `key`
    /// on this owner at `now` (see `Seals::now`). Refusals are logged (the peer sees only the
    /// reason).
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &self,
        access: Access,
        key: &ObjectKey,
        offset: u64,
        length: u64,
        put_id: u64,
        seal: &Seal,
        now: u64,
    ) -> Result<(), Denied> {
        let scope = Scope {
            access,
            tenant: mooncake_common::tenant::tenant_of(key.as_str()),
            key: key.as_str(),
            segment: self.segment.as_str(),
            offset,
            length,
            put_id,
        };
        self.key.check(&scope, seal, now).map_err(|e| {
            tracing::warn!(%key, offset, length, put_id, ?access, reason = %e, "refused an access the master did not seal");
            Denied(Code::PermissionDenied, format!("{access:?} of {key} refused: {e}"))
        })
    }
}

/// What a connection to an owner of a cluster with a secret passes: the keyring it proves its
/// identity to, and the seals every access must carry.
pub struct Gate {
    pub keyring: mooncake_common::auth::Keyring,
    pub seals: Seals,
}
