//! mooncake_bench: a KV-cache-shaped workload. Puts `--keys` values of each `--value-size` in
//! batches of `--batch`, gets them back, checks every byte, and prints a table (or JSON lines).
//! Without `--master` it runs on an embedded default: a master and one owner on loopback in this
//! process, stopped at the end.

mod pattern;
mod stats;

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
    /// Master to run against, HOST:PORT. Without it: an embedded master and owner on loopback.
    #[arg(long)]
    master: Option<String>,
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
    let embedded = match &args.master {
        Some(_) => None,
        None => Some(Embedded::start(&args).await?),
    };
    let master = match (&args.master, &embedded) {
        (Some(m), _) => m.clone(),
        (None, Some(e)) => e.master.rpc_addr.to_string(),
        (None, None) => unreachable!(),
    };
    let config = ClientConfig {
        preferred_segment: args.preferred_segment.clone(),
        ..ClientConfig::new(master.clone())
    };
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
    if !args.json {
        println!(
            "{:<4} {:>10} {:>6} {:>6} {:>8} {:>10} {:>10} {:>7} {:>9} {:>5}",
            "op",
            "value",
            "keys",
            "batch",
            "GiB/s",
            "p50_us",
            "p99_us",
            "errors",
            "verified",
            "path"
        );
    }
    let run_id = std::process::id();
    warm_up(&client, run_id).await;
    let mut failed = false;
    for size in &args.value_size {
        let rows = phase_pair(&client, &args, size.bytes() as usize, run_id).await;
        for row in rows {
            failed |= row.errors > 0;
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:<4} {:>10} {:>6} {:>6} {:>8.3} {:>10.0} {:>10.0} {:>7} {:>9} {:>5}",
                    row.op,
                    ByteSize(row.value_size).to_string(),
                    row.keys,
                    row.batch,
                    row.gib_s,
                    row.p50_us,
                    row.p99_us,
                    row.errors,
                    row.verified,
                    row.path
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

/// Puts then gets `keys` values of `size`, returning the two rows; removes the keys afterwards.
async fn phase_pair(client: &Client, args: &Args, size: usize, run_id: u32) -> Vec<Row> {
    let keys: Vec<String> = (0..args.keys)
        .map(|i| format!("bench/{run_id}/{size}/{i}"))
        .collect();
    let cfg = ReplicateConfig {
        replica_num: args.replicas,
        ..Default::default()
    };
    let batch = args.batch.min(keys.len());
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
        put.record(t.elapsed(), chunk.len() * size);
        for (k, r) in chunk.iter().zip(res) {
            if let Err(e) = r {
                put.errors += 1;
                if put.errors <= 3 {
                    tracing::warn!(key = %k, error = %e, "put failed");
                }
            }
        }
    }

    let put_path = stats::path(before, client.transfer_stats());
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
        get.record(t.elapsed(), chunk.len() * size);
        for ((k, r), b) in chunk.iter().zip(res).zip(bufs.iter()) {
            match r {
                Ok(n) if n == size && pattern::verify(k, b) => get.verified += 1,
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
    }
    let get_path = stats::path(before, client.transfer_stats());
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    if let Err(e) = client.batch_remove(&refs, true).await {
        tracing::warn!(error = %e, "cleanup failed");
    }
    vec![
        put.row("put", size, args.keys, batch, put_path),
        get.row("get", size, args.keys, batch, get_path),
    ]
}

struct Embedded {
    master: RunningMaster,
    owners: Vec<RunningOwner>,
    segment_size: u64,
}

impl Embedded {
    async fn start(args: &Args) -> anyhow::Result<Embedded> {
        // Removed keys that were just read stay leased (10 s), so room for every value size at
        // once keeps one size's leftovers from pushing the next one into eviction.
        let total: u64 = args.value_size.iter().map(|s| s.bytes()).sum();
        let needed =
            total * args.keys as u64 * args.replicas.max(1) as u64 / args.owners.max(1) as u64;
        // Stay below the eviction watermark so the bench measures transfers, not eviction.
        let segment_size = args
            .segment_size
            .map(|s| s.bytes())
            .unwrap_or((needed * 100 / 85 + (64 << 20)).next_multiple_of(1 << 20));
        let master = RunningMaster::start(MasterConfig {
            bind_address: "127.0.0.1".into(),
            rpc_port: 0,
            metrics_port: 0,
            ..Default::default()
        })
        .await
        .context("cannot start the embedded master")?;
        let mut owners = Vec::new();
        for _ in 0..args.owners.max(1) {
            let owner = RunningOwner::start(OwnerConfig {
                master: master.rpc_addr.to_string(),
                host: "127.0.0.1".into(),
                port: 0,
                segment_size: ByteSize(segment_size),
                heartbeat_interval: Duration::from_secs(1),
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
