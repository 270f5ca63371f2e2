//! The client's settings as data, and the preferred-segment resolution connectors rely on:
//! explicit config first, then `MOONCAKE_PREFERRED_SEGMENT`, then none.

use std::time::Duration;

use mooncake_common::{config::duration, SegmentName};
use serde::{Deserialize, Serialize};

use crate::error::ClientError;

/// Environment variable a launcher (`scripts/mooncake_owner`) sets to the node-local owner.
pub const PREFERRED_SEGMENT_ENV: &str = "MOONCAKE_PREFERRED_SEGMENT";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// The master's gRPC address, "host:port".
    pub master: String,
    /// Segment tried first for puts and reads. `None`: take `MOONCAKE_PREFERRED_SEGMENT`.
    pub preferred_segment: Option<String>,
    /// Deadline of each master call.
    #[serde(with = "duration")]
    pub rpc_timeout: Duration,
    /// Deadline for connecting to an owner.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// Deadline of one object's transfer once a connection is in hand.
    #[serde(with = "duration")]
    pub transfer_timeout: Duration,
    /// Connections kept per owner; transfers beyond it queue.
    pub connections_per_owner: usize,
    /// Threads one large TCP batch to one owner may use, each driving one connection (a TCP
    /// receive or send copies every byte on the calling thread, so one thread caps a batch at
    /// one core's copy rate). Used for batches of at least 4 MiB per thread; 1: never.
    pub transfer_threads: usize,
    /// The runtime that polls this client's calls is a current-thread runtime that runs nothing
    /// else (as the Python binding's is), so a large batch may block it while transfer threads
    /// move the bytes. Leave it off when other tasks share such a runtime; multi-threaded
    /// runtimes need neither (their other tasks move to another thread meanwhile).
    pub dedicated_runtime: bool,
    /// Use the same-host shared-memory path to owners on this host that offer it
    /// (`MOONCAKE_SHM=0` in the environment turns it off too).
    pub shared_memory: bool,
    /// Directory of owners' sockets; default: $MOONCAKE_SOCKET_DIR, else /tmp.
    pub socket_dir: Option<std::path::PathBuf>,
    /// How to talk to the master: "framed" (default, lowest latency) or "grpc".
    pub master_protocol: crate::master::MasterProtocol,
    /// How long a framed master call polls for the answer before parking its thread (at most
    /// 1ms; 0: park at once). Answers usually come within tens of microseconds, and waking a
    /// parked thread on an idle core (on a VM, through the hypervisor) costs about as much again.
    /// The calling thread is held meanwhile: keep it small where many tasks share one.
    #[serde(with = "duration")]
    pub master_spin: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            master: "127.0.0.1:50051".into(),
            preferred_segment: None,
            rpc_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            transfer_timeout: Duration::from_secs(10),
            connections_per_owner: 8,
            transfer_threads: default_transfer_threads(),
            dedicated_runtime: false,
            shared_memory: true,
            socket_dir: None,
            master_protocol: Default::default(),
            master_spin: default_master_spin(),
        }
    }
}

/// `MOONCAKE_MASTER_SPIN_US` when set to a number of microseconds (for measurement and
/// debugging), else 50 µs.
fn default_master_spin() -> Duration {
    Duration::from_micros(
        std::env::var(MASTER_SPIN_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(50),
    )
}

/// Environment variable that sets the default of `master_spin`, in microseconds.
pub const MASTER_SPIN_ENV: &str = "MOONCAKE_MASTER_SPIN_US";

/// The longest `master_spin` accepted: it holds the calling thread.
const MAX_MASTER_SPIN: Duration = Duration::from_millis(1);

/// `MOONCAKE_TRANSFER_THREADS` when set to a positive number (for measurement and debugging),
/// else one per core, at most 8.
fn default_transfer_threads() -> usize {
    std::env::var(TRANSFER_THREADS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(8)))
}

/// Environment variable that sets the default of `transfer_threads`.
pub const TRANSFER_THREADS_ENV: &str = "MOONCAKE_TRANSFER_THREADS";

impl ClientConfig {
    pub fn new(master: impl Into<String>) -> Self {
        ClientConfig {
            master: master.into(),
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), ClientError> {
        if self.master.trim().is_empty() {
            return Err(ClientError::Config("master address is empty".into()));
        }
        if self.transfer_threads == 0 {
            return Err(ClientError::Config(
                "transfer_threads must be at least 1 (1: no extra threads)".into(),
            ));
        }
        if self.master_spin > MAX_MASTER_SPIN {
            return Err(ClientError::Config(format!(
                "master_spin must be at most {MAX_MASTER_SPIN:?} (it holds the calling thread), got {:?}",
                self.master_spin
            )));
        }
        if self.connections_per_owner == 0 {
            return Err(ClientError::Config(
                "connections_per_owner must be at least 1".into(),
            ));
        }
        for (name, d) in [
            ("rpc_timeout", self.rpc_timeout),
            ("connect_timeout", self.connect_timeout),
            ("transfer_timeout", self.transfer_timeout),
        ] {
            if d.is_zero() {
                return Err(ClientError::Config(format!(
                    "{name} must be greater than zero"
                )));
            }
        }
        Ok(())
    }
}

/// Resolves the preferred segment from the explicit setting and the environment's value.
/// An explicitly empty value, in either place, is a configuration error rather than "none".
pub fn resolve_preferred(
    explicit: Option<&str>,
    env: Option<&str>,
) -> Result<Option<SegmentName>, ClientError> {
    let (value, source) = match (explicit, env) {
        (Some(v), _) => (v, "preferred_segment"),
        (None, Some(v)) => (v, PREFERRED_SEGMENT_ENV),
        (None, None) => return Ok(None),
    };
    if value.trim().is_empty() {
        return Err(ClientError::Config(format!(
            "{source} is set but empty: name a segment \"host:port\" or leave it unset"
        )));
    }
    SegmentName::parse(value.trim())
        .map(Some)
        .map_err(|e| ClientError::Config(format!("{source}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_wins_then_env_then_none() {
        let seg = |s: &str| Some(SegmentName::parse(s).unwrap());
        assert_eq!(
            resolve_preferred(Some("a:1"), Some("b:2")).unwrap(),
            seg("a:1")
        );
        assert_eq!(resolve_preferred(None, Some("b:2")).unwrap(), seg("b:2"));
        assert_eq!(resolve_preferred(None, None).unwrap(), None);
    }

    #[test]
    fn empty_or_malformed_is_an_error() {
        for (e, v) in [(Some(""), None), (None, Some(" ")), (Some("nohost"), None)] {
            let err = resolve_preferred(e, v).unwrap_err();
            assert_eq!(err.code().as_i32(), -600, "{err}");
        }
        assert!(
            resolve_preferred(Some(""), Some("b:2")).is_err(),
            "explicit empty is not overridden"
        );
    }

    #[test]
    fn master_spin_is_bounded() {
        let mut c = ClientConfig::new("127.0.0.1:1");
        c.master_spin = Duration::ZERO;
        c.validate().unwrap();
        c.master_spin = Duration::from_millis(1);
        c.validate().unwrap();
        c.master_spin = Duration::from_millis(2);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("master_spin"), "{err}");
    }
}
