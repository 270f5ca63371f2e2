//! The master's settings as data: serde with defaults, loaded from a TOML file, then overridden by
//! flags (in the binary), then validated.

use std::time::Duration;

use mooncake_common::config::duration;
use serde::{Deserialize, Serialize};

use crate::core::{AllocationStrategy, EvictionPolicy, LeaseMode, Policy, WhenDiskBehind};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MasterConfig {
    /// Address both listeners bind to.
    pub bind_address: String,
    /// gRPC control plane (Mooncake: 50051). 0 picks a free port.
    pub rpc_port: u16,
    /// HTTP /metrics, /health, /get_all_segments (Mooncake: 9003). 0 picks a free port.
    pub metrics_port: u16,
    /// Read lease granted by a get or a hit of exists: with `lease_mode` "reads", the longest
    /// a reader that never says it is done keeps the object.
    #[serde(with = "duration")]
    pub default_kv_lease_ttl: Duration,
    /// What ends a read lease: "reads" (its readers being done; eviction skips only objects
    /// being read) or "ttl" (the TTL alone, as Mooncake).
    pub lease_mode: LeaseMode,
    /// How long a soft pin protects an object from eviction.
    #[serde(with = "duration")]
    pub soft_pin_ttl: Duration,
    /// Eviction starts when allocated / capacity exceeds this.
    pub eviction_high_watermark_ratio: f64,
    /// Fraction of total capacity freed by one eviction round, at least.
    pub eviction_ratio: f64,
    /// Which objects eviction takes first: "car" (adaptive between recency and frequency;
    /// blocks used once do not flush shared ones) or "lru" (least recently used, as Mooncake).
    pub eviction_policy: EvictionPolicy,
    /// An owner not heard from for this long is dropped with its segments.
    #[serde(with = "duration")]
    pub client_ttl: Duration,
    /// An unfinished put older than this may be taken over by a new put of the same key.
    #[serde(with = "duration")]
    pub put_start_discard_timeout: Duration,
    /// An unfinished put's space is reclaimed after this.
    #[serde(with = "duration")]
    pub put_start_release_timeout: Duration,
    pub allocation_strategy: AllocationStrategy,
    /// Period of the upkeep loop (owner expiry, abandoned puts, watermark eviction).
    #[serde(with = "duration")]
    pub upkeep_interval: Duration,
    /// Offload objects to their owner's SSD tier when their put ends, not only on eviction.
    pub eager_offload: bool,
    /// Offloads queued or in flight per SSD tier, at most; beyond it the SSD counts as behind.
    pub offload_queue_limit: usize,
    /// Eviction of an object whose owner's SSD is behind: "keep" it in memory or "drop" it.
    pub when_disk_behind: WhenDiskBehind,
    /// An offload not reported within this is given up.
    #[serde(with = "duration")]
    pub offload_timeout: Duration,
    /// Reads from disk after which an object is copied back to memory; 0: never.
    pub promote_after_hits: u32,
    /// Once an owner of an earlier master remounts (a restart), how long a get of an unknown key
    /// answers UNAVAILABLE_IN_CURRENT_STATUS (retryable) so the other owners can remount and
    /// report what they hold; longer while reports are coming in. 0 s: never.
    #[serde(with = "duration")]
    pub rebuild_grace: Duration,
    /// The longest that answer may go on while owners are still reporting.
    #[serde(with = "duration")]
    pub rebuild_window: Duration,
    /// Campaign for leadership in etcd; standbys take over when the leader's lease lapses.
    pub enable_ha: bool,
    /// etcd endpoints, "host:port;host:port" (Mooncake's `--etcd_endpoints`).
    pub etcd_endpoints: String,
    /// Names the cluster in etcd: masters, owners and clients of one cluster share it.
    pub cluster_id: String,
    /// The leader's etcd lease: a dead or cut-off leader is replaced within about this long.
    #[serde(with = "duration")]
    pub ha_lease_ttl: Duration,
    /// The address published for clients and owners when this master leads; empty: the bind
    /// address and RPC port (which must then be concrete).
    pub advertise_address: String,
    /// A file holding the cluster's secret: with it, every connection to the RPC port must
    /// prove it holds the same secret (owners and clients read the same file). Unset: the
    /// master runs open, and says so once in its log.
    pub auth_token_file: Option<std::path::PathBuf>,
    /// Tenants: quotas, and which tenants' own token files the master admits (`[[tenants]]`).
    pub tenants: Vec<TenantConfig>,
    /// TLS on the RPC port: the master's certificate chain (PEM). With it, every RPC
    /// connection (framed and gRPC) must speak TLS.
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of `tls_cert` (PEM).
    pub tls_key: Option<std::path::PathBuf>,
    /// With TLS, a CA (PEM) that every peer's client certificate must chain to; unset: peers
    /// show none (they still prove the token where the master has one).
    pub tls_ca: Option<std::path::PathBuf>,
}

/// One tenant of the master's config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's name (what clients give as `tenant_id`; "default" for clients without one).
    pub name: String,
    /// The most bytes of values the tenant may store (each object once); unset: no quota.
    #[serde(default)]
    pub quota: Option<mooncake_common::ByteSize>,
    /// The tenant's token file (`--print_tenant_token` makes it). With it, workers holding only
    /// this token act as this tenant and no other; without it, only holders of the cluster's
    /// secret act as the tenant. Needs `auth_token_file`.
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
}

impl Default for MasterConfig {
    fn default() -> Self {
        let p = Policy::default();
        MasterConfig {
            bind_address: "0.0.0.0".into(),
            rpc_port: 50051,
            metrics_port: 9003,
            default_kv_lease_ttl: p.lease_ttl,
            lease_mode: p.lease_mode,
            soft_pin_ttl: p.soft_pin_ttl,
            eviction_high_watermark_ratio: p.eviction_high_watermark,
            eviction_ratio: p.eviction_ratio,
            eviction_policy: p.eviction_policy,
            client_ttl: p.client_ttl,
            put_start_discard_timeout: p.put_discard_timeout,
            put_start_release_timeout: p.put_release_timeout,
            allocation_strategy: p.strategy,
            upkeep_interval: Duration::from_millis(100),
            eager_offload: p.eager_offload,
            offload_queue_limit: p.offload_queue_limit,
            when_disk_behind: p.when_disk_behind,
            offload_timeout: p.offload_timeout,
            promote_after_hits: p.promote_after_hits,
            rebuild_grace: p.rebuild_grace,
            rebuild_window: p.rebuild_window,
            enable_ha: false,
            etcd_endpoints: String::new(),
            cluster_id: mooncake_common::leader::DEFAULT_CLUSTER_ID.into(),
            ha_lease_ttl: Duration::from_secs(5),
            advertise_address: String::new(),
            auth_token_file: None,
            tenants: Vec::new(),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

/// The longest any of the master's durations may be.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

impl MasterConfig {
    pub fn validate(&self) -> Result<(), String> {
        let ratio_ok = |v: f64| v > 0.0 && v <= 1.0;
        if !ratio_ok(self.eviction_high_watermark_ratio) {
            return Err(format!(
                "eviction_high_watermark_ratio must be in (0, 1], got {}",
                self.eviction_high_watermark_ratio
            ));
        }
        if !ratio_ok(self.eviction_ratio) {
            return Err(format!(
                "eviction_ratio must be in (0, 1], got {}",
                self.eviction_ratio
            ));
        }
        // (name, value, whether zero is allowed)
        for (name, d, zero_ok) in [
            ("default_kv_lease_ttl", self.default_kv_lease_ttl, false),
            ("client_ttl", self.client_ttl, false),
            (
                "put_start_discard_timeout",
                self.put_start_discard_timeout,
                false,
            ),
            (
                "put_start_release_timeout",
                self.put_start_release_timeout,
                false,
            ),
            ("upkeep_interval", self.upkeep_interval, false),
            ("offload_timeout", self.offload_timeout, false),
            ("rebuild_grace", self.rebuild_grace, true),
            ("rebuild_window", self.rebuild_window, true),
            ("ha_lease_ttl", self.ha_lease_ttl, true),
        ] {
            if d.is_zero() && !zero_ok {
                return Err(format!("{name} must be greater than zero"));
            }
            // Far beyond any use, and far from overflowing the instants computed from it.
            if d > MAX_DURATION {
                return Err(format!(
                    "{name} {d:?} is above the limit of {MAX_DURATION:?} (a year)"
                ));
            }
        }
        if self.rebuild_window < self.rebuild_grace {
            return Err(format!(
                "rebuild_window ({:?}) must not be shorter than rebuild_grace ({:?}): the window bounds how long a new master waits for the owners it expects",
                self.rebuild_window, self.rebuild_grace
            ));
        }
        if self.put_start_release_timeout < self.put_start_discard_timeout {
            return Err(format!(
                "put_start_release_timeout ({:?}) must not be shorter than put_start_discard_timeout ({:?})",
                self.put_start_release_timeout, self.put_start_discard_timeout
            ));
        }
        if self.offload_queue_limit == 0 {
            return Err("offload_queue_limit must be at least 1".into());
        }
        if self.enable_ha {
            self.ha()?;
        }
        let mut names = std::collections::HashSet::new();
        for t in &self.tenants {
            let tenant = mooncake_common::tenant::Tenant::parse(&t.name)
                .map_err(|e| format!("tenants: {e}"))?;
            if !names.insert(tenant.clone()) {
                return Err(format!("tenants: {} is listed twice", tenant.label()));
            }
            if t.token_file.is_some() && self.auth_token_file.is_none() {
                return Err(format!(
                    "tenant {}: a token_file needs the cluster's auth_token_file",
                    tenant.label()
                ));
            }
            if t.token_file.is_some() && tenant.is_default() {
                return Err(
                    "the default tenant's workers use the cluster's token; it takes no token_file"
                        .into(),
                );
            }
        }
        if self.rpc_port != 0 && self.rpc_port == self.metrics_port {
            return Err(format!(
                "rpc_port and metrics_port are both {}",
                self.rpc_port
            ));
        }
        Ok(())
    }

    /// The RPC port's TLS acceptor, if TLS is configured.
    pub fn tls(&self) -> Result<Option<mooncake_common::tls::TlsAcceptor>, String> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                mooncake_common::tls::acceptor(cert, key, self.tls_ca.as_deref()).map(Some)
            }
            (None, None) if self.tls_ca.is_none() => Ok(None),
            _ => Err("TLS needs both tls_cert and tls_key (tls_ca only with them)".into()),
        }
    }

    /// The HA settings, checked: endpoints that parse, a whole-second lease of at least 2 s, and
    /// an address others can reach.
    pub fn ha(&self) -> Result<crate::ha::HaConfig, String> {
        let endpoints = mooncake_common::leader::parse_endpoints(&self.etcd_endpoints)
            .map_err(|e| format!("etcd_endpoints: {e}"))?;
        if self.cluster_id.is_empty() || self.cluster_id.contains('/') {
            return Err(format!(
                "cluster_id {:?} must be non-empty and contain no '/'",
                self.cluster_id
            ));
        }
        if self.ha_lease_ttl < Duration::from_secs(2) || self.ha_lease_ttl.subsec_nanos() != 0 {
            return Err(format!(
                "ha_lease_ttl {:?} must be whole seconds, at least 2",
                self.ha_lease_ttl
            ));
        }
        if !self.advertise_address.is_empty() {
            check_advertised(&self.advertise_address, self.rpc_port)?;
        }
        let advertise = if self.advertise_address.is_empty() {
            let unspecified = self
                .bind_address
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified());
            if unspecified || self.rpc_port == 0 {
                return Err("with enable_ha, set advertise_address (or bind to a concrete address and rpc_port): it is what clients and owners are sent to".into());
            }
            format!("{}:{}", self.bind_address, self.rpc_port)
        } else {
            self.advertise_address.clone()
        };
        Ok(crate::ha::HaConfig {
            endpoints,
            cluster_id: self.cluster_id.clone(),
            lease_ttl: self.ha_lease_ttl,
            advertise,
        })
    }

    pub fn policy(&self) -> Policy {
        Policy {
            lease_ttl: self.default_kv_lease_ttl,
            lease_mode: self.lease_mode,
            soft_pin_ttl: self.soft_pin_ttl,
            eviction_high_watermark: self.eviction_high_watermark_ratio,
            eviction_ratio: self.eviction_ratio,
            eviction_policy: self.eviction_policy,
            client_ttl: self.client_ttl,
            put_discard_timeout: self.put_start_discard_timeout,
            put_release_timeout: self.put_start_release_timeout,
            strategy: self.allocation_strategy,
            eager_offload: self.eager_offload,
            offload_queue_limit: self.offload_queue_limit,
            when_disk_behind: self.when_disk_behind,
            offload_timeout: self.offload_timeout,
            promote_after_hits: self.promote_after_hits,
            rebuild_grace: self.rebuild_grace,
            rebuild_window: self.rebuild_window,
            quotas: self
                .tenants
                .iter()
                .filter_map(|t| {
                    let name = mooncake_common::tenant::Tenant::parse(&t.name).ok()?;
                    Some((name.name().to_string(), t.quota?.bytes()))
                })
                .collect(),
        }
    }
}

/// An advertised address others can reach: HOST:PORT with a port, not the unspecified address,
/// and a fixed RPC port behind it (a port picked at random would differ at every start).
fn check_advertised(address: &str, rpc_port: u16) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "advertise_address {address:?} {why}: it is what clients and owners are sent to"
        ))
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return bad("has no port (HOST:PORT)");
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return bad("is not HOST:PORT with a port above 0");
    }
    if host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return bad("is the unspecified address, which nobody can reach");
    }
    if rpc_port == 0 {
        return bad(
            "names a port, but rpc_port is 0 (a different free port at every start); set rpc_port",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        MasterConfig::default().validate().unwrap();
        let c = MasterConfig {
            eviction_ratio: 0.0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("eviction_ratio"));
        let c = MasterConfig {
            put_start_release_timeout: Duration::from_secs(1),
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .contains("put_start_release_timeout"));
    }

    /// A window shorter than the grace (the expected owners were not waited for, and unknown
    /// keys answered "not found" during the rebuild), and durations that overflow the instants
    /// computed from them (the upkeep panicked), are refused by name.
    #[test]
    fn rebuild_window_and_huge_durations_are_checked() {
        let c = MasterConfig {
            rebuild_window: Duration::ZERO,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("rebuild_window"));
        let huge = Duration::from_secs(u64::MAX);
        let c = MasterConfig {
            put_start_discard_timeout: huge,
            put_start_release_timeout: huge,
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .contains("put_start_discard_timeout"));
    }

    /// With HA, the advertised address must be one others can reach, at a fixed port.
    #[test]
    fn the_advertised_address_is_checked() {
        let ha = |advertise: &str, rpc_port: u16| MasterConfig {
            enable_ha: true,
            etcd_endpoints: "127.0.0.1:2379".into(),
            advertise_address: advertise.into(),
            rpc_port,
            ..Default::default()
        };
        ha("10.0.0.7:50051", 50051).validate().unwrap();
        for (bad, port) in [
            ("10.0.0.7", 50051),
            ("0.0.0.0:50051", 50051),
            ("10.0.0.7:0", 50051),
            ("10.0.0.7:50051", 0),
        ] {
            let e = ha(bad, port).validate().unwrap_err();
            assert!(e.contains("advertise_address"), "{bad} {port}: {e}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let e = mooncake_common::config::parse_toml::<MasterConfig>("rpc_prot = 1").unwrap_err();
        assert!(e.contains("rpc_prot"), "{e}");
    }
}
