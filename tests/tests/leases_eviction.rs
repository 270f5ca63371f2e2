//! Leases, eviction and abandoned puts through the running master: eviction frees space under
//! pressure without touching an object being read, a finished read pins nothing (lease mode
//! "reads") while Mooncake's TTL leases keep a store full of read objects full, and an abandoned
//! put's space returns after the release timeout on an injected clock, a get dropped by its
//! caller mid-read hands its hold back, and a put dropped mid-write is revoked.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use mooncake_client::{Client, ClientConfig, Code, MasterApi, ReplicateConfig};
use mooncake_common::master_api::Releases;
use mooncake_master::{
    clock::{ManualClock, Millis},
    core::LeaseMode,
    MasterConfig, RunningMaster,
};
use mooncake_proto::master::{master_client::MasterClient, BatchPutStartRequest, PutStartItem};
use mooncake_tests::{master_config, payload, spawn_owner, Cluster};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_frees_space_under_pressure_and_never_evicts_a_leased_object() {
    let c = Cluster::start(&[16 * MIB]).await;
    let client = c.client().await;
    let cfg = ReplicateConfig::default();
    client
        .put("leased", &payload("leased", MIB as usize), &cfg)
        .await
        .unwrap();
    // A reader that has looked it up and not said it is done: held until the TTL (10 s).
    let reader = c.master.in_process();
    assert_eq!(
        reader
            .exists(&["leased"], Releases::NONE)
            .await
            .unwrap()
            .found,
        vec![Ok(true)]
    );

    // Write 40 MiB into a 16 MiB segment: every put must succeed by evicting older objects.
    for i in 0..40 {
        let k = format!("fill/{i}");
        client
            .put(&k, &payload(&k, MIB as usize), &cfg)
            .await
            .unwrap_or_else(|e| panic!("{k}: {e}"));
    }
    let mut buf = vec![0u8; MIB as usize];
    assert_eq!(client.get("leased", &mut buf).await.unwrap(), MIB as usize);
    assert!(
        buf == payload("leased", MIB as usize),
        "the leased object survived intact"
    );
    let evicted = c.master.with_state(|s| s.counters().evicted_objects);
    assert!(evicted >= 24, "only {evicted} evicted");
    // The newest objects are there and intact.
    let mut buf = vec![0u8; MIB as usize];
    client.get("fill/39", &mut buf).await.unwrap();
    assert!(buf == payload("fill/39", MIB as usize));
    c.master.with_state(|s| s.check_invariants()).unwrap();
    c.shutdown().await;
}

/// Four objects fill the store and are read; then a fifth is put. With lease mode "reads" the
/// finished reads hold nothing and the put evicts one (after the client's releases reach the
/// master, which they do in the background); with "ttl" every read keeps its object for the
/// TTL and the put finds no room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_read_pins_nothing_unless_leases_last_their_ttl() {
    for mode in [LeaseMode::Reads, LeaseMode::Ttl] {
        let config = MasterConfig {
            lease_mode: mode,
            // The put below fills the segment again; at the default watermark the upkeep loop
            // (every 100 ms) would then evict the newest object, unread ("more": CAR takes the
            // recent list first), sometimes before the test reads it back.
            eviction_high_watermark_ratio: 1.0,
            ..master_config()
        };
        let c = Cluster::start_with(config, &[4 * MIB]).await;
        let client = c.client().await;
        let cfg = ReplicateConfig::default();
        let keys = ["r/0", "r/1", "r/2", "r/3"];
        for k in keys {
            client
                .put(k, &payload(k, MIB as usize), &cfg)
                .await
                .unwrap();
        }
        let mut bufs = vec![vec![0u8; MIB as usize]; 4];
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        for r in client.batch_get(&keys, &mut dst).await {
            assert_eq!(r.unwrap(), MIB as usize);
        }
        let value = payload("more", MIB as usize);
        match mode {
            LeaseMode::Reads => {
                let mut stored = false;
                for _ in 0..100 {
                    if client.put("more", &value, &cfg).await.is_ok() {
                        stored = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert!(stored, "the reads' leases were never released");
                let mut buf = vec![0u8; MIB as usize];
                assert_eq!(client.get("more", &mut buf).await.unwrap(), MIB as usize);
                assert!(buf == value);
            }
            LeaseMode::Ttl => {
                let err = client.put("more", &value, &cfg).await.unwrap_err();
                assert_eq!(err.code().as_i32(), -200, "{err}");
            }
        }
        c.master.with_state(|s| s.check_invariants()).unwrap();
        c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_of_leased_objects_rejects_puts_with_no_available_handle() {
    let c = Cluster::start(&[4 * MIB]).await;
    let client = c.client().await;
    let cfg = ReplicateConfig::default();
    for i in 0..4 {
        let k = format!("l/{i}");
        client
            .put(&k, &payload(&k, MIB as usize), &cfg)
            .await
            .unwrap();
    }
    let keys = ["l/0", "l/1", "l/2", "l/3"];
    assert!(client
        .batch_exists(&keys)
        .await
        .unwrap()
        .iter()
        .all(|r| *r.as_ref().unwrap()));
    let err = client
        .put("more", &payload("more", MIB as usize), &cfg)
        .await
        .unwrap_err();
    assert_eq!(err.code().as_i32(), -200, "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_put_is_released_after_the_release_timeout_on_an_injected_clock() {
    let clock = Arc::new(ManualClock::new(Millis(0)));
    let config = mooncake_master::MasterConfig {
        // Owners heartbeat on the real clock's schedule but the master's time is frozen, so a
        // large TTL keeps them alive while the test moves time by minutes.
        client_ttl: Duration::from_secs(24 * 3600),
        ..master_config()
    };
    let c = Cluster::start_with_clock(config, clock.clone(), &[8 * MIB]).await;
    // A writer that starts a put and disappears.
    let mut raw = MasterClient::connect(format!("http://{}", c.master_addr()))
        .await
        .unwrap();
    let r = raw
        .batch_put_start(BatchPutStartRequest {
            items: vec![PutStartItem {
                key: "abandoned".into(),
                size: 2 * MIB,
            }],
            config: None,
            token: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.results[0].code, 0);
    let allocated = || c.master.with_state(|s| s.allocated());
    assert_eq!(allocated(), 2 * MIB);

    let client = c.client().await;
    // Before the discard timeout the key counts as being written (a success no-op for puts).
    let out = client
        .put("abandoned", &payload("a", 100), &ReplicateConfig::default())
        .await
        .unwrap();
    assert_eq!(out, mooncake_client::PutOutcome::AlreadyExists);
    let mut buf = vec![0u8; 100];
    assert_eq!(
        client
            .get("abandoned", &mut buf)
            .await
            .unwrap_err()
            .code()
            .as_i32(),
        -703
    );

    clock.advance(Duration::from_secs(599));
    c.master.upkeep();
    assert_eq!(allocated(), 2 * MIB, "space held until the release timeout");
    clock.advance(Duration::from_secs(1));
    c.master.upkeep();
    assert_eq!(allocated(), 0, "space returned after the release timeout");
    assert!(!client.exists("abandoned").await.unwrap());
    c.shutdown().await;
}

/// A hold handed back after its lease ran out leaves another reader's lease alone: the first
/// reader's existence check leases "k" and it then stays idle past the TTL; a second reader
/// leases "k"; the first reader's next calls hand its old hold back, and the second reader's
/// lease still stands (a remove without force is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_handed_back_after_its_lease_ran_out_leaves_another_readers_lease_alone() {
    let ttl = Duration::from_secs(2);
    let config = MasterConfig {
        default_kv_lease_ttl: ttl,
        ..master_config()
    };
    let c = Cluster::start_with(config, &[4 * MIB]).await;
    let first = c.client().await;
    let cfg = ReplicateConfig::default();
    first.put("k", &payload("k", 4096), &cfg).await.unwrap();
    assert!(first.exists("k").await.unwrap());
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;

    let second = c.master.in_process();
    assert_eq!(
        second.exists(&["k"], Releases::NONE).await.unwrap().found,
        vec![Ok(true)]
    );
    // The first reader's next calls end, and its kept hold goes back with them (or with the
    // background sender, which sends within milliseconds).
    assert!(!first.exists("other").await.unwrap());
    assert!(!first.exists("other").await.unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await;

    assert_eq!(
        second.remove(&["k"], false).await.unwrap(),
        vec![Err(Code::ObjectHasLease)],
        "the second reader's lease was ended by the first reader's late release"
    );
    c.shutdown().await;
}

/// A master in process, an owner of `size` as a process (so that it can be stopped with a
/// transfer under way), and a client that waits long for transfers.
async fn with_stoppable_owner(
    config: MasterConfig,
    size: &str,
) -> (RunningMaster, mooncake_tests::ChildGuard, Client) {
    let master = RunningMaster::start(config).await.unwrap();
    let addr = master.rpc_addr.to_string();
    let (owner, _seg) = spawn_owner(&addr, size, &["--no-shm"]);
    let client = Client::connect(ClientConfig {
        transfer_timeout: Duration::from_secs(30),
        ..ClientConfig::new(&addr)
    })
    .await
    .unwrap();
    (master, owner, client)
}

/// A get its caller drops mid-read (a timeout around it) hands its hold back: before, the hold
/// went back only at the end of the get's reads, so a dropped get left the object leased, and
/// unevictable, for the whole TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_dropped_mid_read_hands_its_hold_back() {
    let config = MasterConfig {
        default_kv_lease_ttl: Duration::from_secs(60),
        ..master_config()
    };
    let (master, owner, client) = with_stoppable_owner(config, "4MiB").await;
    let cfg = ReplicateConfig::default();
    client
        .put("k", &payload("k", MIB as usize), &cfg)
        .await
        .unwrap();
    owner.stop();
    let mut buf = vec![0u8; MIB as usize];
    let read = tokio::time::timeout(Duration::from_millis(500), client.get("k", &mut buf)).await;
    owner.signal(libc::SIGCONT);
    assert!(
        read.is_err(),
        "the read could not end with its owner stopped"
    );
    let reader = master.in_process();
    let removed = mooncake_tests::eventually(Duration::from_secs(5), async || {
        reader.remove(&["k"], false).await.unwrap() == vec![Ok(())]
    })
    .await;
    assert!(removed, "the dropped get's hold was never handed back");
    master.shutdown().await;
}

/// A put its caller drops mid-write (a timeout around it) is revoked: the key can be put again at
/// once. Before, it stayed a put in flight, and every put of the key until the master's discard
/// timeout was told it already exists (a success) for an object that never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_dropped_mid_write_is_revoked() {
    let (master, owner, client) = with_stoppable_owner(master_config(), "8MiB").await;
    let cfg = ReplicateConfig::default();
    let first = vec![1u8; MIB as usize];
    owner.stop();
    let put = tokio::time::timeout(Duration::from_millis(500), client.put("k", &first, &cfg)).await;
    owner.signal(libc::SIGCONT);
    assert!(
        put.is_err(),
        "the write could not end with its owner stopped"
    );
    let value = payload("k", MIB as usize);
    let stored = mooncake_tests::eventually(Duration::from_secs(5), async || {
        matches!(
            client.put("k", &value, &cfg).await,
            Ok(mooncake_client::PutOutcome::Stored)
        )
    })
    .await;
    assert!(stored, "the dropped put still holds the key");
    let mut buf = vec![0u8; MIB as usize];
    assert_eq!(client.get("k", &mut buf).await.unwrap(), MIB as usize);
    assert!(buf == value, "the value read is the second put's");
    master.shutdown().await;
}

/// A client whose calls run on a current-thread runtime that nothing drives between them (the
/// Python binding's default): a finished read's hold still goes back while the caller is idle,
/// so the object is removable (and evictable) at once, not only after the caller's next call
/// or the lease's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_read_of_an_idle_current_thread_client_pins_nothing() {
    let c = Cluster::start(&[8 * MIB]).await;
    let other = c.client().await;
    let config = ClientConfig {
        dedicated_runtime: true,
        ..c.client_config()
    };
    let (read, idle) = std::sync::mpsc::channel();
    let (done, finish) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = rt
            .block_on(Client::connect_with(
                config.clone(),
                None,
                mooncake_tests::transport(&config),
            ))
            .unwrap();
        let value = payload("k", MIB as usize);
        rt.block_on(client.put("k", &value, &ReplicateConfig::default()))
            .unwrap();
        let mut buf = vec![0u8; MIB as usize];
        rt.block_on(client.get("k", &mut buf)).unwrap();
        assert!(buf == value);
        read.send(()).unwrap();
        // Idle: nothing drives this runtime until the test is done.
        let _ = finish.recv();
        rt.block_on(client.close(Duration::from_secs(1)));
    });
    tokio::task::spawn_blocking(move || idle.recv().unwrap())
        .await
        .unwrap();
    let mut removed = None;
    for _ in 0..50 {
        match other.remove("k", false).await {
            Ok(()) => {
                removed = Some(());
                break;
            }
            Err(e) if e.code() == Code::ObjectHasLease => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("remove: {e}"),
        }
    }
    done.send(()).unwrap();
    tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    assert!(
        removed.is_some(),
        "the idle reader's lease was not handed back within 1 s"
    );
    c.shutdown().await;
}

/// An existence check's hold goes back a quarter of its TTL after it was asked for when its
/// client makes no call meanwhile (a check a get does not follow, as a prefix lookup that found
/// too little): before, it waited for the client's next call, was dropped at half the TTL
/// instead, and kept the key leased for the whole TTL (and for as long as other readers kept
/// leasing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existence_checks_hold_goes_back_while_its_client_is_idle() {
    let c = Cluster::start(&[8 * MIB]).await;
    let checker = c.client().await;
    let other = c.client().await;
    let value = payload("k", 4096);
    other
        .put("k", &value, &ReplicateConfig::default())
        .await
        .unwrap();
    assert!(checker.exists("k").await.unwrap());
    let checked = Instant::now();
    // The checker is idle from here on.
    let code = other.remove("k", false).await.unwrap_err().code();
    assert_eq!(code, Code::ObjectHasLease, "the check holds the key");
    let ttl = mooncake_master::MasterConfig::default().default_kv_lease_ttl;
    let mut removed = false;
    while checked.elapsed() < ttl * 6 / 10 {
        match other.remove("k", false).await {
            Ok(()) => {
                removed = true;
                break;
            }
            Err(e) if e.code() == Code::ObjectHasLease => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("remove: {e}"),
        }
    }
    assert!(
        removed,
        "the idle checker's hold was not handed back within {:?}",
        ttl * 6 / 10
    );
    c.shutdown().await;
}
