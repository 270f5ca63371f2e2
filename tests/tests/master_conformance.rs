//! The `MasterApi` conformance suite: the framed, gRPC and in-process implementations answer
//! the same calls with the same domain values (codes, sizes, replicas, leases), and a client
//! built on each moves the same bytes. Every case runs against a real master and a real owner.

use std::{sync::Arc, time::Duration};

use mooncake_client::{
    master::{FramedMaster, GrpcMaster},
    Client, MasterApi, ReplicateConfig, Tier,
};
use mooncake_common::{
    master_api::{Lookup, Releases},
    Code, ReplicaTaskSpec, ReplicaTaskState, ReplicaTaskStatus, ReplicaTaskType,
};
use mooncake_tests::{payload, transport, Cluster};

const SEGMENT: u64 = 16 << 20;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Framed,
    Grpc,
    InProcess,
}

const KINDS: [Kind; 3] = [Kind::Framed, Kind::Grpc, Kind::InProcess];

fn api(c: &Cluster, kind: Kind) -> Arc<dyn MasterApi> {
    let addr = c.master_addr();
    let (rpc, connect) = (Duration::from_secs(3), Duration::from_secs(2));
    // Lazy: neither connects before its first call.
    let [framed, grpc] = wire(&addr, rpc, connect);
    match kind {
        Kind::Framed => framed,
        Kind::Grpc => grpc,
        Kind::InProcess => Arc::new(c.master.in_process()),
    }
}

/// The two wire adapters to `addr`, without a credential, in the default tenant: framed, gRPC.
fn wire(addr: &str, rpc: Duration, connect: Duration) -> [Arc<dyn MasterApi>; 2] {
    let tenant = Default::default();
    [
        Arc::new(FramedMaster::new(
            addr,
            rpc,
            connect,
            Duration::ZERO,
            None,
            tenant,
            None,
        )),
        Arc::new(GrpcMaster::new(addr, rpc, connect, None, &Default::default(), None).unwrap()),
    ]
}

fn codes<T>(results: &[Result<T, Code>]) -> Vec<Code> {
    results
        .iter()
        .map(|r| r.as_ref().err().copied().unwrap_or(Code::Ok))
        .collect()
}

fn lookup_codes(l: &Lookup) -> Vec<Code> {
    codes(l.results())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_api_answers_the_two_phase_put_the_same() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT]).await;
        let m = api(&c, kind);
        let segment = c.owners[0].segment.clone();

        let segs = m.list_segments().await.unwrap();
        assert_eq!(segs.len(), 1, "{kind:?}");
        assert_eq!(
            (&segs[0].name, segs[0].capacity, segs[0].allocated),
            (&segment, SEGMENT, 0),
            "{kind:?}"
        );

        let cfg = ReplicateConfig::default();
        let grants = m
            .put_start(&[("a", 100), ("b", 5000), ("", 5), ("a", 7)], &cfg, 0)
            .await
            .unwrap();
        assert_eq!(grants.results.len(), 4, "{kind:?}");
        let ga = grants.results[0].as_ref().unwrap().clone();
        let gb = grants.results[1].as_ref().unwrap().clone();
        let (ra, rb) = (grants.run(&ga.replicas), grants.run(&gb.replicas));
        assert_eq!(ra.len(), 1, "{kind:?}");
        assert_eq!(
            (&ra[0].segment, ra[0].size, ra[0].tier),
            (&segment, 100, Tier::Memory),
            "{kind:?}"
        );
        assert_eq!((rb[0].size, rb.len()), (5000, 1), "{kind:?}");
        assert_ne!(ga.put_id, gb.put_id, "{kind:?}");
        let empty = grants.results[2].as_ref().unwrap_err();
        assert_eq!(empty.code, Code::InvalidParams, "{kind:?}: {empty}");
        let dup = grants.results[3].as_ref().unwrap_err();
        assert_eq!(dup.code, Code::ObjectAlreadyExists, "{kind:?}: {dup}");
        assert!(!dup.message.is_empty(), "{kind:?}: refusals carry a text");

        // Not readable before its put ends.
        let early = m.get_replicas(&["a"], Releases::NONE).await.unwrap();
        assert_eq!(lookup_codes(&early), [Code::ReplicaIsNotReady], "{kind:?}");

        let ends = m
            .put_end(&[("a", ga.put_id), ("b", gb.put_id), ("b", gb.put_id + 999)])
            .await
            .unwrap();
        assert_eq!(
            codes(&ends),
            [Code::Ok, Code::Ok, Code::ObjectNotFound],
            "{kind:?}"
        );

        let l = m
            .get_replicas(&["a", "none", "", "b"], Releases::NONE)
            .await
            .unwrap();
        assert_eq!(
            lookup_codes(&l),
            [
                Code::Ok,
                Code::ObjectNotFound,
                Code::InvalidParams,
                Code::Ok
            ],
            "{kind:?}"
        );
        let fa = l.results()[0].as_ref().unwrap();
        assert_eq!(fa.size, 100, "{kind:?}");
        assert_eq!(
            l.replicas(fa),
            ra,
            "{kind:?}: the lookup names the granted range"
        );
        assert_eq!(
            l.lease_ttl,
            c.master.with_state(|s| s.policy().lease_ttl),
            "{kind:?}"
        );

        let e = m.exists(&["a", "none", ""], Releases::NONE).await.unwrap();
        assert_eq!(
            e.found,
            [Ok(true), Ok(false), Err(Code::InvalidParams)],
            "{kind:?}"
        );
        assert_eq!(e.lease_ttl, l.lease_ttl, "{kind:?}");

        // A revoked put leaves the key absent and its space free.
        let gc = m.put_start(&[("c", 64)], &cfg, 0).await.unwrap();
        let gc = gc.results[0].as_ref().unwrap().put_id;
        assert_eq!(
            m.put_revoke(&[("c", gc)]).await.unwrap(),
            [Ok(())],
            "{kind:?}"
        );
        assert_eq!(
            codes(&m.put_revoke(&[("c", gc)]).await.unwrap()),
            [Code::ObjectNotFound],
            "{kind:?}"
        );
        assert_eq!(
            lookup_codes(&m.get_replicas(&["c"], Releases::NONE).await.unwrap()),
            [Code::ObjectNotFound],
            "{kind:?}"
        );

        // "a" is leased by the lookup above: only a forced remove takes it.
        assert_eq!(
            codes(&m.remove(&["a", "none"], false).await.unwrap()),
            [Code::ObjectHasLease, Code::ObjectNotFound],
            "{kind:?}"
        );
        assert_eq!(m.remove(&["a"], true).await.unwrap(), [Ok(())], "{kind:?}");
        // A key regex: matched anywhere; one that does not compile is INVALID_PARAMS.
        assert_eq!(
            m.remove_all(true, Some("^zz")).await.unwrap(),
            0,
            "{kind:?}"
        );
        assert_eq!(
            m.remove_all(true, Some("(")).await.unwrap_err().code,
            Code::InvalidParams,
            "{kind:?}"
        );
        assert_eq!(
            m.remove_all(true, Some("b")).await.unwrap(),
            1,
            "{kind:?}: b was left"
        );
        assert_eq!(m.remove_all(true, None).await.unwrap(), 0, "{kind:?}");
        assert_eq!(m.list_segments().await.unwrap()[0].allocated, 0, "{kind:?}");
        c.shutdown().await;
    }
}

/// A start whose answer its caller never got is given up by its token: what it granted is
/// revoked (the key may be put again at once), and a start under an abandoned token that
/// arrives later grants nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_api_gives_up_an_abandoned_start_the_same() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT]).await;
        let m = api(&c, kind);
        let cfg = ReplicateConfig::default();
        let g = m
            .put_start(&[("a", 100), ("b", 100)], &cfg, 7)
            .await
            .unwrap();
        assert!(g.results.iter().all(|r| r.is_ok()), "{kind:?}");
        let ended = m
            .put_end(&[("a", g.results[0].as_ref().unwrap().put_id)])
            .await
            .unwrap();
        assert_eq!(codes(&ended), [Code::Ok], "{kind:?}");
        // Only the put that had not ended goes.
        assert_eq!(m.abandon_put_start(7).await.unwrap(), 1, "{kind:?}");
        let again = m
            .put_start(&[("a", 100), ("b", 100)], &cfg, 8)
            .await
            .unwrap();
        let e = again.results[0].as_ref().unwrap_err();
        assert_eq!(e.code, Code::ObjectAlreadyExists, "{kind:?}: a stays");
        assert!(again.results[1].is_ok(), "{kind:?}: b is free again");
        // Abandoned before it arrived: refused, and the key stays free.
        assert_eq!(m.abandon_put_start(9).await.unwrap(), 0, "{kind:?}");
        let late = m.put_start(&[("c", 100)], &cfg, 9).await.unwrap();
        let e = late.results[0].as_ref().unwrap_err();
        assert_eq!(e.code, Code::InvalidParams, "{kind:?}: {e}");
        assert!(e.message.contains("abandoned"), "{kind:?}: {e}");
        let fresh = m.put_start(&[("c", 100)], &cfg, 10).await.unwrap();
        assert!(fresh.results[0].is_ok(), "{kind:?}");
        // Token 0 names no start.
        assert_eq!(m.abandon_put_start(0).await.unwrap(), 0, "{kind:?}");
        assert!(m.put_start(&[("d", 100)], &cfg, 0).await.unwrap().results[0].is_ok());
        c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_api_refuses_a_bad_config_and_answers_empty_batches() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT]).await;
        let m = api(&c, kind);
        let too_many = ReplicateConfig {
            replica_num: 65,
            ..Default::default()
        };
        let g = m
            .put_start(&[("x", 10), ("y", 10)], &too_many, 0)
            .await
            .unwrap();
        for r in &g.results {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.code, Code::InvalidParams, "{kind:?}: {e}");
            assert!(e.message.contains("replica_num"), "{kind:?}: {e}");
        }
        let too_long = ReplicateConfig {
            preferred_segments: (0..300)
                .map(|i| {
                    mooncake_common::SegmentName::parse(&format!("10.0.0.1:{}", 1000 + i)).unwrap()
                })
                .collect(),
            ..Default::default()
        };
        let g = m.put_start(&[("x", 10)], &too_long, 0).await.unwrap();
        let e = g.results[0].as_ref().unwrap_err();
        assert_eq!(e.code, Code::InvalidParams, "{kind:?}: {e}");
        assert!(e.message.contains("preferred segments"), "{kind:?}: {e}");
        // Unmounted preferred segments are skipped, not refused.
        let elsewhere = ReplicateConfig {
            preferred_segments: vec![mooncake_common::SegmentName::parse("10.255.0.1:9").unwrap()],
            ..Default::default()
        };
        let g = m.put_start(&[("z", 10)], &elsewhere, 0).await.unwrap();
        assert!(g.results[0].is_ok(), "{kind:?}");
        assert!(m
            .put_start(&[], &elsewhere, 0)
            .await
            .unwrap()
            .results
            .is_empty());
        assert!(m
            .get_replicas(&[], Releases::NONE)
            .await
            .unwrap()
            .results()
            .is_empty());
        assert!(m
            .exists(&[], Releases::NONE)
            .await
            .unwrap()
            .found
            .is_empty());
        assert!(m.put_end(&[]).await.unwrap().is_empty());
        assert!(m.remove(&[], true).await.unwrap().is_empty());
        c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_every_master_api_moves_the_same_bytes() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT, SEGMENT]).await;
        let cfg = c.client_config();
        let client = Client::with_master(api(&c, kind), None, transport(&cfg))
            .await
            .unwrap();
        let keys: Vec<String> = (0..16).map(|i| format!("conf/{i}")).collect();
        let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, 65_536 + 17)).collect();
        let items: Vec<(&str, &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let two = ReplicateConfig {
            replica_num: 2,
            ..Default::default()
        };
        for r in client.batch_put(&items, &two).await {
            r.unwrap();
        }
        let names: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        for (r, v) in client.batch_get(&names, &mut dst).await.iter().zip(&values) {
            assert_eq!(*r.as_ref().unwrap(), v.len(), "{kind:?}");
        }
        assert!(bufs == values, "{kind:?}: bytes differ");
        let desc = client.batch_get_replica_desc(&names[..1]).await.unwrap();
        assert_eq!(desc[0].as_ref().unwrap().replicas.len(), 2, "{kind:?}");
        c.shutdown().await;
    }
}

/// Holds handed back with a lookup, with an existence check, or on their own: the last one
/// ends the lease at once (lease mode "reads", the default), so a plain remove then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_api_hands_back_read_holds_the_same() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT]).await;
        let m = api(&c, kind);
        let client = Client::with_master(m.clone(), None, transport(&c.client_config()))
            .await
            .unwrap();
        let cfg = ReplicateConfig::default();
        for k in ["h/a", "h/b", "h/c"] {
            client.put(k, &payload(k, 1000), &cfg).await.unwrap();
        }
        // Two holds on a, one on b and c, all granted by this master's epoch.
        let epoch = m
            .get_replicas(&["h/a", "h/b"], Releases::NONE)
            .await
            .unwrap()
            .epoch;
        assert_ne!(epoch, 0, "{kind:?}");
        let checked = m.exists(&["h/a", "h/c"], Releases::NONE).await.unwrap();
        assert_eq!(checked.epoch, epoch, "{kind:?}");
        let of = |keys| Releases::of(keys, epoch);
        // Holds that name another master's epoch are not this master's to end.
        let foreign = Releases::of(&["h/a", "h/a", "h/b", "h/c"], epoch + 1);
        m.release_leases(foreign).await.unwrap();
        // One of a's and b's go back with a lookup of nothing, c's with a check of nothing.
        m.get_replicas(&[], of(&["h/a", "h/b"])).await.unwrap();
        m.exists(&[], of(&["h/c"])).await.unwrap();
        let removed = m.remove(&["h/a", "h/b", "h/c"], false).await.unwrap();
        assert_eq!(
            codes(&removed),
            vec![Code::ObjectHasLease, Code::Ok, Code::Ok],
            "{kind:?}"
        );
        // Epoch 0 (a caller that does not know it) is taken as this master's.
        m.release_leases(Releases::of(&["h/a"], 0)).await.unwrap();
        assert_eq!(
            codes(&m.remove(&["h/a"], false).await.unwrap()),
            vec![Code::Ok],
            "{kind:?}"
        );
        c.shutdown().await;
    }
}

/// Polls a replica task until it finishes (bounded).
async fn finished(m: &dyn MasterApi, id: u64) -> ReplicaTaskState {
    for _ in 0..400 {
        let t = m.query_task(id).await.unwrap();
        if t.status.is_finished() {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("task {id} did not finish within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_api_runs_replica_tasks_and_clears_replicas_the_same() {
    for kind in KINDS {
        let c = Cluster::start(&[SEGMENT, SEGMENT]).await;
        let m = api(&c, kind);
        let client = Client::with_master(m.clone(), None, transport(&c.client_config()))
            .await
            .unwrap();
        let (a, b) = (
            c.owners[0].segment.to_string(),
            c.owners[1].segment.to_string(),
        );
        let on_a = ReplicateConfig {
            preferred_segments: vec![c.owners[0].segment.clone()],
            ..Default::default()
        };
        let value = payload("task", 300_001);
        client.put("task", &value, &on_a).await.unwrap();
        // A copy: both owners then hold the same bytes.
        let id = m
            .create_replica_task("task", ReplicaTaskSpec::Copy { targets: &[&b] })
            .await
            .unwrap();
        let t = finished(&*m, id).await;
        assert_eq!(
            (t.id, t.kind, t.status),
            (id, ReplicaTaskType::Copy, ReplicaTaskStatus::Success),
            "{kind:?}: {}",
            t.detail
        );
        assert_eq!(t.assigned, vec![b.clone()], "{kind:?}");
        let lookup = m.get_replicas(&["task"], Releases::NONE).await.unwrap();
        let found = lookup.objects.results[0].as_ref().unwrap();
        assert_eq!(lookup.objects.run(&found.replicas).len(), 2, "{kind:?}");
        // The lookup leased the object: its replicas stay.
        let cleared = m.replica_clear(&["task"], Some(&a)).await.unwrap();
        assert_eq!(codes(&cleared), vec![Code::ObjectHasLease], "{kind:?}");
        // A move from a fresh object.
        m.remove(&["task"], true).await.unwrap();
        client.put("task", &value, &on_a).await.unwrap();
        let id = m
            .create_replica_task(
                "task",
                ReplicaTaskSpec::Move {
                    source: &a,
                    target: &b,
                },
            )
            .await
            .unwrap();
        let t = finished(&*m, id).await;
        assert_eq!(
            (t.kind, t.status),
            (ReplicaTaskType::Move, ReplicaTaskStatus::Success),
            "{kind:?}: {}",
            t.detail
        );
        let desc = client.batch_get_replica_desc(&["task"]).await.unwrap();
        let reps = &desc[0].as_ref().unwrap().replicas;
        assert_eq!(reps.len(), 1, "{kind:?}");
        assert_eq!(reps[0].segment.to_string(), b, "{kind:?}");
        let mut buf = vec![0u8; value.len()];
        let got = client.batch_get(&["task"], &mut [&mut buf[..]]).await;
        assert_eq!(*got[0].as_ref().unwrap(), value.len(), "{kind:?}");
        assert!(buf == value, "{kind:?}: the moved replica's bytes differ");
        // Refusals carry Mooncake's codes.
        let refused = |r: Result<u64, mooncake_common::ApiError>| r.unwrap_err().code;
        let copy = |targets| ReplicaTaskSpec::Copy { targets };
        let to_a = [a.as_str()];
        assert_eq!(
            refused(m.create_replica_task("nope", copy(&to_a)).await),
            Code::ObjectNotFound,
            "{kind:?}"
        );
        assert_eq!(
            refused(m.create_replica_task("task", copy(&["127.0.0.1:1"])).await),
            Code::SegmentNotFound,
            "{kind:?}"
        );
        assert_eq!(
            refused(m.create_replica_task("task", copy(&["no port"])).await),
            Code::InvalidParams,
            "{kind:?}"
        );
        assert_eq!(
            m.query_task(id + 1_000_000).await.unwrap_err().code,
            Code::ObjectNotFound,
            "{kind:?}"
        );
        // A clear of whole objects: the leased one (looked up, its reader not done) stays.
        m.get_replicas(&["task"], Releases::NONE).await.unwrap();
        let cleared = m.replica_clear(&["task", "nope"], None).await.unwrap();
        assert_eq!(
            codes(&cleared),
            vec![Code::ObjectHasLease, Code::ObjectNotFound],
            "{kind:?}"
        );
        c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wire_apis_fail_within_their_deadline_when_the_master_is_gone() {
    // A port nothing listens on: bind one, note it, close it.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (rpc, connect) = (Duration::from_millis(500), Duration::from_millis(300));
    let apis = wire(&addr, rpc, connect);
    for m in apis {
        let started = std::time::Instant::now();
        let e = m.get_replicas(&["k"], Releases::NONE).await.unwrap_err();
        assert!(matches!(e.code, Code::RpcFail | Code::RpcTimeout), "{e}");
        assert!(e.code.is_retryable(), "{e}");
        assert!(started.elapsed() < Duration::from_secs(3), "{e}");
    }
}
