//! The same-host path with a real owner process: it is used without being asked for, it can be
//! turned off, the socket is private to the owner's user and group and goes away with the owner,
//! a dead or stopped owner turns same-host calls into errors within the deadlines (queued ones
//! too), a dead owner's pool is unmapped once its successor is reached, and the calls after an
//! owner restarted succeed.

use std::{
    os::unix::fs::PermissionsExt,
    time::{Duration, Instant},
};

use mooncake_client::{
    transport::{
        local::{Deadlines, LocalOwner},
        tcp::TcpConfig,
        HybridConfig, HybridTransport,
    },
    Client, ClientConfig, ReplicateConfig,
};
use mooncake_common::{
    auth::Seal,
    local::socket_path,
    transport::{DataTransport, TransferError, WriteItem},
    ObjectKey, SegmentName, Stamp,
};
use mooncake_tests::{
    free_port, payload, socket_dir, spawn_master, spawn_owner, ChildGuard, TempDir,
};

fn config(master: &str, shm: bool) -> ClientConfig {
    ClientConfig {
        transfer_timeout: Duration::from_secs(2),
        rpc_timeout: Duration::from_secs(2),
        shared_memory: shm,
        ..ClientConfig::new(master)
    }
}

async fn client(master: &str, shm: bool) -> Client {
    let cfg = config(master, shm);
    let transport = Client::default_transport(&cfg).unwrap();
    Client::connect_with(cfg, None, transport).await.unwrap()
}

/// A write of `parts` at offset 0 of an owner's pool, with no seal (an open cluster) and a put
/// id above any a test master hands out.
fn unsealed<'a>(key: &'a ObjectKey, parts: &'a [&'a [u8]]) -> WriteItem<'a> {
    WriteItem {
        key,
        offset: 0,
        stamp: Stamp::new(u64::MAX / 2, &ReplicateConfig::default()),
        seal: Seal::default(),
        parts,
    }
}

/// A client transport that takes the same-host path to the owners whose sockets are in `dir`,
/// one connection each, with short deadlines.
fn hybrid(dir: std::path::PathBuf) -> HybridTransport {
    hybrid_probing_after(dir, Duration::from_secs(10))
}

/// `hybrid`, probing an owner the same-host path did not reach again after `again`.
fn hybrid_probing_after(dir: std::path::PathBuf, again: Duration) -> HybridTransport {
    HybridTransport::new(HybridConfig {
        tcp: TcpConfig {
            connect_timeout: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(2),
            connections_per_owner: 1,
            transfer_threads: 1,
            dedicated_runtime: false,
            credential: None,
        },
        shared_memory: true,
        socket_dir: dir,
        copy_threads: 1,
        probe_again_after: again,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_owner_is_reached_through_shared_memory_unless_turned_off() {
    let (_m, rpc, _) = spawn_master(&[]);
    let (mut owner, seg) = spawn_owner(&rpc, "64MiB", &[]);
    let path = socket_path(
        &mooncake_tests::socket_dir(),
        &SegmentName::parse(&seg).unwrap(),
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o660,
        "only the owner's user and group may map the pool"
    );

    let shm = client(&rpc, true).await;
    let values: Vec<Vec<u8>> = (0..8)
        .map(|i| payload(&format!("s/{i}"), 1 << 20))
        .collect();
    let keys: Vec<String> = (0..8).map(|i| format!("s/{i}")).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    assert!(shm
        .batch_put(&items, &ReplicateConfig::default())
        .await
        .iter()
        .all(|r| r.is_ok()));
    let after_put = shm.transfer_stats();
    assert_eq!(after_put.local_bytes, 8 << 20);
    assert_eq!(after_put.tcp_bytes, 0);

    // A TCP-only client reads what the shared-memory client wrote, and the other way round.
    let tcp = client(&rpc, false).await;
    let mut buf = vec![0u8; 1 << 20];
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(tcp.get(k, &mut buf).await.unwrap(), v.len());
        assert!(&buf == v);
    }
    assert_eq!(tcp.transfer_stats().local_bytes, 0);
    let w = payload("from-tcp", 300_000);
    tcp.put("from-tcp", &w, &ReplicateConfig::default())
        .await
        .unwrap();
    let mut buf = vec![0u8; w.len()];
    shm.get("from-tcp", &mut buf).await.unwrap();
    assert!(buf == w);
    assert!(shm.transfer_stats().local_bytes > after_put.local_bytes);

    // The socket goes away with the owner.
    owner.signal(libc::SIGTERM);
    assert!(owner.wait_exit(Duration::from_secs(10)).is_some());
    assert!(!path.exists(), "socket left behind");
}

/// A batch whose begin frame would pass the owner's frame limit (17,000 keys of 4,000 bytes:
/// 68 MB against 64 MiB) goes over the same-host path as several exchanges; before, the owner
/// refused the frame and closed the connection, and every item failed, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_batch_bigger_than_a_frame_goes_as_several_exchanges() {
    let (_m, rpc, _) = spawn_master(&[]);
    let (_owner, _) = spawn_owner(&rpc, "64MiB", &[]);
    let cfg = ClientConfig {
        transfer_timeout: Duration::from_secs(20),
        rpc_timeout: Duration::from_secs(20),
        shared_memory: true,
        ..ClientConfig::new(&rpc)
    };
    let transport = Client::default_transport(&cfg).unwrap();
    let c = Client::connect_with(cfg, None, transport).await.unwrap();
    let n = 17_000;
    let keys: Vec<String> = (0..n).map(|i| format!("{i:0>4000}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| payload(&k[3990..], 64)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    let put = c.batch_put(&items, &ReplicateConfig::default()).await;
    assert_eq!(
        put.iter().filter(|r| r.is_ok()).count(),
        n,
        "{:?}",
        put.iter().find(|r| r.is_err())
    );
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 64]).collect();
    let key_refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let got = c.batch_get(&key_refs, &mut slices).await;
    assert!(
        got.iter().all(|r| matches!(r, Ok(64))),
        "{:?}",
        got.iter().find(|r| !matches!(r, Ok(64)))
    );
    assert!(bufs == values, "bytes differ");
    let stats = c.transfer_stats();
    assert_eq!(
        stats.local_bytes,
        2 * 64 * n as u64,
        "all through shared memory"
    );
    assert_eq!(stats.tcp_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_or_killed_local_owner_is_an_error_within_the_deadline() {
    let (_m, rpc, _) = spawn_master(&[]);
    let (owner, _seg) = spawn_owner(&rpc, "16MiB", &[]);
    let c = client(&rpc, true).await;
    let v = payload("frozen", 1 << 20);
    c.put("frozen", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    assert!(c.transfer_stats().local_bytes > 0);

    owner.stop();
    let t = Instant::now();
    let mut buf = vec![0u8; v.len()];
    let r = c.get("frozen", &mut buf).await;
    assert_eq!(r.unwrap_err().code().as_i32(), -800);
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );

    owner.signal(libc::SIGKILL);
    let t = Instant::now();
    let r = c.get("frozen", &mut buf).await;
    assert!(r.is_err());
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
}

/// A same-host exchange has the transfer deadline, as a TCP one does: an owner that answers
/// after the connect timeout but within the transfer timeout (here: stopped for longer than
/// the first) serves the calls waiting on it, and nothing falls back or fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_exchange_has_the_transfer_deadline_not_the_connect_one() {
    let (_m, rpc, _) = spawn_master(&[]);
    let (owner, _seg) = spawn_owner(&rpc, "16MiB", &[]);
    let cfg = ClientConfig {
        connect_timeout: Duration::from_secs(1),
        transfer_timeout: Duration::from_secs(30),
        rpc_timeout: Duration::from_secs(5),
        ..ClientConfig::new(&rpc)
    };
    let transport = Client::default_transport(&cfg).unwrap();
    let c = std::sync::Arc::new(Client::connect_with(cfg, None, transport).await.unwrap());
    let v = payload("slow-owner", 1 << 20);
    c.put("slow-owner", &v, &ReplicateConfig::default())
        .await
        .unwrap();
    let local = c.transfer_stats().local_bytes;
    assert!(local > 0, "the same-host path was not taken");

    // One call at a time, so that each finds the connection already open (a new one has the
    // connect timeout to be answered, and a stopped owner answers none).
    let slow_owner = async |call: tokio::task::JoinHandle<_>| {
        owner.stop();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        owner.signal(libc::SIGCONT);
        call.await.unwrap()
    };
    let get = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 20];
            c.get("slow-owner", &mut buf).await.map(|_| buf)
        })
    };
    let got: Vec<u8> = slow_owner(get)
        .await
        .expect("the get waits for a slow owner");
    assert!(got == v, "wrong bytes");
    let w = payload("slow-owner-2", 1 << 20);
    let put = {
        let (c, w) = (c.clone(), w.clone());
        tokio::spawn(async move {
            c.put("slow-owner-2", &w, &ReplicateConfig::default())
                .await
                .map(|_| Vec::new())
        })
    };
    slow_owner(put)
        .await
        .expect("the put waits for a slow owner");
    let mut buf = vec![0u8; w.len()];
    c.get("slow-owner-2", &mut buf).await.unwrap();
    assert!(buf == w, "wrong bytes");
    assert!(
        c.transfer_stats().local_bytes >= local + 3 * (1 << 20),
        "not all same-host"
    );
}

/// An owner on `port` (fixed, so a restart keeps its segment name and socket path).
fn fixed_port_owner(rpc: &str, port: &str) -> (ChildGuard, SegmentName) {
    let args = [
        "--master",
        rpc,
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--segment-size",
        "4MiB",
        "--no-mlock",
        "--heartbeat-interval",
        "200ms",
    ];
    let mut o = ChildGuard::spawn("mooncake_ownerd", &args);
    let line = o.wait_line("mooncake_ownerd ready", Duration::from_secs(30));
    let seg = SegmentName::parse(line.rsplit("segment=").next().unwrap()).unwrap();
    o.remove_on_drop(socket_path(&socket_dir(), &seg));
    (o, seg)
}

/// An owner the same-host path did not reach (not started yet, stopped, restarting) is probed
/// again after a while: once it is back its calls take the same-host path again. Before, the
/// first verdict stood for the client's life, and every call to it went over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_reached_over_tcp_is_probed_again_for_the_same_host_path() {
    let (_m, rpc, _) = spawn_master(&[]);
    let port = free_port().to_string();
    let (_owner, segment) = fixed_port_owner(&rpc, &port);
    let t = hybrid_probing_after(socket_dir(), Duration::from_secs(2));
    let key = ObjectKey::new("k").unwrap();
    let value = payload("k", 64 << 10);
    let parts = [&value[..]];
    let write = || async { t.write_batch(&segment, &[unsealed(&key, &parts)]).await };
    // The owner's socket is away (as while an owner restarts): TCP.
    let path = socket_path(&socket_dir(), &segment);
    let away = path.with_extension("away");
    std::fs::rename(&path, &away).unwrap();
    let started = Instant::now();
    write().await[0].as_ref().unwrap();
    std::fs::rename(&away, &path).unwrap();
    // Within the wait the verdict stands.
    write().await[0].as_ref().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "too slow to tell"
    );
    assert_eq!(t.stats().local_bytes, 0);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    write().await[0].as_ref().unwrap();
    assert_eq!(t.stats().local_bytes, 64 << 10, "probed again");
}

/// The first calls after a same-host owner restarted (on a fixed port) succeed: the client's
/// idle connections to the old owner are found closed and dropped, and a batch that then finds
/// the socket taken by the new owner goes over TCP while the route is made again. Before, the
/// first put failed on a dead connection and the next one on the new owner's pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_after_a_same_host_owner_restarted_succeed() {
    let (_m, rpc, _) = spawn_master(&["--client_ttl", "1"]);
    let port = free_port().to_string();
    let (first, segment) = fixed_port_owner(&rpc, &port);
    let c = client(&rpc, true).await;
    let cfg = ReplicateConfig::default();
    let before = payload("before", 64 << 10);
    c.put("before", &before, &cfg).await.unwrap();
    let local = c.transfer_stats().local_bytes;
    assert!(local >= 64 << 10, "the put went over the same-host path");

    first.signal(libc::SIGKILL);
    drop(first);
    let (_second, again) = fixed_port_owner(&rpc, &port);
    assert_eq!(again, segment);
    // The new owner mounted; the master forgets the old one's objects with it.
    let after = payload("after", 64 << 10);
    assert_eq!(
        c.put("after", &after, &cfg).await.unwrap(),
        mooncake_client::PutOutcome::Stored,
        "the first put after the restart"
    );
    let mut buf = vec![0u8; 64 << 10];
    assert_eq!(c.get("after", &mut buf).await.unwrap(), 64 << 10);
    assert!(buf == after);
    assert!(
        c.transfer_stats().local_bytes > local,
        "the route to the new owner was made again"
    );
}

/// A same-host route made before its owner restarted (on a fixed port: the same segment and
/// socket) never copies through the old owner's pool: a new connection to the new owner, which
/// sends another memory file, fails as a connection error (so the route is made again) instead
/// of writing where the new owner never looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_to_an_owner_that_restarted_never_copies_through_the_old_pool() {
    let (_m, rpc, _) = spawn_master(&["--client_ttl", "1"]);
    let port = free_port().to_string();
    let owner = || fixed_port_owner(&rpc, &port);
    let (first, segment) = owner();
    let path = socket_path(&socket_dir(), &segment);
    let (p, s) = (path.clone(), segment.clone());
    let local = tokio::task::spawn_blocking(move || {
        LocalOwner::connect(&p, &s, Deadlines::both(Duration::from_secs(3)), 1, 1, None)
    })
    .await
    .unwrap()
    .unwrap();

    first.signal(libc::SIGKILL);
    drop(first);
    let (_second, again) = owner();
    assert_eq!(again, segment);

    let key = ObjectKey::new("after-restart").unwrap();
    let value = payload("after-restart", 64 << 10);
    let parts = [&value[..]];
    let item = [unsealed(&key, &parts)];
    // The first write finds the dead connection to the old owner; the next one connects anew.
    let _ = local.write_batch(&item).await;
    let r = local.write_batch(&item).await;
    match &r[0] {
        Err(e @ TransferError::Connect { .. }) => {
            assert!(e.to_string().contains("restarted"), "{e}")
        }
        other => panic!("a write through the old pool's mapping: {other:?}"),
    }
}

/// A Unix socket at `path` that accepts nothing, its backlog full (a wedged owner): a blocking
/// connect to it waits until one is accepted. The returned descriptors keep it so.
fn wedged_socket(path: &std::path::Path) -> Vec<std::os::fd::OwnedFd> {
    use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
    let socket = || {
        // SAFETY: plain socket(2); the result is checked and owned once valid.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor of ours.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
    };
    // SAFETY: sockaddr_un is plain data, zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < addr.sun_path.len());
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    let addr_ptr = &addr as *const libc::sockaddr_un as *const libc::sockaddr;
    let listener = socket();
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket and a sockaddr_un of `len` bytes.
    let rc = unsafe { libc::bind(listener.as_raw_fd(), addr_ptr, len) };
    assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
    // SAFETY: a bound socket.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let mut fds = vec![listener];
    for _ in 0..64 {
        let c = socket();
        // SAFETY: a valid socket; O_NONBLOCK so that a full backlog answers EAGAIN.
        unsafe { libc::fcntl(c.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        // SAFETY: as for bind.
        let rc = unsafe { libc::connect(c.as_raw_fd(), addr_ptr, len) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) {
            return fds;
        }
        fds.push(c);
    }
    panic!("the backlog of {} never filled", path.display());
}

/// An owner socket that accepts nothing turns a call into an error within the deadlines, not a
/// hang: the same-host probe gives up after the connect timeout and the call goes over TCP,
/// where nothing listens either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_socket_that_accepts_nothing_is_an_error_not_a_hang() {
    let dir = TempDir::new("wedged");
    let segment = SegmentName::parse(&format!("127.0.0.1:{}", free_port())).unwrap();
    let _wedged = wedged_socket(&socket_path(dir.path(), &segment));
    let t = hybrid(dir.path().to_path_buf());
    let key = ObjectKey::new("wedged").unwrap();
    let value = payload("wedged", 4096);
    let parts = [&value[..]];
    let item = WriteItem {
        key: &key,
        offset: 0,
        stamp: Stamp::new(1, &ReplicateConfig::default()),
        seal: Seal::default(),
        parts: &parts,
    };
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), t.write(&segment, &item))
        .await
        .expect("the write hung on the wedged socket");
    assert!(r.is_err());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

/// Sends one same-host control frame and reads the answer's header and body.
fn exchange(s: &mut std::os::unix::net::UnixStream, frame: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    s.write_all(frame).unwrap();
    let mut h = [0u8; 5];
    s.read_exact(&mut h).unwrap();
    let (len, _) = mooncake_common::local::frame_header(h).unwrap();
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    body
}

/// A same-host client that goes silent while it holds a range (stopped mid-read) loses it after
/// the owner's frame timeout: the owner closes its connection and releases the range, so a later
/// write there succeeds instead of failing for as long as the silent client lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_same_host_reader_loses_its_range_after_the_frame_timeout() {
    a_reader_that_stops(1, true).await;
}

/// A same-host writer that goes silent mid-write (a stopped process) is told its exchange
/// failed after the frame timeout, but its range stays locked until it closes the connection:
/// the process may resume its copy at any time, and released, the range could meanwhile hold a
/// newer object (here the master reallocates it at once, its put removed). Before, the range
/// went after the frame timeout and the next put there succeeded while the old copy could
/// still land over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_same_host_writer_keeps_its_range_until_it_closes() {
    use mooncake_common::local::LocalOp;
    use std::io::Read;
    let one = OneObject::start().await;
    let mut silent = one.connect();
    let put_id = one.at.put_id;
    let begin = one.begin(LocalOp::BeginWrite, 1, "first", "", |_| put_id);
    let begun = exchange(&mut silent, &begin);
    assert_eq!(&begun[..], &[1, 0, 0, 0, 0, 0, 0, 0], "the write began");

    let c = &one.client;
    let cfg = ReplicateConfig::default();
    c.remove("first", true).await.unwrap();
    let size = one.size as usize;
    let second = payload("second", size);
    // Three frame timeouts: the owner gives up on the writer after one.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(
            c.put("second", &second, &cfg).await.is_err(),
            "a put landed in the range a silent writer may still copy into"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The writer's exchange failed: the owner shut its side of the connection.
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut rest = [0u8; 16];
    assert_eq!(
        silent.read(&mut rest).unwrap(),
        0,
        "the owner's side is shut"
    );
    drop(silent);
    let given_up = Instant::now() + Duration::from_secs(30);
    while let Err(e) = c.put("second", &second, &cfg).await {
        assert!(Instant::now() < given_up, "the range stayed held: {e}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut buf = vec![0u8; size];
    assert_eq!(c.get("second", &mut buf).await.unwrap(), size);
    assert!(buf == second);
    one.shutdown().await;
}

/// The same when the client stops before reading the owner's reply to its begin, and the reply
/// (60,000 items) is too big for the socket's buffer: the owner's write of it is bounded too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_reader_that_does_not_read_its_reply_loses_its_range_too() {
    a_reader_that_stops(60_000, false).await;
}

/// An in-process master and owner (frame timeout 1 s) whose one object, put through a same-host
/// client, fills the segment; with where it lies and a raw connection to the owner's socket that
/// said hello.
struct OneObject {
    master: mooncake_master::RunningMaster,
    owner: mooncake_owner::RunningOwner,
    client: Client,
    at: mooncake_client::ReplicaLocation,
    size: u64,
}

impl OneObject {
    async fn start() -> Self {
        // No watermark eviction: the one object fills the segment, and upkeep would otherwise
        // evict it (or its successor) between a test's put and its get on a loaded machine.
        let master = mooncake_master::RunningMaster::start(mooncake_master::MasterConfig {
            eviction_high_watermark_ratio: 1.0,
            ..mooncake_tests::master_config()
        })
        .await
        .unwrap();
        let addr = master.rpc_addr.to_string();
        let size = 1 << 20;
        let owner = mooncake_owner::RunningOwner::start(mooncake_owner::OwnerConfig {
            frame_timeout: Duration::from_secs(1),
            ..mooncake_tests::owner_config(&addr, size)
        })
        .await
        .unwrap();
        let client = client(&addr, true).await;
        client
            .put(
                "first",
                &payload("first", size as usize),
                &ReplicateConfig::default(),
            )
            .await
            .unwrap();
        let desc = client
            .batch_get_replica_desc(&["first"])
            .await
            .unwrap()
            .remove(0)
            .unwrap();
        let at = desc.replicas[0].clone();
        OneObject {
            master,
            owner,
            client,
            at,
            size,
        }
    }

    /// A raw same-host connection to the object's owner, past its hello.
    fn connect(&self) -> std::os::unix::net::UnixStream {
        use mooncake_common::local::{FrameWriter, LocalOp, VERSION};
        let segment = SegmentName::parse(self.at.segment.as_str()).unwrap();
        let mut s =
            std::os::unix::net::UnixStream::connect(socket_path(&socket_dir(), &segment)).unwrap();
        let mut hello = FrameWriter::new(LocalOp::Hello);
        hello.u8(VERSION).bytes(segment.as_str().as_bytes());
        exchange(&mut s, &hello.finish());
        s
    }

    /// A begin of `items` accesses of the object's range: the first under `first`'s key, the
    /// rest under `rest`'s, with the grants `grant(i)`.
    fn begin(
        &self,
        op: mooncake_common::local::LocalOp,
        items: u32,
        first: &str,
        rest: &str,
        grant: impl Fn(u32) -> u64,
    ) -> Vec<u8> {
        use mooncake_common::local::{FrameWriter, Item};
        let mut begin = FrameWriter::new(op);
        begin.u32(items);
        for i in 0..items {
            begin.item(Item {
                offset: self.at.offset,
                len: self.at.size,
                grant: grant(i),
                flags: 0,
                seal: Seal::default(),
                key: if i == 0 { first } else { rest },
            });
        }
        begin.finish()
    }

    async fn shutdown(self) {
        self.owner.shutdown().await;
        self.master.shutdown().await;
    }
}

/// A reader that begins a read of one object, in a batch of `items` (reading the reply or not),
/// then says nothing more; the object is removed and another put must land in its place.
async fn a_reader_that_stops(items: u32, read_reply: bool) {
    use mooncake_common::local::LocalOp;
    use std::io::Write;
    let one = OneObject::start().await;
    let mut silent = one.connect();
    // The object, then (to make the reply big) reads of a key the range does not hold, which
    // are refused item by item.
    let put_id = one.at.put_id;
    let begin = one.begin(LocalOp::BeginRead, items, "first", "not-here", |_| put_id);
    if read_reply {
        let begun = exchange(&mut silent, &begin);
        assert_eq!(&begun[..], &[1, 0, 0, 0, 0, 0, 0, 0], "the read began");
    } else {
        silent.write_all(&begin).unwrap();
    }

    let c = &one.client;
    let cfg = ReplicateConfig::default();
    c.remove("first", true).await.unwrap();
    // The owner lets go of the range one frame timeout after the reader stopped (after it
    // handled the begin, which takes a while for many items in a debug build).
    let size = one.size as usize;
    let second = payload("second", size);
    let given_up = Instant::now() + Duration::from_secs(30);
    while let Err(e) = c.put("second", &second, &cfg).await {
        assert!(Instant::now() < given_up, "the range stayed held: {e}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut buf = vec![0u8; size];
    assert_eq!(c.get("second", &mut buf).await.unwrap(), size);
    assert!(buf == second);
    drop(silent);
    one.shutdown().await;
}

/// A same-host begin of many writes, each waiting on a range a reader holds, is answered within
/// one frame timeout (1 s): the frame has one deadline, not one per item (8 s here). The range is
/// held for the whole time (a read guard of the owner's pool, as a reader's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_begin_write_has_one_deadline_for_all_its_items() {
    use mooncake_common::local::LocalOp;
    let one = OneObject::start().await;
    let put_id = one.at.put_id;
    let held = one
        .owner
        .pool()
        .read_range_owned(one.at.offset, one.at.size)
        .unwrap();
    let mut writer = one.connect();
    let items = 8;
    let begin = one.begin(LocalOp::BeginWrite, items, "w", "w", |i| {
        put_id + 1 + u64::from(i)
    });
    let started = Instant::now();
    let answer = tokio::task::spawn_blocking(move || exchange(&mut writer, &begin))
        .await
        .unwrap();
    let took = started.elapsed();
    drop(held);
    assert_eq!(answer.len(), 4 + 4 * items as usize);
    assert!(
        answer[4..].chunks(4).all(|c| c != [0, 0, 0, 0]),
        "no write began under the reader: {answer:?}"
    );
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    one.shutdown().await;
}

/// A reader that holds a range and keeps sending frames that let nothing go (empty begins)
/// still loses the range one frame timeout (1 s) after it took it: the limit counts from the
/// hold, not from its last frame. Before, any frame re-armed it, so such a peer kept the range
/// (and every put placed there failed Busy) for as long as it liked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_reader_sending_other_frames_still_loses_its_range() {
    use mooncake_common::local::LocalOp;
    let one = OneObject::start().await;
    let mut reader = one.connect();
    let put_id = one.at.put_id;
    let begun = exchange(
        &mut reader,
        &one.begin(LocalOp::BeginRead, 1, "first", "", |_| put_id),
    );
    assert_eq!(&begun[..], &[1, 0, 0, 0, 0, 0, 0, 0], "the read began");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let chatter = {
        let stop = stop.clone();
        let empty = one.begin(LocalOp::BeginRead, 0, "", "", |_| 0);
        std::thread::spawn(move || {
            use std::io::Write;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if reader.write_all(&empty).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let c = &one.client;
    c.remove("first", true).await.unwrap();
    let size = one.size as usize;
    let second = payload("second", size);
    let given_up = Instant::now() + Duration::from_secs(10);
    let mut stored = false;
    while Instant::now() < given_up {
        if c.put("second", &second, &ReplicateConfig::default())
            .await
            .is_ok()
        {
            stored = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    chatter.join().unwrap();
    assert!(stored, "the chattering reader kept its range");
    let mut buf = vec![0u8; size];
    assert_eq!(c.get("second", &mut buf).await.unwrap(), size);
    assert!(buf == second);
    one.shutdown().await;
}

/// How many mappings of an owner's pool of `size` bytes this process holds.
fn pool_mappings(size: u64) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:mooncake-segment"))
        .filter(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let len = u64::from_str_radix(b, 16).unwrap() - u64::from_str_radix(a, 16).unwrap();
            len == size
        })
        .count()
}

/// An owner that died and came back under another name (port 0) leaves no mapping of its old
/// pool behind once the client reaches the new one: nothing would call the old name again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_of_an_owner_that_died_is_unmapped_when_its_successor_is_reached() {
    // A size no other test here uses, to tell these pools' mappings apart.
    const SIZE: u64 = 7 << 20;
    let (_m, rpc, _) = spawn_master(&[]);
    let t = hybrid(socket_dir());
    let key = ObjectKey::new("probe").unwrap();
    let value = payload("probe", 4096);
    let parts = [&value[..]];
    let item = [unsealed(&key, &parts)];
    let (first, seg) = spawn_owner(&rpc, "7MiB", &[]);
    let seg = SegmentName::parse(&seg).unwrap();
    let _ = t.write_batch(&seg, &item).await;
    assert_eq!(pool_mappings(SIZE), 1, "the first owner's pool is mapped");
    first.signal(libc::SIGKILL);
    drop(first);
    let (_second, seg) = spawn_owner(&rpc, "7MiB", &[]);
    let seg = SegmentName::parse(&seg).unwrap();
    let _ = t.write_batch(&seg, &item).await;
    assert_eq!(
        pool_mappings(SIZE),
        1,
        "only the second owner's pool is mapped"
    );
}

/// Calls queued behind a stopped owner's only connection wait for it no longer than for an
/// exchange: each one fails within its deadline instead of after the ones before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_behind_a_stopped_owner_fail_within_their_own_deadline() {
    let (_m, rpc, _) = spawn_master(&[]);
    let (owner, seg) = spawn_owner(&rpc, "16MiB", &[]);
    let seg = SegmentName::parse(&seg).unwrap();
    let path = socket_path(&socket_dir(), &seg);
    let s = seg.clone();
    let local = std::sync::Arc::new(
        tokio::task::spawn_blocking(move || {
            LocalOwner::connect(
                &path,
                &s,
                Deadlines::both(Duration::from_secs(1)),
                1,
                1,
                None,
            )
        })
        .await
        .unwrap()
        .unwrap(),
    );
    owner.stop();
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let local = local.clone();
            tokio::spawn(async move {
                let key = ObjectKey::new(&format!("queued/{i}")).unwrap();
                let value = payload("queued", 4096);
                let parts = [&value[..]];
                let item = [unsealed(&key, &parts)];
                let t = Instant::now();
                let r = local.write_batch(&item).await;
                (r[0].is_err(), t.elapsed())
            })
        })
        .collect();
    for call in calls {
        let (failed, took) = call.await.unwrap();
        assert!(failed);
        // One exchange deadline (1 s) each, not one after another (up to 4 s).
        assert!(took < Duration::from_millis(3500), "took {took:?}");
    }
    owner.signal(libc::SIGCONT);
}

/// An owner whose runtime ends without a shutdown (a test that returns early, an embedding
/// process that exits its runtime) leaves no same-host socket file behind: before, only an
/// orderly stop removed it.
#[test]
fn an_owner_dropped_without_a_shutdown_leaves_no_socket_behind() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (path, running) = rt.block_on(async {
        let master = mooncake_master::RunningMaster::start(mooncake_tests::master_config())
            .await
            .unwrap();
        let owner = mooncake_owner::RunningOwner::start(mooncake_tests::owner_config(
            &master.rpc_addr.to_string(),
            4 << 20,
        ))
        .await
        .unwrap();
        let path = socket_path(&socket_dir(), &owner.segment);
        assert!(path.exists(), "{}", path.display());
        (path, (master, owner))
    });
    // The runtime ends first, its tasks dropped mid-loop, the owner never told to stop.
    drop(rt);
    assert!(!path.exists(), "{} was left behind", path.display());
    drop(running);
}

/// A same-host owner gone for good (stopped, and never called again) is let go of within the
/// tidy interval (10 s) of the client's next call to anyone: its whole pool stays allocated
/// while a client maps it. Before, only a new route (or a probe of another owner) let go of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_same_host_owners_pool_is_let_go() {
    // A size no other test here uses, to tell these pools' mappings apart.
    const SIZE: u64 = 13 << 20;
    let (_m, rpc, _) = spawn_master(&[]);
    let (mut gone, gone_seg) = spawn_owner(&rpc, "13MiB", &[]);
    let (_stays, stays_seg) = spawn_owner(&rpc, "13MiB", &[]);
    let shm = client(&rpc, true).await;
    for (key, seg) in [("gone", &gone_seg), ("stays", &stays_seg)] {
        let on = ReplicateConfig {
            preferred_segments: vec![SegmentName::parse(seg).unwrap()],
            ..ReplicateConfig::default()
        };
        shm.put(key, &payload(key, 1 << 20), &on).await.unwrap();
    }
    assert_eq!(pool_mappings(SIZE), 2);
    assert_eq!(shm.transfer_stats().tcp_bytes, 0, "both over shared memory");
    gone.signal(libc::SIGKILL);
    gone.wait_exit(Duration::from_secs(15))
        .expect("the owner dies");
    let mut buf = vec![0u8; 1 << 20];
    let until = Instant::now() + Duration::from_secs(30);
    while pool_mappings(SIZE) > 1 {
        assert!(
            Instant::now() < until,
            "the departed owner's pool is still mapped"
        );
        assert_eq!(shm.get("stays", &mut buf).await.unwrap(), 1 << 20);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(buf == payload("stays", 1 << 20));
}
