//! No read ever returns another key's or another version's bytes: a reader holding the location
//! of a removed object whose range was reused (by another key, or by a new put of the same key)
//! gets an error from the owner, not the new object's bytes.

use mooncake_client::ReplicateConfig;
use mooncake_common::ObjectKey;
use mooncake_tests::{payload, transport, Cluster, Single};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_location_reused_by_another_key_is_refused() {
    let c = Cluster::start(&[1 << 20]).await;
    let client = c.client().await;
    let cfg = ReplicateConfig::default();
    client
        .put("old", &payload("old", 4096), &cfg)
        .await
        .unwrap();
    let old = client
        .batch_get_replica_desc(&["old"])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    let loc = old.replicas[0].clone();
    // Forced removal frees the range at once although "old" is leased; the next put reuses it.
    client.remove("old", true).await.unwrap();
    client
        .put("new", &payload("new", 4096), &cfg)
        .await
        .unwrap();
    let new = client
        .batch_get_replica_desc(&["new"])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(
        new.replicas[0].offset, loc.offset,
        "the allocator reuses the freed range"
    );

    let t = transport(&c.client_config());
    let mut buf = vec![0u8; 4096];
    let err = t
        .read1(
            &loc.segment,
            &ObjectKey::new("old").unwrap(),
            loc.offset,
            loc.put_id,
            &mut [&mut buf[..]],
        )
        .await
        .unwrap_err();
    assert_eq!(err.code().as_i32(), -704, "{err}");
    assert!(
        buf.iter().all(|b| *b == 0),
        "no byte of the new object reached the stale reader"
    );
    t.read1(
        &loc.segment,
        &ObjectKey::new("new").unwrap(),
        loc.offset,
        new.replicas[0].put_id,
        &mut [&mut buf[..]],
    )
    .await
    .unwrap();
    assert!(buf == payload("new", 4096));

    // The same key put again into the same range with other bytes: the old version's location
    // reads nothing.
    client.remove("new", true).await.unwrap();
    client
        .put("new", &payload("new, second version", 4096), &cfg)
        .await
        .unwrap();
    let again = client
        .batch_get_replica_desc(&["new"])
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(again.replicas[0].offset, loc.offset);
    let mut buf = vec![0u8; 4096];
    let err = t
        .read1(
            &loc.segment,
            &ObjectKey::new("new").unwrap(),
            loc.offset,
            new.replicas[0].put_id,
            &mut [&mut buf[..]],
        )
        .await
        .unwrap_err();
    assert_eq!(err.code().as_i32(), -704, "{err}");
    assert!(buf.iter().all(|b| *b == 0));
    c.shutdown().await;
}
