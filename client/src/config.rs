//! The client's settings as data, and the one place the client reads its environment
//! (`ClientConfig::with_env`): a file or code builds the config, the environment is applied
//! over it, and explicit settings (flags, `setup()` arguments) go last. Nothing else in the
//! client reads an environment variable.

use std::{path::PathBuf, time::Duration};

use mooncake_common::{auth::Credential, tenant::Tenant};
use mooncake_common::{
    config::duration,
    local::{DEFAULT_SOCKET_DIR, SHM_ENV, SOCKET_DIR_ENV},
    SegmentName,
};
use serde::{Deserialize, Serialize};

use crate::error::ClientError;

/// Environment variable a launcher (`scripts/mooncake_owner`) sets to the node-local owner.
pub const PREFERRED_SEGMENT_ENV: &str = "MOONCAKE_PREFERRED_SEGMENT";

/// How the client talks to the master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MasterProtocol {
    /// Length-prefixed protobuf frames over plain TCP: the lowest latency.
    #[default]
    Framed,
    /// gRPC (HTTP/2), for masters behind gRPC-aware proxies.
    Grpc,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// The master: "host:port", or "etcd://host:port;host:port" to follow the cluster's elected
    /// master through etcd.
    pub master: String,
    /// The cluster's name in etcd, with an `etcd://` master (`MC_STORE_CLUSTER_ID`).
    pub cluster_id: String,
    /// Segment tried first for puts and reads (`MOONCAKE_PREFERRED_SEGMENT` when unset here).
    pub preferred_segment: Option<String>,
    /// Deadline of each master call.
    #[serde(with = "duration")]
    pub rpc_timeout: Duration,
    /// Deadline for connecting to an owner (and, on the same-host path, for its answer to a
    /// new connection).
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// Deadline of one transfer call to one owner, from its start: a batch's items for that owner
    /// (waiting for a connection, connecting and the exchange included) end by it together, so
    /// size it for the largest batch one owner gets, not for one object. The same on the
    /// same-host path, copies included.
    #[serde(with = "duration")]
    pub transfer_timeout: Duration,
    /// Connections kept per owner; transfers beyond it queue.
    pub connections_per_owner: usize,
    /// Threads one large TCP batch to one owner may use, each driving one connection (a TCP
    /// receive or send copies every byte on the calling thread, so one thread caps a batch at
    /// one core's copy rate). Used for batches of at least 16 MiB per thread; 1: never.
    /// `MOONCAKE_TRANSFER_THREADS`.
    pub transfer_threads: usize,
    /// The runtime that polls this client's calls is a current-thread runtime that runs nothing
    /// else (as the Python binding's is), so a large batch may block it while transfer threads
    /// move the bytes. Leave it off when other tasks share such a runtime; multi-threaded
    /// runtimes need neither (their other tasks move to another thread meanwhile).
    pub dedicated_runtime: bool,
    /// Use the same-host shared-memory path to owners on this host that offer it
    /// (`MOONCAKE_SHM=0` turns it off).
    pub shared_memory: bool,
    /// Directory of owners' sockets; owners must use the same (`MOONCAKE_SOCKET_DIR`).
    pub socket_dir: PathBuf,
    /// Threads a large same-host batch's copies may use: 2, or 1 for the calling thread only
    /// (`MOONCAKE_COPY_THREADS`).
    pub copy_threads: usize,
    /// How to talk to the master: "framed" (default, lowest latency) or "grpc".
    pub master_protocol: MasterProtocol,
    /// How long a framed master call polls for the answer before parking its thread (at most
    /// 1ms; 0: park at once). Answers usually come within tens of microseconds, and waking a
    /// parked thread on an idle core (on a VM, through the hypervisor) costs about as much again.
    /// The calling thread is held meanwhile: keep it small where many tasks share one.
    /// `MOONCAKE_MASTER_SPIN_US`, in microseconds.
    #[serde(with = "duration")]
    pub master_spin: Duration,
    /// A file holding the cluster's secret, proved on every connection to the master and to
    /// owners (which refuse a client without it when they have one). Unset: no proof.
    pub auth_token_file: Option<PathBuf>,
    /// The tenant whose namespace this client's keys live in (`tenant_id` of `setup()`,
    /// `MOONCAKE_TENANT_ID`); unset or "default": the default tenant, or the tenant whose
    /// token `auth_token_file` holds.
    pub tenant_id: Option<String>,
    /// TLS to the master (whose RPC port runs TLS): the CA its certificate chains to (PEM;
    /// `MOONCAKE_TLS_CA`). Unset: plain TCP.
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM; `MOONCAKE_TLS_CERT`), for masters that check clients;
    /// with `tls_key` (`MOONCAKE_TLS_KEY`).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            master: "127.0.0.1:50051".into(),
            cluster_id: mooncake_common::leader::DEFAULT_CLUSTER_ID.into(),
            preferred_segment: None,
            rpc_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            transfer_timeout: Duration::from_secs(10),
            connections_per_owner: 8,
            transfer_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            dedicated_runtime: false,
            shared_memory: true,
            socket_dir: PathBuf::from(DEFAULT_SOCKET_DIR),
            copy_threads: 2,
            master_protocol: Default::default(),
            master_spin: Duration::from_micros(50),
            auth_token_file: None,
            tenant_id: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }
}

/// Sets `master_spin`, in microseconds.
pub const MASTER_SPIN_ENV: &str = "MOONCAKE_MASTER_SPIN_US";
/// A master call's deadline, in milliseconds (`rpc_timeout`).
pub const RPC_TIMEOUT_ENV: &str = "MOONCAKE_RPC_TIMEOUT_MS";
/// Sets `transfer_threads`.
pub const TRANSFER_THREADS_ENV: &str = "MOONCAKE_TRANSFER_THREADS";
/// Sets `copy_threads`.
pub const COPY_THREADS_ENV: &str = "MOONCAKE_COPY_THREADS";
/// Sets `cluster_id` (Mooncake's name).
pub const CLUSTER_ID_ENV: &str = "MC_STORE_CLUSTER_ID";
/// Sets `auth_token_file`.
pub const AUTH_TOKEN_FILE_ENV: &str = "MOONCAKE_AUTH_TOKEN_FILE";
/// Sets `tenant_id`.
pub const TENANT_ID_ENV: &str = "MOONCAKE_TENANT_ID";
/// Set `tls_ca`, `tls_cert` and `tls_key`.
pub const TLS_ENV: [&str; 3] = ["MOONCAKE_TLS_CA", "MOONCAKE_TLS_CERT", "MOONCAKE_TLS_KEY"];

/// The longest `master_spin` accepted: it holds the calling thread.
const MAX_MASTER_SPIN: Duration = Duration::from_millis(1);

fn parsed<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, ClientError> {
    value
        .trim()
        .parse()
        .map_err(|_| ClientError::Config(format!("{name}={value:?} is not a valid number")))
}

/// A switch from the environment: 1/true/on/yes or 0/false/off/no, any case.
pub fn switch(name: &str, value: &str) -> Result<bool, ClientError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(ClientError::Config(format!(
            "{name}={value:?}: expected 1 or 0 (true/false, on/off, yes/no)"
        ))),
    }
}

impl ClientConfig {
    pub fn new(master: impl Into<String>) -> Self {
        ClientConfig {
            master: master.into(),
            ..Default::default()
        }
    }

    /// The environment applied over this config, `env` answering a variable's value:
    /// `MOONCAKE_PREFERRED_SEGMENT` (only where `preferred_segment` is unset),
    /// `MOONCAKE_MASTER_SPIN_US`, `MOONCAKE_TRANSFER_THREADS`, `MOONCAKE_COPY_THREADS`,
    /// `MOONCAKE_SHM` ("0": no same-host path), `MOONCAKE_SOCKET_DIR`, `MC_STORE_CLUSTER_ID` and
    /// `MOONCAKE_AUTH_TOKEN_FILE`.
    /// A value that does not
    /// parse is a configuration error naming the variable.
    pub fn with_env(mut self, env: impl Fn(&str) -> Option<String>) -> Result<Self, ClientError> {
        if self.preferred_segment.is_none() {
            // Set but empty is unset, as connectors read it (`... or os.getenv(...)`).
            self.preferred_segment = env(PREFERRED_SEGMENT_ENV).filter(|v| !v.trim().is_empty());
        }
        if let Some(v) = env(MASTER_SPIN_ENV) {
            self.master_spin = Duration::from_micros(parsed(MASTER_SPIN_ENV, &v)?);
        }
        if let Some(v) = env(RPC_TIMEOUT_ENV) {
            self.rpc_timeout = Duration::from_millis(parsed(RPC_TIMEOUT_ENV, &v)?);
        }
        if let Some(v) = env(TRANSFER_THREADS_ENV) {
            self.transfer_threads = parsed(TRANSFER_THREADS_ENV, &v)?;
        }
        if let Some(v) = env(COPY_THREADS_ENV) {
            self.copy_threads = parsed(COPY_THREADS_ENV, &v)?;
        }
        if let Some(v) = env(SHM_ENV) {
            self.shared_memory = switch(SHM_ENV, &v)?;
        }
        // Set but empty is unset: an empty directory would be the working directory.
        if let Some(v) = env(SOCKET_DIR_ENV).filter(|v| !v.trim().is_empty()) {
            self.socket_dir = PathBuf::from(v);
        }
        // Set but empty is unset (`export MC_STORE_CLUSTER_ID=${CLUSTER:-}`): an empty id names
        // no cluster, and the leader would never be found.
        if let Some(v) = env(CLUSTER_ID_ENV).filter(|v| !v.trim().is_empty()) {
            self.cluster_id = v.trim().to_string();
        }
        // Set but empty is unset (scripts export it for some runs only).
        if let Some(v) = env(AUTH_TOKEN_FILE_ENV).filter(|v| !v.trim().is_empty()) {
            self.auth_token_file = Some(PathBuf::from(v.trim()));
        }
        if let Some(v) = env(TENANT_ID_ENV).filter(|v| !v.trim().is_empty()) {
            self.tenant_id = Some(v.trim().to_string());
        }
        for (name, field) in
            TLS_ENV
                .iter()
                .zip([&mut self.tls_ca, &mut self.tls_cert, &mut self.tls_key])
        {
            if let Some(v) = env(name).filter(|v| !v.trim().is_empty()) {
                *field = Some(PathBuf::from(v.trim()));
            }
        }
        Ok(self)
    }

    /// `with_env` over this process's environment.
    pub fn with_process_env(self) -> Result<Self, ClientError> {
        self.with_env(|name| std::env::var(name).ok())
    }

    /// What this client proves to the master and the owners: the secret `auth_token_file`
    /// holds, the cluster's or a tenant's (none without one).
    pub fn credential(&self) -> Result<Option<Credential>, ClientError> {
        self.auth_token_file
            .as_deref()
            .map(Credential::from_file)
            .transpose()
            .map_err(ClientError::Config)
    }

    /// TLS to the master, if configured.
    pub fn master_tls(&self) -> Result<Option<mooncake_common::tls::TlsClient>, ClientError> {
        mooncake_common::tls::TlsClient::from_files(
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
        )
        .map_err(ClientError::Config)
    }

    /// The tenant this client's keys belong to: `tenant_id`, or the tenant of a tenant's
    /// token; the two must agree where both are given.
    pub fn tenant(&self) -> Result<Tenant, ClientError> {
        let asked = Tenant::parse(self.tenant_id.as_deref().unwrap_or(""))
            .map_err(|e| ClientError::Config(format!("tenant_id: {e}")))?;
        let bound = self
            .credential()?
            .and_then(|c| c.tenant().map(str::to_string));
        match bound {
            Some(name) if asked.is_default() => Tenant::parse(&name).map_err(ClientError::Config),
            Some(name) if name != asked.name() => Err(ClientError::Config(format!(
                "tenant_id is {asked} but the auth token file holds tenant {name}'s token"
            ))),
            _ => Ok(asked),
        }
    }

    /// The preferred segment, parsed (see `resolve_preferred`).
    pub fn preferred(&self) -> Result<Option<SegmentName>, ClientError> {
        resolve_preferred(self.preferred_segment.as_deref())
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
        if !(1..=2).contains(&self.copy_threads) {
            return Err(ClientError::Config(format!(
                "copy_threads must be 1 or 2, got {}",
                self.copy_threads
            )));
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

/// Parses a preferred segment setting: empty is none (Mooncake's `preferred_segment=''`), and
/// a value that is not a segment name ("host:port") is a configuration error naming it.
pub fn resolve_preferred(value: Option<&str>) -> Result<Option<SegmentName>, ClientError> {
    let Some(value) = value.filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let source = "preferred_segment (or MOONCAKE_PREFERRED_SEGMENT)";
    SegmentName::parse(value.trim())
        .map(Some)
        .map_err(|e| ClientError::Config(format!("{source}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn explicit_wins_then_env_then_none() {
        let seg = |s: &str| Some(SegmentName::parse(s).unwrap());
        let explicit = ClientConfig {
            preferred_segment: Some("a:1".into()),
            ..ClientConfig::new("m:1")
        };
        let from_env = env(&[(PREFERRED_SEGMENT_ENV, "b:2")]);
        let c = explicit.clone().with_env(&from_env).unwrap();
        assert_eq!(c.preferred().unwrap(), seg("a:1"));
        let c = ClientConfig::new("m:1").with_env(&from_env).unwrap();
        assert_eq!(c.preferred().unwrap(), seg("b:2"));
        let c = ClientConfig::new("m:1").with_env(env(&[])).unwrap();
        assert_eq!(c.preferred().unwrap(), None);
    }

    #[test]
    fn empty_is_none_and_malformed_is_an_error() {
        for v in ["nohost", "host:0", "a:b"] {
            let err = resolve_preferred(Some(v)).unwrap_err();
            assert_eq!(err.code().as_i32(), -600, "{err}");
        }
        for v in ["", " "] {
            assert_eq!(resolve_preferred(Some(v)).unwrap(), None, "{v:?}");
            let from_env = ClientConfig::new("m:1")
                .with_env(env(&[(PREFERRED_SEGMENT_ENV, v)]))
                .unwrap();
            assert_eq!(
                from_env.preferred().unwrap(),
                None,
                "{v:?} in the environment"
            );
        }
        let explicit_empty = ClientConfig {
            preferred_segment: Some(String::new()),
            ..ClientConfig::new("m:1")
        };
        let c = explicit_empty
            .with_env(env(&[(PREFERRED_SEGMENT_ENV, "b:2")]))
            .unwrap();
        assert_eq!(
            c.preferred().unwrap(),
            None,
            "explicit empty is not overridden"
        );
    }

    #[test]
    fn the_environment_sets_every_knob_and_bad_numbers_are_named() {
        let c = ClientConfig::new("m:1")
            .with_env(env(&[
                (MASTER_SPIN_ENV, "7"),
                (TRANSFER_THREADS_ENV, "3"),
                (COPY_THREADS_ENV, "1"),
                (SHM_ENV, "0"),
                (SOCKET_DIR_ENV, "/run/mc"),
                (RPC_TIMEOUT_ENV, "12000"),
            ]))
            .unwrap();
        assert_eq!(c.master_spin, Duration::from_micros(7));
        assert_eq!(c.rpc_timeout, Duration::from_secs(12));
        assert_eq!((c.transfer_threads, c.copy_threads), (3, 1));
        assert!(!c.shared_memory);
        assert_eq!(c.socket_dir, PathBuf::from("/run/mc"));
        c.validate().unwrap();
        let err = ClientConfig::new("m:1")
            .with_env(env(&[(TRANSFER_THREADS_ENV, "many")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(TRANSFER_THREADS_ENV), "{err}");
        let c = ClientConfig::new("m:1")
            .with_env(env(&[(TRANSFER_THREADS_ENV, "0")]))
            .unwrap();
        assert!(c.validate().is_err(), "0 transfer threads is refused");
        // An empty cluster id is no cluster id: the default stays.
        let c = ClientConfig::new("m:1")
            .with_env(env(&[(CLUSTER_ID_ENV, " ")]))
            .unwrap();
        assert_eq!(c.cluster_id, ClientConfig::default().cluster_id);
        let c = ClientConfig::new("m:1")
            .with_env(env(&[(CLUSTER_ID_ENV, "prod")]))
            .unwrap();
        assert_eq!(c.cluster_id, "prod");
        // The same-host switch reads the usual spellings and names anything else (before, only
        // "0" turned it off: "false" left it on); an empty socket directory is unset.
        for (v, on) in [
            ("false", false),
            ("OFF", false),
            ("no", false),
            ("1", true),
            ("yes", true),
        ] {
            let c = ClientConfig::new("m:1")
                .with_env(env(&[(SHM_ENV, v)]))
                .unwrap();
            assert_eq!(c.shared_memory, on, "{v}");
        }
        let err = ClientConfig::new("m:1")
            .with_env(env(&[(SHM_ENV, "nope")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(SHM_ENV), "{err}");
        let c = ClientConfig::new("m:1")
            .with_env(env(&[(SOCKET_DIR_ENV, "")]))
            .unwrap();
        assert_eq!(c.socket_dir, ClientConfig::default().socket_dir);
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
