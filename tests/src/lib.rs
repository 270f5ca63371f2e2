//! Test harness: in-process clusters on 127.0.0.1 with port 0, the real binaries as child
//! processes that are killed when their guard drops, and deterministic per-key payloads so every
//! read is checked byte for byte.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, Arc},
    time::Duration,
};

use mooncake_client::{Client, ClientConfig};
use mooncake_common::ByteSize;
use mooncake_master::{clock::Clock, MasterConfig, RunningMaster};
use mooncake_owner::{OwnerConfig, RunningOwner};

pub mod delay;
pub mod etcd;
pub mod fuzz;
pub mod fuzz_net;
pub mod netns;

/// Puts `payload(key, size)` under every key in one batch; panics unless each is stored.
pub async fn put_payloads(
    client: &Client,
    keys: &[String],
    size: usize,
    config: &mooncake_client::ReplicateConfig,
) {
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, size)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(vals.iter().map(|v| v.as_slice()))
        .collect();
    for (k, r) in keys.iter().zip(client.batch_put(&items, config).await) {
        let outcome = r.unwrap_or_else(|e| panic!("{k}: {e}"));
        assert_eq!(outcome, mooncake_client::PutOutcome::Stored, "{k}");
    }
}

/// Gets every key in one batch; panics unless each comes back as `payload(key, size)`.
pub async fn check_payloads(client: &Client, keys: &[String], size: usize) {
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; size]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    for (i, r) in client
        .batch_get(&refs, &mut slices)
        .await
        .iter()
        .enumerate()
    {
        assert_eq!(get_code(r), size as i64, "{}: {r:?}", keys[i]);
        assert!(
            bufs[i] == payload(&keys[i], size),
            "wrong bytes for {}",
            keys[i]
        );
    }
}

/// A free loopback port: bound and released, from a range no connect() takes its local port
/// from (see below).
pub fn free_port() -> u16 {
    // Below the kernel's ephemeral range (32768 and up here): a port handed out now and bound
    // later (a standby binds only once it leads) is never taken meanwhile as the local port of
    // some connect() of a test running beside this one. Each call of this process moves on.
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let start = std::process::id().wrapping_mul(97);
    for _ in 0..SPAN {
        let port = FIRST + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + SPAN)
}

/// A master config for tests: loopback, free ports.
pub fn master_config() -> MasterConfig {
    MasterConfig {
        bind_address: "127.0.0.1".into(),
        rpc_port: 0,
        metrics_port: 0,
        ..Default::default()
    }
}

pub fn owner_config(master: &str, size: u64) -> OwnerConfig {
    OwnerConfig {
        master: master.to_string(),
        host: "127.0.0.1".into(),
        port: 0,
        segment_size: ByteSize(size),
        lock_memory: false,
        heartbeat_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

pub struct Cluster {
    pub master: RunningMaster,
    pub owners: Vec<RunningOwner>,
}

impl Cluster {
    pub async fn start(owner_sizes: &[u64]) -> Cluster {
        Self::start_with(master_config(), owner_sizes).await
    }

    pub async fn start_with(config: MasterConfig, owner_sizes: &[u64]) -> Cluster {
        let master = RunningMaster::start(config).await.expect("start master");
        Self::with_owners(master, owner_sizes).await
    }

    pub async fn start_with_clock(
        config: MasterConfig,
        clock: Arc<dyn Clock>,
        owner_sizes: &[u64],
    ) -> Cluster {
        let master = RunningMaster::start_with_clock(config, clock)
            .await
            .expect("start master");
        Self::with_owners(master, owner_sizes).await
    }

    async fn with_owners(master: RunningMaster, owner_sizes: &[u64]) -> Cluster {
        let addr = master.rpc_addr.to_string();
        let mut owners = Vec::new();
        for size in owner_sizes {
            owners.push(
                RunningOwner::start(owner_config(&addr, *size))
                    .await
                    .expect("start owner"),
            );
        }
        Cluster { master, owners }
    }

    pub fn master_addr(&self) -> String {
        self.master.rpc_addr.to_string()
    }

    pub fn client_config(&self) -> ClientConfig {
        ClientConfig {
            preferred_segment: None,
            transfer_timeout: Duration::from_secs(5),
            rpc_timeout: Duration::from_secs(3),
            ..ClientConfig::new(self.master_addr())
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect_with(self.client_config(), None, transport(&self.client_config()))
            .await
            .expect("connect client")
    }

    pub async fn shutdown(self) {
        for o in self.owners {
            o.shutdown().await;
        }
        self.master.shutdown().await;
    }
}

/// The TCP transport a client built from `config` would use.
pub fn transport(config: &ClientConfig) -> Arc<dyn mooncake_common::transport::DataTransport> {
    tcp_transport(config)
}

/// `transport`, as the TCP transport itself (for tests that look into its connections).
pub fn tcp_transport(config: &ClientConfig) -> Arc<mooncake_client::transport::TcpTransport> {
    Arc::new(mooncake_client::transport::TcpTransport::new(
        mooncake_client::transport::tcp::TcpConfig {
            connect_timeout: config.connect_timeout,
            transfer_timeout: config.transfer_timeout,
            connections_per_owner: config.connections_per_owner,
            transfer_threads: config.transfer_threads,
            dedicated_runtime: config.dedicated_runtime,
            credential: config.credential().expect("a readable auth token file"),
        },
    ))
}

/// A raw TCP transport proving `credential` (None: none), with 3 s deadlines, for tests that
/// talk to owners without a client.
pub fn tcp_with(
    credential: Option<mooncake_common::auth::Credential>,
) -> mooncake_client::transport::TcpTransport {
    mooncake_client::transport::TcpTransport::new(mooncake_client::transport::tcp::TcpConfig {
        connect_timeout: Duration::from_secs(3),
        transfer_timeout: Duration::from_secs(3),
        connections_per_owner: 2,
        transfer_threads: 1,
        dedicated_runtime: false,
        credential,
    })
}

/// Deterministic bytes for a key: different keys give different bytes at every length.
pub fn payload(key: &str, len: usize) -> Vec<u8> {
    let mut x: u64 = 0xcbf29ce484222325;
    for b in key.bytes() {
        x = (x ^ b as u64).wrapping_mul(0x100000001b3);
    }
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes()[..(len - out.len()).min(8)]);
    }
    out
}

/// Path of a workspace binary, (re)built once per test process so it is never stale: cargo only
/// builds a package's binaries for that package's own integration tests.
pub fn bin_path(name: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .to_path_buf();
    let path = dir.join(name);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == name) {
        let pkg = match name {
            "mooncake_master" => "mooncake-master",
            "mooncake_ownerd" => "mooncake-owner",
            "mooncake_bench" => "mooncake-bench",
            "mooncake_fuzz" => "mooncake-tests",
            other => panic!("unknown binary {other}"),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", pkg, "--bin", name]);
        if dir.file_name().is_some_and(|d| d == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build of {name} failed");
        built.push(name.to_string());
    }
    assert!(path.exists(), "{} not found", path.display());
    path
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub struct ChildGuard {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Files the child would have removed on a clean exit (an owner's socket), removed on drop.
    leftovers: Vec<PathBuf>,
}

impl ChildGuard {
    /// Spawns `bin` with `args`, stdout piped for `wait_line`, stderr inherited.
    pub fn spawn(bin: &str, args: &[&str]) -> ChildGuard {
        Self::spawn_cmd(Command::new(bin_path(bin)).args(args))
    }

    pub fn spawn_cmd(cmd: &mut Command) -> ChildGuard {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn child");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildGuard {
            child,
            lines,
            leftovers: Vec::new(),
        }
    }

    /// The first stdout line starting with `prefix`, within `timeout`.
    pub fn wait_line(&self, prefix: &str, timeout: Duration) -> String {
        self.line_within(prefix, timeout).unwrap_or_else(|| {
            panic!("no line starting with {prefix:?} within {timeout:?} (or the child exited)")
        })
    }

    /// The first stdout line starting with `prefix` within `timeout`, or None.
    pub fn line_within(&self, prefix: &str, timeout: Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Some(l),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// A file the child would remove on a clean exit (an owner's socket), removed when the
    /// guard drops.
    pub fn remove_on_drop(&mut self, path: PathBuf) {
        self.leftovers.push(path);
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Spawns `cmd` with SIGINT at its default action, as a terminal's Ctrl-C finds a command:
    /// a test run started in the background (`nohup`, a script's `&`) hands SIGINT down ignored,
    /// and a shell cannot trap a signal that was ignored when it started.
    pub fn spawn_interruptible(cmd: &mut Command) -> ChildGuard {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the hook makes one async-signal-safe call, signal(2).
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        Self::spawn_cmd(cmd)
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on the pid of a child this guard owns and has not reaped.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Sends SIGSTOP and waits until every thread of the child is stopped.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let task_dir = format!("/proc/{}/task", self.pid());
        while std::time::Instant::now() < deadline {
            let all_stopped = std::fs::read_dir(&task_dir)
                .map(|tasks| {
                    tasks.flatten().all(|t| {
                        std::fs::read_to_string(t.path().join("status"))
                            .map(|s| {
                                // Stopped, or a thread exited and not yet reaped.
                                s.lines().any(|l| {
                                    l.starts_with("State:")
                                        && ["T (stopped)", "Z (zombie)", "X (dead)"]
                                            .iter()
                                            .any(|state| l.contains(state))
                                })
                            })
                            .unwrap_or(true)
                    })
                })
                .unwrap_or(false);
            if all_stopped {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("child {} did not stop", self.pid());
    }

    /// Waits for exit up to `timeout`; None if still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // A stopped child must be continued to die promptly after SIGKILL on some kernels.
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        for f in &self.leftovers {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Starts the master binary on free loopback ports; returns it with its RPC and HTTP addresses.
/// The flags of a master on loopback at `port` ("0": any free one), its metrics on any port.
pub fn loopback_master_args(port: &str) -> [&str; 6] {
    [
        "--rpc_address",
        "127.0.0.1",
        "--rpc_port",
        port,
        "--metrics_port",
        "0",
    ]
}

pub fn spawn_master(extra: &[&str]) -> (ChildGuard, String, String) {
    let mut args = loopback_master_args("0").to_vec();
    args.extend_from_slice(extra);
    let m = ChildGuard::spawn("mooncake_master", &args);
    let line = m.wait_line("mooncake_master ready", Duration::from_secs(20));
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .expect("address in ready line")
            .to_string()
    };
    (m, field("rpc="), field("http="))
}

/// Starts the owner binary against `master`; returns it with its segment name.
pub fn spawn_owner(master: &str, size: &str, extra: &[&str]) -> (ChildGuard, String) {
    spawn_owner_on(master, size, "0", extra)
}

/// `spawn_owner` on data port `port` ("0": any free one).
pub fn spawn_owner_on(
    master: &str,
    size: &str,
    port: &str,
    extra: &[&str],
) -> (ChildGuard, String) {
    let mut args = vec![
        "--master",
        master,
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--segment-size",
        size,
        "--no-mlock",
    ];
    args.extend_from_slice(extra);
    let mut o = ChildGuard::spawn("mooncake_ownerd", &args);
    let line = o.wait_line("mooncake_ownerd ready", Duration::from_secs(20));
    let seg = line
        .rsplit("segment=")
        .next()
        .expect("segment in ready line")
        .to_string();
    if let Ok(name) = mooncake_common::SegmentName::parse(&seg) {
        // A SIGKILLed owner cannot remove its same-host socket; the guard does.
        let dir = socket_dir();
        o.leftovers
            .push(mooncake_common::local::socket_path(&dir, &name));
    }
    (o, seg)
}

/// A fresh directory under the system temp dir (a real file system here, so O_DIRECT works),
/// removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("mooncake-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create the test directory");
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `f` every 50 ms until it returns true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A put's outcome as a number, the way the Python binding answers it: 0 for stored or already
/// there, else the code.
pub fn put_code(r: &Result<mooncake_client::PutOutcome, mooncake_client::ClientError>) -> i32 {
    r.as_ref().map_or_else(|e| e.code().as_i32(), |_| 0)
}

/// A get's outcome as a number, the way the Python binding answers it: bytes read, else the code.
pub fn get_code(r: &Result<usize, mooncake_client::ClientError>) -> i64 {
    r.as_ref()
        .map_or_else(|e| i64::from(e.code().as_i32()), |n| *n as i64)
}

/// The same-host socket directory an owner started here uses (its default, or the environment's).
pub fn socket_dir() -> PathBuf {
    OwnerConfig::default()
        .with_env(|name| std::env::var(name).ok())
        .socket_dir
}

/// A plain HTTP/1.1 GET to `addr` ("host:port"): the status and the body.
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The value of the unlabelled Prometheus series `name` in `text`.
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("{name} missing"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// One write or read by its fields, through `DataTransport`'s single-item calls (no seal: for
/// clusters without a secret).
#[allow(async_fn_in_trait)] // used by this crate's tests only
pub trait Single {
    async fn write1(
        &self,
        seg: &mooncake_common::SegmentName,
        key: &mooncake_common::ObjectKey,
        offset: u64,
        stamp: mooncake_common::Stamp,
        parts: &[&[u8]],
    ) -> Result<(), mooncake_common::transport::TransferError>;
    async fn read1(
        &self,
        seg: &mooncake_common::SegmentName,
        key: &mooncake_common::ObjectKey,
        offset: u64,
        put_id: u64,
        parts: &mut [&mut [u8]],
    ) -> Result<(), mooncake_common::transport::TransferError>;
}

impl<T: mooncake_common::transport::DataTransport + ?Sized> Single for T {
    async fn write1(
        &self,
        seg: &mooncake_common::SegmentName,
        key: &mooncake_common::ObjectKey,
        offset: u64,
        stamp: mooncake_common::Stamp,
        parts: &[&[u8]],
    ) -> Result<(), mooncake_common::transport::TransferError> {
        let item = mooncake_common::transport::WriteItem {
            key,
            offset,
            stamp,
            seal: mooncake_common::auth::Seal::default(),
            parts,
        };
        self.write(seg, &item).await
    }

    async fn read1(
        &self,
        seg: &mooncake_common::SegmentName,
        key: &mooncake_common::ObjectKey,
        offset: u64,
        put_id: u64,
        parts: &mut [&mut [u8]],
    ) -> Result<(), mooncake_common::transport::TransferError> {
        let mut item = mooncake_common::transport::ReadItem {
            key,
            offset,
            put_id,
            seal: mooncake_common::auth::Seal::default(),
            parts,
        };
        self.read(seg, &mut item).await
    }
}
