//! Replica placement through the real service: replica_num lands on distinct owners, the
//! preferred segment is honoured, and a full or unknown preferred segment falls back silently.

use std::collections::HashSet;

use mooncake_client::{Client, ReplicateConfig};
use mooncake_tests::{payload, transport, Cluster};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_land_on_two_distinct_owners_and_both_serve_the_bytes() {
    let c = Cluster::start(&[16 * MIB, 16 * MIB]).await;
    let client = c.client().await;
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let v = payload("r2", 300_000);
    client.put("r2", &v, &cfg).await.unwrap();
    let desc = client
        .batch_get_replica_desc(&["r2"])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(desc.size, 300_000);
    let segs: HashSet<_> = desc.replicas.iter().map(|r| r.segment.clone()).collect();
    assert_eq!(segs.len(), 2);
    let owners: HashSet<_> = c.owners.iter().map(|o| o.segment.clone()).collect();
    assert_eq!(segs, owners);
    // Each owner really holds the bytes: its catalog names the key and version at the replica's
    // offset.
    for o in &c.owners {
        let r = desc
            .replicas
            .iter()
            .find(|r| r.segment == o.segment)
            .unwrap();
        assert!(o.catalog().holds(
            r.offset,
            300_000,
            &mooncake_common::ObjectKey::new("r2").unwrap(),
            r.put_id,
        ));
    }
    // Reads succeed from either replica: prefer each owner in turn.
    for o in &c.owners {
        let pc = Client::connect_with(
            c.client_config(),
            Some(o.segment.clone()),
            transport(&c.client_config()),
        )
        .await
        .unwrap();
        let mut buf = vec![0u8; v.len()];
        assert_eq!(pc.get("r2", &mut buf).await.unwrap(), v.len());
        assert!(buf == v);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_segment_is_honoured_and_falls_back_when_full_or_unknown() {
    let c = Cluster::start(&[4 * MIB, 64 * MIB]).await;
    let small = c.owners[0].segment.clone();
    // The client's default preferred segment (as MOONCAKE_PREFERRED_SEGMENT would set it).
    let client = Client::connect_with(
        c.client_config(),
        Some(small.clone()),
        transport(&c.client_config()),
    )
    .await
    .unwrap();
    let hard = ReplicateConfig {
        hard_pin: true,
        ..Default::default()
    };
    for i in 0..3 {
        let k = format!("pref/{i}");
        client
            .put(&k, &payload(&k, MIB as usize), &hard)
            .await
            .unwrap();
        let d = client
            .batch_get_replica_desc(&[&k])
            .await
            .unwrap()
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(
            d.replicas[0].segment, small,
            "{k} not on the preferred segment"
        );
    }
    // The preferred segment has 1 MiB left and everything on it is hard-pinned: 2 MiB must fall
    // back to the other owner without an error.
    let k = "pref/spill";
    let v = payload(k, 2 * MIB as usize);
    client
        .put(k, &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let d = client
        .batch_get_replica_desc(&[k])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(d.replicas[0].segment, c.owners[1].segment);
    let mut buf = vec![0u8; v.len()];
    client.get(k, &mut buf).await.unwrap();
    assert!(buf == v);

    // An unknown preferred segment in the per-put config falls back too.
    let unknown = ReplicateConfig {
        preferred_segments: vec![mooncake_common::SegmentName::parse("10.255.0.1:9").unwrap()],
        ..Default::default()
    };
    client
        .put("pref/unknown", &payload("u", 1000), &unknown)
        .await
        .unwrap();
    assert!(client.exists("pref/unknown").await.unwrap());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_segment_from_the_environment_and_an_empty_one_is_none() {
    let c = Cluster::start(&[8 * MIB, 8 * MIB]).await;
    let seg = c.owners[1].segment.to_string();
    // The env var is read by `ClientConfig::with_process_env`; this test owns the variable in
    // this process.
    std::env::set_var(mooncake_client::PREFERRED_SEGMENT_ENV, &seg);
    let client = Client::connect(c.client_config().with_process_env().unwrap())
        .await
        .unwrap();
    assert_eq!(
        client.preferred_segment().map(|s| s.to_string()),
        Some(seg.clone())
    );
    for i in 0..4 {
        let k = format!("env/{i}");
        client
            .put(&k, &payload(&k, 1000), &ReplicateConfig::default())
            .await
            .unwrap();
        let d = client
            .batch_get_replica_desc(&[&k])
            .await
            .unwrap()
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(d.replicas[0].segment.to_string(), seg);
    }
    // Explicit config wins over the environment.
    let explicit = c.owners[0].segment.to_string();
    let mut cfg = c.client_config();
    cfg.preferred_segment = Some(explicit.clone());
    let client = Client::connect(cfg.clone().with_process_env().unwrap())
        .await
        .unwrap();
    assert_eq!(
        client.preferred_segment().map(|s| s.to_string()),
        Some(explicit)
    );
    // Empty is none, in the config and in the environment (as connectors read it); a value
    // that names no segment is an error naming where it came from.
    cfg.preferred_segment = Some(String::new());
    let client = Client::connect(cfg).await.unwrap();
    assert_eq!(client.preferred_segment(), None);
    std::env::set_var(mooncake_client::PREFERRED_SEGMENT_ENV, "");
    let client = Client::connect(c.client_config().with_process_env().unwrap())
        .await
        .unwrap();
    assert_eq!(client.preferred_segment(), None);
    std::env::set_var(mooncake_client::PREFERRED_SEGMENT_ENV, "no-port");
    let err = Client::connect(c.client_config().with_process_env().unwrap())
        .await
        .err()
        .expect("a malformed env value must fail");
    assert!(
        err.to_string().contains("MOONCAKE_PREFERRED_SEGMENT"),
        "{err}"
    );
    std::env::remove_var(mooncake_client::PREFERRED_SEGMENT_ENV);
    c.shutdown().await;
}
