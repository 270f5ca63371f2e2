//! mooncake_bench keeps working: a short embedded run in JSON mode, every get verified.

use mooncake_tests::{bin_path, TempDir};

#[test]
fn the_bench_runs_embedded_and_verifies_every_byte() {
    let rows = run_json(&[
        "--value-size",
        "4KiB,100KiB",
        "--keys",
        "40",
        "--batch",
        "16",
        "--json",
    ]);
    assert_eq!(rows.len(), 4);
    for r in &rows {
        for field in [
            "op",
            "value_size",
            "keys",
            "batch",
            "gib_s",
            "p50_us",
            "p99_us",
            "errors",
            "verified",
        ] {
            assert!(r.get(field).is_some(), "{field} missing in {r}");
        }
        assert_eq!(r["errors"], 0);
        assert_eq!(r["keys"], 40);
        if r["op"] == "get" {
            assert_eq!(r["verified"], 40);
        }
    }
}

fn run_json(args: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(bin_path("mooncake_bench"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The SSD-tier workflow of the README: one run puts (with eager offload) and keeps the values,
/// a second process on the same SSD directory with little memory reads them all from disk.
#[test]
fn the_bench_writes_to_an_ssd_tier_and_a_second_run_reads_it_back_from_disk() {
    let dir = TempDir::new("bench-ssd");
    let d = dir.path().to_str().unwrap();
    let common = [
        "--ssd-path",
        d,
        "--ssd-size",
        "64MiB",
        "--value-size",
        "256KiB",
        "--keys",
        "64",
        "--batch",
        "16",
        "--key-prefix",
        "smoke",
        "--json",
    ];
    let mut put = common.to_vec();
    put.extend(["--op", "put", "--eager-offload", "--segment-size", "64MiB"]);
    let rows = run_json(&put);
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["put", "ssd-w"]);
    assert_eq!(rows[0]["errors"], 0);
    let mut get = common.to_vec();
    get.extend(["--op", "get", "--segment-size", "8MiB"]);
    let rows = run_json(&get);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["errors"], 0);
    assert_eq!(rows[0]["verified"], 64);
    assert_eq!(rows[0]["tier"], "disk");
    assert_eq!(rows[0]["disk_keys"], 64);
}

/// Trace mode: a small trace whose working set fits the cache twice over replays with every
/// repeated prefix hit and every block verified; one that does not fit stays at or below what
/// Belady's MIN can reach.
#[test]
fn the_bench_replays_a_trace_and_reports_hits_next_to_lru_and_min() {
    let dir = TempDir::new("bench-trace");
    let path = dir.path().join("trace.jsonl");
    // 40 requests over 4 conversations: each turn extends its conversation's prefix by 2.
    let mut lines = String::new();
    for turn in 0..10u64 {
        for conv in 0..4u64 {
            let ids: Vec<u64> = (0..2 * (turn + 1)).map(|b| conv * 1000 + b).collect();
            lines.push_str(&format!("{{\"hash_ids\": {ids:?}}}\n"));
        }
    }
    std::fs::write(&path, lines).unwrap();
    let trace = path.to_str().unwrap();
    let roomy = run_json(&[
        "--trace",
        trace,
        "--block-size",
        "16KiB",
        "--segment-size",
        "64MiB",
        "--json",
    ]);
    let r = &roomy[0];
    // Turn t (t >= 1) finds the 2t blocks of the turn before: 2 * (1 + ... + 9) = 90 per
    // conversation of 110 blocks.
    let expected = 90.0 * 4.0 / 440.0;
    for field in ["hit_ratio", "lru_hit_ratio", "min_hit_ratio"] {
        let v = r[field].as_f64().unwrap();
        assert!(
            (v - expected).abs() < 1e-9,
            "{field} = {v}, expected {expected}: {r}"
        );
    }
    assert_eq!(r["verified"], 360);
    assert_eq!(r["wrong_bytes"], 0);
    assert_eq!(r["failed_gets"], 0);
    assert_eq!(r["failed_puts"], 0);
    assert_eq!(r["unique_blocks"], 80);
    // Only the simulations, at a capacity of 16 blocks: MIN beats LRU on this cyclic pattern.
    let sim = run_json(&[
        "--trace",
        trace,
        "--simulate-only",
        "--block-size",
        "1MiB",
        "--segment-size",
        "16MiB",
        "--eviction-watermark",
        "1.0",
        "--json",
    ]);
    let s = &sim[0];
    assert_eq!(s["capacity_blocks"], 16);
    let (lru, min) = (
        s["lru_hit_ratio"].as_f64().unwrap(),
        s["min_hit_ratio"].as_f64().unwrap(),
    );
    assert!(min > lru, "MIN {min} must beat LRU {lru} here");
}

/// `--config` takes the client's settings from a TOML file (config/client.toml's format), its
/// master included: the bench runs against that master instead of an embedded one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_reads_client_settings_from_a_config_file() {
    let c = mooncake_tests::Cluster::start(&[16 << 20]).await;
    let dir = TempDir::new("bench-config");
    let path = dir.path().join("client.toml");
    std::fs::write(
        &path,
        format!(
            "master = \"{}\"\nrpc_timeout = \"4s\"\nshared_memory = false\n",
            c.master_addr()
        ),
    )
    .unwrap();
    let config = path.display().to_string();
    let rows = tokio::task::spawn_blocking(move || {
        run_json(&[
            "--config",
            &config,
            "--value-size",
            "4KiB",
            "--keys",
            "20",
            "--batch",
            "10",
            "--json",
        ])
    })
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["errors"] == 0));
    // The puts went to the file's master (and were removed by the bench after).
    let (_, m) = mooncake_tests::http_get(&c.master.http_addr.to_string(), "/metrics").await;
    let puts = mooncake_tests::metric(&m, "master_put_start_requests_total");
    assert!(puts >= 20, "{puts}");
    c.shutdown().await;
}
