//! `mooncake_fuzz`: drives the fuzz targets of `mooncake_tests::fuzz` and the network fuzzer.
//!
//!   mooncake_fuzz decoders [--inputs 10000000] [--seed 1] [--target NAME] [--save]
//!   mooncake_fuzz network [--frames 100000] [--seed 1] [--bin-dir DIR]
//!
//! `decoders` feeds every target (or one) that many inputs and prints a table; `--save` keeps each
//! failing input under `tests/fuzz_corpus/<target>/` for the `fuzz` test to replay. `network`
//! starts a master and an owner (from DIR, default: this binary's directory), sends them mutated
//! frames with a real client's verified round trip every 2000 frames, then reports whether either
//! server panicked (their logs), died, or grew. Exits 1 on any finding.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use mooncake_client::{Client, ClientConfig};
use mooncake_tests::{
    fuzz::{self, CountingAlloc, Finding},
    fuzz_net::{fuzz_servers, panics_logged, round_trip, rss_kib, start_servers},
    TempDir,
};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("bad value for {name}")))
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ok = match args.get(1).map(String::as_str) {
        Some("decoders") => decoders(&args),
        Some("network") => network(&args),
        _ => {
            eprintln!("usage: mooncake_fuzz decoders|network [options] (see the source's header)");
            std::process::exit(2);
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}

fn decoders(args: &[String]) -> bool {
    let inputs: u64 = arg(args, "--inputs", 10_000_000);
    let seed: u64 = arg(args, "--seed", 1);
    let only: String = arg(args, "--target", String::new());
    let save = args.iter().any(|a| a == "--save");
    // Panics are caught and counted; their messages would only flood the terminal.
    std::panic::set_hook(Box::new(|_| {}));
    println!("| target | inputs | panics | oversized allocations | inputs/s |");
    println!("|---|---|---|---|---|");
    let mut clean = true;
    for t in fuzz::TARGETS {
        if !only.is_empty() && t.name != only {
            continue;
        }
        let start = Instant::now();
        let report = fuzz::fuzz(t, inputs, seed);
        let secs = start.elapsed().as_secs_f64();
        let panics = report
            .findings
            .iter()
            .filter(|(_, f)| matches!(f, Finding::Panic(_)))
            .count();
        let allocs = report.findings.len() - panics;
        println!(
            "| {} | {} | {panics} | {allocs} | {:.0} |",
            t.name,
            report.inputs,
            report.inputs as f64 / secs
        );
        for (input, finding) in &report.findings {
            clean = false;
            eprintln!("{}: {finding:?} on {} bytes", t.name, input.len());
            if save {
                let dir = fuzz::corpus_dir(t.name);
                std::fs::create_dir_all(&dir).expect("create the corpus directory");
                let name = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    input.hash(&mut h);
                    format!("{:016x}.bin", h.finish())
                };
                std::fs::write(dir.join(name), input).expect("save the input");
            }
        }
    }
    clean
}

fn network(args: &[String]) -> bool {
    let frames: u64 = arg(args, "--frames", 100_000);
    let seed: u64 = arg(args, "--seed", 1);
    let own_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let bin_dir: PathBuf = arg(args, "--bin-dir", own_dir);
    let logs = TempDir::new("fuzz-net");
    let (master, owner, servers) = start_servers(logs.path(), |name| bin_dir.join(name));
    let rpc = servers.master.clone();
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let (rss_before, report, secs) = rt.block_on(async {
        let client = Client::connect(ClientConfig::new(&rpc))
            .await
            .expect("a client before the fuzzing");
        // Warm up the servers' memory before measuring it.
        check(&client, 0).await.expect("a first round trip");
        let before = (rss_kib(master.pid()), rss_kib(owner.pid()));
        let start = Instant::now();
        let mut n = 0u64;
        let report = fuzz_servers(&servers, frames, seed, 16, 2000, || {
            n += 1;
            let client = &client;
            let round = n;
            async move { check(client, round).await }
        })
        .await;
        (before, report, start.elapsed().as_secs_f64())
    });
    let rss_after = (rss_kib(master.pid()), rss_kib(owner.pid()));
    let mut master = master;
    let mut owner = owner;
    let alive = master.child.try_wait().ok().flatten().is_none()
        && owner.child.try_wait().ok().flatten().is_none();
    let panics = panics_logged(logs.path());
    println!("| frames | connections | seconds | round trips (failed) | panics in logs | servers alive | master RSS MiB (before, after) | owner RSS MiB (before, after) |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {secs:.0} | {} ({}) | {panics} | {alive} | {:.1}, {:.1} | {:.1}, {:.1} |",
        report.frames,
        report.connections,
        report.checks,
        report.failed_checks.len(),
        rss_before.0 as f64 / 1024.0,
        rss_after.0 as f64 / 1024.0,
        rss_before.1 as f64 / 1024.0,
        rss_after.1 as f64 / 1024.0,
    );
    for f in &report.failed_checks {
        eprintln!("a round trip failed: {f}");
    }
    report.failed_checks.is_empty() && panics == 0 && alive
}

/// A put and a verified get of a fresh key (see `fuzz_net::round_trip`).
async fn check(client: &Client, round: u64) -> Result<(), String> {
    round_trip(client, &format!("fuzz-check/{round}"), 64 << 10).await
}
