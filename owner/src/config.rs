//! The owner's settings as data: serde with defaults, a TOML file, then the environment
//! (`with_env`), then flags, then `validate`.

use std::{path::PathBuf, time::Duration};

use mooncake_common::{config::duration, ByteSize};

use crate::ssd::EngineKind;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OwnerConfig {
    /// The master: "host:port", or "etcd://host:port;host:port" to follow the cluster's elected
    /// master through etcd.
    pub master: String,
    /// The cluster's name in etcd, with an `etcd://` master (`MC_STORE_CLUSTER_ID`).
    pub cluster_id: String,
    /// Address the data plane binds to and that clients connect to; it names the segment.
    pub host: String,
    /// Data-plane port; 0 picks a free one.
    pub port: u16,
    /// Memory contributed to the store.
    pub segment_size: ByteSize,
    /// Lock the pool in memory (warns and goes on when not permitted).
    pub lock_memory: bool,
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    /// Deadline of each call to the master.
    #[serde(with = "duration")]
    pub rpc_timeout: Duration,
    /// How long start-up keeps trying to mount before giving up with an error.
    #[serde(with = "duration")]
    pub mount_timeout: Duration,
    /// A peer that starts a frame must finish sending it within this.
    #[serde(with = "duration")]
    pub frame_timeout: Duration,
    /// Written (atomically) with the segment name once the owner serves: a readiness signal.
    pub ready_file: Option<PathBuf>,
    /// Offer the pool to clients on this host over a Unix-domain socket (memfd passing).
    pub shared_memory: bool,
    /// Directory of that socket (`MOONCAKE_SOCKET_DIR`); clients must use the same.
    pub socket_dir: PathBuf,
    /// Directory of the SSD tier (on a file system with O_DIRECT); none: memory only. An owner
    /// restarted on the same directory serves the objects it finds there again.
    pub ssd_path: Option<PathBuf>,
    /// Bytes of the SSD tier, preallocated in one file.
    pub ssd_size: ByteSize,
    /// How the SSD tier submits I/O: "auto" (io_uring, else pread), "uring" or "pread".
    pub ssd_engine: EngineKind,
    /// I/O operations in flight on the SSD at most (the io_uring queue depth).
    pub ssd_queue_depth: u32,
    /// Offloads and promotions worked on at once.
    pub ssd_concurrency: usize,
    /// Bytes of disk reads buffered at once for clients; more wait their turn.
    pub ssd_read_budget: ByteSize,
    /// A file holding the cluster's secret: the data port and the same-host socket refuse peers
    /// that do not prove it, and the owner proves it to the master and to other owners. Unset:
    /// open, as the master must then be too.
    pub auth_token_file: Option<PathBuf>,
    /// Hand the same-host path (which maps the whole pool) to workers holding a tenant's token
    /// too; by default they are refused it and use TCP, where every byte moves under a seal.
    pub tenants_share_memory: bool,
    /// TLS to the master (whose RPC port runs TLS): the CA its certificate chains to (PEM).
    pub tls_ca: Option<PathBuf>,
    /// This owner's client certificate (PEM), for a master that checks clients; with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

impl Default for OwnerConfig {
    fn default() -> Self {
        OwnerConfig {
            master: "127.0.0.1:50051".into(),
            cluster_id: mooncake_common::leader::DEFAULT_CLUSTER_ID.into(),
            host: "127.0.0.1".into(),
            port: 0,
            segment_size: ByteSize::gib(4),
            lock_memory: true,
            heartbeat_interval: Duration::from_secs(1),
            rpc_timeout: Duration::from_secs(3),
            mount_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(30),
            ready_file: None,
            shared_memory: true,
            socket_dir: PathBuf::from(mooncake_common::local::DEFAULT_SOCKET_DIR),
            ssd_path: None,
            ssd_size: ByteSize::gib(16),
            ssd_engine: EngineKind::Auto,
            ssd_queue_depth: 64,
            ssd_concurrency: 32,
            ssd_read_budget: ByteSize::mib(256),
            auth_token_file: None,
            tenants_share_memory: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }
}

impl OwnerConfig {
    /// The environment applied over this config, `env` answering a variable's value: the one
    /// place the owner reads it (`MOONCAKE_SOCKET_DIR`, `MC_STORE_CLUSTER_ID` and
    /// `MOONCAKE_AUTH_TOKEN_FILE`, which clients read too). Binaries apply it between the config
    /// file and their flags.
    pub fn with_env(mut self, env: impl Fn(&str) -> Option<String>) -> Self {
        // Set but empty is unset (an empty directory would be the working directory), as
        // clients read it.
        if let Some(dir) =
            env(mooncake_common::local::SOCKET_DIR_ENV).filter(|v| !v.trim().is_empty())
        {
            self.socket_dir = PathBuf::from(dir);
        }
        // Set but empty is unset (`export MC_STORE_CLUSTER_ID=${CLUSTER:-}`), as clients read it.
        if let Some(id) = env("MC_STORE_CLUSTER_ID").filter(|v| !v.trim().is_empty()) {
            self.cluster_id = id.trim().to_string();
        }
        if let Some(file) = env("MOONCAKE_AUTH_TOKEN_FILE").filter(|f| !f.trim().is_empty()) {
            self.auth_token_file = Some(PathBuf::from(file.trim()));
        }
        self
    }

    /// TLS to the master, if configured.
    pub fn master_tls(&self) -> Result<Option<mooncake_common::tls::TlsClient>, String> {
        mooncake_common::tls::TlsClient::from_files(
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
        )
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.segment_size.bytes() < 4096 {
            return Err(format!(
                "segment_size must be at least 4KiB, got {}",
                self.segment_size
            ));
        }
        mooncake_common::leader::MasterAddress::parse(&self.master)?;
        if let Ok(ip) = self.host.parse::<std::net::IpAddr>() {
            if ip.is_unspecified() {
                return Err(format!(
                    "host {} is not an address clients can connect to: pass the node's address",
                    self.host
                ));
            }
        }
        if self.ssd_path.is_some() {
            if self.ssd_size.bytes() < (1 << 20) {
                return Err(format!(
                    "ssd_size must be at least 1MiB, got {}",
                    self.ssd_size
                ));
            }
            if self.ssd_queue_depth == 0 || self.ssd_concurrency == 0 {
                return Err("ssd_queue_depth and ssd_concurrency must be at least 1".into());
            }
        }
        for (name, d) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("rpc_timeout", self.rpc_timeout),
            ("mount_timeout", self.mount_timeout),
            ("frame_timeout", self.frame_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be greater than zero"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster id set but empty is unset: an empty one names no cluster, and the owner would
    /// look for a leader that never comes.
    #[test]
    fn an_empty_cluster_id_in_the_environment_is_unset() {
        let default = OwnerConfig::default().cluster_id;
        let c = OwnerConfig::default().with_env(|n| (n == "MC_STORE_CLUSTER_ID").then(String::new));
        assert_eq!(c.cluster_id, default);
        let c = OwnerConfig::default()
            .with_env(|n| (n == "MC_STORE_CLUSTER_ID").then(|| "prod".to_string()));
        assert_eq!(c.cluster_id, "prod");
    }
}
