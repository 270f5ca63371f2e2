//! Real processes on loopback: an owner killed with SIGKILL loses its objects after the client
//! TTL, new puts go to the surviving owner, and calls in flight finish (with errors) within their
//! deadlines. A stopped (SIGSTOP) owner turns reads into errors within the transfer timeout, and
//! a key repeated in a batch whose write failed reports the failure for every occurrence. The
//! idle connections to an owner that went are dropped once a new owner is met, and never used
//! for a call to an owner restarted on the same address.

use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_common::SegmentName;
use mooncake_tests::get_code;
use mooncake_tests::{eventually, payload, spawn_master, spawn_owner, transport};

fn client_config(master: &str) -> ClientConfig {
    ClientConfig {
        transfer_timeout: Duration::from_secs(2),
        rpc_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(1),
        ..ClientConfig::new(master)
    }
}

async fn client_preferring(master: &str, seg: &str) -> Client {
    let cfg = client_config(master);
    Client::connect_with(
        cfg.clone(),
        Some(SegmentName::parse(seg).unwrap()),
        transport(&cfg),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_disappears_after_the_ttl_and_puts_go_to_the_survivor() {
    let (_master, rpc, _http) = spawn_master(&["--client_ttl", "2"]);
    let (owner_a, seg_a) = spawn_owner(&rpc, "64MiB", &["--heartbeat-interval", "200ms"]);
    let (_owner_b, seg_b) = spawn_owner(&rpc, "64MiB", &["--heartbeat-interval", "200ms"]);
    let on_a = client_preferring(&rpc, &seg_a).await;
    let on_b = client_preferring(&rpc, &seg_b).await;
    let cfg = ReplicateConfig::default();
    const N: usize = 16;
    const SIZE: usize = 512 << 10;
    let keys_a: Vec<String> = (0..N).map(|i| format!("a/{i}")).collect();
    let keys_b: Vec<String> = (0..N).map(|i| format!("b/{i}")).collect();
    for (client, keys) in [(&on_a, &keys_a), (&on_b, &keys_b)] {
        let vals: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, SIZE)).collect();
        let items: Vec<(&str, &[u8])> = keys
            .iter()
            .map(|k| k.as_str())
            .zip(vals.iter().map(|v| v.as_slice()))
            .collect();
        assert!(client
            .batch_put(&items, &cfg)
            .await
            .iter()
            .all(|r| r.is_ok()));
    }
    let d = on_a
        .batch_get_replica_desc(&[&keys_a[0]])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(d.replicas[0].segment.as_str(), seg_a);

    // Readers hammer owner A while it is killed; every call must come back within its deadline.
    let reader = {
        let keys = keys_a.clone();
        let client = client_preferring(&rpc, &seg_a).await;
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            let mut failures = 0;
            let stop = Instant::now() + Duration::from_secs(3);
            while Instant::now() < stop {
                let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
                let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; SIZE]).collect();
                let mut slices: Vec<&mut [u8]> =
                    bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                let t = Instant::now();
                let res = client.batch_get(&refs, &mut slices).await;
                worst = worst.max(t.elapsed());
                for (i, r) in res.iter().enumerate() {
                    match r {
                        Ok(n) => assert!(
                            bufs[i][..*n] == payload(&keys[i], SIZE)[..],
                            "wrong bytes for {}",
                            keys[i]
                        ),
                        Err(_) => failures += 1,
                    }
                }
            }
            (worst, failures)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed_at = Instant::now();
    owner_a.signal(libc::SIGKILL);
    let (worst, failures) = reader.await.unwrap();
    assert!(failures > 0, "reads of a killed owner must fail");
    // Deadlines: 2 s transfer + 2 s RPC; a batch must never take longer than both together.
    assert!(worst < Duration::from_secs(5), "a batch took {worst:?}");

    // After the 2 s TTL the master forgets A's objects; B's stay readable.
    let gone = eventually(Duration::from_secs(10), async || {
        on_b.batch_exists(&[&keys_a[0]])
            .await
            .map(|r| !*r[0].as_ref().unwrap())
            .unwrap_or(false)
    })
    .await;
    assert!(
        gone,
        "objects of the dead owner still listed after {:?}",
        killed_at.elapsed()
    );
    let segs = on_b.list_segments().await.unwrap();
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].name.as_str(), seg_b);
    let mut buf = vec![0u8; SIZE];
    assert_eq!(on_b.get(&keys_b[3], &mut buf).await.unwrap(), SIZE);
    assert!(buf == payload(&keys_b[3], SIZE));

    // New puts that prefer the dead owner land on the survivor.
    let v = payload("after", SIZE);
    on_a.put("after", &v, &cfg).await.unwrap();
    let d = on_a
        .batch_get_replica_desc(&["after"])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(d.replicas[0].segment.as_str(), seg_b);
    let mut buf = vec![0u8; SIZE];
    let r = on_a.get("after", &mut buf).await;
    assert_eq!(get_code(&r), SIZE as i64);
    assert!(buf == v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_owner_turns_reads_and_writes_into_errors_within_the_deadline() {
    let (_master, rpc, _http) = spawn_master(&[]);
    let (owner, seg) = spawn_owner(&rpc, "16MiB", &[]);
    let client = client_preferring(&rpc, &seg).await;
    let v = payload("frozen", 1 << 20);
    client
        .put("frozen", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    owner.stop();
    let t = Instant::now();
    let mut buf = vec![0u8; v.len()];
    let r = client.get("frozen", &mut buf).await;
    let took = t.elapsed();
    assert_eq!(get_code(&r), -800, "{r:?}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(4),
        "took {took:?}"
    );
    let t = Instant::now();
    let r = client.put("frozen2", &v, &ReplicateConfig::default()).await;
    assert_eq!(r.unwrap_err().code().as_i32(), -800);
    assert!(t.elapsed() < Duration::from_secs(4));
    // A key twice in one batch: the master grants the first and answers the second "already
    // exists"; the first's write fails, so the second reports no object either.
    let twice = client
        .batch_put(
            &[("twice", &v[..]), ("twice", &v[..])],
            &ReplicateConfig::default(),
        )
        .await;
    for r in &twice {
        assert_eq!(r.as_ref().unwrap_err().code().as_i32(), -800, "{twice:?}");
    }
    owner.signal(libc::SIGCONT);
    assert!(!client.exists("twice").await.unwrap());
    // The owner serves again; the failed put was revoked, so it can be retried.
    client
        .put("frozen2", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; v.len()];
    client.get("frozen2", &mut buf).await.unwrap();
    assert!(buf == v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_is_an_rpc_error_within_the_deadline() {
    let (mut master, rpc, _http) = spawn_master(&[]);
    let (_owner, _seg) = spawn_owner(&rpc, "8MiB", &[]);
    let client = Client::connect_with(client_config(&rpc), None, transport(&client_config(&rpc)))
        .await
        .unwrap();
    master.stop();
    let t = Instant::now();
    let r = client.put("k", b"v", &ReplicateConfig::default()).await;
    assert_eq!(r.unwrap_err().code().as_i32(), -901);
    assert!(t.elapsed() < Duration::from_secs(4));
    master.signal(libc::SIGKILL);
    master.wait_exit(Duration::from_secs(5));
    let t = Instant::now();
    let err = client.exists("k").await.unwrap_err();
    assert!(matches!(err.code().as_i32(), -900 | -901), "{err}");
    assert!(t.elapsed() < Duration::from_secs(4));
    // Connecting to a master that is not there fails within the deadline too.
    let t = Instant::now();
    assert!(Client::connect(client_config(&rpc)).await.is_err());
    assert!(t.elapsed() < Duration::from_secs(4));
}

/// A batch over a healthy owner and a stopped one: the stopped owner's key fails at the transfer
/// timeout, which outlasts the lease; the healthy owner's key, read within milliseconds, is
/// served (its read ended well inside the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_owner_in_a_batch_does_not_make_other_owners_reads_late() {
    let (_master, rpc, _http) = spawn_master(&["--default_kv_lease_ttl", "1000"]);
    let (_a, seg_a) = spawn_owner(&rpc, "16MiB", &[]);
    let (b, seg_b) = spawn_owner(&rpc, "16MiB", &[]);
    let on_a = client_preferring(&rpc, &seg_a).await;
    let on_b = client_preferring(&rpc, &seg_b).await;
    let (va, vb) = (payload("on-a", 64 << 10), payload("on-b", 64 << 10));
    let cfg = ReplicateConfig::default();
    on_a.put("on-a", &va, &cfg).await.unwrap();
    on_b.put("on-b", &vb, &cfg).await.unwrap();
    b.stop();
    let (mut ba, mut bb) = (vec![0u8; va.len()], vec![0u8; vb.len()]);
    let r = on_a
        .batch_get(&["on-a", "on-b"], &mut [&mut ba[..], &mut bb[..]])
        .await;
    assert_eq!(r[0].as_ref().ok(), Some(&va.len()), "{r:?}");
    assert!(ba == va);
    assert_eq!(get_code(&r[1]), -800, "{r:?}");
    b.signal(libc::SIGCONT);
}

/// An owner restarted on another port is another target: the idle connections to the one
/// that went, which it closed, are dropped once the client meets a new owner, instead of
/// staying open for the life of the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_an_owner_that_went_are_dropped_when_a_new_one_is_met() {
    let (_master, rpc, _http) = spawn_master(&[]);
    let (mut owner_a, seg_a) = spawn_owner(&rpc, "16MiB", &[]);
    let cfg = ClientConfig {
        connections_per_owner: 2,
        transfer_threads: 1,
        ..client_config(&rpc)
    };
    let tcp = mooncake_tests::tcp_transport(&cfg);
    let client = Client::connect_with(cfg, None, tcp.clone()).await.unwrap();
    let v = payload("went/a", 64 << 10);
    client
        .put("went/a", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let seg_a = SegmentName::parse(&seg_a).unwrap();
    assert_eq!(tcp.idle_connections(&seg_a), 1);

    owner_a.signal(libc::SIGTERM);
    assert!(owner_a.wait_exit(Duration::from_secs(10)).is_some());
    let (_owner_b, seg_b) = spawn_owner(&rpc, "16MiB", &[]);
    let w = payload("went/b", 64 << 10);
    client
        .put("went/b", &w, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; w.len()];
    client.get("went/b", &mut buf).await.unwrap();
    assert!(buf == w, "wrong bytes");
    assert_eq!(
        tcp.idle_connections(&SegmentName::parse(&seg_b).unwrap()),
        1
    );
    assert_eq!(
        tcp.idle_connections(&seg_a),
        0,
        "a connection to the owner that went"
    );
}

/// An owner restarted on the same address: the client's idle connections to its predecessor
/// are closed, and the next call opens a new one instead of failing on an old one (its write
/// passed and its read met end of file: -800 for the whole chunk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_call_to_an_owner_restarted_on_its_address_succeeds() {
    let (_master, rpc, _http) = spawn_master(&[]);
    let port = mooncake_tests::free_port().to_string();
    let args = ["--heartbeat-interval", "200ms"];
    let (mut owner, seg) = mooncake_tests::spawn_owner_on(&rpc, "16MiB", &port, &args);
    let cfg = ClientConfig {
        connections_per_owner: 2,
        transfer_threads: 1,
        ..client_config(&rpc)
    };
    let tcp = mooncake_tests::tcp_transport(&cfg);
    let client = Client::connect_with(cfg, None, tcp.clone()).await.unwrap();
    let v = payload("first", 64 << 10);
    client
        .put("first", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let name = SegmentName::parse(&seg).unwrap();
    assert_eq!(tcp.idle_connections(&name), 1);

    owner.signal(libc::SIGKILL);
    assert!(owner.wait_exit(Duration::from_secs(10)).is_some());
    let (_owner, again) = mooncake_tests::spawn_owner_on(&rpc, "16MiB", &port, &args);
    assert_eq!(again, seg, "the same address");
    let w = payload("second", 64 << 10);
    client
        .put("second", &w, &ReplicateConfig::default())
        .await
        .expect("the first put to the restarted owner");
    let mut buf = vec![0u8; w.len()];
    client.get("second", &mut buf).await.unwrap();
    assert!(buf == w, "wrong bytes");
}

/// An owner stopped (SIGTERM) while it copies from an owner that does not answer (a replica
/// task; the read would wait out the 30 s frame timeout) leaves the copy to the master's task
/// timeout and exits in order within its bound, unmounted, before `scripts/mooncake_owner`
/// would SIGKILL it (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_stopped_mid_copy_unmounts_and_exits_within_its_bound() {
    let (_master, rpc, _http) = spawn_master(&[]);
    let (source, seg_a) = spawn_owner(&rpc, "16MiB", &[]);
    let (mut copier, seg_b) = spawn_owner(&rpc, "16MiB", &[]);
    let client = client_preferring(&rpc, &seg_a).await;
    let v = payload("copied", 1 << 20);
    client
        .put("copied", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    source.stop();
    let id = client.create_copy_task("copied", &[&seg_b]).await.unwrap();
    let assigned = eventually(Duration::from_secs(5), async || {
        let t = client.query_task(id).await.unwrap();
        t.status == mooncake_common::ReplicaTaskStatus::Processing
    })
    .await;
    assert!(assigned, "the copy was not handed to the owner");
    // The copier has the task; let its read reach the stopped source.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    copier.signal(libc::SIGTERM);
    let status = copier
        .wait_exit(Duration::from_secs(40))
        .expect("the owner did not exit");
    let took = t.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        took < mooncake_owner::SHUTDOWN_WITHIN + Duration::from_secs(1),
        "took {took:?}"
    );
    // Unmounted, not left to the master's client TTL.
    let segments = client.list_segments().await.unwrap();
    assert!(
        segments.iter().all(|s| s.name.as_str() != seg_b),
        "{segments:?}"
    );
    source.signal(libc::SIGCONT);
}

/// An owner stopped (SIGTERM) while it still starts (here: waiting for a master that does not
/// answer) exits in order, saying so, instead of dying of the signal's default action.
#[test]
fn an_owner_stopped_while_starting_exits_in_order() {
    let port = mooncake_tests::free_port().to_string();
    let master = format!("127.0.0.1:{port}");
    let mut owner = mooncake_tests::ChildGuard::spawn(
        "mooncake_ownerd",
        &[
            "--master",
            &master,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "4MiB",
            "--no-mlock",
            "--mount-timeout",
            "60s",
        ],
    );
    std::thread::sleep(std::time::Duration::from_secs(1));
    owner.signal(libc::SIGTERM);
    let status = owner
        .wait_exit(std::time::Duration::from_secs(15))
        .expect("the owner did not exit");
    assert_eq!(
        status.code(),
        Some(1),
        "{status:?}: an exit, not a death by signal"
    );
}

/// A copy from an owner that does not answer (stopped) fails on the copying owner within its
/// budget (two thirds of its frame timeout, counted from the poll that brought it), before the
/// master gives the task up: the task says why, and the copy's room is back at once. Before,
/// the budget was the whole frame timeout, which the master's task timeout (the same 30 s by
/// default, counted earlier) always beat: the room was then held for the release timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_from_a_silent_owner_fails_on_the_copier_before_the_master_gives_it_up() {
    use mooncake_common::ReplicaTaskStatus;
    // The copier's old budget (its frame timeout, 5 s from taking a slot) lost to the master's
    // task timeout (4 s from the task's creation); its new one (3.3 s from the poll) wins.
    let master = mooncake_master::RunningMaster::start(mooncake_master::MasterConfig {
        offload_timeout: Duration::from_secs(4),
        ..mooncake_tests::master_config()
    })
    .await
    .unwrap();
    let rpc = master.rpc_addr.to_string();
    let (source, seg_a) = spawn_owner(&rpc, "16MiB", &[]);
    let copier = mooncake_owner::RunningOwner::start(mooncake_owner::OwnerConfig {
        frame_timeout: Duration::from_secs(5),
        ..mooncake_tests::owner_config(&rpc, 16 << 20)
    })
    .await
    .unwrap();
    let seg_b = copier.segment.clone();
    let client = client_preferring(&rpc, &seg_a).await;
    client
        .put(
            "copied",
            &payload("copied", 1 << 20),
            &ReplicateConfig::default(),
        )
        .await
        .unwrap();
    source.stop();
    let id = client
        .create_copy_task("copied", &[seg_b.as_str()])
        .await
        .unwrap();
    let failed = eventually(Duration::from_secs(10), async || {
        client.query_task(id).await.unwrap().status == ReplicaTaskStatus::Failed
    })
    .await;
    assert!(failed, "the copy did not fail");
    let detail = client.query_task(id).await.unwrap().detail;
    assert!(!detail.contains("did not report"), "{detail}");
    let allocated = client
        .list_segments()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.name == seg_b)
        .unwrap()
        .allocated;
    assert_eq!(allocated, 0, "the copy's room is back ({detail})");
    source.signal(libc::SIGCONT);
    copier.shutdown().await;
    master.shutdown().await;
}

/// An owner whose start fails after it mounted (here: its ready file cannot be written) stops
/// in order and unmounts: before, its segment stayed mounted until the master expired it, and
/// puts were placed on an owner that had exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_fails_to_start_after_mounting_unmounts() {
    let c = mooncake_tests::Cluster::start(&[]).await;
    let started = mooncake_owner::RunningOwner::start(mooncake_owner::OwnerConfig {
        ready_file: Some("/nonexistent-mooncake-dir/ready".into()),
        ..mooncake_tests::owner_config(&c.master_addr(), 4 << 20)
    })
    .await;
    assert!(started.is_err());
    let client = c.client().await;
    assert!(client.list_segments().await.unwrap().is_empty());
    c.shutdown().await;
}
