//! Real processes on loopback: a master stopped (SIGSTOP) for three client TTLs and then resumed
//! drops no owner that heartbeats again within one TTL of the resumption, so what the owners hold
//! in memory stays readable; peers silent mid-handshake do not keep a master from stopping.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_tests::{http_get, metric, payload, spawn_master, spawn_owner, transport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_stopped_for_three_ttls_keeps_the_owners_that_heartbeat_again() {
    let (master, rpc, http) = spawn_master(&["--client_ttl", "2"]);
    let (_owner, seg) = spawn_owner(&rpc, "16MiB", &["--heartbeat-interval", "200ms"]);
    let cfg = ClientConfig {
        transfer_timeout: Duration::from_secs(2),
        rpc_timeout: Duration::from_secs(2),
        ..ClientConfig::new(&rpc)
    };
    let client = Client::connect_with(cfg.clone(), None, transport(&cfg))
        .await
        .unwrap();
    let v = payload("stall", 300_000);
    client
        .put("stall", &v, &ReplicateConfig::default())
        .await
        .unwrap();

    master.stop();
    tokio::time::sleep(Duration::from_secs(6)).await;
    master.signal(libc::SIGCONT);
    // Past one more TTL: an owner the master dropped on resumption would be gone by now.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (_, metrics) = http_get(&http, "/metrics").await;
    assert_eq!(metric(&metrics, "master_expired_clients_total"), 0);
    let segments = client.list_segments().await.unwrap();
    assert_eq!(segments.len(), 1);
    assert_eq!(segments[0].name.as_str(), seg);
    let mut buf = vec![0u8; v.len()];
    assert_eq!(client.get("stall", &mut buf).await.unwrap(), v.len());
    assert!(buf == v, "the bytes held before the stop come back");
}

/// Peers that never finish talking (silent mid-handshake on the RPC and HTTP ports) do not keep
/// a master from stopping: an HA leader that steps down must be able to campaign again, and
/// SIGTERM must end the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_peers_do_not_keep_a_master_from_stopping() {
    use tokio::io::AsyncWriteExt;
    let m = mooncake_master::RunningMaster::start(mooncake_tests::master_config())
        .await
        .unwrap();
    // The start of an HTTP/2 preface on the RPC port (routed to gRPC), one byte of a request on
    // the HTTP port; then nothing.
    let mut rpc = tokio::net::TcpStream::connect(m.rpc_addr).await.unwrap();
    rpc.write_all(b"PRI ").await.unwrap();
    let mut http = tokio::net::TcpStream::connect(m.http_addr).await.unwrap();
    http.write_all(b"G").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(30), m.shutdown())
        .await
        .expect("the master stopped despite its silent peers");
    drop((rpc, http));
}
