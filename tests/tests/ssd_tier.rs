//! The SSD tier end to end, on a real file on disk: objects spill from memory to SSD under
//! pressure and every one reads back byte for byte; a corrupted record reads as -801; a full SSD
//! evicts its oldest records and the master forgets them (never wrong bytes); an owner killed
//! with SIGKILL and restarted on its SSD directory serves its objects again; puts do not fail
//! while an owner's SSD is stuck and another owner's memory could be freed.

use std::{
    io::{Seek, SeekFrom, Write},
    time::Duration,
};

use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_common::{ByteSize, ObjectKey};
use mooncake_master::{MasterConfig, RunningMaster};
use mooncake_owner::RunningOwner;
use mooncake_tests::get_code;
use mooncake_tests::{
    master_config, owner_config, payload, spawn_master, spawn_owner, transport, TempDir,
};

const KIB: usize = 1 << 10;

async fn tiered_owner(master: &str, mem: u64, dir: &TempDir, ssd: u64) -> RunningOwner {
    let mut cfg = owner_config(master, mem);
    cfg.ssd_path = Some(dir.path().to_path_buf());
    cfg.ssd_size = ByteSize(ssd);
    cfg.shared_memory = false;
    RunningOwner::start(cfg).await.expect("start owner")
}

async fn client(master: &str) -> Client {
    let cfg = ClientConfig {
        transfer_timeout: Duration::from_secs(5),
        rpc_timeout: Duration::from_secs(3),
        ..ClientConfig::new(master)
    };
    Client::connect_with(cfg.clone(), None, transport(&cfg))
        .await
        .expect("connect")
}

/// Puts `keys` in batches of 8; every put must succeed.
async fn put_all(c: &Client, keys: &[String], size: usize) {
    for chunk in keys.chunks(8) {
        let vals: Vec<Vec<u8>> = chunk.iter().map(|k| payload(k, size)).collect();
        let items: Vec<(&str, &[u8])> = chunk
            .iter()
            .map(|k| k.as_str())
            .zip(vals.iter().map(|v| v.as_slice()))
            .collect();
        for (k, r) in chunk
            .iter()
            .zip(c.batch_put(&items, &ReplicateConfig::default()).await)
        {
            assert!(r.is_ok(), "put {k}: {r:?}");
        }
    }
}

/// Gets `keys` in one batch; returns the code of each, checking every hit byte for byte.
async fn get_all(c: &Client, keys: &[String], size: usize) -> Vec<i64> {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; size]).collect();
    let names: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let res = c.batch_get(&names, &mut slices).await;
    let mut codes = Vec::new();
    for ((k, r), b) in keys.iter().zip(&res).zip(&bufs) {
        if r.is_ok() {
            assert!(b[..] == payload(k, size)[..], "{k}: wrong bytes");
        }
        codes.push(get_code(r));
    }
    codes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_spill_to_ssd_and_read_back_exactly_and_a_corrupt_record_is_refused() {
    // No promotion: the corrupted record must stay the only copy.
    let master = RunningMaster::start(MasterConfig {
        promote_after_hits: 0,
        ..master_config()
    })
    .await
    .unwrap();
    let addr = master.rpc_addr.to_string();
    let dir = TempDir::new("ssd-spill");
    let owner = tiered_owner(&addr, 8 << 20, &dir, 64 << 20).await;
    let c = client(&addr).await;
    const SIZE: usize = 512 * KIB;
    // Three times the memory.
    let keys: Vec<String> = (0..48).map(|i| format!("spill/{i}")).collect();
    put_all(&c, &keys, SIZE).await;
    let codes = get_all(&c, &keys, SIZE).await;
    assert!(codes.iter().all(|c| *c == SIZE as i64), "{codes:?}");
    let st = c.transfer_stats();
    assert!(st.disk_keys >= 24, "most keys came from disk: {st:?}");
    assert!(st.memory_keys >= 1, "{st:?}");
    assert_eq!(st.disk_keys + st.memory_keys, 48);
    assert_eq!(st.disk_bytes, st.disk_keys * SIZE as u64);

    // Metrics show the tier.
    let metrics = master.with_state(|s| {
        mooncake_master::metrics::Metrics::default().render(
            s,
            mooncake_master::clock::Millis(0),
            true,
        )
    });
    assert!(
        metrics.contains("segment_ssd_capacity_bytes{segment="),
        "{metrics}"
    );
    assert!(metrics.contains("master_offloads_done_total"), "{metrics}");

    // Flip one byte of a disk-only object's value on disk: its get is refused with -801.
    let ssd = owner.ssd().expect("ssd tier").clone();
    let names: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let descs = c.batch_get_replica_desc(&names).await.unwrap();
    let victim = keys
        .iter()
        .zip(&descs)
        .find(|(_, d)| {
            d.as_ref().is_ok_and(|d| {
                d.replicas
                    .iter()
                    .all(|r| r.tier == mooncake_client::Tier::Disk)
            })
        })
        .expect("some key only on disk")
        .0
        .clone();
    let offset = ssd
        .record_offset(&ObjectKey::new(victim.as_str()).unwrap())
        .unwrap();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(ssd.path())
        .unwrap();
    f.seek(SeekFrom::Start(offset + 8192)).unwrap();
    f.write_all(&[0x5A ^ payload(&victim, SIZE)[8192 - 64 - victim.len()]])
        .unwrap();
    f.sync_all().unwrap();
    let code = get_all(&c, std::slice::from_ref(&victim), SIZE).await[0];
    assert_eq!(code, -801, "a corrupt record must be refused");
    // The owner drops the record and the master forgets the object: gets say "not found".
    let gone = mooncake_tests::eventually(Duration::from_secs(5), async || {
        get_all(&c, std::slice::from_ref(&victim), SIZE).await[0] == -704
    })
    .await;
    assert!(gone, "a corrupt record is dropped after it was found");
    owner.shutdown().await;
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ssd_evicts_its_oldest_records_and_never_returns_wrong_bytes() {
    let master = RunningMaster::start(master_config()).await.unwrap();
    let addr = master.rpc_addr.to_string();
    let dir = TempDir::new("ssd-full");
    // 4 MiB of memory and 8 MiB of SSD for 24 MiB of objects.
    let owner = tiered_owner(&addr, 4 << 20, &dir, 8 << 20).await;
    let c = client(&addr).await;
    const SIZE: usize = 256 * KIB;
    let keys: Vec<String> = (0..96).map(|i| format!("full/{i}")).collect();
    put_all(&c, &keys, SIZE).await;
    let codes = get_all(&c, &keys, SIZE).await;
    let hits = codes.iter().filter(|c| **c == SIZE as i64).count();
    assert!(
        codes.iter().all(|c| *c == SIZE as i64 || *c == -704),
        "{codes:?}"
    );
    assert!(hits >= 30, "memory and SSD hold about 12 MiB: {hits} hits");
    assert!(hits < 96, "24 MiB cannot all fit: {codes:?}");
    // The newest keys are the ones kept.
    assert!(codes[88..].iter().all(|c| *c == SIZE as i64), "{codes:?}");
    let stats = owner.ssd().unwrap().stats();
    assert!(stats.evicted_records > 0, "{stats:?}");
    assert!(stats.used <= stats.capacity);
    owner.shutdown().await;
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_killed_and_restarted_on_its_ssd_directory_serves_its_objects_again() {
    let dir = TempDir::new("ssd-restart");
    let dir_s = dir.path().to_str().unwrap().to_string();
    let (_master, rpc, _http) = spawn_master(&["--client_ttl", "2", "--eager_offload"]);
    let ssd = [
        "--ssd-path",
        dir_s.as_str(),
        "--ssd-size",
        "64MiB",
        "--no-shm",
    ];
    let (owner, _seg) = spawn_owner(&rpc, "16MiB", &ssd);
    let c = client(&rpc).await;
    const SIZE: usize = 256 * KIB;
    let keys: Vec<String> = (0..32).map(|i| format!("warm/{i}")).collect();
    put_all(&c, &keys, SIZE).await;
    // Eager offload: wait until every object has its disk copy.
    let names: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let all_on_disk = mooncake_tests::eventually(Duration::from_secs(10), async || {
        let d = c.batch_get_replica_desc(&names).await.unwrap();
        d.iter().all(|r| {
            r.as_ref().is_ok_and(|r| {
                r.replicas
                    .iter()
                    .any(|x| x.tier == mooncake_client::Tier::Disk)
            })
        })
    })
    .await;
    assert!(all_on_disk, "eager offload did not finish");
    owner.signal(libc::SIGKILL);
    let (_owner2, _seg2) = spawn_owner(&rpc, "16MiB", &ssd);
    // Every object comes back from the SSD directory, byte for byte.
    let back = mooncake_tests::eventually(Duration::from_secs(10), async || {
        get_all(&c, &keys, SIZE)
            .await
            .iter()
            .all(|x| *x == SIZE as i64)
    })
    .await;
    assert!(back, "objects did not come back after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_only_object_read_twice_is_promoted_back_to_memory() {
    let master = RunningMaster::start(MasterConfig {
        promote_after_hits: 2,
        ..master_config()
    })
    .await
    .unwrap();
    let addr = master.rpc_addr.to_string();
    let dir = TempDir::new("ssd-promote");
    let owner = tiered_owner(&addr, 4 << 20, &dir, 64 << 20).await;
    let c = client(&addr).await;
    const SIZE: usize = 256 * KIB;
    let keys: Vec<String> = (0..32).map(|i| format!("hot/{i}")).collect();
    put_all(&c, &keys, SIZE).await;
    // The oldest key went to disk; make room so its promotion can find memory.
    let cold = keys[0].clone();
    let names: Vec<&str> = keys[8..].iter().map(|k| k.as_str()).collect();
    for r in c.batch_remove(&names, true).await.unwrap() {
        assert!(r.is_ok());
    }
    let tiers = async || -> Vec<mooncake_client::Tier> {
        c.batch_get_replica_desc(&[&cold]).await.unwrap()[0]
            .as_ref()
            .unwrap()
            .replicas
            .iter()
            .map(|r| r.tier)
            .collect()
    };
    assert_eq!(tiers().await, vec![mooncake_client::Tier::Disk]); // hit 1
    assert_eq!(
        get_all(&c, std::slice::from_ref(&cold), SIZE).await[0],
        SIZE as i64
    ); // hit 2
    let promoted = mooncake_tests::eventually(Duration::from_secs(5), async || {
        tiers().await.contains(&mooncake_client::Tier::Memory)
    })
    .await;
    assert!(promoted, "a hot disk-only object comes back to memory");
    assert_eq!(
        get_all(&c, std::slice::from_ref(&cold), SIZE).await[0],
        SIZE as i64
    );
    owner.shutdown().await;
    master.shutdown().await;
}

/// A put short of memory while offloads to a stuck SSD are under way takes memory another owner
/// can free at once: before, every eviction round counted the stuck offloads as room coming and
/// freed nothing else, and the put failed with -200 for as long as the SSD stayed stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_take_memory_freed_at_once_when_offloads_are_stuck() {
    let master = RunningMaster::start(master_config()).await.unwrap();
    let addr = master.rpc_addr.to_string();
    let dir = TempDir::new("ssd-stuck");
    let dir_s = dir.path().to_str().unwrap().to_string();
    let ssd = [
        "--ssd-path",
        dir_s.as_str(),
        "--ssd-size",
        "64MiB",
        "--no-shm",
    ];
    // A: tiered, a process (so it can be stopped); B: no SSD tier.
    let (tiered, seg_a) = spawn_owner(&addr, "4MiB", &ssd);
    let mut cfg_b = owner_config(&addr, 4 << 20);
    cfg_b.shared_memory = false;
    let plain = RunningOwner::start(cfg_b).await.expect("start owner");
    let seg_b = plain.segment.to_string();
    let c = client(&addr).await;
    const SIZE: usize = 1 << 20;
    let on = |seg: &str| ReplicateConfig {
        preferred_segments: vec![mooncake_common::SegmentName::parse(seg).unwrap()],
        ..ReplicateConfig::default()
    };
    // A's objects first (the oldest in the eviction order), then B's: 7 of 8 MiB, under the
    // high watermark, so no upkeep round starts offloads before A is stopped.
    let a_keys: Vec<String> = (0..4).map(|i| format!("a/{i}")).collect();
    let b_keys: Vec<String> = (0..3).map(|i| format!("b/{i}")).collect();
    for (keys, seg) in [(&a_keys, seg_a.as_str()), (&b_keys, seg_b.as_str())] {
        for k in keys.iter() {
            let v = payload(k, SIZE);
            c.put(k, &v, &on(seg))
                .await
                .unwrap_or_else(|e| panic!("put {k}: {e:?}"));
        }
    }
    // A's SSD is as good as stuck: the owner cannot take or report an offload.
    tiered.stop();
    let big = "big/0";
    let v = payload(big, 2 * SIZE);
    let put = c.put(big, &v, &ReplicateConfig::default()).await;
    tiered.signal(libc::SIGCONT);
    put.expect("B's oldest objects make room at once");
    let mut buf = vec![0u8; 2 * SIZE];
    assert_eq!(get_code(&c.get(big, &mut buf).await), (2 * SIZE) as i64);
    assert!(buf == v, "wrong bytes");
    // What made room was B's oldest object, not an object of A's without its disk copy.
    assert_eq!(get_code(&c.get(&b_keys[0], &mut buf[..SIZE]).await), -704);
    plain.shutdown().await;
    master.shutdown().await;
}
