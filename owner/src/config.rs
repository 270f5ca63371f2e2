//! The owner's settings as data: serde with defaults, a TOML file, then flags, then `validate`.

use std::{path::PathBuf, time::Duration};

use mooncake_common::{config::duration, ByteSize};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OwnerConfig {
    /// The master's gRPC address, "host:port".
    pub master: String,
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
    /// Directory of that socket; default: $MOONCAKE_SOCKET_DIR, else /tmp. Clients must agree.
    pub socket_dir: Option<PathBuf>,
}

impl Default for OwnerConfig {
    fn default() -> Self {
        OwnerConfig {
            master: "127.0.0.1:50051".into(),
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
            socket_dir: None,
        }
    }
}

impl OwnerConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.segment_size.bytes() < 4096 {
            return Err(format!(
                "segment_size must be at least 4KiB, got {}",
                self.segment_size
            ));
        }
        if self.master.is_empty() {
            return Err("master address is empty: pass --master HOST:PORT".into());
        }
        if let Ok(ip) = self.host.parse::<std::net::IpAddr>() {
            if ip.is_unspecified() {
                return Err(format!(
                    "host {} is not an address clients can connect to: pass the node's address",
                    self.host
                ));
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
