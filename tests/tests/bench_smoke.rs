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
