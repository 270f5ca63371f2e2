//! ssd_probe: the raw bandwidth of one directory's disk through the owner's SSD engines. Writes
//! `--size` bytes sequentially in `--block` transfers with `--depth` in flight to an O_DIRECT file,
//! syncs, reads it all back checking a per-page stamp, prints GiB/s and removes the file.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::{bail, ensure, Context};
use clap::Parser;
use mooncake_common::ByteSize;
use mooncake_owner::ssd::{open_direct, open_engine, AlignedBuf, DiskEngine, EngineKind, ALIGN};
use tokio::task::JoinSet;

#[derive(Parser, Debug)]
#[command(
    name = "ssd_probe",
    about = "Sequential O_DIRECT write and read bandwidth of a directory's disk"
)]
struct Args {
    /// Directory on the disk to measure; the probe file `ssd_probe.tmp` is created and removed there.
    #[arg(long)]
    dir: PathBuf,
    /// Total bytes to write and read back.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Bytes per transfer (a multiple of 4 KiB).
    #[arg(long, default_value = "1MiB")]
    block: ByteSize,
    /// Transfers in flight.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    #[arg(long, default_value = "auto")]
    engine: EngineKind,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Removes the probe file when dropped, also when the probe fails.
struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Stamps every 4 KiB page of block `index` with its block and page number.
fn stamp(buf: &mut [u8], index: u64) {
    for (page, chunk) in buf.chunks_exact_mut(ALIGN).enumerate() {
        chunk[..8].copy_from_slice(&index.to_le_bytes());
        chunk[8..16].copy_from_slice(&(page as u64).to_le_bytes());
    }
}

fn check(buf: &[u8], index: u64) -> anyhow::Result<()> {
    for (page, chunk) in buf.chunks_exact(ALIGN).enumerate() {
        let (b, p) = (&chunk[..8], &chunk[8..16]);
        if b != index.to_le_bytes() || p != (page as u64).to_le_bytes() {
            bail!("block {index} page {page} read back wrong bytes");
        }
    }
    Ok(())
}

/// Moves every block with `depth` transfers in flight; returns GiB/s.
async fn phase(engine: &Arc<dyn DiskEngine>, args: &Args, write: bool) -> anyhow::Result<f64> {
    let (block, blocks) = (args.block.bytes(), args.size.bytes() / args.block.bytes());
    let mut free: Vec<AlignedBuf> = (0..args.depth.min(blocks as usize))
        .map(|_| {
            let mut buf = AlignedBuf::with_capacity(block as usize);
            buf.set_len(block as usize);
            buf
        })
        .collect();
    let mut set = JoinSet::new();
    let start = Instant::now();
    let mut next = 0;
    while next < blocks || !set.is_empty() {
        while next < blocks {
            let Some(mut buf) = free.pop() else { break };
            let (i, offset) = (next, next * block);
            let op = if write {
                stamp(&mut buf, i);
                engine.write_at(buf, offset)
            } else {
                engine.read_at(buf, offset)
            };
            set.spawn(async move { (i, op.await) });
            next += 1;
        }
        let (i, (buf, r)) = set.join_next().await.expect("a transfer is in flight")?;
        r.with_context(|| format!("{} of block {i}", if write { "write" } else { "read" }))?;
        if !write {
            check(&buf, i)?;
        }
        free.push(buf);
    }
    if write {
        engine.sync().await.context("sync")?;
    }
    Ok(args.size.bytes() as f64 / (1u64 << 30) as f64 / start.elapsed().as_secs_f64())
}

async fn probe(args: &Args, path: &Path) -> anyhow::Result<(EngineKind, f64, f64)> {
    let file = open_direct(path, args.size.bytes())?;
    let engine = open_engine(args.engine, file, args.depth as u32)?;
    let write = phase(&engine, args, true).await?;
    let read = phase(&engine, args, false).await?;
    Ok((engine.kind(), write, read))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let (size, block) = (args.size.bytes(), args.block.bytes());
    ensure!(
        block > 0 && block.is_multiple_of(ALIGN as u64),
        "--block must be a positive multiple of 4KiB"
    );
    ensure!(
        size >= block && size.is_multiple_of(block),
        "--size must be a positive multiple of --block"
    );
    ensure!(args.depth > 0, "--depth must be at least 1");
    let path = args.dir.join("ssd_probe.tmp");
    let _remove = Remove(path.clone());
    let (engine, write, read) = probe(&args, &path).await?;
    if args.json {
        let row = serde_json::json!({
            "engine": engine, "block": block, "depth": args.depth, "size": size,
            "write_gib_s": write, "read_gib_s": read,
        });
        println!("{row}");
    } else {
        println!(
            "{:<6} {:>8} {:>5} {:>8} {:>12} {:>11}",
            "engine", "block", "depth", "size", "write GiB/s", "read GiB/s"
        );
        println!(
            "{:<6} {:>8} {:>5} {:>8} {write:>12.2} {read:>11.2}",
            engine.to_string(),
            args.block.to_string(),
            args.depth,
            args.size.to_string()
        );
    }
    Ok(())
}
