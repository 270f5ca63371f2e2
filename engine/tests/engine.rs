//! Two engines on loopback in one process, over TCP and over the same-host path (one
//! `process_vm` copy): batches both ways verified byte for byte, refusals of every range a peer
//! did not register, unregistering under a transfer, and dead or silent peers turned into
//! errors within the deadline.

use std::time::{Duration, Instant};

use mooncake_engine::{EngineConfig, EngineError, TransferEngine, TransferOp, TransferRequest};

async fn engine(timeout: Duration) -> TransferEngine {
    engine_on(timeout, false).await
}

async fn engine_on(timeout: Duration, same_host: bool) -> TransferEngine {
    TransferEngine::start(EngineConfig {
        local_hostname: "127.0.0.1:5555".into(),
        transfer_timeout: timeout,
        same_host,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn addr(v: &[u8]) -> u64 {
    v.as_ptr() as u64
}

/// The same requests with their local side moved from the buffer at `from` to the one at `to`.
fn moved(requests: &[TransferRequest], from: u64, to: u64) -> Vec<TransferRequest> {
    (requests.iter())
        .map(|r| TransferRequest {
            local: r.local - from + to,
            ..*r
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_move_both_ways_byte_for_byte() {
    for same_host in [false, true] {
        batches_both_ways(same_host).await;
    }
}

async fn batches_both_ways(same_host: bool) {
    let a = engine_on(Duration::from_secs(10), same_host).await;
    let b = engine(Duration::from_secs(10)).await;
    assert!(a.session_name().starts_with("127.0.0.1:"));
    assert_ne!(
        a.rpc_port(),
        5555,
        "a free port is picked, as Mooncake does"
    );
    // The last: more ranges than one same-host grant lists (all of a request's KV blocks).
    let shapes = [
        (64usize, 4096usize),
        (16, 128 << 10),
        (8, 4 << 20),
        (40_000, 16),
    ];
    for (blocks, block) in shapes {
        let src = pattern(blocks * block, 7);
        let dst = vec![0u8; blocks * block];
        let back = vec![0u8; blocks * block];
        a.register(addr(&src), src.len() as u64).unwrap();
        a.register(addr(&back), back.len() as u64).unwrap();
        b.register(addr(&dst), dst.len() as u64).unwrap();
        // Scatter: block i goes to slot (i * 7) % blocks on the peer.
        let slot = |i: usize| (i * 7) % blocks;
        let writes: Vec<TransferRequest> = (0..blocks)
            .map(|i| TransferRequest {
                local: addr(&src) + (i * block) as u64,
                remote: addr(&dst) + (slot(i) * block) as u64,
                len: block as u64,
            })
            .collect();
        a.transfer(b.session_name(), TransferOp::Write, &writes)
            .await
            .unwrap();
        for i in 0..blocks {
            assert_eq!(
                &dst[slot(i) * block..][..block],
                &src[i * block..][..block],
                "block {i} of {block} bytes"
            );
        }
        // And back, by reading from the peer.
        let reads = moved(&writes, addr(&src), addr(&back));
        a.transfer(b.session_name(), TransferOp::Read, &reads)
            .await
            .unwrap();
        assert!(back == src, "read back {blocks} x {block}");
        for v in [&src, &back] {
            a.unregister(addr(v)).await.unwrap();
        }
        b.unregister(addr(&dst)).await.unwrap();
    }
    assert!(a.regions().is_empty() && b.regions().is_empty());
    let stats = a.stats();
    if same_host {
        assert_eq!(
            (stats.same_host_batches, stats.tcp_batches),
            (8, 0),
            "{stats:?}"
        );
    } else {
        assert_eq!(
            (stats.same_host_batches, stats.tcp_batches),
            (0, 8),
            "{stats:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_and_small_payloads_pipelined_on_one_connection_land_byte_for_byte() {
    // One connection, so the target reads every frame of the batch from one stream: after a
    // large write it reads the next header alone, after a small one through its buffer.
    let a = TransferEngine::start(EngineConfig {
        local_hostname: "127.0.0.1".into(),
        connections_per_peer: 1,
        same_host: false,
        ..Default::default()
    })
    .await
    .unwrap();
    let b = engine(Duration::from_secs(10)).await;
    let sizes = [
        3usize,
        200 << 10,
        4096,
        64 << 10,
        (16 << 10) - 1,
        16 << 10,
        1,
        (1 << 20) + 5,
        17,
        (16 << 10) + 1,
        300 << 10,
        9,
    ];
    let total: usize = sizes.iter().sum();
    let src = pattern(total, 5);
    let mut dst = vec![0u8; total];
    a.register(addr(&src), total as u64).unwrap();
    b.register(addr(&dst), total as u64).unwrap();
    let mut at = 0;
    let writes: Vec<TransferRequest> = sizes
        .iter()
        .map(|&n| {
            let r = TransferRequest {
                local: addr(&src) + at as u64,
                remote: addr(&dst) + at as u64,
                len: n as u64,
            };
            at += n;
            r
        })
        .collect();
    for round in 0..3 {
        // Each round in another order, so every size follows every kind of frame.
        let mut batch = writes.clone();
        batch.rotate_left(round * 5);
        a.transfer(b.session_name(), TransferOp::Write, &batch)
            .await
            .unwrap();
        assert!(dst == src, "round {round}: the target's bytes differ");
        // Cleared between rounds while unregistered, so no transfer touches it meanwhile.
        b.unregister(addr(&dst)).await.unwrap();
        dst.fill(0);
        b.register(addr(&dst), total as u64).unwrap();
    }
    assert_eq!(a.stats().tcp_batches, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_reaches_only_what_its_target_registered() {
    for same_host in [false, true] {
        only_registered_ranges(same_host).await;
    }
}

async fn only_registered_ranges(same_host: bool) {
    let a = engine_on(Duration::from_secs(5), same_host).await;
    let b = engine(Duration::from_secs(5)).await;
    let src = pattern(8192, 1);
    let dst = vec![0u8; 4096];
    let outside = vec![0u8; 4096];
    a.register(addr(&src), 8192).unwrap();
    b.register(addr(&dst), 4096).unwrap();
    let w = |remote: u64, len: u64| {
        [TransferRequest {
            local: addr(&src),
            remote,
            len,
        }]
    };
    for (what, req) in [
        ("unregistered memory", w(addr(&outside), 16)),
        ("a range running past the region", w(addr(&dst) + 4000, 200)),
        ("a range wrapping the address space", w(u64::MAX - 8, 16)),
        ("address 0", w(0, 16)),
    ] {
        let e = a
            .transfer(b.session_name(), TransferOp::Write, &req)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("not inside a registered region"),
            "{what}: {e}"
        );
        assert_eq!(e.code(), -1, "{what}");
        let e = a
            .transfer(b.session_name(), TransferOp::Read, &req)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("registered region"), "{what}: {e}");
    }
    // A batch large enough for the same-host path, reaching past the peer's region.
    let big = pattern(256 << 10, 2);
    a.register(addr(&big), big.len() as u64).unwrap();
    let e = a
        .transfer(
            b.session_name(),
            TransferOp::Write,
            &[TransferRequest {
                local: addr(&big),
                remote: addr(&dst),
                len: big.len() as u64,
            }],
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("not inside a registered region"),
        "{e}"
    );
    assert!(dst.iter().all(|&x| x == 0) && outside.iter().all(|&x| x == 0));
    // After refusals the connections stay usable.
    a.transfer(b.session_name(), TransferOp::Write, &w(addr(&dst), 4096))
        .await
        .unwrap();
    assert_eq!(&dst[..], &src[..4096]);
    // A local buffer outside this engine's regions is refused before anything is sent.
    let stray = vec![0u8; 64];
    let e = a
        .transfer(
            b.session_name(),
            TransferOp::Read,
            &[TransferRequest {
                local: addr(&stray),
                remote: addr(&dst),
                len: 64,
            }],
        )
        .await
        .unwrap_err();
    assert!(matches!(e, EngineError::NotRegistered { .. }));
    assert_eq!(e.code(), -3);
    // A session name that is not the target's own (here: the same port by another name) is
    // refused by the target.
    let alias = format!("localhost:{}", b.rpc_port());
    let e = a
        .transfer(&alias, TransferOp::Write, &w(addr(&dst), 16))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not localhost"), "{e}");
    // Regions of a peer, as get_first_buffer_address needs.
    assert_eq!(
        a.peer_regions(b.session_name()).await.unwrap(),
        vec![(addr(&dst), 4096)]
    );
    assert!(matches!(
        a.transfer("no-port", TransferOp::Write, &w(addr(&dst), 1))
            .await,
        Err(EngineError::Invalid(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistering_waits_for_the_transfer_that_uses_the_region() {
    for same_host in [false, true] {
        unregister_under_a_transfer(same_host).await;
    }
}

async fn unregister_under_a_transfer(same_host: bool) {
    let a = std::sync::Arc::new(engine_on(Duration::from_secs(20), same_host).await);
    let b = engine(Duration::from_secs(20)).await;
    let len = 128usize << 20;
    let src = pattern(len, 3);
    let dst = vec![0u8; len];
    b.register(addr(&dst), len as u64).unwrap();
    let reqs: Vec<TransferRequest> = (0..64)
        .map(|i| TransferRequest {
            local: addr(&src) + (i * (len / 64)) as u64,
            remote: addr(&dst) + (i * (len / 64)) as u64,
            len: (len / 64) as u64,
        })
        .collect();
    // Until a round where the transfer took the region before unregistering did (a transfer
    // that comes second is refused, which is right too but shows nothing).
    for round in 0..20 {
        a.register(addr(&src), len as u64).unwrap();
        let (name, a2, reqs) = (b.session_name().to_string(), a.clone(), reqs.clone());
        let transfer =
            tokio::spawn(async move { a2.transfer(&name, TransferOp::Write, &reqs).await });
        tokio::time::sleep(Duration::from_millis(2)).await;
        a.unregister(addr(&src)).await.unwrap();
        // What the peer holds the moment unregister returned.
        let complete = dst == src;
        match transfer.await.unwrap() {
            Ok(()) => {
                assert!(
                    complete,
                    "unregister returned before the transfer's bytes moved"
                );
                return;
            }
            Err(e) => assert!(
                matches!(e, EngineError::NotRegistered { .. }),
                "round {round}: {e}"
            ),
        }
    }
    panic!("the transfer never started before unregister in 20 rounds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_silent_peers_fail_within_the_deadline() {
    for same_host in [false, true] {
        dead_and_silent(same_host).await;
    }
}

async fn dead_and_silent(same_host: bool) {
    let deadline = Duration::from_millis(500);
    let a = engine_on(deadline, same_host).await;
    let src = pattern(4096, 9);
    a.register(addr(&src), 4096).unwrap();
    let req = [TransferRequest {
        local: addr(&src),
        remote: 0x10000,
        len: 4096,
    }];
    // A peer that is gone: nothing listens on its port.
    let gone = engine(deadline).await;
    let name = gone.session_name().to_string();
    drop(gone);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    assert!(a.transfer(&name, TransferOp::Write, &req).await.is_err());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // A peer that accepts and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let name = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    for op in [TransferOp::Write, TransferOp::Read] {
        let t = Instant::now();
        let e = a.transfer(&name, op, &req).await.unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
        // Asking whether the peer is on this host shares the call's one deadline.
        assert!(t.elapsed() < deadline * 3, "{:?}", t.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_behind_a_silent_peer_end_by_their_own_deadline() {
    for same_host in [false, true] {
        queued_behind_silent(same_host).await;
    }
}

/// More calls than connections to a peer that never answers: the ones waiting for a connection
/// fail by their own deadline too, not one deadline after those ahead of them.
async fn queued_behind_silent(same_host: bool) {
    let deadline = Duration::from_millis(1500);
    let a = engine_on(deadline, same_host).await;
    let src = pattern(256 << 10, 3);
    a.register(addr(&src), src.len() as u64).unwrap();
    // 256 KiB each: large enough for the same-host path to be asked first.
    let req = [TransferRequest {
        local: addr(&src),
        remote: 0x10000,
        len: src.len() as u64,
    }];
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let name = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    // 8 connections per peer by default: 20 calls queue for them.
    let calls = (0..20).map(|_| async {
        let t = Instant::now();
        let r = a.transfer(&name, TransferOp::Write, &req).await;
        (r, t.elapsed())
    });
    for (r, took) in futures::future::join_all(calls).await {
        let e = r.unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
        // Before one deadline per call, the queued calls took two deadlines or more.
        assert!(
            took < deadline + Duration::from_millis(700),
            "same_host {same_host}: {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_buffers_are_registered_and_local_bytes_stay_inside_regions() {
    let a = engine(Duration::from_secs(5)).await;
    let b = engine(Duration::from_secs(5)).await;
    let buf = a.allocate_managed(1 << 20).unwrap();
    assert_eq!(buf % 4096, 0);
    assert_eq!(a.regions(), vec![(buf, 1 << 20)]);
    a.write_local(buf + 10, b"hello").unwrap();
    assert_eq!(a.read_local(buf + 10, 5).unwrap(), b"hello");
    assert!(
        a.read_local(buf + (1 << 20) - 2, 5).is_err(),
        "past the end"
    );
    let far = b.allocate_managed(4096).unwrap();
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &[TransferRequest {
            local: buf + 10,
            remote: far,
            len: 5,
        }],
    )
    .await
    .unwrap();
    assert_eq!(b.read_local(far, 5).unwrap(), b"hello");
    a.free_managed(buf).await.unwrap();
    assert!(a.regions().is_empty());
    assert!(a.free_managed(buf).await.is_err());
    assert!(
        a.read_local(buf, 1).is_err(),
        "freed memory is not readable"
    );
    // Unregistered first (as `unregister_memory` would): still freed, its mapping gone.
    let other = a.allocate_managed(1 << 20).unwrap();
    let before = mapping(other).expect("mapped");
    a.unregister(other).await.unwrap();
    a.free_managed(other).await.unwrap();
    assert_ne!(
        mapping(other).as_ref(),
        Some(&before),
        "the buffer was unmapped"
    );
    // And one unregistered when its engine goes is freed with it.
    let last = a.allocate_managed(1 << 20).unwrap();
    let before = mapping(last).expect("mapped");
    a.unregister(last).await.unwrap();
    drop(a);
    assert_ne!(
        mapping(last).as_ref(),
        Some(&before),
        "freed with its engine"
    );
}

/// The /proc/self/maps line of the mapping at `addr` less its permissions (its range, offset,
/// device, inode and file): another mapping placed at the same address meanwhile, by a test
/// running beside this one, has another inode.
fn mapping(addr: u64) -> Option<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(&format!("{addr:x}-")))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} {}", f[0], f[2..].join(" "))
        })
}

/// A managed buffer unregistered and partly registered again is not freed under that region,
/// neither by `free_managed` (refused as in use, -4) nor with its engine (left allocated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_buffer_with_a_region_registered_inside_is_not_freed() {
    let a = engine(Duration::from_secs(5)).await;
    let buf = a.allocate_managed(1 << 20).unwrap();
    a.unregister(buf).await.unwrap();
    a.register(buf + 4096, 4096).unwrap();
    let e = a.free_managed(buf).await.unwrap_err();
    assert_eq!(e.code(), -4, "{e}");
    assert!(matches!(e, EngineError::InUse { .. }), "{e}");
    // Still mapped: the region inside it is read and written as before.
    a.write_local(buf + 4096, b"kv").unwrap();
    assert_eq!(a.read_local(buf + 4096, 2).unwrap(), b"kv");
    // Once that region goes, the buffer can.
    a.unregister(buf + 4096).await.unwrap();
    a.free_managed(buf).await.unwrap();
    // With its engine: left allocated while a region inside it remains.
    let kept = a.allocate_managed(1 << 20).unwrap();
    let before = mapping(kept).expect("mapped");
    a.unregister(kept).await.unwrap();
    a.register(kept + (8 << 10), 4096).unwrap();
    drop(a);
    assert_eq!(mapping(kept), Some(before), "left allocated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_is_staged_never_read_as_host_memory() {
    use mooncake_client::device::{host_backed::HostBackedDevice, DeviceMemory};
    use mooncake_engine::Devices;
    use std::sync::Arc;

    // Device-like memory whose addresses fault if dereferenced: only its copies move bytes.
    let (dev_a, dev_b) = (
        Arc::new(HostBackedDevice::new()),
        Arc::new(HostBackedDevice::new()),
    );
    let start = |dev: Arc<HostBackedDevice>| {
        TransferEngine::start(EngineConfig {
            local_hostname: "127.0.0.1".into(),
            transfer_timeout: Duration::from_secs(10),
            same_host: true, // a device's memory must still go over TCP, staged
            devices: Devices(vec![dev as Arc<dyn DeviceMemory>]),
            ..Default::default()
        })
    };
    let a = start(dev_a.clone()).await.unwrap();
    let b = start(dev_b.clone()).await.unwrap();
    let len = 1usize << 20;
    let src = pattern(len, 11);
    let da = dev_a.alloc(len);
    let db = dev_b.alloc(len);
    dev_a.copy_from_host(&src, da).unwrap();
    let host_b = vec![0u8; len];
    let host_a = pattern(len, 12);
    a.register(da as u64, len as u64).unwrap();
    a.register(addr(&host_a), len as u64).unwrap();
    b.register(db as u64, len as u64).unwrap();
    b.register(addr(&host_b), len as u64).unwrap();
    let one = |local: u64, remote: u64| {
        [TransferRequest {
            local,
            remote,
            len: len as u64,
        }]
    };
    // Device -> host: staged on the caller.
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &one(da as u64, addr(&host_b)),
    )
    .await
    .unwrap();
    assert!(host_b == src);
    // Host -> device: staged on the target.
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &one(addr(&host_a), db as u64),
    )
    .await
    .unwrap();
    let mut got = vec![0u8; len];
    dev_b.copy_to_host(db, &mut got).unwrap();
    assert!(got == host_a);
    // Device -> device, by reading: staged on both sides.
    a.transfer(
        b.session_name(),
        TransferOp::Read,
        &one(da as u64, db as u64),
    )
    .await
    .unwrap();
    dev_a.copy_to_host(da, &mut got).unwrap();
    assert!(got == host_a);
    let stats = a.stats();
    assert_eq!(
        (stats.same_host_batches, stats.tcp_batches),
        (0, 3),
        "{stats:?}"
    );
    assert!(!dev_a.take_staging_sizes().is_empty() && !dev_b.take_staging_sizes().is_empty());
    // Host memory on both sides still takes the same-host path; a device target refuses it
    // and the transfer goes over TCP, staged there.
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &one(addr(&host_a), addr(&host_b)),
    )
    .await
    .unwrap();
    assert_eq!(a.stats().same_host_batches, 1);
    let src2 = pattern(len, 13);
    a.write_local(addr(&host_a), &src2).unwrap();
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &one(addr(&host_a), db as u64),
    )
    .await
    .unwrap();
    dev_b.copy_to_host(db, &mut got).unwrap();
    assert!(got == src2);
    // A range a device claims only part of is refused, not taken for host memory.
    let e = a.register(da as u64 + (len as u64) - 16, 4096).unwrap_err();
    assert!(e.to_string().contains("partly device memory"), "{e}");
    // Local reads and writes of device memory go through the device too.
    a.write_local(da as u64 + 5, b"gpu").unwrap();
    assert_eq!(a.read_local(da as u64 + 5, 3).unwrap(), b"gpu");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_callers_small_transfers_take_blocking_sockets_with_the_same_checks() {
    let deadline = Duration::from_millis(500);
    let a = engine(deadline).await;
    let b = engine(deadline).await;
    // A requester for a caller that waits for its calls (as the binding's synchronous ones).
    let sync = a.requester(true);
    let src = pattern(64 << 10, 21);
    let dst = vec![0u8; 64 << 10];
    let back = vec![0u8; 64 << 10];
    a.register(addr(&src), src.len() as u64).unwrap();
    a.register(addr(&back), back.len() as u64).unwrap();
    b.register(addr(&dst), dst.len() as u64).unwrap();
    for len in [1u64, 4096, 64 << 10] {
        let w = [TransferRequest {
            local: addr(&src),
            remote: addr(&dst),
            len,
        }];
        sync.transfer(b.session_name(), TransferOp::Write, &w)
            .await
            .unwrap();
        assert_eq!(&dst[..len as usize], &src[..len as usize]);
        let r = [TransferRequest {
            local: addr(&back),
            ..w[0]
        }];
        sync.transfer(b.session_name(), TransferOp::Read, &r)
            .await
            .unwrap();
        assert_eq!(&back[..len as usize], &src[..len as usize]);
    }
    // Refused by the target, and the connection stays usable.
    let outside = [TransferRequest {
        local: addr(&src),
        remote: addr(&dst) + (64 << 10) - 8,
        len: 16,
    }];
    let e = sync
        .transfer(b.session_name(), TransferOp::Write, &outside)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("not inside a registered region"),
        "{e}"
    );
    let ok = [TransferRequest {
        local: addr(&src),
        remote: addr(&dst),
        len: 8,
    }];
    sync.transfer(b.session_name(), TransferOp::Write, &ok)
        .await
        .unwrap();
    // A silent peer: an error within the deadline, not a wait.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let name = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    let t = Instant::now();
    assert!(sync.transfer(&name, TransferOp::Read, &ok).await.is_err());
    assert!(t.elapsed() < deadline * 3, "{:?}", t.elapsed());
    // A dead one: at once.
    let name = b.session_name().to_string();
    drop(b);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    assert!(sync.transfer(&name, TransferOp::Write, &ok).await.is_err());
    assert!(t.elapsed() < deadline * 3, "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_grant_holds_its_range_until_released_or_disconnected() {
    let deadline = Duration::from_millis(200);
    let b = engine(deadline).await;
    let region = vec![0u8; 4096];
    b.register(addr(&region), 4096).unwrap();
    // A peer that is granted the range and then neither copies nor releases: its copy could
    // still be running, so the range is never given up under it.
    let (s, status, _) = raw_grant(&b, 0, addr(&region), 4096).await;
    assert_eq!(status, 0, "granted");
    // Unregistering gives up after twice the deadline: -4, and the region stays registered.
    let t = Instant::now();
    let e = b.unregister(addr(&region)).await.unwrap_err();
    assert_eq!(e.code(), -4, "{e}");
    assert!(t.elapsed() < deadline * 4, "{:?}", t.elapsed());
    assert_eq!(b.regions(), vec![(addr(&region), 4096)]);
    // Once the peer is gone, its grant goes with it.
    drop(s);
    b.unregister(addr(&region)).await.unwrap();
    // A peer that holds a grant past four times the deadline (stuck, or hostile) has its
    // connection closed, and the range goes.
    b.register(addr(&region), 4096).unwrap();
    let (mut s, status, _) = raw_grant(&b, 0, addr(&region), 4096).await;
    assert_eq!(status, 0, "granted");
    let t = Instant::now();
    let mut rest = Vec::new();
    use tokio::io::AsyncReadExt;
    let closed = tokio::time::timeout(deadline * 10, s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "closed");
    assert!(t.elapsed() >= deadline * 3, "{:?}", t.elapsed());
    b.unregister(addr(&region)).await.unwrap();
}

/// A same-host peer that is granted a range and then sends requests without reading their
/// answers (so that the engine's flush of them cannot finish) loses its grant all the same, by
/// the grant's deadline: the range can be unregistered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_holder_that_reads_no_answers_loses_its_grant() {
    use mooncake_common::wire::{Op, RequestHeader};
    use tokio::io::AsyncWriteExt;

    let deadline = Duration::from_millis(250);
    let b = engine(deadline).await;
    let region = vec![0u8; 4096];
    b.register(addr(&region), 4096).unwrap();
    // A small receive buffer: the engine's answers back up after about a megabyte.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock
        .connect(b.session_name().parse().unwrap())
        .await
        .unwrap();
    let name = b.session_name().as_bytes();
    let frame = |op, length, grant| {
        let mut f = RequestHeader {
            op,
            key_len: name.len() as u16,
            flags: 0,
            request_id: 1,
            offset: 0,
            length,
            grant,
            seal: Default::default(),
        }
        .encode()
        .to_vec();
        f.extend_from_slice(name);
        f
    };
    let mut grant = frame(Op::PeerGrant, 16, b.incarnation());
    grant.extend_from_slice(&addr(&region).to_le_bytes());
    grant.extend_from_slice(&4096u64.to_le_bytes());
    s.write_all(&grant).await.unwrap();
    // Bursts of requests, each let through before the next: the engine answers a burst, then
    // flushes its answers as the peer waits for them. Its reply buffer never fills within a
    // burst (where a frame's own deadline would end the connection): it is the flush that waits
    // on this peer once the socket's buffers are full, about a megabyte on.
    let burst = frame(Op::PeerRegions, 0, 0).repeat(256);
    for _ in 0..400 {
        match tokio::time::timeout(deadline / 2, s.write_all(&burst)).await {
            Ok(Ok(())) => tokio::time::sleep(Duration::from_millis(2)).await,
            // The engine stopped reading (its flush waits), or closed the connection.
            Ok(Err(_)) | Err(_) => break,
        }
    }
    // The grant goes by its deadline (four times the engine's), the connection unread.
    let t = Instant::now();
    let released = tokio::time::timeout(deadline * 20, async {
        while b.unregister(addr(&region)).await.is_err() {}
    })
    .await;
    assert!(released.is_ok(), "still held after {:?}", t.elapsed());
    drop(s);
}

/// A stopping engine answers a connection that holds a grant only with the release of it:
/// reads and writes of its memory are refused, and the connection closes once released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_engine_answers_a_grant_holder_only_its_release() {
    use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let b = engine(Duration::from_secs(5)).await;
    let region = vec![7u8; 4096];
    b.register(addr(&region), 4096).unwrap();
    let (mut s, status, len) = raw_grant(&b, 0, addr(&region), 4096).await;
    assert_eq!(status, 0, "granted");
    let mut answer = vec![0u8; len as usize];
    s.read_exact(&mut answer).await.unwrap();
    b.stop();
    let name = b.session_name().as_bytes().to_vec();
    let frame = |op, length| {
        let mut f = RequestHeader {
            op,
            key_len: name.len() as u16,
            flags: 0,
            request_id: 2,
            offset: addr(&region),
            length,
            grant: b.incarnation(),
            seal: Default::default(),
        }
        .encode()
        .to_vec();
        f.extend_from_slice(&name);
        f
    };
    s.write_all(&frame(Op::PeerRead, 4096)).await.unwrap();
    let mut hb = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut hb).await.unwrap();
    let r = ResponseHeader::decode(&hb).unwrap();
    assert_eq!((r.op, r.status), (Op::PeerRead, -1010), "refused");
    let mut msg = vec![0u8; r.length as usize];
    s.read_exact(&mut msg).await.unwrap();
    assert!(String::from_utf8_lossy(&msg).contains("stopping"));
    s.write_all(&frame(Op::PeerRelease, 0)).await.unwrap();
    s.read_exact(&mut hb).await.unwrap();
    assert_eq!(ResponseHeader::decode(&hb).unwrap().status, 0, "released");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert_eq!(closed.unwrap().unwrap(), 0, "closed after the release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_an_earlier_incarnation_are_refused_and_move_nothing() {
    use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let b = engine(Duration::from_secs(2)).await;
    let region = vec![7u8; 4096];
    b.register(addr(&region), 4096).unwrap();
    let mut s = tokio::net::TcpStream::connect(b.session_name())
        .await
        .unwrap();
    let name = b.session_name().as_bytes().to_vec();
    let earlier = b.incarnation() ^ 0x5a5a;
    let head = |op, length, grant| {
        let mut f = RequestHeader {
            op,
            key_len: name.len() as u16,
            flags: 0,
            request_id: 1,
            offset: if op == Op::PeerGrant {
                0
            } else {
                addr(&region)
            },
            length,
            grant,
            seal: Default::default(),
        }
        .encode()
        .to_vec();
        f.extend_from_slice(&name);
        f
    };
    // Pipelined: a write, a read and a grant naming another incarnation, then a write naming
    // this one. The refused writes' payloads are skipped, so the stream stays in step.
    let mut frames = head(Op::PeerWrite, 4096, earlier);
    frames.extend_from_slice(&[1u8; 4096]);
    frames.extend(head(Op::PeerRead, 4096, earlier));
    frames.extend(head(Op::PeerGrant, 16, earlier));
    frames.extend_from_slice(&addr(&region).to_le_bytes());
    frames.extend_from_slice(&4096u64.to_le_bytes());
    // A write naming no incarnation, as an engine from before incarnations sends it: refused
    // as an older release (InvalidParams), not as a restart.
    frames.extend(head(Op::PeerWrite, 4096, 0));
    frames.extend_from_slice(&[3u8; 4096]);
    frames.extend(head(Op::PeerWrite, 4096, b.incarnation()));
    frames.extend_from_slice(&[2u8; 4096]);
    s.write_all(&frames).await.unwrap();
    let refusals = [
        (Op::PeerWrite, -101, "restarted"),
        (Op::PeerRead, -101, "restarted"),
        (Op::PeerGrant, -101, "restarted"),
        (Op::PeerWrite, -600, "older release"),
    ];
    for (op, code, says) in refusals {
        let mut hb = [0u8; RESPONSE_HEADER_LEN];
        s.read_exact(&mut hb).await.unwrap();
        let r = ResponseHeader::decode(&hb).unwrap();
        assert_eq!((r.op, r.status), (op, code), "{op:?} refused with {code}");
        let mut msg = vec![0u8; r.length as usize];
        s.read_exact(&mut msg).await.unwrap();
        let msg = String::from_utf8_lossy(&msg);
        assert!(msg.contains(says), "{msg}");
    }
    let mut hb = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut hb).await.unwrap();
    assert_eq!(
        ResponseHeader::decode(&hb).unwrap().status,
        0,
        "this incarnation's write"
    );
    assert_eq!(b.read_local(addr(&region), 4096).unwrap(), vec![2u8; 4096]);
    // Nothing is held by the refused grant: the region can go at once.
    drop(s);
    b.unregister(addr(&region)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_met_once_is_named_by_its_incarnation_on_every_path() {
    // Over TCP, the same-host path and a waiting caller's blocking small transfers, the
    // requests carry the incarnation the peer answered with: they are served.
    for same_host in [false, true] {
        let a = engine_on(Duration::from_secs(2), same_host).await;
        let b = engine_on(Duration::from_secs(2), same_host).await;
        let src = pattern(1 << 20, 9);
        let dst = vec![0u8; 1 << 20];
        a.register(addr(&src), src.len() as u64).unwrap();
        b.register(addr(&dst), dst.len() as u64).unwrap();
        let sync = a.requester(true);
        let target = b.session_name().to_string();
        for len in [4096u64, 1 << 20] {
            let one = [TransferRequest {
                local: addr(&src),
                remote: addr(&dst),
                len,
            }];
            sync.transfer(&target, TransferOp::Write, &one)
                .await
                .unwrap();
            a.transfer(&target, TransferOp::Write, &one).await.unwrap();
        }
        assert_eq!(b.read_local(addr(&dst), 1 << 20).unwrap(), src);
        assert_ne!(a.incarnation(), b.incarnation());
    }
}

/// The inode of the memory file mapped at `addr` in this process, and how many mappings of it
/// this process has (from /proc/self/maps).
fn memory_file_at(addr: u64) -> (u64, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let fields = |l: &str| -> (u64, u64, u64) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (lo, hi) = f[0].split_once('-').unwrap();
        let r = |h: &str| u64::from_str_radix(h, 16).unwrap();
        (r(lo), r(hi), f[4].parse().unwrap())
    };
    let inode = (maps.lines().map(fields))
        .find(|&(lo, hi, _)| (lo..hi).contains(&addr))
        .map(|(_, _, inode)| inode)
        .unwrap();
    assert_ne!(inode, 0, "a managed buffer lies in a memory file");
    let n = maps.lines().filter(|l| fields(l).2 == inode).count();
    (inode, n)
}

fn mappings_of(inode: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    (maps.lines())
        .filter(|l| l.split_whitespace().nth(4) == Some(&inode.to_string()))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_managed_buffer_is_copied_through_a_mapping_and_a_freed_one_is_let_go() {
    const LEN: usize = 8 << 20;
    let a = engine_on(Duration::from_secs(10), true).await;
    let b = engine(Duration::from_secs(10)).await;
    let (src, back) = (pattern(LEN, 3), vec![0u8; LEN]);
    a.register(addr(&src), LEN as u64).unwrap();
    a.register(addr(&back), LEN as u64).unwrap();
    let blocks = |local: u64, remote: u64, n: usize| -> Vec<TransferRequest> {
        let block = LEN / n;
        (0..n)
            .map(|i| TransferRequest {
                local: local + (i * block) as u64,
                // Scattered on the target: block i to slot (i * 5) % n.
                remote: remote + ((i * 5) % n * block) as u64,
                len: block as u64,
            })
            .collect()
    };
    let first = b.allocate_managed(LEN as u64).unwrap();
    let (inode, n) = memory_file_at(first);
    assert_eq!(n, 1, "only the target maps its buffer yet");
    let writes = blocks(addr(&src), first, 16);
    a.transfer(b.session_name(), TransferOp::Write, &writes)
        .await
        .unwrap();
    for w in &writes {
        let got = b.read_local(w.remote, w.len).unwrap();
        assert!(got[..] == src[(w.local - addr(&src)) as usize..][..w.len as usize]);
    }
    assert_eq!(mappings_of(inode), 2, "the caller mapped the target's file");
    let reads = moved(&writes, addr(&src), addr(&back));
    a.transfer(b.session_name(), TransferOp::Read, &reads)
        .await
        .unwrap();
    assert!(back == src);
    let stats = a.stats();
    assert_eq!((stats.same_host_batches, stats.mapped_batches), (2, 2));
    // Freed, and a new buffer (which may get the freed one's descriptor): bytes go to the new
    // one, and the next grant lets the old mapping go.
    b.free_managed(first).await.unwrap();
    let second = b.allocate_managed(LEN as u64).unwrap();
    let src2 = pattern(LEN, 99);
    a.register(addr(&src2), LEN as u64).unwrap();
    a.transfer(
        b.session_name(),
        TransferOp::Write,
        &blocks(addr(&src2), second, 4),
    )
    .await
    .unwrap();
    let mut want = vec![0u8; LEN];
    for w in blocks(0, 0, 4) {
        want[w.remote as usize..][..w.len as usize]
            .copy_from_slice(&src2[w.local as usize..][..w.len as usize]);
    }
    assert!(b.read_local(second, LEN as u64).unwrap() == want);
    assert_eq!(mappings_of(inode), 0, "the freed buffer's file is let go");
    assert_eq!(memory_file_at(second).1, 2);
    // A batch across a managed buffer and ordinary memory: one process_vm copy instead.
    let plain = vec![0u8; LEN];
    b.register(addr(&plain), LEN as u64).unwrap();
    let mut mixed = blocks(addr(&src), second, 2);
    mixed[1].remote = addr(&plain);
    a.transfer(b.session_name(), TransferOp::Write, &mixed)
        .await
        .unwrap();
    assert!(b.read_local(second, (LEN / 2) as u64).unwrap()[..] == src[..LEN / 2]);
    assert!(plain[..LEN / 2] == src[LEN / 2..]);
    let stats = a.stats();
    assert_eq!((stats.same_host_batches, stats.mapped_batches), (4, 3));
    // Freeing the buffer leaves the caller's mapping until its next grant; stopping the caller
    // unmaps it.
    let (inode2, _) = memory_file_at(second);
    b.free_managed(second).await.unwrap();
    assert_eq!(mappings_of(inode2), 1);
    drop(a);
    assert_eq!(
        mappings_of(inode2),
        0,
        "the stopped caller's mapping is gone"
    );
    b.unregister(addr(&plain)).await.unwrap();
}

/// A raw `PeerGrant` of one range to `e`, with `flags`: the connection (which holds the grant
/// until closed), the answer's status and its length.
async fn raw_grant(
    e: &TransferEngine,
    flags: u16,
    addr: u64,
    len: u64,
) -> (tokio::net::TcpStream, i32, u64) {
    use mooncake_common::wire::{Op, RequestHeader, RESPONSE_HEADER_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut s = tokio::net::TcpStream::connect(e.session_name())
        .await
        .unwrap();
    let name = e.session_name().as_bytes();
    let mut frame = RequestHeader {
        op: Op::PeerGrant,
        key_len: name.len() as u16,
        flags,
        request_id: 1,
        offset: 0,
        length: 16,
        grant: e.incarnation(),
        seal: Default::default(),
    }
    .encode()
    .to_vec();
    frame.extend_from_slice(name);
    frame.extend_from_slice(&addr.to_le_bytes());
    frame.extend_from_slice(&len.to_le_bytes());
    s.write_all(&frame).await.unwrap();
    let mut answer = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut answer).await.unwrap();
    (
        s,
        i32::from_le_bytes(answer[4..8].try_into().unwrap()),
        u64::from_le_bytes(answer[16..24].try_into().unwrap()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_mappings_go_with_the_engine_that_offered_them() {
    use mooncake_common::wire::PEER_GRANT_FILES;

    const LEN: usize = 1 << 20;
    let a = engine_on(Duration::from_secs(10), true).await;
    let b = engine(Duration::from_secs(10)).await;
    let src = pattern(LEN, 5);
    a.register(addr(&src), LEN as u64).unwrap();
    // 4 x 128 KiB: a batch short enough to be copied on the calling task.
    let quarter = |local: u64, remote: u64| -> Vec<TransferRequest> {
        (0..4)
            .map(|i| TransferRequest {
                local: local + (i * (128 << 10)) as u64,
                remote: remote + ((3 - i) * (128 << 10)) as u64,
                len: 128 << 10,
            })
            .collect()
    };
    let m = b.allocate_managed(LEN as u64).unwrap();
    a.transfer(b.session_name(), TransferOp::Write, &quarter(addr(&src), m))
        .await
        .unwrap();
    for i in 0..4usize {
        let got = b
            .read_local(m + ((3 - i) * (128 << 10)) as u64, 128 << 10)
            .unwrap();
        assert!(got[..] == src[i * (128 << 10)..][..128 << 10], "block {i}");
    }
    assert_eq!(a.stats().mapped_batches, 1);
    let (inode, n) = memory_file_at(m);
    assert_eq!(n, 2);
    // The engine stops (its buffers freed); another in the same process answers the caller
    // next, and the caller lets the stopped one's file go.
    drop(b);
    assert_eq!(mappings_of(inode), 1, "the caller's mapping alone");
    let c = engine(Duration::from_secs(10)).await;
    let m2 = c.allocate_managed(LEN as u64).unwrap();
    a.transfer(
        c.session_name(),
        TransferOp::Write,
        &quarter(addr(&src), m2),
    )
    .await
    .unwrap();
    assert_eq!(mappings_of(inode), 0, "the stopped engine's file is let go");
    assert_eq!(a.stats().mapped_batches, 2);
    assert!(c.read_local(m2 + (3 << 17), 128 << 10).unwrap()[..] == src[..128 << 10]);
    // The grant answer: the pid alone unless the caller asks where the ranges lie (a caller of
    // an older release expects 8 bytes).
    let (_, status, len) = raw_grant(&c, 0, m2, 4096).await;
    assert_eq!((status, len), (0, 8));
    let (_, status, len) = raw_grant(&c, PEER_GRANT_FILES, m2, 4096).await;
    assert_eq!((status, len), (0, 16 + 32));
}
