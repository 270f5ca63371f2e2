//! The master's HTTP port: Prometheus metrics with Mooncake's names, health, and the segment list.

use mooncake_client::ReplicateConfig;
use mooncake_tests::{http_get, metric, payload, Cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_segments() {
    let c = Cluster::start(&[8 << 20, 4 << 20]).await;
    let client = c.client().await;
    for i in 0..3 {
        let k = format!("m/{i}");
        client
            .put(&k, &payload(&k, 1000), &ReplicateConfig::default())
            .await
            .unwrap();
    }
    let mut buf = vec![0u8; 1000];
    client.get("m/0", &mut buf).await.unwrap();
    let _ = client.get("missing", &mut buf).await;
    let addr = c.master.http_addr;

    let (status, body) = http_get(&addr.to_string(), "/health").await;
    assert_eq!((status, body.trim()), (200, "OK"));

    let (status, m) = http_get(&addr.to_string(), "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(metric(&m, "master_key_count"), 3);
    assert_eq!(metric(&m, "master_total_capacity_bytes"), 12 << 20);
    assert_eq!(
        metric(&m, "master_allocated_bytes"),
        3 * 1024,
        "3 x 1000 B in 64 B granules"
    );
    assert_eq!(metric(&m, "master_active_clients"), 2);
    assert_eq!(metric(&m, "master_put_start_requests_total"), 3);
    assert_eq!(metric(&m, "master_get_replica_list_requests_total"), 2);
    assert_eq!(metric(&m, "master_get_replica_list_failures_total"), 1);
    for o in &c.owners {
        let line = format!("segment_total_capacity_bytes{{segment=\"{}\"}}", o.segment);
        assert!(m.contains(&line), "{line} missing");
    }
    assert!(m.contains("master_evicted_keys_total"));
    // What an operator needs to tell a master's state: serving, rebuilding, puts open.
    assert_eq!(metric(&m, "master_leading"), 1);
    assert_eq!(metric(&m, "master_puts_in_flight"), 0);
    assert!(m.contains("\nmaster_rebuilding "));
    for op in [
        "abandon_put_start",
        "report_tasks",
        "register_disk",
        "disk_dropped",
    ] {
        assert_eq!(metric(&m, &format!("master_{op}_requests_total")), 0);
    }

    let (status, segs) = http_get(&addr.to_string(), "/get_all_segments").await;
    assert_eq!(status, 200);
    let mut got: Vec<&str> = segs.lines().collect();
    got.sort();
    let mut want: Vec<String> = c.owners.iter().map(|o| o.segment.to_string()).collect();
    want.sort();
    assert_eq!(got, want);
    c.shutdown().await;
}
