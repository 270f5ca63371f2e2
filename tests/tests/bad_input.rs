//! Bad input is a clear error and the servers keep serving: malformed and truncated data-plane
//! frames, out-of-range offsets, reads of ranges that do not hold the key, stalled frames, unknown
//! flags, an owner that cannot mount, and memory that is not host memory.

use std::time::{Duration, Instant};

use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};
use mooncake_owner::RunningOwner;
use mooncake_tests::{bin_path, master_config, owner_config, payload, Cluster};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const MIB: u64 = 1 << 20;

fn header(op: Op, key: &str, offset: u64, length: u64) -> Vec<u8> {
    let mut v = RequestHeader {
        op,
        key_len: key.len() as u16,
        flags: 0,
        request_id: 7,
        offset,
        length,
        grant: 0,
        seal: Default::default(),
    }
    .encode()
    .to_vec();
    v.extend_from_slice(key.as_bytes());
    v
}

async fn response(s: &mut TcpStream) -> (ResponseHeader, Vec<u8>) {
    let mut hb = [0u8; RESPONSE_HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hb))
        .await
        .unwrap()
        .unwrap();
    let h = ResponseHeader::decode(&hb).unwrap();
    let mut body = vec![0u8; h.length as usize];
    s.read_exact(&mut body).await.unwrap();
    (h, body)
}

async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn ping_ok(addr: std::net::SocketAddr) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&header(Op::Ping, "", 0, 0)).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, 0, "owner stopped serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_truncated_and_out_of_range_frames_get_errors_and_the_owner_keeps_serving() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let mut oc = owner_config(&master.rpc_addr.to_string(), 4 * MIB);
    oc.frame_timeout = Duration::from_millis(500);
    let owner = RunningOwner::start(oc).await.unwrap();
    let addr = owner.data_addr;

    // Garbage: an error reply naming the problem, then the connection closes.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0xde; mooncake_common::wire::REQUEST_HEADER_LEN])
        .await
        .unwrap();
    let (h, msg) = response(&mut s).await;
    assert_eq!(h.status, -600);
    assert!(
        String::from_utf8_lossy(&msg).contains("bad magic"),
        "{}",
        String::from_utf8_lossy(&msg)
    );
    assert!(closed(&mut s).await);
    ping_ok(addr).await;

    // A newer protocol version is refused with a message saying so.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut h = header(Op::Ping, "", 0, 0);
    h[2] = 9;
    s.write_all(&h).await.unwrap();
    let (h, msg) = response(&mut s).await;
    assert_eq!(h.status, -600);
    assert!(String::from_utf8_lossy(&msg).contains("unsupported protocol version 9"));

    // Truncated: half a header, then the peer goes away.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&header(Op::Write, "k", 0, 10)[..13])
        .await
        .unwrap();
    drop(s);
    ping_ok(addr).await;

    // A write past the end of the segment: refused, its payload drained, the connection usable.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut f = header(Op::Write, "k", 4 * MIB - 10, 100);
    f.extend_from_slice(&[1u8; 100]);
    f.extend_from_slice(&header(Op::Ping, "", 0, 0));
    s.write_all(&f).await.unwrap();
    let (h, msg) = response(&mut s).await;
    assert_eq!(h.status, -600);
    assert!(String::from_utf8_lossy(&msg).contains("outside the segment"));
    assert_eq!(response(&mut s).await.0.status, 0);

    // Offset overflow and reads out of range.
    s.write_all(&header(Op::Read, "k", u64::MAX - 5, 100))
        .await
        .unwrap();
    assert_eq!(response(&mut s).await.0.status, -600);
    s.write_all(&header(Op::Read, "k", 4 * MIB, 1))
        .await
        .unwrap();
    assert_eq!(response(&mut s).await.0.status, -600);

    // A read of a range that does not hold the key: not found, never another key's bytes.
    let mut f = header(Op::Write, "mine", 0, 64);
    f.extend_from_slice(&payload("mine", 64));
    s.write_all(&f).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, 0);
    s.write_all(&header(Op::Read, "theirs", 0, 64))
        .await
        .unwrap();
    assert_eq!(response(&mut s).await.0.status, -704);
    s.write_all(&header(Op::Read, "mine", 0, 64)).await.unwrap();
    let (h, body) = response(&mut s).await;
    assert_eq!(h.status, 0);
    assert_eq!(body, payload("mine", 64));
    // The owner lets go of a read's range just after sending the value, so a writer racing in
    // at once may find it busy. A ping on the same connection is answered only after that.
    s.write_all(&header(Op::Ping, "", 0, 0)).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, 0);

    // A payload larger than the segment cannot be drained sanely: error, connection closed.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&header(Op::Write, "k", 0, 1 << 30))
        .await
        .unwrap();
    assert!(closed(&mut s).await);

    // Zero-length key on a write: malformed.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut f = header(Op::Write, "", 0, 10);
    f.extend_from_slice(&[0u8; 10]);
    s.write_all(&f).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, -600);

    // A frame that stalls mid-payload is cut off after the frame timeout.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut f = header(Op::Write, "slow", 0, 100);
    f.extend_from_slice(&[0u8; 10]);
    s.write_all(&f).await.unwrap();
    let t = Instant::now();
    assert!(closed(&mut s).await);
    assert!(t.elapsed() < Duration::from_secs(3));
    ping_ok(addr).await;
    // Its ten bytes landed over "mine": the range no longer names "mine" (never torn bytes).
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&header(Op::Read, "mine", 0, 64)).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, -704);
    // Likewise for a writer that goes away mid-payload.
    let mut f = header(Op::Write, "whole", 4096, 64);
    f.extend_from_slice(&payload("whole", 64));
    s.write_all(&f).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, 0);
    let mut w = TcpStream::connect(addr).await.unwrap();
    let mut f = header(Op::Write, "torn", 4096, 64);
    f.extend_from_slice(&[9u8; 20]);
    w.write_all(&f).await.unwrap();
    drop(w);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        s.write_all(&header(Op::Read, "whole", 4096, 64))
            .await
            .unwrap();
        let (h, body) = response(&mut s).await;
        if h.status == -704 {
            break;
        }
        // Until the owner sees the writer gone, the range is busy or still whole.
        assert!(
            h.status == -800 || (h.status == 0 && body == payload("whole", 64)),
            "status {} after a torn write",
            h.status
        );
        assert!(
            Instant::now() < deadline,
            "the torn range still names its old key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // After the stalled writer was cut off its range is free for a proper write.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut f = header(Op::Write, "slow", 0, 100);
    f.extend_from_slice(&[5u8; 100]);
    s.write_all(&f).await.unwrap();
    assert_eq!(response(&mut s).await.0.status, 0);

    owner.shutdown().await;
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_refuses_bad_ids_per_item_and_keeps_serving() {
    let c = Cluster::start(&[4 * MIB]).await;
    let mut raw = mooncake_proto::master::master_client::MasterClient::connect(format!(
        "http://{}",
        c.master_addr()
    ))
    .await
    .unwrap();
    use mooncake_proto::master as pb;
    let r = raw
        .batch_put_start(pb::BatchPutStartRequest {
            items: vec![
                pb::PutStartItem {
                    key: "".into(),
                    size: 10,
                },
                pb::PutStartItem {
                    key: "ok".into(),
                    size: 0,
                },
                pb::PutStartItem {
                    key: "x".repeat(5000),
                    size: 10,
                },
            ],
            config: None,
            token: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.results.iter().all(|x| x.code == -600), "{:?}", r.results);
    let bad_cfg = raw
        .batch_put_start(pb::BatchPutStartRequest {
            items: vec![pb::PutStartItem {
                key: "k".into(),
                size: 10,
            }],
            config: Some(pb::ReplicateConfig {
                preferred_segments: vec!["no port".into()],
                ..Default::default()
            }),
            token: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(bad_cfg.results[0].code, -600);
    let mount = raw
        .mount_segment(pb::MountSegmentRequest {
            client_id: "nothex".into(),
            segment: "h:1".into(),
            size: 100,
            disk_capacity: 0,
            ..Default::default()
        })
        .await;
    assert_eq!(mount.unwrap_err().code(), tonic::Code::InvalidArgument);
    let client = c.client().await;
    client
        .put("still", b"serving", &Default::default())
        .await
        .unwrap();
    c.shutdown().await;
}

fn run(bin: &str, args: &[&str]) -> (i32, String) {
    run_path(&bin_path(bin), args)
}

fn run_path(exe: &std::path::Path, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(exe).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unknown_flags_and_bad_values_exit_non_zero_with_a_message() {
    let (code, err) = run("mooncake_master", &["--no_such_flag", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("--no_such_flag"), "{err}");
    let (code, err) = run("mooncake_ownerd", &["--bogus"]);
    assert_eq!(code, 2);
    assert!(err.contains("--bogus"), "{err}");
    let (code, err) = run(
        "mooncake_master",
        &[
            "--eviction_ratio",
            "2",
            "--rpc_port",
            "0",
            "--metrics_port",
            "0",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("eviction_ratio"), "{err}");
    let (code, err) = run("mooncake_ownerd", &["--segment-size", "lots"]);
    assert_eq!(code, 2);
    assert!(err.contains("invalid size"), "{err}");
    let (code, err) = run(
        "mooncake_ownerd",
        &["--host", "0.0.0.0", "--master", "127.0.0.1:1"],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("not an address clients can connect to"),
        "{err}"
    );
}

#[test]
fn an_owner_that_cannot_mount_exits_non_zero_with_a_clear_message() {
    // Port 1 on loopback: nothing listens there. Build before the clock starts (and do not go
    // through `bin_path` again: another test may hold its lock while it builds another binary).
    let exe = bin_path("mooncake_ownerd");
    let t = Instant::now();
    let (code, err) = run_path(
        &exe,
        &[
            "--master",
            "127.0.0.1:1",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "1MiB",
            "--no-mlock",
            "--mount-timeout",
            "1s",
        ],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot mount the segment") && err.contains("127.0.0.1:1"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// Memory a registration would take for host memory must be mapped readable and writable in
/// this process: a reserved range with no access (as the address space of device memory a build
/// does not recognise) or a read-only one is refused, never dereferenced later.
#[test]
fn only_readable_and_writable_memory_counts_as_host_memory() {
    use mooncake_common::host_memory::readable_and_writable;
    let heap = vec![0u8; 1 << 16];
    assert!(readable_and_writable(heap.as_ptr() as usize, heap.len()));
    for prot in [libc::PROT_NONE, libc::PROT_READ] {
        // SAFETY: a new anonymous mapping, unmapped below; nothing dereferences it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 16,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(!readable_and_writable(p as usize, 1 << 16), "prot {prot}");
        // SAFETY: the mapping made above, of that length.
        unsafe { libc::munmap(p, 1 << 16) };
    }
}
