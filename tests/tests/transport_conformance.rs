//! One conformance suite for every data transport: TCP, and the same-host shared-memory path.
//! Both must move bytes exactly, refuse bad ranges, wrong keys and wrong versions with the same
//! codes, fence writes of older grants, and report per-item results in batches.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use mooncake_client::transport::{tcp::TcpConfig, HybridConfig, HybridTransport, TcpTransport};
use mooncake_common::{
    auth::Seal,
    transport::{DataTransport, ReadItem, WriteItem},
    ObjectKey, SegmentName, Stamp,
};
use mooncake_tests::{payload, Cluster, Single};

/// A new grant, larger than every earlier one, as a master issues them.
fn grant() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn stamp(put_id: u64) -> Stamp {
    Stamp {
        put_id,
        replica_num: 1,
        ..Stamp::default()
    }
}

const SEG: u64 = 16 << 20;

fn tcp_config(transfer_threads: usize) -> TcpConfig {
    TcpConfig {
        connect_timeout: std::time::Duration::from_secs(2),
        transfer_timeout: std::time::Duration::from_secs(5),
        connections_per_owner: 4,
        transfer_threads,
        dedicated_runtime: false,
        credential: None,
    }
}

fn transports() -> Vec<(&'static str, Arc<dyn DataTransport>)> {
    vec![
        ("tcp", Arc::new(TcpTransport::new(tcp_config(1)))),
        ("tcp-threads", Arc::new(TcpTransport::new(tcp_config(3)))),
        (
            "shm",
            Arc::new(HybridTransport::new(HybridConfig {
                tcp: tcp_config(2),
                shared_memory: true,
                socket_dir: mooncake_tests::socket_dir(),
                copy_threads: 2,
                probe_again_after: mooncake_client::transport::hybrid::PROBE_AGAIN_AFTER,
            })),
        ),
    ]
}

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

async fn conformance(name: &str, t: &dyn DataTransport, seg: &SegmentName) {
    // Round trip, written in two parts and read back in three.
    let v = payload(name, 10_000);
    let (a, b) = v.split_at(3_000);
    let g = grant();
    t.write1(seg, &k("obj"), 4096, stamp(g), &[a, b])
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let (mut x, mut y, mut z) = (vec![0u8; 1], vec![0u8; 8_999], vec![0u8; 1_000]);
    t.read1(
        seg,
        &k("obj"),
        4096,
        g,
        &mut [&mut x[..], &mut y[..], &mut z[..]],
    )
    .await
    .unwrap();
    assert!([x, y, z].concat() == v, "{name}: bytes differ");

    // The wrong key or the wrong version at a valid range: not found, and the buffer is
    // untouched.
    let mut buf = vec![7u8; 10_000];
    for (key, version) in [("other", g), ("obj", g + 1000)] {
        let e = t
            .read1(seg, &k(key), 4096, version, &mut [&mut buf[..]])
            .await
            .unwrap_err();
        assert_eq!(e.code().as_i32(), -704, "{name}: {e}");
        assert!(
            buf.iter().all(|b| *b == 7),
            "{name}: a refused read wrote into the buffer"
        );
    }

    // Out of range, both ways.
    let e = t
        .write1(seg, &k("far"), SEG - 10, stamp(grant()), &[&[1u8; 100][..]])
        .await
        .unwrap_err();
    assert_eq!(e.code().as_i32(), -600, "{name}: {e}");
    let e = t
        .read1(seg, &k("obj"), u64::MAX - 5, g, &mut [&mut buf[..10]])
        .await
        .unwrap_err();
    assert_eq!(e.code().as_i32(), -600, "{name}: {e}");

    // Batches answer per item.
    let (p1, p2) = (payload("b1", 5000), payload("b2", 7000));
    let p1s: [&[u8]; 1] = [&p1];
    let p2s: [&[u8]; 1] = [&p2];
    let bad: [&[u8]; 1] = [&[0u8; 64]];
    let (k1, k2, k3) = (k("b1"), k("b2"), k("b3"));
    let (g1, g2, g3) = (grant(), grant(), grant());
    let writes = [
        WriteItem {
            key: &k1,
            offset: 65536,
            stamp: stamp(g1),
            seal: Seal::default(),
            parts: &p1s,
        },
        WriteItem {
            key: &k3,
            offset: SEG,
            stamp: stamp(g3),
            seal: Seal::default(),
            parts: &bad,
        },
        WriteItem {
            key: &k2,
            offset: 131072,
            stamp: stamp(g2),
            seal: Seal::default(),
            parts: &p2s,
        },
    ];
    let res = t.write_batch(seg, &writes).await;
    assert!(res[0].is_ok() && res[2].is_ok(), "{name}: {res:?}");
    assert_eq!(res[1].as_ref().unwrap_err().code().as_i32(), -600, "{name}");
    let (mut r1, mut r2, mut r3) = (vec![0u8; 5000], vec![0u8; 7000], vec![0u8; 64]);
    let (mut d1, mut d2, mut d3) = ([&mut r1[..]], [&mut r2[..]], [&mut r3[..]]);
    let mut reads = [
        ReadItem {
            key: &k2,
            offset: 131072,
            put_id: g2,
            seal: Seal::default(),
            parts: &mut d2,
        },
        ReadItem {
            key: &k3,
            offset: 200_000,
            put_id: g3,
            seal: Seal::default(),
            parts: &mut d3,
        },
        ReadItem {
            key: &k1,
            offset: 65536,
            put_id: g1,
            seal: Seal::default(),
            parts: &mut d1,
        },
    ];
    let res = t.read_batch(seg, &mut reads).await;
    assert!(res[0].is_ok() && res[2].is_ok(), "{name}: {res:?}");
    assert_eq!(res[1].as_ref().unwrap_err().code().as_i32(), -704, "{name}");
    assert!(r1 == p1 && r2 == p2, "{name}: batch bytes differ");

    // Rewriting a range under a newer grant replaces its key: the old key no longer reads.
    let newer = grant();
    let nv = payload("newer", 10_000);
    t.write1(seg, &k("newer"), 4096, stamp(newer), &[&nv[..]])
        .await
        .unwrap();
    let e = t
        .read1(seg, &k("obj"), 4096, g, &mut [&mut buf[..]])
        .await
        .unwrap_err();
    assert_eq!(e.code().as_i32(), -704, "{name}");

    // A write of an older grant over it (an abandoned transfer arriving late) is refused and
    // changes nothing, wherever it overlaps.
    for (offset, len) in [(4096, 10_000), (4000, 200), (14_000, 500)] {
        let e = t
            .write1(seg, &k("obj"), offset, stamp(g), &[&vec![0xEE; len][..]])
            .await
            .unwrap_err();
        assert_eq!(e.code().as_i32(), -800, "{name}: {e}");
    }
    t.read1(seg, &k("newer"), 4096, newer, &mut [&mut buf[..]])
        .await
        .unwrap();
    assert!(buf == nv, "{name}: a stale write changed the bytes");
}

/// Reads of `keys[i]` at `offset(i)`, version `grants[i]`, each into its one buffer.
fn read_items<'a, 'b>(
    keys: &'a [ObjectKey],
    dsts: &'a mut [[&'b mut [u8]; 1]],
    grants: &[u64],
    offset: impl Fn(usize) -> u64,
) -> Vec<ReadItem<'a, 'b>> {
    dsts.iter_mut()
        .enumerate()
        .map(|(i, d)| ReadItem {
            key: &keys[i],
            offset: offset(i),
            put_id: grants[i],
            seal: Seal::default(),
            parts: d,
        })
        .collect()
}

/// Batches of several MiB (which the TCP transport spreads over threads), with a refused item
/// in the middle: every item's bytes and result come back in order, and the connections stay
/// usable afterwards.
async fn large_batches(name: &str, t: &dyn DataTransport, seg: &SegmentName) {
    const N: usize = 7;
    const LEN: usize = 1_300_000;
    let keys: Vec<ObjectKey> = (0..N).map(|i| k(&format!("large/{i}"))).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k.as_str(), LEN)).collect();
    let offset = |i: usize| if i == 3 { SEG } else { (i * LEN) as u64 };
    let parts: Vec<[&[u8]; 1]> = values.iter().map(|v| [&v[..]]).collect();
    for round in 0..2 {
        let grants: Vec<u64> = (0..N).map(|_| grant()).collect();
        let writes: Vec<WriteItem<'_>> = (0..N)
            .map(|i| WriteItem {
                key: &keys[i],
                offset: offset(i),
                stamp: stamp(grants[i]),
                seal: Seal::default(),
                parts: &parts[i],
            })
            .collect();
        let res = t.write_batch(seg, &writes).await;
        for (i, r) in res.iter().enumerate() {
            match (i, r) {
                (3, Err(e)) => assert_eq!(e.code().as_i32(), -600, "{name}"),
                (3, Ok(())) => panic!("{name}: an out-of-range write succeeded"),
                (_, r) => assert!(r.is_ok(), "{name} round {round} item {i}: {r:?}"),
            }
        }
        let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; LEN]).collect();
        let mut dsts: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
        let mut reads = read_items(&keys, &mut dsts, &grants, |i| {
            if i == 3 {
                0
            } else {
                offset(i)
            }
        });
        let res = t.read_batch(seg, &mut reads).await;
        drop(reads);
        for (i, r) in res.iter().enumerate() {
            if i == 3 {
                // The range at 0 holds another key.
                assert_eq!(r.as_ref().unwrap_err().code().as_i32(), -704, "{name}");
            } else {
                assert!(r.is_ok(), "{name} round {round} item {i}: {r:?}");
                assert!(bufs[i] == values[i], "{name}: item {i} bytes differ");
            }
        }
    }
}

/// A batch of many small values (more answers than one `writev` of the owner carries, some read
/// into two parts), with refused items among them (first, last, two in a row): answers stay in
/// order and every byte is right.
async fn many_small(name: &str, t: &dyn DataTransport, seg: &SegmentName) {
    const N: usize = 1100;
    const LEN: usize = 1000;
    const BASE: u64 = 9 << 20;
    let keys: Vec<ObjectKey> = (0..N).map(|i| k(&format!("small/{i}"))).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k.as_str(), LEN)).collect();
    let parts: Vec<[&[u8]; 1]> = values.iter().map(|v| [&v[..]]).collect();
    let grants: Vec<u64> = (0..N).map(|_| grant()).collect();
    let writes: Vec<WriteItem<'_>> = (0..N)
        .map(|i| WriteItem {
            key: &keys[i],
            offset: BASE + (i * LEN) as u64,
            stamp: stamp(grants[i]),
            seal: Seal::default(),
            parts: &parts[i],
        })
        .collect();
    let res = t.write_batch(seg, &writes).await;
    assert!(res.iter().all(|r| r.is_ok()), "{name}: {res:?}");
    for refused in [vec![777], vec![0, 500, 777, 778, N - 1]] {
        let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; LEN]).collect();
        let mut dsts: Vec<Vec<&mut [u8]>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| match i % 3 {
                0 => {
                    let (x, y) = b.split_at_mut(300);
                    vec![x, y]
                }
                _ => vec![&mut b[..]],
            })
            .collect();
        let mut reads: Vec<ReadItem<'_, '_>> = dsts
            .iter_mut()
            .enumerate()
            .map(|(i, d)| ReadItem {
                key: &keys[if refused.contains(&i) { (i + 1) % N } else { i }],
                offset: BASE + (i * LEN) as u64,
                put_id: grants[i],
                seal: Seal::default(),
                parts: d,
            })
            .collect();
        let res = t.read_batch(seg, &mut reads).await;
        drop(reads);
        drop(dsts);
        for (i, r) in res.iter().enumerate() {
            if refused.contains(&i) {
                assert_eq!(r.as_ref().unwrap_err().code().as_i32(), -704, "{name}");
            } else {
                assert!(r.is_ok(), "{name} item {i}: {r:?}");
                assert!(bufs[i] == values[i], "{name}: item {i} bytes differ");
            }
        }
    }
}

/// The large-batch part on current-thread runtimes too: one the cluster shares (the batch must
/// stay on it, or the owner it waits for would never run), and a dedicated one (the Python
/// binding's), where the caller's thread itself waits for the transfer threads.
#[test]
fn large_batches_on_current_thread_runtimes() {
    let current = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    current().block_on(async {
        let c = Cluster::start(&[SEG]).await;
        let seg = c.owners[0].segment.clone();
        let t = TcpTransport::new(tcp_config(2));
        large_batches("tcp-threads/shared-runtime", &t, &seg).await;
        c.shutdown().await;
    });
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = servers.block_on(Cluster::start(&[SEG]));
    let seg = c.owners[0].segment.clone();
    let t = TcpTransport::new(TcpConfig {
        dedicated_runtime: true,
        credential: None,
        ..tcp_config(2)
    });
    current().block_on(large_batches("tcp-threads/dedicated-runtime", &t, &seg));
    servers.block_on(c.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_passes_the_same_suite() {
    let c = Cluster::start(&[SEG]).await;
    let seg = c.owners[0].segment.clone();
    for (name, t) in transports() {
        conformance(name, t.as_ref(), &seg).await;
        large_batches(name, t.as_ref(), &seg).await;
        many_small(name, t.as_ref(), &seg).await;
        let stats = t.stats();
        if name == "shm" {
            assert!(
                stats.local_bytes > 0 && stats.tcp_bytes == 0,
                "{name}: {stats:?}"
            );
        }
    }
    c.shutdown().await;
}

/// A batch of reads from an owner on this host goes over one connection: the caller's one thread
/// receives it all, and more connections would only spread the owner's sending over threads that
/// compete with it for the cores. (That a batch of writes of the same size may spread is the
/// transport's unit test: whether it opens more connections depends on how the runtime polls.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_reads_take_one_connection() {
    const N: usize = 6;
    const LEN: usize = 1 << 20;
    let c = Cluster::start(&[SEG]).await;
    let seg = c.owners[0].segment.clone();
    let t = TcpTransport::new(tcp_config(1));
    let keys: Vec<ObjectKey> = (0..N).map(|i| k(&format!("spread/{i}"))).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k.as_str(), LEN)).collect();
    let mut grants: Vec<u64> = Vec::new();
    for i in 0..N {
        grants.push(grant());
        t.write1(
            &seg,
            &keys[i],
            (i * LEN) as u64,
            stamp(grants[i]),
            &[&values[i][..]],
        )
        .await
        .unwrap();
    }
    assert_eq!(
        t.idle_connections(&seg),
        1,
        "one write at a time needs one connection"
    );

    let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; LEN]).collect();
    let mut dsts: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
    let mut reads = read_items(&keys, &mut dsts, &grants, |i| (i * LEN) as u64);
    let res = t.read_batch(&seg, &mut reads).await;
    drop(reads);
    assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    assert!(bufs == values, "read bytes differ");
    assert_eq!(t.idle_connections(&seg), 1, "a same-host read batch spread");
    drop(t);
    c.shutdown().await;
}
