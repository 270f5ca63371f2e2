//! `mooncake_ownerd`: contributes a memory segment to the store and serves it until Ctrl-C or
//! SIGTERM. Exits non-zero with a message when it cannot start or mount.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use mooncake_common::{
    config::{load_toml, parse_duration},
    ByteSize,
};
use mooncake_owner::{ssd::EngineKind, OwnerConfig, RunningOwner};

#[derive(Parser, Debug)]
#[command(
    name = "mooncake_ownerd",
    version,
    about = "Owner daemon: serves a memory segment (and optionally an SSD tier) of the KV object store"
)]
struct Args {
    /// TOML config file; flags given on the command line override its values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The master: HOST:PORT, or etcd://HOST:PORT;HOST:PORT to follow the elected one.
    #[arg(long)]
    master: Option<String>,
    /// The cluster's name in etcd (with an etcd:// master).
    #[arg(long = "cluster-id", alias = "cluster_id")]
    cluster_id: Option<String>,
    /// Address clients reach this owner at; the data plane binds to it.
    #[arg(long)]
    host: Option<String>,
    /// Data-plane port; 0 picks a free one.
    #[arg(long)]
    port: Option<u16>,
    /// Memory to contribute, e.g. 4GiB.
    #[arg(long)]
    segment_size: Option<ByteSize>,
    /// Write the segment name to this file once serving (readiness signal).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Do not try to lock the pool in memory.
    #[arg(long)]
    no_mlock: bool,
    /// Do not offer the same-host shared-memory path (local clients then use TCP).
    #[arg(long)]
    no_shm: bool,
    /// Directory of the same-host socket (default: /tmp, or $MOONCAKE_SOCKET_DIR).
    #[arg(long)]
    socket_dir: Option<PathBuf>,
    /// Heartbeat period, e.g. 1s.
    #[arg(long, value_parser = parse_duration)]
    heartbeat_interval: Option<Duration>,
    /// How long to keep trying to mount at start-up, e.g. 10s.
    #[arg(long, value_parser = parse_duration)]
    mount_timeout: Option<Duration>,
    /// Directory of the SSD tier (objects evicted from memory go there; kept across restarts).
    #[arg(long)]
    ssd_path: Option<PathBuf>,
    /// Size of the SSD tier, e.g. 64GiB (preallocated).
    #[arg(long)]
    ssd_size: Option<ByteSize>,
    /// SSD I/O engine: auto, uring or pread.
    #[arg(long)]
    ssd_engine: Option<EngineKind>,
    /// A file holding the cluster's secret (as the master's --auth_token_file).
    #[arg(long = "auth_token_file", alias = "auth-token-file")]
    auth_token_file: Option<PathBuf>,
    /// TLS to the master: the CA its certificate chains to (PEM).
    #[arg(long = "tls_ca")]
    tls_ca: Option<PathBuf>,
    /// This owner's client certificate (PEM), for a master started with --tls_ca.
    #[arg(long = "tls_cert")]
    tls_cert: Option<PathBuf>,
    /// The key of --tls_cert (PEM).
    #[arg(long = "tls_key")]
    tls_key: Option<PathBuf>,
}

fn config(args: Args) -> Result<OwnerConfig, String> {
    let mut c: OwnerConfig = match &args.config {
        Some(path) => load_toml(path).map_err(|e| e.to_string())?,
        None => OwnerConfig::default(),
    }
    .with_env(|name| std::env::var(name).ok());
    macro_rules! set {
        ($($field:ident <- $arg:expr),* $(,)?) => { $(if let Some(v) = $arg { c.$field = v; })* };
    }
    set!(
        master <- args.master,
        cluster_id <- args.cluster_id,
        host <- args.host,
        port <- args.port,
        segment_size <- args.segment_size,
        heartbeat_interval <- args.heartbeat_interval,
        mount_timeout <- args.mount_timeout,
        ssd_size <- args.ssd_size,
        ssd_engine <- args.ssd_engine,
    );
    if args.ssd_path.is_some() {
        c.ssd_path = args.ssd_path;
    }
    if args.auth_token_file.is_some() {
        c.auth_token_file = args.auth_token_file;
    }
    for (field, arg) in [
        (&mut c.tls_ca, args.tls_ca),
        (&mut c.tls_cert, args.tls_cert),
        (&mut c.tls_key, args.tls_key),
    ] {
        if arg.is_some() {
            *field = arg;
        }
    }
    if args.ready_file.is_some() {
        c.ready_file = args.ready_file;
    }
    if args.no_mlock {
        c.lock_memory = false;
    }
    if args.no_shm {
        c.shared_memory = false;
    }
    if let Some(dir) = args.socket_dir {
        c.socket_dir = dir;
    }
    c.validate()
        .map_err(|e| format!("invalid configuration: {e}"))?;
    Ok(c)
}

fn main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mooncake_ownerd: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = rt.block_on(run());
    // Not waiting for blocking work still under way (a sync the shutdown gave up on, a write of
    // a task it left to the master): `STOP_WITHIN` holds.
    rt.shutdown_timeout(Duration::from_millis(200));
    code
}

async fn run() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = match config(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mooncake_ownerd: {e}");
            return ExitCode::from(2);
        }
    };
    // Installed before the start (which may take a while: the pool, the SSD tier's recovery,
    // the mount): a signal meanwhile is an orderly stop, not the default death that leaves a
    // mounted segment to the master's TTL.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    let mut starting = tokio::spawn(RunningOwner::start(config));
    let started = tokio::select! {
        r = &mut starting => Some(r),
        _ = term.recv() => None,
        _ = int.recv() => None,
    };
    let started = match started {
        Some(r) => r,
        // Stopped while starting: a start about to finish (its segment mounted, say) is let
        // finish and shut down in order; one still waiting (for a master) is given up.
        None => match tokio::time::timeout(START_GRACE, &mut starting).await {
            Ok(Ok(Ok(owner))) => {
                tracing::info!("stopped while starting: shutting down");
                owner.shutdown().await;
                return ExitCode::SUCCESS;
            }
            _ => {
                starting.abort();
                eprintln!("mooncake_ownerd: stopped before it was ready");
                return ExitCode::from(1);
            }
        },
    };
    let owner = match started {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            eprintln!("mooncake_ownerd: {e}");
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("mooncake_ownerd: the start failed: {e}");
            return ExitCode::from(1);
        }
    };
    println!("mooncake_ownerd ready segment={}", owner.segment);
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
    // The shutdown is bounded by itself; a second signal ends it at once.
    tokio::select! {
        _ = owner.shutdown() => {}
        _ = term.recv() => tracing::warn!("second stop signal: exiting without finishing the shutdown"),
        _ = int.recv() => tracing::warn!("second stop signal: exiting without finishing the shutdown"),
    }
    ExitCode::SUCCESS
}

/// How long a start under way when a stop signal came may still take to finish.
const START_GRACE: Duration = Duration::from_secs(1);

/// The most a stop signal's handling takes, a start's grace and the shutdown: under the 10 s
/// that `scripts/mooncake_owner` waits before SIGKILL.
const STOP_WITHIN: Duration = Duration::from_secs(9);
const _: () = assert!(
    START_GRACE.as_millis() + mooncake_owner::SHUTDOWN_WITHIN.as_millis() < STOP_WITHIN.as_millis()
);
