//! The fuzz targets in CI: the kept corpus replayed, every decoder fed a burst of fresh inputs,
//! the harness shown to catch what it looks for, and live servers fed mutated frames while a real
//! client keeps working. `mooncake_fuzz` runs the same for millions of inputs.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig};
use mooncake_proto::framed as rpc_wire;
use mooncake_tests::{
    bin_path,
    fuzz::{self, CountingAlloc, Finding, Target},
    fuzz_net::{fuzz_servers, panics_logged, round_trip, rss_kib, start_servers},
    TempDir,
};
use tokio::io::AsyncWriteExt;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn the_kept_corpus_passes_every_target() {
    let mut replayed = 0;
    for t in fuzz::TARGETS {
        let Ok(dir) = std::fs::read_dir(fuzz::corpus_dir(t.name)) else {
            continue;
        };
        for f in dir.flatten() {
            let input = std::fs::read(f.path()).unwrap();
            if let Err(finding) = fuzz::check(t, &input) {
                panic!(
                    "{}: {} fails again: {finding:?}",
                    t.name,
                    f.path().display()
                );
            }
            replayed += 1;
        }
    }
    println!("replayed {replayed} kept inputs");
}

#[test]
fn every_decoder_survives_fresh_inputs() {
    for t in fuzz::TARGETS {
        let report = fuzz::fuzz(t, 20_000, 0xC0FFEE);
        assert!(
            report.findings.is_empty(),
            "{}: {:?}",
            t.name,
            report.findings.first().map(|(i, f)| (i.len(), f))
        );
        assert_eq!(report.inputs, 20_000);
    }
}

fn panics_on_ff(b: &[u8]) {
    assert!(b.first() != Some(&0xFF), "a planted bug");
}

fn trusts_a_declared_length(b: &[u8]) {
    if let Some(len) = b.first_chunk::<4>() {
        let declared = u32::from_le_bytes(*len) as usize;
        if declared > (64 << 20) {
            // Reserved, never touched: what a decoder that trusts a length asks for.
            let v: Vec<u8> = Vec::with_capacity(declared);
            std::hint::black_box(&v);
        }
    }
}

#[test]
fn the_harness_catches_panics_and_oversized_allocations() {
    std::panic::set_hook(Box::new(|_| {}));
    let buggy = Target {
        name: "planted-panic",
        seeds: || vec![vec![0u8; 8]],
        run: panics_on_ff,
    };
    assert!(matches!(
        fuzz::check(&buggy, &[0xFF, 1]),
        Err(Finding::Panic(_))
    ));
    assert!(fuzz::check(&buggy, &[0x00, 1]).is_ok());
    assert!(
        !fuzz::fuzz(&buggy, 5_000, 1).findings.is_empty(),
        "the mutations find it"
    );
    let greedy = Target {
        name: "planted-allocation",
        seeds: || vec![vec![0u8; 8]],
        run: trusts_a_declared_length,
    };
    assert!(matches!(
        fuzz::check(&greedy, &u32::MAX.to_le_bytes()),
        Err(Finding::Allocation { .. })
    ));
    assert!(!fuzz::fuzz(&greedy, 5_000, 1).findings.is_empty());
    let _ = std::panic::take_hook();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_servers_survive_mutated_frames_and_keep_serving() {
    let logs = TempDir::new("fuzz-live");
    let (mut master, mut owner, servers) = start_servers(logs.path(), bin_path);
    let client = Client::connect(ClientConfig::new(&servers.master))
        .await
        .unwrap();
    let mut n = 0;
    let report = fuzz_servers(&servers, 3_000, 7, 8, 500, || {
        n += 1;
        let (client, n) = (&client, n);
        async move { round_trip(client, &format!("fuzz/{n}"), 32 << 10).await }
    })
    .await;
    assert!(
        report.failed_checks.is_empty(),
        "{:?}",
        report.failed_checks
    );
    assert!(report.checks >= 6 && report.frames >= 3_000);
    assert!(
        master.child.try_wait().unwrap().is_none(),
        "the master died"
    );
    assert!(owner.child.try_wait().unwrap().is_none(), "the owner died");
    assert_eq!(panics_logged(logs.path()), 0, "a server panicked");
}

/// The bug the network fuzzer found: a frame that declared a large body made the master (and the
/// owner's same-host socket) allocate and zero all of it before a byte of it arrived. Kept as a
/// regression: 32 such frames at once, each sending a kilobyte and waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_declaring_huge_bodies_cost_only_what_they_send() {
    let logs = TempDir::new("fuzz-declared");
    let (master, owner, servers) = start_servers(logs.path(), bin_path);
    let before = (rss_kib(master.pid()), rss_kib(owner.pid()));
    let mut held = Vec::new();
    for i in 0..32 {
        if i % 2 == 0 {
            let mut s = tokio::net::TcpStream::connect(&servers.master)
                .await
                .unwrap();
            s.write_all(&rpc_wire::hello()).await.unwrap();
            s.write_all(&rpc_wire::encode_header(rpc_wire::MAX_BODY, 2, 1))
                .await
                .unwrap();
            s.write_all(&[0u8; 1024]).await.unwrap();
            held.push(Box::new(s) as Box<dyn std::any::Any + Send>);
        } else if let Some(path) = &servers.socket {
            let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
            let mut frame = (mooncake_common::local::MAX_FRAME as u32)
                .to_le_bytes()
                .to_vec();
            frame.push(2); // BeginWrite
            frame.extend_from_slice(&[0u8; 1024]);
            s.write_all(&frame).await.unwrap();
            held.push(Box::new(s));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = (rss_kib(master.pid()), rss_kib(owner.pid()));
    drop(held);
    let grew = |b: u64, a: u64| a.saturating_sub(b) / 1024;
    assert!(
        grew(before.0, after.0) < 64 && grew(before.1, after.1) < 64,
        "RSS grew by {} MiB (master) and {} MiB (owner) for 32 frames of 1 KiB",
        grew(before.0, after.0),
        grew(before.1, after.1)
    );
}
