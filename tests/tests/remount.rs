//! A restarted master does not know the owners; their next heartbeat is told to remount, and they
//! do, so the store serves again without restarting any owner.

use std::time::Duration;

use mooncake_client::ReplicateConfig;
use mooncake_master::{MasterConfig, RunningMaster};
use mooncake_tests::{eventually, master_config, payload, Cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_remount_after_a_master_restart() {
    let c = Cluster::start(&[8 << 20, 8 << 20]).await;
    let (rpc_port, http_port) = (c.master.rpc_addr.port(), c.master.http_addr.port());
    let Cluster { master, owners } = c;
    master.shutdown().await;

    let config = MasterConfig {
        rpc_port,
        metrics_port: http_port,
        ..master_config()
    };
    // The old listener's port can take a moment to be bindable again.
    let mut restarted = None;
    for _ in 0..50 {
        match RunningMaster::start(config.clone()).await {
            Ok(m) => {
                restarted = Some(m);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let master = restarted.expect("master restarts on its old port");
    assert_eq!(master.with_state(|s| s.segment_stats().len()), 0);
    let back = eventually(Duration::from_secs(10), async || {
        master.with_state(|s| s.segment_stats().len()) == 2
    })
    .await;
    assert!(back, "owners did not remount");

    let c = Cluster { master, owners };
    let client = c.client().await;
    let v = payload("after-restart", 70_000);
    client
        .put("after-restart", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; v.len()];
    client.get("after-restart", &mut buf).await.unwrap();
    assert!(buf == v);
    c.shutdown().await;
}

/// A mount whose answer was lost is retried after the master merged the catalog its owner
/// reported: the retry is told there is nothing to report, and the owner takes the master's
/// epoch. Before, the retry's report was refused ("not reporting a catalog"), the mount failed,
/// and the owner, never taking the epoch, remounted at every heartbeat, dropping the notes of
/// what to forget each brought.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_mount_after_a_merged_report_succeeds() {
    use mooncake_common::{ClientId, ObjectKey, SegmentName, Stamp};
    use mooncake_owner::{catalog::Catalog, master_link::MasterLink};
    use std::sync::Arc;

    let master = RunningMaster::start(master_config()).await.unwrap();
    let catalog = Arc::new(Catalog::default());
    let stamp = Stamp {
        put_id: 7,
        replica_num: 1,
        ..Stamp::default()
    };
    catalog.record(0, 4096, ObjectKey::new("kept").unwrap(), stamp, 7);
    catalog.saw_grant(7);
    let link = MasterLink::new(
        &master.rpc_addr.to_string(),
        mooncake_common::leader::DEFAULT_CLUSTER_ID,
        ClientId::from_u128(42),
        SegmentName::parse("127.0.0.1:1").unwrap(),
        1 << 20,
        Duration::from_secs(3),
        None,
        catalog,
        None,
        None,
    )
    .unwrap();
    link.mount().await.unwrap();
    let epoch = link.epoch();
    assert_ne!(epoch, 0);
    // The same mount again, as after a lost answer.
    link.mount().await.expect("a retried mount succeeds");
    assert_eq!(link.epoch(), epoch);
    assert!(
        !link
            .heartbeat(Duration::from_secs(2))
            .await
            .unwrap()
            .remount,
        "the master knows the owner: no remount"
    );
    let stats = master.with_state(|s| s.segment_stats());
    assert_eq!(stats.len(), 1);
    assert_eq!(
        stats[0].allocated, 4096,
        "the reported object, laid out once"
    );
    master.shutdown().await;
}

/// The master keeps the notes of ranges to forget until a heartbeat says they were applied:
/// one whose answer is lost on its way loses none, and the owner's next heartbeat acknowledges
/// them. Before, they were handed out once; with the answer lost, the object came back at the
/// next rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freed_range_notes_stay_until_the_owner_applied_them() {
    use mooncake_common::{master_api::MasterApi, ClientId, SegmentName};
    use mooncake_owner::{catalog::Catalog, master_link::MasterLink};
    use std::sync::Arc;

    let master = RunningMaster::start(master_config()).await.unwrap();
    let owner = ClientId::from_u128(43);
    let link = MasterLink::new(
        &master.rpc_addr.to_string(),
        mooncake_common::leader::DEFAULT_CLUSTER_ID,
        owner,
        SegmentName::parse("127.0.0.1:2").unwrap(),
        1 << 20,
        Duration::from_secs(3),
        None,
        Arc::new(Catalog::default()),
        None,
        None,
    )
    .unwrap();
    link.mount().await.unwrap();
    // An object put and removed (no bytes needed: the owner only forgets its range).
    let api = master.in_process();
    let grant = api
        .put_start(&[("gone", 4096)], &ReplicateConfig::default(), 0)
        .await
        .unwrap();
    let put_id = grant.results[0].as_ref().unwrap().put_id;
    api.put_end(&[("gone", put_id)]).await.unwrap()[0].unwrap();
    api.remove(&["gone"], false).await.unwrap()[0].unwrap();
    let pending = || master.with_state_mut(|s| s.freed_notes(owner, 0).len());
    assert_eq!(pending(), 1);

    // Handed out, and kept until the next heartbeat says it was applied.
    assert!(
        !link
            .heartbeat(Duration::from_secs(2))
            .await
            .unwrap()
            .remount
    );
    assert_eq!(pending(), 1, "not acknowledged yet");
    assert!(
        !link
            .heartbeat(Duration::from_secs(2))
            .await
            .unwrap()
            .remount
    );
    assert_eq!(pending(), 0, "acknowledged");
    master.shutdown().await;
}
