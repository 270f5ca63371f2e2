//! Connection authentication against real processes: a master and owners started with the
//! cluster's token file refuse, on every port (framed RPC, gRPC, the data port, the same-host
//! socket, and the owner's link to the master), a peer without the token and a peer with another
//! one; peers with the token work end to end, owner-to-owner copies included.

use std::{os::unix::fs::PermissionsExt, path::Path, sync::Arc, time::Duration};

use mooncake_client::{
    transport::{
        local::{Deadlines, LocalOwner},
        TcpTransport,
    },
    Client, ClientConfig, MasterProtocol, ReplicateConfig,
};
use mooncake_common::{
    auth::Credential,
    local::{frame_header, socket_path, FrameReader, FrameWriter, LocalOp},
    transport::{DataTransport, ReadItem},
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code, ObjectKey, SegmentName,
};
use mooncake_tests::{payload, spawn_master, spawn_owner, ChildGuard, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &str = "w5Kq8ZyV0u1b3E4sR9tL2mN6pX7cA0dF";

/// A token file holding `secret`, readable only by its owner.
fn token_file(dir: &TempDir, name: &str, secret: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

fn config(master: &str, token: Option<&str>, protocol: MasterProtocol, shm: bool) -> ClientConfig {
    ClientConfig {
        auth_token_file: token.map(Into::into),
        master_protocol: protocol,
        shared_memory: shm,
        rpc_timeout: Duration::from_secs(3),
        transfer_timeout: Duration::from_secs(3),
        ..ClientConfig::new(master)
    }
}

/// An authenticated master and two owners.
struct Guarded {
    _dir: TempDir,
    token: String,
    wrong: String,
    _master: ChildGuard,
    rpc: String,
    _owners: Vec<ChildGuard>,
    segments: Vec<String>,
}

fn start_guarded() -> Guarded {
    let dir = TempDir::new("auth");
    let token = token_file(&dir, "token", SECRET);
    let wrong = token_file(&dir, "wrong", "another secret of 32 characters!");
    let (master, rpc, _) = spawn_master(&["--auth_token_file", &token]);
    let mut owners = Vec::new();
    let mut segments = Vec::new();
    for _ in 0..2 {
        let (o, seg) = spawn_owner(&rpc, "64MiB", &["--auth_token_file", &token]);
        owners.push(o);
        segments.push(seg);
    }
    Guarded {
        _dir: dir,
        token,
        wrong,
        _master: master,
        rpc,
        _owners: owners,
        segments,
    }
}

fn tcp(credential: Option<Credential>) -> TcpTransport {
    mooncake_tests::tcp_with(credential)
}

fn credential(file: &str) -> Credential {
    Credential::cluster_from_file(Path::new(file)).unwrap()
}

/// Reads 64 bytes of `key` at offset 0 of `segment` through `t`: the refusal's code, if any.
async fn read_code(t: &TcpTransport, segment: &str, key: &str) -> Option<Code> {
    read_codes(t, segment, &[key]).await.remove(0)
}

/// `read_code` for each of `keys`, in one batch (each at its own offset).
async fn read_codes(t: &TcpTransport, segment: &str, keys: &[&str]) -> Vec<Option<Code>> {
    let seg = SegmentName::parse(segment).unwrap();
    let keys: Vec<ObjectKey> = keys.iter().map(|k| ObjectKey::new(k).unwrap()).collect();
    let mut bufs = vec![[0u8; 64]; keys.len()];
    let mut parts: Vec<[&mut [u8]; 1]> = bufs.iter_mut().map(|b| [&mut b[..]]).collect();
    let mut items: Vec<ReadItem> = keys
        .iter()
        .zip(parts.iter_mut())
        .enumerate()
        .map(|(i, (key, parts))| ReadItem {
            key,
            offset: 64 * i as u64,
            put_id: 1,
            seal: Default::default(),
            parts,
        })
        .collect();
    let r = t.read_batch(&seg, &mut items).await;
    r.into_iter().map(|r| r.err().map(|e| e.code())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_port_refuses_a_peer_without_the_token() {
    let g = start_guarded();
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let err = Client::connect(config(&g.rpc, None, protocol, false))
            .await
            .err()
            .expect("a client without the token is refused");
        assert_eq!(err.code(), Code::Unauthenticated, "{protocol:?}: {err}");
        assert!(err.to_string().contains("auth_token_file"), "{err}");
    }

    // The data port answers a raw request with the code and what to configure.
    let mut s = tokio::net::TcpStream::connect(&g.segments[0])
        .await
        .unwrap();
    let key = b"any/key";
    let h = RequestHeader {
        op: Op::Read,
        key_len: key.len() as u16,
        flags: 0,
        request_id: 77,
        offset: 0,
        length: 16,
        grant: 1,
        seal: Default::default(),
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(key).await.unwrap();
    let mut head = [0u8; wire::RESPONSE_HEADER_LEN];
    s.read_exact(&mut head).await.unwrap();
    let answer = ResponseHeader::decode(&head).unwrap();
    assert_eq!(
        (answer.code(), answer.request_id),
        (Code::Unauthenticated, 77)
    );
    let mut why = vec![0u8; answer.length as usize];
    s.read_exact(&mut why).await.unwrap();
    assert!(String::from_utf8_lossy(&why).contains("auth_token_file"));
    assert_eq!(s.read(&mut [0u8; 1]).await.unwrap(), 0, "then it closes");
    assert_eq!(
        read_code(&tcp(None), &g.segments[0], "k").await,
        Some(Code::Unauthenticated)
    );
    // A batch too: the owner refuses the first request and closes; every item reports the
    // refusal (before: the others a broken connection, TransferFail).
    assert_eq!(
        read_codes(&tcp(None), &g.segments[0], &["a", "b", "c"]).await,
        vec![Some(Code::Unauthenticated); 3]
    );

    // The same-host socket answers the hello with the code and hands out no memory.
    let seg = SegmentName::parse(&g.segments[0]).unwrap();
    let path = socket_path(&mooncake_tests::socket_dir(), &seg);
    let mut u = tokio::net::UnixStream::connect(&path).await.unwrap();
    let mut w = FrameWriter::new(LocalOp::Hello);
    w.u8(mooncake_common::local::VERSION)
        .bytes(seg.as_str().as_bytes());
    u.write_all(&w.finish()).await.unwrap();
    let mut reply = [0u8; 17];
    u.read_exact(&mut reply).await.unwrap();
    let (_, op) = frame_header(reply[..5].try_into().unwrap()).unwrap();
    let status = FrameReader::new(&reply[5..]).i32().unwrap();
    assert_eq!(
        (op, status),
        (LocalOp::Hello, Code::Unauthenticated.as_i32())
    );
    let local = LocalOwner::connect(
        &path,
        &seg,
        Deadlines::both(Duration::from_secs(3)),
        1,
        1,
        None,
    );
    let err = local.err().expect("no memfd without the token");
    assert!(err.to_string().contains("auth_token_file"), "{err}");

    // An owner without the token cannot mount, and says why.
    let mut o = ChildGuard::spawn(
        "mooncake_ownerd",
        &[
            "--master",
            &g.rpc,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "16MiB",
            "--no-mlock",
            "--mount-timeout",
            "1s",
        ],
    );
    let status = o
        .wait_exit(Duration::from_secs(20))
        .expect("an owner that cannot mount exits");
    assert!(!status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_on_every_port() {
    let g = start_guarded();
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let err = Client::connect(config(&g.rpc, Some(&g.wrong), protocol, false))
            .await
            .err()
            .expect("a client with another secret is refused");
        assert_eq!(err.code(), Code::Unauthenticated, "{protocol:?}: {err}");
    }
    let wrong = credential(&g.wrong);
    assert_eq!(
        read_code(&tcp(Some(wrong.clone())), &g.segments[0], "k").await,
        Some(Code::Unauthenticated)
    );
    let seg = SegmentName::parse(&g.segments[0]).unwrap();
    let path = socket_path(&mooncake_tests::socket_dir(), &seg);
    assert!(LocalOwner::connect(
        &path,
        &seg,
        Deadlines::both(Duration::from_secs(3)),
        1,
        1,
        Some(wrong)
    )
    .is_err());
    // The right one passes the same doors, to meet the next check: a read the master did not
    // seal moves no byte.
    let right = credential(&g.token);
    assert_eq!(
        read_code(&tcp(Some(right.clone())), &g.segments[0], "k").await,
        Some(Code::PermissionDenied)
    );
    assert!(LocalOwner::connect(
        &path,
        &seg,
        Deadlines::both(Duration::from_secs(3)),
        1,
        1,
        Some(right)
    )
    .is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_opens_every_path_end_to_end() {
    let g = start_guarded();
    let cases = [
        (MasterProtocol::Framed, true),
        (MasterProtocol::Framed, false),
        (MasterProtocol::Grpc, false),
    ];
    for (i, (protocol, shm)) in cases.into_iter().enumerate() {
        let client = Client::connect(config(&g.rpc, Some(&g.token), protocol, shm))
            .await
            .unwrap();
        let keys: Vec<String> = (0..16).map(|k| format!("auth/{i}/{k}")).collect();
        let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, 256 << 10)).collect();
        let items: Vec<(&str, &[u8])> = keys
            .iter()
            .map(|k| k.as_str())
            .zip(values.iter().map(|v| v.as_slice()))
            .collect();
        for r in client.batch_put(&items, &ReplicateConfig::default()).await {
            r.unwrap();
        }
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        for (got, want) in client.batch_get_owned(&refs).await.into_iter().zip(&values) {
            assert!(got.unwrap() == *want, "{protocol:?} shm={shm}: wrong bytes");
        }
        let stats = client.transfer_stats();
        if shm {
            assert!(stats.local_bytes > 0, "the same-host path was used");
        } else {
            assert_eq!(stats.local_bytes, 0);
        }
    }

    // An owner-to-owner copy: the target owner proves the token to the source owner.
    let client = Client::connect(config(
        &g.rpc,
        Some(&g.token),
        MasterProtocol::Framed,
        false,
    ))
    .await
    .unwrap();
    let value = payload("auth/copied", 1 << 20);
    client
        .put(
            "auth/copied",
            &value,
            &ReplicateConfig {
                preferred_segments: vec![SegmentName::parse(&g.segments[0]).unwrap()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let id = client
        .create_copy_task("auth/copied", &[g.segments[1].as_str()])
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let task = loop {
        let t = client.query_task(id).await.unwrap();
        if t.status.is_finished() || std::time::Instant::now() > deadline {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        task.status,
        mooncake_common::ReplicaTaskStatus::Success,
        "{}",
        task.detail
    );
    let desc = client
        .batch_get_replica_desc(&["auth/copied"])
        .await
        .unwrap();
    assert_eq!(
        desc[0].as_ref().unwrap().replicas.len(),
        2,
        "two replicas now"
    );
}

/// An open cluster (no token anywhere) serves peers without a token; a peer given a token
/// refuses it on every port, since an open server proves nothing (whoever took its address, a
/// squatted socket path or a spoofed host, could be answering).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_cluster_serves_peers_without_a_token_and_those_with_one_refuse_it() {
    let dir = TempDir::new("auth-open");
    let token = token_file(&dir, "token", SECRET);
    let (_m, rpc, _) = spawn_master(&[]);
    let (_o, seg) = spawn_owner(&rpc, "32MiB", &[]);
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let client = Client::connect(config(&rpc, None, protocol, true))
            .await
            .unwrap();
        let key = format!("open/{protocol:?}");
        let value = payload(&key, 4096);
        client
            .put(&key, &value, &ReplicateConfig::default())
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        assert_eq!(client.get(&key, &mut buf).await.unwrap(), 4096);
        assert_eq!(buf, value);

        let err = Client::connect(config(&rpc, Some(&token), protocol, false))
            .await
            .err()
            .expect("a client with a token refuses an open master");
        assert_eq!(err.code(), Code::Unauthenticated, "{protocol:?}: {err}");
        assert!(err.to_string().contains("runs open"), "{err}");
    }
    let t = Arc::new(tcp(Some(credential(&token))));
    assert_eq!(read_code(&t, &seg, "k").await, Some(Code::Unauthenticated));
    let seg = SegmentName::parse(&seg).unwrap();
    let path = socket_path(&mooncake_tests::socket_dir(), &seg);
    let err = LocalOwner::connect(
        &path,
        &seg,
        Deadlines::both(Duration::from_secs(3)),
        1,
        1,
        Some(credential(&token)),
    )
    .err()
    .expect("no same-host path to a socket that proves nothing");
    assert!(err.to_string().contains("runs open"), "{err}");
}

/// A gRPC connection that did not authenticate is answered UNAUTHENTICATED call after call,
/// and closed after a while: before, the master kept it (HTTP/2 keepalive answered) for as long
/// as the peer did, so such connections could pile up until the port ran out of descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_grpc_connection_is_closed_after_a_while() {
    let dir = TempDir::new("auth-refused");
    let token = token_file(&dir, "token", SECRET);
    let (_master, rpc, _) = spawn_master(&["--auth_token_file", &token]);
    let mut s = tokio::net::TcpStream::connect(&rpc).await.unwrap();
    // An HTTP/2 client's preface and an empty SETTINGS frame: the gRPC side of the port.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(9), s.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "still open after 9 s");
    assert!(!sink.is_empty(), "the server spoke HTTP/2 first");
}
