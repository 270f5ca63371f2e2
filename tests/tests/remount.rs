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
