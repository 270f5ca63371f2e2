//! The master answers the same calls over its framed RPC and over gRPC, on one port, a
//! malformed framed connection does not disturb it, and a stopping master answers long polls at
//! once.

use mooncake_client::{Client, MasterProtocol, ReplicateConfig};
use mooncake_proto::framed as rpc_wire;
use mooncake_tests::{payload, transport, Cluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_and_grpc_clients_see_the_same_store() {
    let c = Cluster::start(&[8 << 20]).await;
    let mut clients = Vec::new();
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let mut cfg = c.client_config();
        cfg.master_protocol = protocol;
        clients.push(
            Client::connect_with(cfg.clone(), None, transport(&cfg))
                .await
                .unwrap(),
        );
    }
    let v = payload("both", 70_000);
    clients[0]
        .put("both", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; v.len()];
    clients[1].get("both", &mut buf).await.unwrap();
    assert!(buf == v);
    clients[1]
        .put("g", b"from grpc", &ReplicateConfig::default())
        .await
        .unwrap();
    for cl in &clients {
        assert_eq!(
            cl.batch_exists(&["both", "g", "none"])
                .await
                .unwrap()
                .iter()
                .map(|r| *r.as_ref().unwrap())
                .collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(cl.list_segments().await.unwrap().len(), 1);
    }
    assert_eq!(clients[0].remove_all(true).await.unwrap(), 2);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_framed_connection_is_dropped_and_the_master_keeps_serving() {
    let c = Cluster::start(&[8 << 20]).await;
    let addr = c.master.rpc_addr;
    // A wrong version in the hello: the connection is closed.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut hello = rpc_wire::hello();
    hello[4] = 99;
    s.write_all(&hello).await.unwrap();
    let mut b = [0u8; 8];
    assert!(matches!(s.read(&mut b).await, Ok(0) | Err(_)));
    // A valid hello, then an unknown method and an undecodable body: error answers, same connection.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&rpc_wire::hello()).await.unwrap();
    s.read_exact(&mut b).await.unwrap();
    rpc_wire::check_hello(&b).unwrap();
    for (method, body) in [
        (99u32, vec![]),
        (rpc_wire::Method::BatchExists as u32, vec![0xff, 0xff, 0xff]),
    ] {
        s.write_all(&rpc_wire::encode_header(body.len(), method, 5))
            .await
            .unwrap();
        s.write_all(&body).await.unwrap();
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        s.read_exact(&mut h).await.unwrap();
        let (len, status, id) = rpc_wire::decode_header(&h).unwrap();
        assert_eq!((status as i32, id), (rpc_wire::STATUS_BAD_REQUEST, 5));
        let mut text = vec![0u8; len];
        s.read_exact(&mut text).await.unwrap();
        assert!(!text.is_empty());
    }
    // A body longer than the limit: the connection is closed.
    s.write_all(&rpc_wire::encode_header(rpc_wire::MAX_BODY + 1, 8, 6))
        .await
        .unwrap();
    assert!(matches!(s.read(&mut b).await, Ok(0) | Err(_)));
    let client = c.client().await;
    client
        .put("still", b"serving", &ReplicateConfig::default())
        .await
        .unwrap();
    c.shutdown().await;
}

/// A stopping master answers owners' long polls at once, so they turn to the next leader without
/// waiting out their poll and the shutdown does not wait for them. Before, a poll held the
/// shutdown for the rest of its wait (up to 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_master_answers_long_polls_at_once() {
    use mooncake_proto::master::{
        master_client::MasterClient, MountSegmentRequest, PollTasksRequest,
    };
    let master = mooncake_master::RunningMaster::start(mooncake_tests::master_config())
        .await
        .unwrap();
    let mut raw = MasterClient::connect(format!("http://{}", master.rpc_addr))
        .await
        .unwrap();
    let (owner, segment) = ("0123456789abcdef0123456789abcdef", "127.0.0.1:1");
    let mounted = raw
        .mount_segment(MountSegmentRequest {
            client_id: owner.into(),
            segment: segment.into(),
            size: 1 << 20,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mounted.code, 0, "{}", mounted.message);
    let poll = tokio::spawn(async move {
        raw.poll_tasks(PollTasksRequest {
            client_id: owner.into(),
            segment: segment.into(),
            max_tasks: 1,
            wait_ms: 5000,
            epoch: mounted.epoch,
        })
        .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let stopping = std::time::Instant::now();
    master.shutdown().await;
    let took = stopping.elapsed();
    let answer = poll.await.unwrap();
    assert!(
        took < std::time::Duration::from_secs(4),
        "the shutdown waited {took:?} for the long poll"
    );
    if let Ok(a) = answer {
        assert!(a.into_inner().tasks.is_empty());
    }
}

/// A call naming more keys than the master takes in one call is refused whole, over both
/// protocols, before any of it is done: nothing is leased (the key stays removable). Before, a
/// request of a million tiny keys asked for an answer twenty times its size, all built (and
/// leased) before the frame limit refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_over_the_key_limit_is_refused_whole() {
    use mooncake_client::Code;
    let c = Cluster::start(&[8 << 20]).await;
    let too_many = vec!["k"; mooncake_master::wire::MAX_BATCH_KEYS + 1];
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let mut cfg = c.client_config();
        cfg.master_protocol = protocol;
        let client = Client::connect_with(cfg.clone(), None, transport(&cfg))
            .await
            .unwrap();
        client
            .put("k", b"v", &ReplicateConfig::default())
            .await
            .unwrap();
        let err = client.batch_exists(&too_many).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidParams, "{protocol:?}: {err}");
        assert!(err.to_string().contains("split the batch"), "{err}");
        let err = client.batch_remove(&too_many, false).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidParams, "{protocol:?}: {err}");
        client.remove("k", false).await.unwrap();
    }
    c.shutdown().await;
}

/// The master's end of an RPC connection has TCP keepalive on: a client whose host died while
/// idle (the master waits for its next call without a deadline) is found out, instead of its
/// connection, task and buffers being kept for ever. Read from the kernel's socket table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_masters_rpc_connections_have_keepalive() {
    let c = Cluster::start(&[8 << 20]).await;
    let port = c.master.rpc_addr.port();
    let mut s = tokio::net::TcpStream::connect(c.master.rpc_addr)
        .await
        .unwrap();
    s.write_all(&rpc_wire::hello()).await.unwrap();
    let mut b = [0u8; 8];
    s.read_exact(&mut b).await.unwrap();
    let out = std::process::Command::new("ss")
        .args([
            "-tnoH",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .expect("ss (iproute2) runs");
    let table = String::from_utf8_lossy(&out.stdout);
    let ours = table
        .lines()
        .find(|l| l.contains(&s.local_addr().unwrap().to_string()))
        .unwrap_or_else(|| panic!("the connection is not in the table:\n{table}"));
    assert!(ours.contains("timer:(keepalive"), "{ours}");
    c.shutdown().await;
}
