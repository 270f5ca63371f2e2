//! mooncake_bench keeps working: a short embedded run in JSON mode, every get verified.

use mooncake_tests::bin_path;

#[test]
fn the_bench_runs_embedded_and_verifies_every_byte() {
    let out = std::process::Command::new(bin_path("mooncake_bench"))
        .args([
            "--value-size",
            "4KiB,100KiB",
            "--keys",
            "40",
            "--batch",
            "16",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
