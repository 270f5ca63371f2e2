//! Nothing lost across a master restart, without HA: the owners are the source of truth. A master
//! killed with SIGKILL and started again on the same address learns from the remounting owners
//! what their pools hold (replica counts and pins included), every object whose put ended before
//! the kill reads back byte for byte through a client that never reconnected by hand, lookups
//! made during the rebuild wait for it instead of answering "not found", and new puts never land
//! over the old objects. Real master and owner processes on loopback.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig, PutOutcome, ReplicateConfig};
use mooncake_tests::{
    check_payloads, free_port, get_code, loopback_master_args, payload, put_payloads, spawn_owner,
    ChildGuard,
};

fn master_on(port: u16) -> ChildGuard {
    master_with(port, &[])
}

fn master_with(port: u16, flags: &[&str]) -> ChildGuard {
    let port = port.to_string();
    let mut args = loopback_master_args(&port).to_vec();
    args.extend_from_slice(flags);
    let m = ChildGuard::spawn("mooncake_master", &args);
    m.wait_line("mooncake_master ready", Duration::from_secs(20));
    m
}

const SIZE: usize = 64 << 10;

async fn read_back(client: &Client, keys: &[String]) {
    check_payloads(client, keys, SIZE).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_master_rebuilds_its_catalog_from_the_owners_reports() {
    let port = free_port();
    let rpc = format!("127.0.0.1:{port}");
    let mut master = master_on(port);
    let beat = ["--heartbeat-interval", "200ms"];
    let (_a, seg_a) = spawn_owner(&rpc, "32MiB", &beat);
    let (_b, seg_b) = spawn_owner(&rpc, "32MiB", &beat);
    let client = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(5),
        ..ClientConfig::new(&rpc)
    })
    .await
    .unwrap();

    let one: Vec<String> = (0..120).map(|i| format!("one/{i}")).collect();
    let two: Vec<String> = (0..20).map(|i| format!("two/{i}")).collect();
    let put =
        async |keys: &[String], cfg: &ReplicateConfig| put_payloads(&client, keys, SIZE, cfg).await;
    put(&one, &ReplicateConfig::default()).await;
    let twice = ReplicateConfig {
        replica_num: 2,
        hard_pin: true,
        ..ReplicateConfig::default()
    };
    put(&two, &twice).await;
    // Removed objects stay removed across the restart: the master tells their owners to forget
    // the ranges at the next heartbeat (every 200 ms; a second leaves room for a slow machine).
    let (one, removed) = one.split_at(100);
    for k in removed {
        client.remove(k, false).await.unwrap();
    }
    // A copy of one object to the segment that lacks it, finished before the kill.
    let desc = client
        .batch_get_replica_desc(&[one[0].as_str()])
        .await
        .unwrap()
        .remove(0)
        .unwrap();
    let other = if desc.replicas[0].segment.as_str() == seg_a {
        seg_b.clone()
    } else {
        seg_a.clone()
    };
    let task = client
        .create_copy_task(&one[0], &[other.as_str()])
        .await
        .unwrap();
    let mut done = false;
    for _ in 0..200 {
        let state = client.query_task(task).await.unwrap();
        if state.status == mooncake_common::ReplicaTaskStatus::Success {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(done, "the copy never finished");
    tokio::time::sleep(Duration::from_secs(1)).await;

    master.signal(libc::SIGKILL);
    master.wait_exit(Duration::from_secs(5));
    let _master = master_on(port);

    // The same client, at once: every lookup waits for the rebuild and finds the exact bytes.
    read_back(&client, one).await;
    read_back(&client, &two).await;
    // A put of a key the master does not know yet waits for the rebuild too (an owner yet to
    // report may hold it), then stores.
    let during = ["during/rebuild".to_string()];
    put(&during, &ReplicateConfig::default()).await;
    // The task went with the old master; asked for it, the new one says so.
    let err = client.query_task(task).await.unwrap_err();
    assert_eq!(err.code().as_i32(), -704, "{err}");
    assert!(
        err.to_string().contains("an earlier master made it"),
        "{err}"
    );
    assert_eq!(
        client
            .batch_get_replica_desc(&[one[0].as_str()])
            .await
            .unwrap()[0]
            .as_ref()
            .unwrap()
            .replicas
            .len(),
        2,
        "the copy was reported"
    );
    let descs = client
        .batch_get_replica_desc(&two.iter().map(|k| k.as_str()).collect::<Vec<_>>())
        .await
        .unwrap();
    for d in descs {
        assert_eq!(d.unwrap().replicas.len(), 2, "both replicas were reported");
    }

    // A key nobody put is definitely missing once the rebuild is over (within the deadline),
    // and so is every key removed before the kill.
    let mut buf = vec![0u8; SIZE];
    assert_eq!(get_code(&client.get("never/put", &mut buf).await), -704);
    for k in removed {
        assert_eq!(
            get_code(&client.get(k, &mut buf).await),
            -704,
            "{k} came back"
        );
    }
    // Keys are write-once across the restart, and new puts never land over old objects.
    assert_eq!(
        client
            .put(
                &one[0],
                &payload("other", SIZE),
                &ReplicateConfig::default()
            )
            .await
            .unwrap(),
        PutOutcome::AlreadyExists
    );
    let fresh: Vec<String> = (0..100).map(|i| format!("fresh/{i}")).collect();
    put(&fresh, &ReplicateConfig::default()).await;
    read_back(&client, &fresh).await;
    read_back(&client, &during).await;
    read_back(&client, one).await;
    read_back(&client, &two).await;
    let segs = client.list_segments().await.unwrap();
    assert_eq!(segs.len(), 2);
    let used: u64 = segs.iter().map(|s| s.allocated).sum();
    // 100 (one of them copied) + 2 x 20 + 100 + 1 objects of 64 KiB are accounted for.
    assert_eq!(
        used,
        (101 + 40 + 100 + 1) * SIZE as u64,
        "{segs:?} (owner {seg_a})"
    );
}

/// A read hold granted by a master that has restarted since never ends a lease the new master
/// granted: a reader checks "k" (keeping its hold for the get that usually follows), the master
/// restarts, a second reader leases "k" from the new one, and then the first reader's next calls
/// hand its old hold back. The second reader's lease stands: a remove without force is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_from_before_a_restart_leaves_the_new_masters_leases_alone() {
    let port = free_port();
    let rpc = format!("127.0.0.1:{port}");
    // Leases far longer than the restart, so that the old hold is still in time to go back.
    let ttl = ["--default_kv_lease_ttl", "60000"];
    let mut master = master_with(port, &ttl);
    let (_owner, _) = spawn_owner(&rpc, "8MiB", &["--heartbeat-interval", "200ms"]);
    let connect = async || {
        Client::connect(ClientConfig {
            rpc_timeout: Duration::from_secs(5),
            ..ClientConfig::new(&rpc)
        })
        .await
        .unwrap()
    };
    let first = connect().await;
    first
        .put("k", &payload("k", 4096), &ReplicateConfig::default())
        .await
        .unwrap();
    assert!(first.exists("k").await.unwrap());

    master.signal(libc::SIGKILL);
    master.wait_exit(Duration::from_secs(5));
    let _master = master_with(port, &ttl);
    let second = connect().await;
    // Waits for the rebuild, then leases "k" until the second reader's next call.
    assert!(second.exists("k").await.unwrap());

    assert!(!first.exists("other").await.unwrap());
    assert!(!first.exists("other").await.unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = connect().await.remove("k", false).await.unwrap_err();
    assert_eq!(
        err.code(),
        mooncake_client::Code::ObjectHasLease,
        "the new master's lease was ended by a hold the old one granted: {err}"
    );
}

/// A removal asked of a restarted master before the owner holding the key has reported waits
/// for the report and removes it: before, the master answered "not found", the caller took the
/// key as gone, and the report brought it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_during_the_rebuild_waits_for_the_report() {
    let port = free_port();
    let rpc = format!("127.0.0.1:{port}");
    let mut master = master_on(port);
    let (owner, _seg) = spawn_owner(&rpc, "16MiB", &["--heartbeat-interval", "200ms"]);
    let client = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(8),
        ..ClientConfig::new(&rpc)
    })
    .await
    .unwrap();
    let keys = vec!["gone/0".to_string()];
    put_payloads(&client, &keys, SIZE, &ReplicateConfig::default()).await;

    // The owner cannot report until it is let go on.
    owner.stop();
    master.signal(libc::SIGKILL);
    master.wait_exit(Duration::from_secs(5));
    // A grace long enough for the owner to be let go on and report on a loaded machine, short
    // enough for the last get's "not found" to come within the client's deadline.
    let _master = master_with(port, &["--rebuild_grace_sec", "5"]);
    // The client's connection went with the old master: a call that changes nothing finds the
    // new one (a removal is not asked twice after a broken connection).
    let mut reconnected = false;
    for _ in 0..50 {
        if client.list_segments().await.is_ok() {
            reconnected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reconnected);
    let removal = tokio::spawn(async move {
        let r = client.remove("gone/0", false).await;
        (client, r)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    owner.signal(libc::SIGCONT);
    let (client, removed) = removal.await.unwrap();
    removed.expect("removed once its owner reported it");
    let mut buf = vec![0u8; SIZE];
    assert_eq!(get_code(&client.get("gone/0", &mut buf).await), -704);
}

/// More freed-range notes than one heartbeat's answer carries (16,384) reach the owner in one
/// round of heartbeats, not one answer's worth per heartbeat interval: 17,000 objects removed
/// before a restart stay removed though only one of the owner's heartbeats (every 8 s) came
/// between. Before, the notes left for the next answer brought their objects back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_freed_notes_is_applied_in_one_heartbeat_round() {
    const N: usize = 17_000;
    const SMALL: usize = 256;
    const BEAT: Duration = Duration::from_secs(8);
    let port = free_port();
    let rpc = format!("127.0.0.1:{port}");
    // The restarted master waits for an owner that heartbeats this seldom.
    let flags = ["--rebuild_grace_sec", "10"];
    let mut master = master_with(port, &flags);
    let (_owner, _) = spawn_owner(&rpc, "64MiB", &["--heartbeat-interval", "8s"]);
    // Its heartbeats come at once, then every 8 s from about now.
    let mounted = std::time::Instant::now();
    let client = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(30),
        ..ClientConfig::new(&rpc)
    })
    .await
    .unwrap();
    let keys: Vec<String> = (0..N).map(|i| format!("gone/{i}")).collect();
    for chunk in keys.chunks(2000) {
        put_payloads(&client, chunk, SMALL, &ReplicateConfig::default()).await;
    }
    let kept: Vec<String> = (0..10).map(|i| format!("kept/{i}")).collect();
    put_payloads(&client, &kept, SMALL, &ReplicateConfig::default()).await;
    assert_eq!(
        client.remove_by_regex("^gone/", false).await.unwrap(),
        N as u64
    );
    // Halfway between the next heartbeat and the one after (4 s either side, for a loaded
    // machine's drift).
    let beats = mounted.elapsed().as_secs_f64() / BEAT.as_secs_f64();
    let next = mounted + BEAT.mul_f64(beats.ceil());
    tokio::time::sleep_until((next + BEAT / 2).into()).await;

    master.signal(libc::SIGKILL);
    master.wait_exit(Duration::from_secs(5));
    let _master = master_with(port, &flags);
    check_payloads(&client, &kept, SMALL).await;
    let mut back = 0;
    for chunk in keys.chunks(2000) {
        let refs: Vec<&str> = chunk.iter().map(|k| k.as_str()).collect();
        for r in client.batch_exists(&refs).await.unwrap() {
            back += usize::from(r.unwrap());
        }
    }
    assert_eq!(back, 0, "removed objects came back after the restart");
}
