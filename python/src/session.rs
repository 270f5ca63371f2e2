//! One `setup()`'s worth of state: the I/O runtime, the client, and the embedded owner when the
//! process contributes memory itself (`global_segment_size > 0`).

use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, ClientError};
use mooncake_common::{Code, SegmentName};
use tokio::runtime::Runtime;

use crate::config::SetupArgs;

pub struct Session {
    /// The process that set it up: a fork's copy is not usable (see `NativeStore::session`).
    pub pid: u32,
    /// Drives the client's calls. A current-thread runtime by default: the calling Python thread
    /// polls the sockets itself, with no hand-off to an I/O thread on every wait (the lowest
    /// latency for the one-caller-per-process shape of inference workers). `MOONCAKE_IO_THREADS=N`
    /// (N > 0) gives it N worker threads instead.
    pub rt: IoRuntime,
    pub client: Client,
    /// With a current-thread runtime, one caller at a time drives it (see `io`): the lane.
    lane: Option<parking_lot::Mutex<()>>,
    /// The runtime and client of the callers who find the lane taken, made at the first such
    /// call, from this config and preferred segment.
    shared: std::sync::OnceLock<(IoRuntime, Client)>,
    /// When starting them last failed; held while one caller starts them.
    shared_failed: parking_lot::Mutex<Option<Instant>>,
    shared_from: (ClientConfig, Option<SegmentName>),
    pub hostname: String,
    /// The master and this host, for segments mounted later (`mount_memory`).
    master: String,
    host: String,
    #[cfg(feature = "embedded-owner")]
    owner: Option<(Runtime, mooncake_owner::RunningOwner)>,
    /// Memory this process added after setup (`allocate_and_mount_segment`), one owner each.
    #[cfg(feature = "embedded-owner")]
    mounted: parking_lot::Mutex<Vec<(Runtime, mooncake_owner::RunningOwner)>>,
}

/// How long a failed start of the shared runtime and client is not tried again (see
/// `Session::shared`).
const SHARED_RETRY: Duration = Duration::from_secs(2);

/// How long `close` waits for each client's read leases to go back.
const LEASES_BACK_WITHIN: Duration = Duration::from_secs(1);

fn runtime(threads: usize, name: &str) -> Result<Runtime, SetupError> {
    let mut b = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| SetupError {
            code: Code::InternalError,
            message: format!("cannot start I/O threads: {e}"),
        })
}

/// Why `setup` failed, as the code it returns and the message it logs.
pub struct SetupError {
    pub code: Code,
    pub message: String,
}

impl From<ClientError> for SetupError {
    fn from(e: ClientError) -> Self {
        SetupError {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

fn invalid(message: impl Into<String>) -> SetupError {
    SetupError {
        code: Code::InvalidParams,
        message: message.into(),
    }
}

impl Session {
    /// `threads`: I/O threads when MOONCAKE_IO_THREADS is not set (0: none, the calling thread
    /// drives its calls).
    pub fn start(args: &SetupArgs, threads: usize) -> Result<Session, SetupError> {
        match args.protocol.to_ascii_lowercase().as_str() {
            "tcp" => {}
            "rdma" => return Err(invalid(
                "protocol \"rdma\" is not available: this build has no RDMA transport; use \"tcp\"",
            )),
            other => {
                return Err(invalid(format!(
                    "unknown protocol {other:?}: expected \"tcp\""
                )))
            }
        }
        if args.master_server_addr.trim().is_empty() {
            return Err(invalid("master_server_addr is empty"));
        }
        // The binding's one read of the environment: the client's and the owner's variables
        // (applied over their defaults, under setup()'s arguments), and its own thread count.
        let env = |name: &str| std::env::var(name).ok();
        let threads = env("MOONCAKE_IO_THREADS")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(threads);
        let rt = runtime(threads, "mooncake-io")?;
        // The binding's deadlines, under the environment (MOONCAKE_RPC_TIMEOUT_MS, ...).
        let mut config = ClientConfig {
            connect_timeout: Duration::from_secs(2),
            rpc_timeout: Duration::from_secs(5),
            // The runtime exists only for this client's calls.
            dedicated_runtime: true,
            ..ClientConfig::new(args.master_server_addr.trim())
        }
        .with_env(env)?;
        if let Some(t) = args
            .tenant_id
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty() && *t != "default")
        {
            config.tenant_id = Some(t.to_string());
        }
        // Connect first: an unreachable master fails here within the connect deadline.
        let client = rt.block_on(Client::connect(config.clone()))?;
        let (host, port) = split_host(&args.local_hostname)?;
        if args.global_segment_size == 0 {
            let preferred = config.preferred()?;
            return Ok(Session {
                pid: std::process::id(),
                lane: lane_of(&rt),
                shared: Default::default(),
                shared_failed: Default::default(),
                shared_from: (config, preferred),
                rt: IoRuntime(Some(rt)),
                client,
                hostname: args.local_hostname.clone(),
                master: args.master_server_addr.trim().to_string(),
                host,
                #[cfg(feature = "embedded-owner")]
                owner: None,
                #[cfg(feature = "embedded-owner")]
                mounted: Default::default(),
            });
        }
        Self::with_owner(rt, config, args, host, port, env)
    }

    #[cfg(feature = "embedded-owner")]
    fn with_owner(
        rt: Runtime,
        config: ClientConfig,
        args: &SetupArgs,
        host: String,
        port: u16,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Session, SetupError> {
        let master = args.master_server_addr.trim().to_string();
        let (owner_rt, owner) = start_owner(&master, &host, port, args.global_segment_size, env)?;
        // Puts and reads prefer this process's own segment unless configured otherwise.
        let preferred = config.preferred()?.or_else(|| Some(owner.segment.clone()));
        let transport = Client::default_transport(&config)?;
        let client = rt.block_on(Client::connect_with(
            config.clone(),
            preferred.clone(),
            transport,
        ))?;
        Ok(Session {
            pid: std::process::id(),
            lane: lane_of(&rt),
            shared: Default::default(),
            shared_failed: Default::default(),
            shared_from: (config, preferred),
            hostname: owner.segment.to_string(),
            rt: IoRuntime(Some(rt)),
            client,
            master,
            host,
            owner: Some((owner_rt, owner)),
            mounted: Default::default(),
        })
    }

    /// Adds `size` bytes of this process's memory to the store as a segment of its own (an
    /// owner inside this process); its name.
    #[cfg(feature = "embedded-owner")]
    pub fn mount_memory(&self, size: u64) -> Result<String, SetupError> {
        if size == 0 {
            return Err(invalid("a segment of 0 bytes"));
        }
        let env = |name: &str| std::env::var(name).ok();
        let (rt, owner) = start_owner(&self.master, &self.host, 0, size, env)?;
        let name = owner.segment.to_string();
        self.mounted.lock().push((rt, owner));
        Ok(name)
    }

    #[cfg(not(feature = "embedded-owner"))]
    pub fn mount_memory(&self, _: u64) -> Result<String, SetupError> {
        Err(invalid("mounting memory needs the embedded-owner feature"))
    }

    /// Unmounts and frees segments `mount_memory` made; false for a name it did not make.
    #[cfg(feature = "embedded-owner")]
    pub fn unmount_memory(&self, name: &str) -> bool {
        let taken = {
            let mut mounted = self.mounted.lock();
            let at = mounted.iter().position(|(_, o)| o.segment.as_str() == name);
            at.map(|i| mounted.remove(i))
        };
        match taken {
            Some((rt, owner)) => {
                rt.block_on(owner.shutdown());
                rt.shutdown_timeout(Duration::from_secs(2));
                true
            }
            None => false,
        }
    }

    #[cfg(not(feature = "embedded-owner"))]
    pub fn unmount_memory(&self, _: &str) -> bool {
        false
    }

    #[cfg(not(feature = "embedded-owner"))]
    fn with_owner(
        _: Runtime,
        _: ClientConfig,
        _: &SetupArgs,
        _: String,
        _: u16,
        _: impl Fn(&str) -> Option<String>,
    ) -> Result<Session, SetupError> {
        Err(invalid("global_segment_size > 0 needs the embedded-owner feature; pass 0 for a requester-only client"))
    }

    /// The runtime and client a call runs on: the session's own, or, when another thread drives
    /// its current-thread runtime now, the shared ones. A caller waiting for the lane would wait
    /// out the other's whole call (and with it its own deadlines), since nothing drives the
    /// sockets of a current-thread runtime but its caller, and a large transfer blocks that one
    /// in its transfer threads.
    fn io(&self) -> Io<'_> {
        let own = |lane| Io {
            rt: &self.rt,
            client: &self.client,
            _lane: lane,
        };
        let Some(lane) = &self.lane else {
            return own(None);
        };
        if let Some(g) = lane.try_lock() {
            return own(Some(g));
        }
        match self.shared() {
            Some((rt, client)) => Io {
                rt,
                client,
                _lane: None,
            },
            None => own(Some(lane.lock())),
        }
    }

    /// Runs `call` with the client of the runtime `io` picks, to its end, on this thread.
    pub fn block_on<T>(&self, call: impl AsyncFnOnce(&Client) -> T) -> T {
        let io = self.io();
        io.rt.block_on(call(io.client))
    }

    /// The shared runtime and client, started by the first caller that needs them. After a
    /// failed start (a master briefly unreachable, say) callers take turns on the lane until
    /// `SHARED_RETRY` has passed, then the next one tries again.
    fn shared(&self) -> Option<&(IoRuntime, Client)> {
        if let Some(s) = self.shared.get() {
            return Some(s);
        }
        let mut failed = self.shared_failed.lock();
        if let Some(s) = self.shared.get() {
            return Some(s);
        }
        if failed.is_some_and(|at| at.elapsed() < SHARED_RETRY) {
            return None;
        }
        match self.start_shared() {
            Some(s) => {
                *failed = None;
                Some(self.shared.get_or_init(|| s))
            }
            None => {
                *failed = Some(Instant::now());
                None
            }
        }
    }

    /// The shared runtime and client (see `io`); none if they cannot start (then callers take
    /// turns on the lane).
    fn start_shared(&self) -> Option<(IoRuntime, Client)> {
        let (config, preferred) = &self.shared_from;
        let config = ClientConfig {
            // Its callers may be many at once.
            dedicated_runtime: false,
            ..config.clone()
        };
        let started = runtime(2, "mooncake-io-shared").and_then(|rt| {
            let transport = Client::default_transport(&config)?;
            let client = rt.block_on(Client::connect_with(config, preferred.clone(), transport))?;
            Ok((IoRuntime(Some(rt)), client))
        });
        match started {
            Ok(x) => Some(x),
            Err(e) => {
                tracing::warn!(error = %e.message, "cannot start the runtime for concurrent calls; they take turns");
                None
            }
        }
    }

    /// What this session's calls moved so far, on both its runtimes.
    pub fn transfer_stats(&self) -> mooncake_common::transport::TransferStats {
        let mut t = self.client.transfer_stats();
        if let Some((_, c)) = self.shared.get() {
            t += c.transfer_stats();
        }
        t
    }

    /// Stops the embedded owners (unmounting their segments) and the I/O threads, waiting for
    /// them.
    pub fn close(mut self) {
        #[cfg(feature = "embedded-owner")]
        stop_owners(self.take_owners());
        // Each client hands back its read leases while its runtime still runs.
        if let Some((mut rt, client)) = self.shared.take() {
            if let Some(rt) = rt.0.take() {
                rt.block_on(client.close(LEASES_BACK_WITHIN));
                drop(client);
                rt.shutdown_timeout(Duration::from_secs(2));
            }
        }
        if let Some(rt) = self.rt.0.take() {
            rt.block_on(self.client.close(LEASES_BACK_WITHIN));
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// How long calls in flight may still take: each ends by its deadlines (a put's start,
    /// its transfer, its end or revocation).
    pub fn calls_end_within(&self) -> Duration {
        let config = &self.shared_from.0;
        config.rpc_timeout * 3 + config.transfer_timeout + Duration::from_secs(1)
    }

    #[cfg(feature = "embedded-owner")]
    fn take_owners(&mut self) -> Vec<(Runtime, mooncake_owner::RunningOwner)> {
        let mounted = std::mem::take(self.mounted.get_mut());
        self.owner.take().into_iter().chain(mounted).collect()
    }
}

/// A session not closed (`close()` while calls were in flight) ends where its last reference
/// goes: in one of those calls, on a thread of its own I/O runtime, or on a Python thread that
/// holds the GIL. Waiting there for runtime threads panics (inside the runtime) or can deadlock
/// (with the GIL): the embedded owners stop on a thread of their own, and the I/O runtime shuts
/// down without waiting (see `IoRuntime`).
impl Drop for Session {
    fn drop(&mut self) {
        #[cfg(feature = "embedded-owner")]
        {
            let owners = self.take_owners();
            if !owners.is_empty() {
                let stopping = std::thread::Builder::new()
                    .name("mooncake-close".into())
                    .spawn(move || stop_owners(owners));
                if let Err(e) = stopping {
                    tracing::warn!(error = %e, "cannot start a thread to stop the embedded owners");
                }
            }
        }
    }
}

/// Stops embedded owners (unmounting their segments) and their threads.
#[cfg(feature = "embedded-owner")]
fn stop_owners(owners: Vec<(Runtime, mooncake_owner::RunningOwner)>) {
    for (rt, owner) in owners {
        rt.block_on(owner.shutdown());
        rt.shutdown_timeout(Duration::from_secs(2));
    }
}

/// The runtime and client of one call (see `Session::io`), holding the lane while it uses it.
struct Io<'a> {
    pub rt: &'a Runtime,
    pub client: &'a Client,
    _lane: Option<parking_lot::MutexGuard<'a, ()>>,
}

/// A lane for a current-thread runtime (see `Session::io`); none for worker threads, which
/// serve any number of callers at once.
fn lane_of(rt: &Runtime) -> Option<parking_lot::Mutex<()>> {
    (rt.handle().runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
        .then(Default::default)
}

/// The session's I/O runtime: `close` waits for its threads; dropped anywhere else (see
/// `Session`'s `Drop`), it shuts down without waiting.
pub struct IoRuntime(Option<Runtime>);

impl std::ops::Deref for IoRuntime {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        self.0
            .as_ref()
            .expect("the runtime lasts as long as the session")
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// An owner inside this process serving `size` bytes on `host:port` (0: any port). It serves
/// other processes whether or not this one is inside a call: it gets threads of its own.
#[cfg(feature = "embedded-owner")]
fn start_owner(
    master: &str,
    host: &str,
    port: u16,
    size: u64,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(Runtime, mooncake_owner::RunningOwner), SetupError> {
    let config = mooncake_owner::OwnerConfig {
        master: master.to_string(),
        host: host.to_string(),
        port,
        segment_size: mooncake_common::ByteSize(size),
        mount_timeout: Duration::from_secs(3),
        ..mooncake_owner::OwnerConfig::default().with_env(env)
    };
    let rt = runtime(2, "mooncake-owner")?;
    let owner = rt
        .block_on(mooncake_owner::RunningOwner::start(config))
        .map_err(|e| SetupError {
            code: Code::InternalError,
            message: e.to_string(),
        })?;
    Ok((rt, owner))
}

/// "host" or "host:port" (port 0 or absent: pick a free one).
fn split_host(s: &str) -> Result<(String, u16), SetupError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(invalid("local_hostname is empty"));
    }
    if let Ok(seg) = SegmentName::parse(s) {
        let (h, p) = seg.as_str().rsplit_once(':').expect("validated");
        let h = h.trim_start_matches('[').trim_end_matches(']');
        return Ok((h.to_string(), p.parse().expect("validated")));
    }
    Ok((s.to_string(), 0))
}
