//! mooncake_bench: a KV-cache-shaped workload. Puts `--keys` values of each `--value-size` in
//! batches of `--batch`, gets them back, checks every byte, and prints a table (or JSON lines).
//! Without `--master` it runs on an embedded default: a master and one owner on loopback in this
//! process (with an SSD tier when `--ssd-path` is given), stopped at the end. `--op put` leaves
//! the values in the store under `--key-prefix`, so `--op get` in another run (another process,
//! node, or after an owner restart) reads them back and verifies them. `--trace FILE` replays a
//! prefix-cache trace instead (see `trace`): requests/s, the block hit ratio next to exact LRU's
//! and Belady's MIN at the same capacity, and lookup+get and put latencies.

mod pattern;
mod stats;
mod trace;

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_common::ByteSize;
use mooncake_master::{MasterConfig, RunningMaster};
use mooncake_owner::{OwnerConfig, RunningOwner};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "mooncake_bench",
    version,
    about = "Put/get workload against the KV store, verified byte for byte"
)]
struct Args {
    /// Master to run against, HOST:PORT or etcd://HOST:PORT;HOST:PORT (the cluster from
    /// MC_STORE_CLUSTER_ID). Without it: an embedded master and owner on loopback.
    #[arg(long)]
    master: Option<String>,
    /// Client settings from a TOML file (config/client.toml's format), under the environment
    /// and the flags; its master is run against unless --master names another.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Value sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4KiB,256KiB,1MiB,4MiB")]
    value_size: Vec<ByteSize>,
    /// Keys per value size.
    #[arg(long, default_value_t = 512)]
    keys: usize,
    /// Keys per batch call.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Preferred segment for puts and reads (else MOONCAKE_PREFERRED_SEGMENT).
    #[arg(long)]
    preferred_segment: Option<String>,
    /// Embedded mode: owners to start.
    #[arg(long, default_value_t = 1)]
    owners: usize,
    /// Embedded mode: segment size per owner (default: enough for the largest value size).
    #[arg(long)]
    segment_size: Option<ByteSize>,
    /// One JSON object per phase per line instead of a table.
    #[arg(long)]
    json: bool,
    /// put: write and keep the values; get: read values an earlier `put` wrote and verify
    /// them; putget: both, then remove the values.
    #[arg(long, default_value = "putget")]
    op: BenchOp,
    /// Keys are PREFIX/SIZE/I (default: bench/<pid>); give the same prefix to a later `--op get`.
    #[arg(long)]
    key_prefix: Option<String>,
    /// Embedded mode: give the owner an SSD tier in this directory.
    #[arg(long)]
    ssd_path: Option<std::path::PathBuf>,
    /// Embedded mode: size of that SSD tier.
    #[arg(long, default_value = "4GiB")]
    ssd_size: ByteSize,
    /// Embedded mode: offload every value to the SSD tier as its put ends.
    #[arg(long)]
    eager_offload: bool,
    /// Replay this prefix-cache trace (JSON lines with `hash_ids`, as ../shared/data) instead
    /// of the uniform phases; in embedded mode the segment defaults to 512 MiB.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Trace mode: bytes per KV block.
    #[arg(long, default_value = "64KiB")]
    block_size: ByteSize,
    /// The master's eviction high watermark (fraction of memory in use): set for the embedded
    /// master (0.95 when not given), and the capacity LRU and MIN are simulated at in trace
    /// mode (with `--master`, give the remote master's; not given, its default, 0.90).
    #[arg(long)]
    eviction_watermark: Option<f64>,
    /// Trace mode: only simulate exact LRU and Belady's MIN at the capacity `--segment-size`
    /// (512 MiB by default) holds under `--eviction-watermark`; no store is started.
    #[arg(long)]
    simulate_only: bool,
    /// Embedded mode: what ends a read lease, reads (its readers being done) or ttl.
    #[arg(long)]
    lease_mode: Option<mooncake_master::core::LeaseMode>,
    /// Embedded mode: which objects eviction takes first, car or lru.
    #[arg(long)]
    eviction_policy: Option<mooncake_master::core::EvictionPolicy>,
    /// Embedded mode: the master's read lease, e.g. 10s or 200ms.
    #[arg(long, value_parser = mooncake_common::config::parse_duration)]
    lease_ttl: Option<Duration>,
    /// The cluster's secret file: the client proves it (as MOONCAKE_AUTH_TOKEN_FILE does), and
    /// in embedded mode the master and owners require it (connections authenticated, every
    /// transfer sealed).
    #[arg(long)]
    auth_token_file: Option<std::path::PathBuf>,
}

impl Args {
    /// The eviction watermark the store runs at (see `eviction_watermark`).
    fn watermark(&self) -> f64 {
        self.eviction_watermark.unwrap_or(if self.master.is_some() {
            mooncake_master::MasterConfig::default().eviction_high_watermark_ratio
        } else {
            0.95
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchOp {
    Put,
    Get,
    Putget,
}

#[derive(Serialize)]
struct Row {
    op: &'static str,
    value_size: u64,
    keys: usize,
    batch: usize,
    gib_s: f64,
    p50_us: f64,
    p99_us: f64,
    errors: usize,
    verified: usize,
    seconds: f64,
    /// Which data path moved the bytes: "shm" (same-host shared memory), "tcp", or "mixed".
    path: &'static str,
    /// Gets: which tier served them ("mem", "disk", "mixed"); "-" for puts and SSD rows.
    tier: &'static str,
    /// Gets: keys served from an SSD tier.
    disk_keys: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.keys == 0 || args.batch == 0 || args.value_size.is_empty() {
        bail!("--keys, --batch and --value-size must be positive");
    }
    if args.value_size.iter().any(|s| s.bytes() == 0) {
        bail!("--value-size must be positive");
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    if let (Some(path), true) = (&args.trace, args.simulate_only) {
        return simulate(&args, path);
    }
    let file: Option<ClientConfig> = match &args.config {
        Some(path) => Some(mooncake_common::config::load_toml(path)?),
        None => None,
    };
    let remote = args
        .master
        .clone()
        .or_else(|| file.as_ref().map(|c| c.master.clone()));
    let embedded = match &remote {
        Some(_) => None,
        None => Some(Embedded::start(&args).await?),
    };
    let master = match (&remote, &embedded) {
        (Some(m), _) => m.clone(),
        (None, Some(e)) => e.master.rpc_addr.to_string(),
        (None, None) => unreachable!(),
    };
    // Defaults (or the file), then the environment (MOONCAKE_SHM, MOONCAKE_TRANSFER_THREADS,
    // ...), then flags.
    let base = match file {
        Some(c) => ClientConfig {
            master: master.clone(),
            ..c
        },
        None => ClientConfig::new(master.clone()),
    };
    let mut config = base.with_process_env()?;
    if let Some(p) = &args.preferred_segment {
        config.preferred_segment = Some(p.clone());
    }
    if let Some(f) = &args.auth_token_file {
        config.auth_token_file = Some(f.clone());
    }
    let client = Client::connect(config)
        .await
        .with_context(|| format!("cannot connect to master {master}"))?;
    if let Some(e) = &embedded {
        eprintln!(
            "mooncake_bench: embedded master {} with {} owner(s) of {} each",
            e.master.rpc_addr,
            e.owners.len(),
            ByteSize(e.segment_size)
        );
    }
    if let Some(path) = &args.trace {
        let res = replay_trace(&client, &args, path, embedded.as_ref()).await;
        if let Some(e) = embedded {
            e.stop().await;
        }
        return res;
    }
    if !args.json {
        println!(
            "{:<5} {:>10} {:>6} {:>6} {:>8} {:>10} {:>10} {:>7} {:>9} {:>5} {:>5}",
            "op",
            "value",
            "keys",
            "batch",
            "GiB/s",
            "p50_us",
            "p99_us",
            "errors",
            "verified",
            "path",
            "tier"
        );
    }
    let run_id = std::process::id();
    let prefix = args
        .key_prefix
        .clone()
        .unwrap_or_else(|| format!("bench/{run_id}"));
    warm_up(&client, run_id).await;
    let mut failed = false;
    for size in &args.value_size {
        let rows = phases(
            &client,
            &args,
            size.bytes() as usize,
            &prefix,
            embedded.as_ref(),
        )
        .await;
        for row in rows {
            failed |= row.errors > 0;
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:<5} {:>10} {:>6} {:>6} {:>8.3} {:>10.0} {:>10.0} {:>7} {:>9} {:>5} {:>5}",
                    row.op,
                    ByteSize(row.value_size).to_string(),
                    row.keys,
                    row.batch,
                    row.gib_s,
                    row.p50_us,
                    row.p99_us,
                    row.errors,
                    row.verified,
                    row.path,
                    row.tier
                );
            }
        }
    }
    if let Some(e) = embedded {
        e.stop().await;
    }
    if failed {
        bail!("some operations failed (see the errors column)");
    }
    Ok(())
}

/// Trace mode without a store: the hit ratios of exact LRU and Belady's MIN.
fn simulate(args: &Args, path: &std::path::Path) -> anyhow::Result<()> {
    let t = trace::Trace::load(path)?;
    let block = args.block_size.bytes();
    anyhow::ensure!(block > 0, "--block-size must be positive");
    let memory = args.segment_size.map_or(512 << 20, |s| s.bytes()) * args.owners.max(1) as u64;
    let capacity = (memory as f64 * args.watermark() / block as f64) as usize;
    let (lru, min) = (
        trace::lru_hit_ratio(&t, capacity),
        trace::min_hit_ratio(&t, capacity),
    );
    if args.json {
        let v = serde_json::json!({
            "requests": t.requests.len(), "blocks": t.blocks(), "unique_blocks": t.unique_blocks(),
            "capacity_blocks": capacity, "lru_hit_ratio": lru, "min_hit_ratio": min,
        });
        println!("{v}");
    } else {
        println!(
            "trace {}: {} requests, {} blocks ({} unique); {capacity} blocks fit: LRU {lru:.3}, MIN {min:.3}",
            path.display(),
            t.requests.len(),
            t.blocks(),
            t.unique_blocks()
        );
    }
    Ok(())
}

/// Trace mode: replays the trace and prints what it measured.
async fn replay_trace(
    client: &Client,
    args: &Args,
    path: &std::path::Path,
    embedded: Option<&Embedded>,
) -> anyhow::Result<()> {
    let t = trace::Trace::load(path)?;
    let block = args.block_size.bytes() as usize;
    anyhow::ensure!(block > 0, "--block-size must be positive");
    // The simulations get the blocks the store keeps before it evicts: its memory under the
    // watermark.
    let memory: u64 = match embedded {
        Some(e) => e.segment_size * e.owners.len() as u64,
        None => client
            .list_segments()
            .await?
            .iter()
            .map(|s| s.capacity)
            .sum(),
    };
    let capacity = (memory as f64 * args.watermark() / block as f64) as usize;
    let prefix = args
        .key_prefix
        .clone()
        .unwrap_or_else(|| format!("trace/{}", std::process::id()));
    warm_up(client, std::process::id()).await;
    let r = trace::replay(client, &t, block, &prefix, capacity).await;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "trace {}: {} requests, {} blocks ({} unique) of {}, {} blocks fit (LRU and MIN \
             simulated at an eviction watermark of {})",
            path.display(),
            r.requests,
            r.blocks,
            r.unique_blocks,
            ByteSize(r.block_size),
            r.capacity_blocks,
            args.watermark()
        );
        if args.ssd_path.is_some() {
            println!(
                "(the owner has an SSD tier: hits include reads from it, while LRU and MIN hold only \
                 what memory does)"
            );
        }
        println!(
            "{:>10} {:>12} {:>8} {:>8} {:>8} {:>12} {:>12} {:>10} {:>10} {:>9} {:>7}",
            "req/s",
            "store_req/s",
            "hit",
            "LRU",
            "MIN",
            "lookup_p50",
            "lookup_p99",
            "put_p50",
            "put_p99",
            "verified",
            "errors"
        );
        println!(
            "{:>10.0} {:>12.0} {:>8.3} {:>8.3} {:>8.3} {:>12.0} {:>12.0} {:>10.0} {:>10.0} {:>9} {:>7}",
            r.requests_per_s,
            r.store_requests_per_s,
            r.hit_ratio,
            r.lru_hit_ratio,
            r.min_hit_ratio,
            r.lookup_get_p50_us,
            r.lookup_get_p99_us,
            r.put_p50_us,
            r.put_p99_us,
            r.verified,
            r.wrong_bytes + r.failed_gets + r.failed_puts + r.lookup_errors
        );
    }
    if r.wrong_bytes > 0 || r.lookup_errors > 0 {
        bail!(
            "{} blocks read back wrong, {} block lookups failed",
            r.wrong_bytes,
            r.lookup_errors
        );
    }
    Ok(())
}

/// Opens connections and maps same-host pools before anything is timed: one small put, get
/// and remove on every owner the master places it on.
async fn warm_up(client: &Client, run_id: u32) {
    let segments = client
        .list_segments()
        .await
        .map(|s| s.len())
        .unwrap_or(1)
        .max(1);
    for i in 0..segments * 4 {
        let key = format!("bench/{run_id}/warmup/{i}");
        let mut buf = [0u8; 64];
        if client
            .put(&key, &buf, &ReplicateConfig::default())
            .await
            .is_ok()
        {
            let _ = client.get(&key, &mut buf).await;
            let _ = client.remove(&key, true).await;
        }
    }
}

/// The phases `--op` asks for, on `keys` values of `size`: put, then (in an embedded run with
/// an SSD tier) the SSD write row, then get; putget removes the keys afterwards.
async fn phases(
    client: &Client,
    args: &Args,
    size: usize,
    prefix: &str,
    embedded: Option<&Embedded>,
) -> Vec<Row> {
    let keys: Vec<String> = (0..args.keys)
        .map(|i| format!("{prefix}/{size}/{i}"))
        .collect();
    let batch = args.batch.min(keys.len());
    let mut rows = Vec::new();
    if args.op != BenchOp::Get {
        let ssd_before = embedded.and_then(|e| e.ssd_written());
        let t = Instant::now();
        rows.push(put_phase(client, args, &keys, size, batch).await);
        if let (Some(e), Some(before)) = (embedded, ssd_before) {
            rows.push(e.ssd_write_row(before, t, size, args.keys, batch).await);
        }
    }
    if args.op != BenchOp::Put {
        rows.push(get_phase(client, args, &keys, size, batch).await);
    }
    if args.op == BenchOp::Putget {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        if let Err(e) = client.batch_remove(&refs, true).await {
            tracing::warn!(error = %e, "cleanup failed");
        }
    }
    rows
}

async fn put_phase(
    client: &Client,
    args: &Args,
    keys: &[String],
    size: usize,
    batch: usize,
) -> Row {
    let cfg = ReplicateConfig {
        replica_num: args.replicas,
        ..Default::default()
    };
    let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; size]).collect();
    let mut put = stats::Phase::default();
    let before = client.transfer_stats();
    for chunk in keys.chunks(batch) {
        for (k, b) in chunk.iter().zip(bufs.iter_mut()) {
            pattern::fill(k, b);
        }
        let items: Vec<(&str, &[u8])> = chunk
            .iter()
            .map(|k| k.as_str())
            .zip(bufs.iter().map(|b| b.as_slice()))
            .collect();
        let t = Instant::now();
        let res = client.batch_put(&items, &cfg).await;
        let took = t.elapsed();
        let mut stored = 0;
        for (k, r) in chunk.iter().zip(res) {
            match r {
                Ok(_) => stored += size,
                Err(e) => {
                    put.errors += 1;
                    if put.errors <= 3 {
                        tracing::warn!(key = %k, error = %e, "put failed");
                    }
                }
            }
        }
        // Only what was stored counts toward the rate.
        put.record(took, stored);
    }
    let path = stats::path(before, client.transfer_stats());
    put.row("put", size, keys.len(), batch, path, "-")
}

async fn get_phase(
    client: &Client,
    _args: &Args,
    keys: &[String],
    size: usize,
    batch: usize,
) -> Row {
    let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; size]).collect();
    let mut get = stats::Phase::default();
    let before = client.transfer_stats();
    for chunk in keys.chunks(batch) {
        for b in bufs.iter_mut() {
            b.fill(0);
        }
        let refs: Vec<&str> = chunk.iter().map(|k| k.as_str()).collect();
        let mut slices: Vec<&mut [u8]> = bufs
            .iter_mut()
            .take(chunk.len())
            .map(|b| b.as_mut_slice())
            .collect();
        let t = Instant::now();
        let res = client.batch_get(&refs, &mut slices).await;
        let took = t.elapsed();
        let mut read = 0;
        for ((k, r), b) in chunk.iter().zip(res).zip(bufs.iter()) {
            match r {
                Ok(n) if n == size && pattern::verify(k, b) => {
                    get.verified += 1;
                    read += size;
                }
                Ok(n) => {
                    get.errors += 1;
                    tracing::error!(key = %k, bytes = n, "WRONG BYTES");
                }
                Err(e) => {
                    get.errors += 1;
                    if get.errors <= 3 {
                        tracing::warn!(key = %k, error = %e, "get failed");
                    }
                }
            }
        }
        // Only what was read (and verified) counts toward the rate.
        get.record(took, read);
    }
    let after = client.transfer_stats();
    let mut row = get.row(
        "get",
        size,
        keys.len(),
        batch,
        stats::path(before, after),
        stats::tier(before, after),
    );
    row.disk_keys = after.disk_keys - before.disk_keys;
    row
}

struct Embedded {
    master: RunningMaster,
    owners: Vec<RunningOwner>,
    segment_size: u64,
}

impl Embedded {
    /// Bytes written to the owners' SSD tiers so far; None without one.
    fn ssd_written(&self) -> Option<u64> {
        let tiers: Vec<u64> = self
            .owners
            .iter()
            .filter_map(|o| o.ssd().map(|s| s.stats().written_bytes))
            .collect();
        (!tiers.is_empty()).then(|| tiers.iter().sum())
    }

    /// The SSD write row: bytes the owners wrote to SSD since `before`, over the time from the
    /// put phase's start until no offload is left (waiting at most 60 s for them to land).
    async fn ssd_write_row(
        &self,
        before: u64,
        start: Instant,
        size: usize,
        keys: usize,
        batch: usize,
    ) -> Row {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.master.with_state(|s| s.offloads_outstanding()) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = start.elapsed();
        let written = self.ssd_written().unwrap_or(before) - before;
        for o in &self.owners {
            if let Some(s) = o.ssd() {
                tracing::info!(buffers = s.buffers_allocated(), stats = ?s.stats(), "ssd tier after the put phase");
            }
        }
        Row {
            op: "ssd-w",
            value_size: size as u64,
            keys,
            batch,
            gib_s: written as f64 / took.as_secs_f64() / (1u64 << 30) as f64,
            p50_us: 0.0,
            p99_us: 0.0,
            errors: 0,
            verified: 0,
            seconds: took.as_secs_f64(),
            path: "-",
            tier: "disk",
            disk_keys: 0,
        }
    }
}

impl Embedded {
    async fn start(args: &Args) -> anyhow::Result<Embedded> {
        // Removed keys that were just read stay leased (10 s), so room for every value size at
        // once keeps one size's leftovers from pushing the next one into eviction.
        let total: u64 = args.value_size.iter().map(|s| s.bytes()).sum();
        let needed =
            total * args.keys as u64 * args.replicas.max(1) as u64 / args.owners.max(1) as u64;
        // Stay below the eviction watermark so the bench measures transfers, not eviction; a
        // trace runs against a cache smaller than its working set on purpose.
        let default_size = match args.trace {
            Some(_) => 512 << 20,
            None => (needed * 100 / 85 + (64 << 20)).next_multiple_of(1 << 20),
        };
        let segment_size = args.segment_size.map_or(default_size, |s| s.bytes());
        let defaults = MasterConfig::default();
        let master = RunningMaster::start(MasterConfig {
            bind_address: "127.0.0.1".into(),
            rpc_port: 0,
            metrics_port: 0,
            eager_offload: args.eager_offload,
            eviction_high_watermark_ratio: args.watermark(),
            default_kv_lease_ttl: args.lease_ttl.unwrap_or(defaults.default_kv_lease_ttl),
            lease_mode: args.lease_mode.unwrap_or(defaults.lease_mode),
            eviction_policy: args.eviction_policy.unwrap_or(defaults.eviction_policy),
            auth_token_file: args.auth_token_file.clone(),
            ..defaults
        })
        .await
        .context("cannot start the embedded master")?;
        let mut owners = Vec::new();
        for i in 0..args.owners.max(1) {
            let owner = RunningOwner::start(OwnerConfig {
                master: master.rpc_addr.to_string(),
                host: "127.0.0.1".into(),
                port: 0,
                segment_size: ByteSize(segment_size),
                heartbeat_interval: Duration::from_secs(1),
                // One directory per owner: each tier owns its file.
                ssd_path: args.ssd_path.as_ref().map(|p| p.join(format!("owner{i}"))),
                ssd_size: args.ssd_size,
                auth_token_file: args.auth_token_file.clone(),
                ..Default::default()
            })
            .await
            .context("cannot start the embedded owner")?;
            owners.push(owner);
        }
        Ok(Embedded {
            master,
            owners,
            segment_size,
        })
    }

    async fn stop(self) {
        for o in self.owners {
            o.shutdown().await;
        }
        self.master.shutdown().await;
    }
}
