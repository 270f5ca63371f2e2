//! The conformance suite every `DiskEngine` must pass: the same tests run against io_uring and
//! pread, on real O_DIRECT files in a temporary directory.

use std::{io, path::Path, sync::Arc, time::Duration};

use futures::{future::join_all, FutureExt};

use super::{
    open_direct, open_engine, test_dir::TempDir, AlignedBuf, DiskEngine, EngineKind, ALIGN,
};

const FILE_SIZE: u64 = 16 << 20;

fn open(kind: EngineKind, path: &Path) -> Arc<dyn DiskEngine> {
    let file = open_direct(path, FILE_SIZE).expect("open the test file with O_DIRECT");
    let engine = open_engine(kind, file, 16).expect("start the engine");
    assert_eq!(engine.kind(), kind);
    engine
}

fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn pattern(seed: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::with_capacity(len);
    buf.set_len(len);
    for (i, c) in buf.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    buf
}

fn assert_pattern(buf: &[u8], seed: u64) {
    for (i, c) in buf.chunks_exact(8).enumerate() {
        assert_eq!(
            c,
            word(seed, i as u64).to_le_bytes(),
            "wrong bytes at {} (seed {seed})",
            i * 8
        );
    }
}

fn empty(len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::with_capacity(len);
    buf.set_len(len);
    buf
}

async fn timed<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("the engine did not answer within 60 s")
}

async fn write(engine: &dyn DiskEngine, seed: u64, len: usize, offset: u64) {
    let (buf, r) = engine.write_at(pattern(seed, len), offset).await;
    r.unwrap_or_else(|e| panic!("write of {len} at {offset}: {e}"));
    assert_eq!(buf.len(), len);
}

async fn read_check(engine: &dyn DiskEngine, seed: u64, len: usize, offset: u64) {
    let (buf, r) = engine.read_at(empty(len), offset).await;
    r.unwrap_or_else(|e| panic!("read of {len} at {offset}: {e}"));
    assert_eq!(buf.len(), len);
    assert_pattern(&buf, seed);
}

async fn round_trip(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    let sizes = [ALIGN, 1 << 20, (4 << 20) + ALIGN];
    let offsets = [0, ALIGN as u64, 7 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        for (j, &offset) in offsets.iter().enumerate() {
            let seed = (i * 10 + j) as u64;
            write(&*engine, seed, len, offset).await;
            read_check(&*engine, seed, len, offset).await;
        }
    }
}

async fn concurrent(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    const OPS: u64 = 64;
    const LEN: usize = 64 << 10;
    let writes = (0..OPS).map(|i| engine.write_at(pattern(100 + i, LEN), i * LEN as u64));
    for (buf, r) in join_all(writes).await {
        r.expect("concurrent write");
        assert_eq!(buf.len(), LEN);
    }
    let reads = (0..OPS).map(|i| engine.read_at(empty(LEN), i * LEN as u64));
    for (i, (buf, r)) in join_all(reads).await.into_iter().enumerate() {
        r.expect("concurrent read");
        assert_pattern(&buf, 100 + i as u64);
    }
}

async fn misaligned(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    let cases = [(ALIGN, 512u64), (ALIGN + 512, 0), (100, ALIGN as u64)];
    for (len, offset) in cases {
        let (buf, r) = engine.write_at(pattern(1, len), offset).await;
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(buf.len(), len, "the buffer comes back unchanged");
        let (buf, r) = engine.read_at(empty(len), offset).await;
        let e = r.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("multiples of 4096"), "{e}");
        assert_eq!(buf.len(), len);
    }
}

async fn past_the_end(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    write(&*engine, 7, ALIGN, FILE_SIZE - ALIGN as u64).await;
    let (buf, r) = engine
        .read_at(empty(2 * ALIGN), FILE_SIZE - ALIGN as u64)
        .await;
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    assert_pattern(&buf[..ALIGN], 7);
    let (_, r) = engine.read_at(empty(ALIGN), FILE_SIZE).await;
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    read_check(&*engine, 7, ALIGN, FILE_SIZE - ALIGN as u64).await;
}

async fn sync(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    write(&*engine, 3, 1 << 20, 0).await;
    engine.sync().await.expect("sync");
    let (syncs, (_, w)) = futures::join!(
        join_all((0..4).map(|_| engine.sync())),
        engine.write_at(pattern(4, ALIGN), 2 << 20)
    );
    w.expect("write beside syncs");
    assert!(syncs.into_iter().all(|r| r.is_ok()));
}

async fn abandoned(kind: EngineKind) {
    let dir = TempDir::new();
    let engine = open(kind, &dir.file());
    write(&*engine, 5, 1 << 20, 0).await;
    // Polled once and dropped: the engine must finish (and free) these without the caller.
    for i in 0..32 {
        let _ = engine.read_at(empty(1 << 20), 0).now_or_never();
        let _ = engine
            .write_at(pattern(6, ALIGN), (2 << 20) + i * ALIGN as u64)
            .now_or_never();
    }
    read_check(&*engine, 5, 1 << 20, 0).await;
}

async fn other_engine_reads(kind: EngineKind, other: EngineKind) {
    let dir = TempDir::new();
    {
        let engine = open(kind, &dir.file());
        write(&*engine, 9, 3 << 20, 5 << 20).await;
        engine.sync().await.expect("sync");
    }
    let engine = open(other, &dir.file());
    read_check(&*engine, 9, 3 << 20, 5 << 20).await;
}

macro_rules! conformance {
    ($name:ident, $kind:expr, $other:expr) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn round_trip() {
                timed(super::round_trip($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent() {
                timed(super::concurrent($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn misaligned() {
                timed(super::misaligned($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn past_the_end() {
                timed(super::past_the_end($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sync() {
                timed(super::sync($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn abandoned() {
                timed(super::abandoned($kind)).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn other_engine_reads() {
                timed(super::other_engine_reads($kind, $other)).await
            }
        }
    };
}

conformance!(uring, EngineKind::Uring, EngineKind::Pread);
conformance!(pread, EngineKind::Pread, EngineKind::Uring);

#[test]
fn open_direct_refuses_a_misaligned_size() {
    let dir = TempDir::new();
    let e = open_direct(&dir.file(), FILE_SIZE + 1).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn open_direct_extends_and_keeps() {
    let dir = TempDir::new();
    assert_eq!(
        open_direct(&dir.file(), 1 << 20)
            .unwrap()
            .metadata()
            .unwrap()
            .len(),
        1 << 20
    );
    assert_eq!(
        open_direct(&dir.file(), 2 << 20)
            .unwrap()
            .metadata()
            .unwrap()
            .len(),
        2 << 20
    );
    assert_eq!(
        open_direct(&dir.file(), 1 << 20)
            .unwrap()
            .metadata()
            .unwrap()
            .len(),
        2 << 20
    );
}

#[test]
fn engine_kind_parses_and_prints() {
    for kind in [EngineKind::Auto, EngineKind::Uring, EngineKind::Pread] {
        assert_eq!(kind.to_string().parse::<EngineKind>().unwrap(), kind);
        let json = serde_name(kind);
        assert_eq!(json, kind.to_string());
    }
    assert!("spdk".parse::<EngineKind>().is_err());
}

/// The serde name of `kind`, through the toml serializer the owner's config already uses.
fn serde_name(kind: EngineKind) -> String {
    #[derive(serde::Serialize)]
    struct W {
        engine: EngineKind,
    }
    let s = toml::to_string(&W { engine: kind }).unwrap();
    s.trim()
        .trim_start_matches("engine = ")
        .trim_matches('"')
        .to_string()
}

#[tokio::test]
async fn auto_picks_a_working_engine() {
    let dir = TempDir::new();
    let file = open_direct(&dir.file(), FILE_SIZE).unwrap();
    let engine = open_engine(EngineKind::Auto, file, 4).unwrap();
    assert_ne!(engine.kind(), EngineKind::Auto);
    write(&*engine, 11, ALIGN, 0).await;
    read_check(&*engine, 11, ALIGN, 0).await;
}
