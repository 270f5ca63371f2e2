//! Writes are fenced by their grant (put id): a write of an abandoned transfer that is still
//! draining from a socket is superseded by a later grant of the same range at once (the later one
//! neither waits for the frame deadline nor gets overwritten), and a stale write arriving after
//! the later one landed is refused without touching a byte. Raw frames over real TCP against an
//! owner, so the stale writer can stop mid-payload exactly where a stalled client would.

use std::time::{Duration, Instant};

use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};
use mooncake_owner::RunningOwner;
use mooncake_tests::{master_config, owner_config, payload};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const LEN: usize = 1 << 20;

fn frame(op: Op, key: &str, length: u64, grant: u64) -> Vec<u8> {
    let mut v = RequestHeader {
        op,
        key_len: key.len() as u16,
        flags: 1,
        request_id: grant,
        offset: 0,
        length,
        grant,
        seal: Default::default(),
    }
    .encode()
    .to_vec();
    v.extend_from_slice(key.as_bytes());
    v
}

async fn answer(s: &mut TcpStream) -> (i32, Vec<u8>) {
    let mut hb = [0u8; RESPONSE_HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hb))
        .await
        .expect("the owner answers")
        .unwrap();
    let h = ResponseHeader::decode(&hb).unwrap();
    let mut body = vec![0u8; h.length as usize];
    s.read_exact(&mut body).await.unwrap();
    (h.status, body)
}

async fn read(addr: std::net::SocketAddr, key: &str, grant: u64) -> (i32, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&frame(Op::Read, key, LEN as u64, grant))
        .await
        .unwrap();
    answer(&mut s).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_grant_supersedes_an_abandoned_write_and_a_stale_one_never_lands() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let mut oc = owner_config(&master.rpc_addr.to_string(), 4 << 20);
    // Long enough that waiting for the stale writer's deadline would show.
    oc.frame_timeout = Duration::from_secs(20);
    let owner = RunningOwner::start(oc).await.unwrap();
    let addr = owner.data_addr;

    // Put 5 starts writing and stalls a tenth of the way in (its client gave up).
    let stale = payload("stale", LEN);
    let mut abandoned = TcpStream::connect(addr).await.unwrap();
    let mut f = frame(Op::Write, "k", LEN as u64, 5);
    f.extend_from_slice(&stale[..LEN / 10]);
    abandoned.write_all(&f).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Put 9 of the same range (granted after put 5 was revoked) lands at once.
    let fresh = payload("fresh", LEN);
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut f = frame(Op::Write, "k", LEN as u64, 9);
    f.extend_from_slice(&fresh);
    let t = Instant::now();
    s.write_all(&f).await.unwrap();
    assert_eq!(answer(&mut s).await.0, 0);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the later grant waited {:?} for the abandoned write",
        t.elapsed()
    );
    assert_eq!(read(addr, "k", 9).await, (0, fresh.clone()));

    // The rest of the abandoned payload arrives: refused, and not a byte of it lands.
    abandoned.write_all(&stale[LEN / 10..]).await.unwrap();
    let (status, message) = answer(&mut abandoned).await;
    assert_eq!(status, -800, "{}", String::from_utf8_lossy(&message));
    assert!(String::from_utf8_lossy(&message).contains("superseded"));
    assert_eq!(read(addr, "k", 9).await, (0, fresh.clone()));
    assert_eq!(read(addr, "k", 5).await.0, -704);

    // The same stale put sent whole after the later one landed: refused, bytes unchanged; the
    // connection stays usable (the payload was drained).
    let mut f = frame(Op::Write, "k", LEN as u64, 5);
    f.extend_from_slice(&stale);
    abandoned.write_all(&f).await.unwrap();
    let (status, message) = answer(&mut abandoned).await;
    assert_eq!(status, -800);
    assert!(String::from_utf8_lossy(&message).contains("stale"));
    abandoned
        .write_all(&frame(Op::Read, "k", LEN as u64, 9))
        .await
        .unwrap();
    assert_eq!(answer(&mut abandoned).await, (0, fresh.clone()));

    owner.shutdown().await;
    master.shutdown().await;
}
