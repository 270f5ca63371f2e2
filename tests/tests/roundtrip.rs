//! Values from 1 byte to 16 MiB round-trip byte for byte through a master and two owners on
//! loopback; batches mix hits, misses and bad items; codes follow Mooncake's conventions; a slow
//! removal pattern holds up no other call.

use mooncake_client::{PutOutcome, ReplicateConfig};
use mooncake_tests::{get_code, put_code};
use mooncake_tests::{payload, transport, Cluster};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_from_one_byte_to_16_mib_round_trip() {
    let c = Cluster::start(&[64 * MIB, 64 * MIB]).await;
    let client = c.client().await;
    let sizes = [
        1usize,
        2,
        63,
        64,
        65,
        4095,
        4096,
        4097,
        65_536 + 3,
        1 << 20,
        (4 << 20) - 1,
        16 << 20,
    ];
    let keys: Vec<String> = sizes.iter().map(|s| format!("rt/{s}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().zip(sizes).map(|(k, s)| payload(k, s)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    let put = client.batch_put(&items, &ReplicateConfig::default()).await;
    for (k, r) in keys.iter().zip(&put) {
        assert!(matches!(r, Ok(PutOutcome::Stored)), "{k}: {r:?}");
    }

    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|s| vec![0u8; *s]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let key_refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let got = client.batch_get(&key_refs, &mut slices).await;
    for (i, r) in got.iter().enumerate() {
        assert_eq!(*r.as_ref().unwrap(), sizes[i], "{}", keys[i]);
        assert!(bufs[i] == values[i], "{}: bytes differ", keys[i]);
    }

    // Single-key get into a larger buffer returns the object size and leaves the tail alone.
    let mut big = vec![0xAAu8; 100];
    assert_eq!(client.get("rt/63", &mut big).await.unwrap(), 63);
    assert_eq!(&big[..63], &values[2][..]);
    assert!(big[63..].iter().all(|b| *b == 0xAA));

    // Buffers an allocator makes, all in one call with the hits' sizes in key order (a miss
    // asks for none): one shorter than the value is refused, not filled in part and passed for
    // the whole (a `Vec::with_capacity` has length 0).
    let mut asked = Vec::new();
    let short = client
        .batch_get_alloc(&["rt/4097", "rt/none", "rt/63"], |sizes| {
            asked.push(sizes.to_vec());
            sizes
                .iter()
                .map(|&n| {
                    Ok(if n == 4097 {
                        Vec::with_capacity(n)
                    } else {
                        vec![0u8; n]
                    })
                })
                .collect()
        })
        .await;
    assert_eq!(asked, vec![vec![4097, 63]], "one call, the hits' sizes");
    assert!(
        matches!(
            short[0],
            Err(mooncake_client::ClientError::BufferTooSmall {
                need: 4097,
                have: 0
            })
        ),
        "{:?}",
        short[0].as_ref().map(Vec::len)
    );
    assert_eq!(short[1].as_ref().unwrap_err().code().as_i32(), -704);
    assert_eq!(short[2].as_deref().unwrap(), &values[2][..]);
    // One rounded up (a pool's slab) gets the value in its first bytes, the rest untouched.
    let long = client
        .batch_get_alloc(&["rt/63"], |sizes| {
            sizes.iter().map(|&n| Ok(vec![0xAAu8; n + 1000])).collect()
        })
        .await;
    let long = long[0].as_ref().unwrap();
    assert_eq!(&long[..63], &values[2][..]);
    assert!(long[63..].iter().all(|b| *b == 0xAA));
    // An allocator that returns fewer buffers than asked fails the keys left without one.
    let fewer = client
        .batch_get_alloc(&["rt/63", "rt/4097"], |sizes| vec![Ok(vec![0u8; sizes[0]])])
        .await;
    assert_eq!(fewer[0].as_deref().unwrap(), &values[2][..]);
    assert_eq!(fewer[1].as_ref().unwrap_err().code().as_i32(), -600);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_mix_hits_misses_and_bad_items_with_mooncake_codes() {
    let c = Cluster::start(&[16 * MIB]).await;
    let client = c.client().await;
    let v = payload("hit", 5000);
    let cfg = ReplicateConfig::default();
    let first = client.put("hit", &v, &cfg).await;
    assert_eq!(first.unwrap(), PutOutcome::Stored);

    // Write-once: the same key again is a success no-op (0), and the original bytes stay.
    let other = payload("other", 5000);
    let again = client
        .batch_put(&[("hit", &other), ("", &v), ("zero", &[])], &cfg)
        .await;
    assert_eq!(again[0].as_ref().unwrap(), &PutOutcome::AlreadyExists);
    assert_eq!(put_code(&again[0]), 0);
    assert_eq!(put_code(&again[1]), -600, "empty key");
    assert_eq!(put_code(&again[2]), -600, "zero size");

    let mut a = vec![0u8; 5000];
    let mut b = vec![0u8; 10];
    let mut m = vec![0u8; 10];
    let mut e = vec![0u8; 10];
    let mut bufs: Vec<&mut [u8]> = vec![&mut a, &mut b, &mut m, &mut e];
    let got = client
        .batch_get(&["hit", "hit", "miss", ""], &mut bufs)
        .await;
    assert_eq!(get_code(&got[0]), 5000);
    assert_eq!(get_code(&got[1]), -600, "buffer too small");
    assert_eq!(get_code(&got[2]), -704, "miss");
    assert_eq!(get_code(&got[3]), -600, "empty key");
    assert!(a == v);

    let ex = client.batch_exists(&["hit", "miss"]).await.unwrap();
    assert!(ex[0].as_ref().unwrap());
    assert!(!ex[1].as_ref().unwrap());

    // The hit was just leased by get/exists: a plain remove is refused, force works.
    let err = client.remove("hit", false).await.unwrap_err();
    assert_eq!(err.code().as_i32(), -706);
    client.remove("hit", true).await.unwrap();
    assert_eq!(
        client
            .remove("hit", false)
            .await
            .unwrap_err()
            .code()
            .as_i32(),
        -704
    );
    assert!(!client.exists("hit").await.unwrap());

    for i in 0..5 {
        client
            .put(&format!("all/{i}"), &payload("x", 100), &cfg)
            .await
            .unwrap();
    }
    assert_eq!(client.remove_all(false).await.unwrap(), 5);
    assert!(!client.exists("all/0").await.unwrap());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_larger_than_any_segment_is_a_clear_error_and_the_store_keeps_serving() {
    let c = Cluster::start(&[4 * MIB]).await;
    let client = c.client().await;
    let big = vec![1u8; 5 << 20];
    let err = client
        .put("big", &big, &ReplicateConfig::default())
        .await
        .unwrap_err();
    assert_eq!(err.code().as_i32(), -600);
    assert!(
        err.to_string()
            .contains("larger than the largest mounted segment"),
        "{err}"
    );
    let v = payload("small", 1000);
    client
        .put("small", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; 1000];
    assert_eq!(client.get("small", &mut buf).await.unwrap(), 1000);
    assert!(buf == v);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_outlives_its_lease_is_lease_expired() {
    let config = mooncake_master::MasterConfig {
        default_kv_lease_ttl: std::time::Duration::from_millis(1),
        ..mooncake_tests::master_config()
    };
    let c = Cluster::start_with(config, &[64 * MIB]).await;
    let client = c.client().await;
    // 16 MiB cannot cross loopback in under a millisecond, so the lease is always over.
    let v = payload("slow", 16 << 20);
    client
        .put("slow", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; v.len()];
    let err = client.get("slow", &mut buf).await.unwrap_err();
    assert_eq!(err.code().as_i32(), -707, "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_scattered_over_several_buffers_round_trip() {
    let c = Cluster::start(&[16 * MIB]).await;
    let client = c.client().await;
    let (k, v) = (payload("k-half", 3000), payload("v-half", 5000));
    let kv_parts: [&[u8]; 2] = [&k, &v];
    let empty_parts: [&[u8]; 2] = [&[], &[]];
    let items: Vec<(&str, &[&[u8]])> = vec![("kv", &kv_parts), ("empty-parts", &empty_parts)];
    let put = client
        .batch_put_parts(&items, &ReplicateConfig::default())
        .await;
    assert_eq!(put[0].as_ref().unwrap(), &PutOutcome::Stored);
    assert_eq!(put_code(&put[1]), -600);
    // Read back split differently, with spare room at the end.
    let (mut a, mut b, mut tail) = (vec![0u8; 1000], vec![0u8; 6000], vec![0xEEu8; 4000]);
    let mut bufs = vec![vec![&mut a[..], &mut b[..], &mut tail[..]]];
    let got = client.batch_get_parts(&["kv"], &mut bufs).await;
    assert_eq!(*got[0].as_ref().unwrap(), 8000);
    let mut joined = a.clone();
    joined.extend_from_slice(&b);
    joined.extend_from_slice(&tail[..1000]);
    let mut want = k.clone();
    want.extend_from_slice(&v);
    assert!(joined == want);
    assert!(
        tail[1000..].iter().all(|x| *x == 0xEE),
        "bytes past the object are untouched"
    );
    // Parts that cannot hold the object together are too small.
    let (mut s1, mut s2) = (vec![0u8; 4000], vec![0u8; 3999]);
    let mut bufs = vec![vec![&mut s1[..], &mut s2[..]]];
    assert_eq!(
        get_code(&client.batch_get_parts(&["kv"], &mut bufs).await[0]),
        -600
    );
    c.shutdown().await;
}

/// A removal pattern that backtracks to its limit on every key is matched without the master's
/// lock: other calls are answered while it runs, and it still removes what it matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_removal_pattern_does_not_hold_up_other_calls() {
    // Real processes: a master whose calls share the test's runtime would stall the test too.
    let (_master, rpc, _) = mooncake_tests::spawn_master(&[]);
    let (_owner, _) = mooncake_tests::spawn_owner(&rpc, "64MiB", &[]);
    let client = std::sync::Arc::new(
        mooncake_client::Client::connect(mooncake_client::ClientConfig {
            rpc_timeout: std::time::Duration::from_secs(60),
            ..mooncake_client::ClientConfig::new(&rpc)
        })
        .await
        .unwrap(),
    );
    let cfg = ReplicateConfig::default();
    let keys: Vec<String> = (0..N_SLOW)
        .map(|i| format!("{}{i}", "a".repeat(24)))
        .collect();
    let value = payload("slow", 64);
    let items: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), &value[..])).collect();
    assert!(client
        .batch_put(&items, &cfg)
        .await
        .iter()
        .all(|r| r.is_ok()));
    client.put("b-key", &value, &cfg).await.unwrap();
    let remover = {
        let client = client.clone();
        tokio::spawn(async move {
            let t = std::time::Instant::now();
            // Nested repetition before a backreference: the backtracking engine, to its limit.
            let n = client.remove_by_regex(r"^(a+)+\1b|^b-key$", true).await;
            (n, t.elapsed())
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let asked = std::time::Instant::now();
    client.put("during", &value, &cfg).await.unwrap();
    let answered = asked.elapsed();
    let (n, took) = remover.await.unwrap();
    assert_eq!(n.unwrap(), 1, "only b-key matches");
    eprintln!("removal took {took:?}; a put during it {answered:?}");
    // Held up, the put would wait out most of the removal (took less the 100 ms above).
    assert!(
        took > std::time::Duration::from_secs(1),
        "the pattern was not slow ({took:?}): nothing measured"
    );
    assert!(
        answered < took / 2,
        "a put waited {answered:?} during a removal of {took:?}"
    );
}

/// Keys the slow pattern is tried on (each costs it about a tenth of a second in a debug build).
const N_SLOW: usize = 24;

/// A batch whose request would not fit one frame is refused at once with INVALID_PARAMS, before
/// anything is sent (the master would drop the connection, and a lookup would be sent again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_a_frame_is_refused_at_once() {
    let c = Cluster::start(&[4 * MIB]).await;
    let client = c.client().await;
    // 70,000 keys of 4,000 bytes: about 280 MB, over the 256 MiB frame limit.
    let keys: Vec<String> = (0..70_000).map(|i| format!("{i:04000}")).collect();
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let e = client.batch_exists(&refs).await.unwrap_err();
    assert_eq!(e.code().as_i32(), -600, "{e}");
    assert!(e.to_string().contains("split the batch"), "{e}");
    c.shutdown().await;
}

/// Thousands of reads with long keys on one connection: the requests and the answers each
/// outgrow the sockets' buffers. Sent all at once before any answer was read, the client
/// waited on its sending while the owner, its answers unread, stopped reading: every key failed
/// at the deadline. Batches now go in windows that cannot block both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_outgrowing_the_socket_buffers_both_ways_round_trips_on_one_connection() {
    let c = Cluster::start(&[64 * MIB]).await;
    let cfg = mooncake_client::ClientConfig {
        connections_per_owner: 1,
        transfer_threads: 1,
        transfer_timeout: std::time::Duration::from_secs(5),
        ..c.client_config()
    };
    let client = mooncake_client::Client::connect_with(cfg.clone(), None, transport(&cfg))
        .await
        .unwrap();
    let long = "x".repeat(3800);
    let keys: Vec<String> = (0..4096).map(|i| format!("{i:05}/{long}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, 4096)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    for r in client.batch_put(&items, &ReplicateConfig::default()).await {
        assert!(matches!(r, Ok(PutOutcome::Stored)), "{r:?}");
    }
    let names: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let mut bufs = vec![vec![0u8; 4096]; keys.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    for (k, r) in keys.iter().zip(client.batch_get(&names, &mut slices).await) {
        assert_eq!(r.unwrap_or_else(|e| panic!("{}: {e}", &k[..5])), 4096);
    }
    assert!(bufs == values, "bytes differ");
    c.shutdown().await;
}
