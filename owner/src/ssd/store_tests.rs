//! The ring log on a real file: round trips, wrap-around eviction of the oldest records, corrupt
//! records refused with -801, deletes that survive a reopen, and recovery after a reopen. Runs on
//! both engines.

use std::io::{Seek, SeekFrom, Write};

use mooncake_common::{Code, ObjectKey};

use super::{store::DATA_FILE, test_dir::TempDir, Dropped, EngineKind, SsdError, SsdStore};

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn open(dir: &TempDir, cap: u64, kind: EngineKind) -> (std::sync::Arc<SsdStore>, usize) {
    let (s, rec) = SsdStore::open(dir.path(), cap, kind, 16, 64 << 20)
        .await
        .unwrap();
    (s, rec.len())
}

async fn put(s: &SsdStore, key: &str, put_id: u64, v: &[u8]) -> Vec<(ObjectKey, u64)> {
    let mut r = s.reserve(&k(key), v.len() as u64).unwrap();
    let victims = r
        .victims
        .iter()
        .map(|v| (v.key.clone(), v.put_id))
        .collect();
    s.evict_victims(&mut r);
    let buf = s.encode(&r, &k(key), put_id, v);
    s.write(r, buf, &k(key), put_id, v.len() as u64)
        .await
        .unwrap();
    victims
}

async fn round_trip_wrap_and_recover(kind: EngineKind) {
    let dir = TempDir::new();
    // 1 MiB of records: 64 KiB values take 17 blocks each, so 15 fit.
    let cap = (1 << 20) + 4096;
    let (s, n) = open(&dir, cap, kind).await;
    assert_eq!(n, 0);
    for i in 0..15u8 {
        assert!(put(&s, &format!("k{i}"), 100 + i as u64, &value(i, 65536))
            .await
            .is_empty());
    }
    for i in 0..15u8 {
        let v = s
            .read(&k(&format!("k{i}")), 100 + i as u64, 65536)
            .await
            .unwrap();
        assert_eq!(&v[..], &value(i, 65536)[..]);
    }
    // Wrong version or length: not found, never the bytes.
    assert!(matches!(
        s.read(&k("k1"), 7, 65536).await,
        Err(SsdError::NotFound { .. })
    ));
    // The head wraps: the oldest record is in the way.
    let victims = put(&s, "new", 999, &value(77, 65536)).await;
    assert_eq!(victims, vec![(k("k0"), 100)]);
    assert!(s.read(&k("k0"), 100, 65536).await.is_err());
    assert_eq!(s.stats().records, 15);
    assert_eq!(s.stats().evicted_records, 1);
    assert_eq!(s.delete(&k("k5"), 105, None).await.unwrap(), Dropped::Gone);
    assert!(
        s.delete(&k("k6"), 1, None).await.unwrap() == Dropped::NotFound,
        "another version"
    );
    s.sync().await.unwrap();
    drop(s);

    let (s, n) = open(&dir, cap, kind).await;
    assert_eq!(n, 14, "15 live records minus the deleted one");
    assert!(s.read(&k("k5"), 105, 65536).await.is_err());
    let v = s.read(&k("new"), 999, 65536).await.unwrap();
    assert_eq!(&v[..], &value(77, 65536)[..]);
    for i in (1..15u8).filter(|i| *i != 5) {
        let v = s
            .read(&k(&format!("k{i}")), 100 + i as u64, 65536)
            .await
            .unwrap();
        assert_eq!(&v[..], &value(i, 65536)[..]);
    }
    // Writing goes on after the newest record: k1 is the next victim.
    let victims = put(&s, "newer", 1000, &value(78, 65536)).await;
    assert_eq!(victims, vec![(k("k1"), 101)]);
}

async fn corrupt_records_are_refused(kind: EngineKind) {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 4 << 20, kind).await;
    put(&s, "a", 1, &value(1, 10_000)).await;
    put(&s, "b", 2, &value(2, 10_000)).await;
    let (oa, ob) = (
        s.record_offset(&k("a")).unwrap(),
        s.record_offset(&k("b")).unwrap(),
    );
    let path = s.path().to_path_buf();
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // A flipped value byte in a, a flipped header byte in b.
    f.seek(SeekFrom::Start(oa + 5000)).unwrap();
    f.write_all(&[0xFF ^ value(1, 10_000)[5000 - 64 - 1]])
        .unwrap();
    f.seek(SeekFrom::Start(ob + 20)).unwrap();
    f.write_all(&[0xAB]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    for (key, id) in [("a", 1), ("b", 2)] {
        match s.read(&k(key), id, 10_000).await {
            Err(e @ SsdError::Corrupt { .. }) => assert_eq!(e.code(), Code::ChecksumMismatch),
            Err(e) => panic!("{key}: expected a corrupt record, got {e}"),
            Ok(_) => panic!("{key}: corrupt bytes were handed out"),
        }
    }
    assert_eq!(s.stats().corrupt_reads, 2);
    drop(s);
    // On reopen, b's header no longer checks out (not recovered); a's header is intact and its
    // value is still refused when read.
    let (s, n) = open(&dir, 4 << 20, kind).await;
    assert_eq!(n, 1);
    assert!(matches!(
        s.read(&k("a"), 1, 10_000).await,
        Err(SsdError::Corrupt { .. })
    ));
}

#[tokio::test]
async fn ring_round_trip_wrap_and_recover_uring() {
    round_trip_wrap_and_recover(EngineKind::Uring).await;
}

#[tokio::test]
async fn ring_round_trip_wrap_and_recover_pread() {
    round_trip_wrap_and_recover(EngineKind::Pread).await;
}

#[tokio::test]
async fn corrupt_records_are_refused_uring() {
    corrupt_records_are_refused(EngineKind::Uring).await;
}

#[tokio::test]
async fn corrupt_records_are_refused_pread() {
    corrupt_records_are_refused(EngineKind::Pread).await;
}

#[tokio::test]
async fn a_full_tier_refuses_oversized_records_and_a_wrong_size_is_named() {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 64 << 10, EngineKind::Pread).await;
    assert!(matches!(
        s.reserve(&k("big"), 1 << 20),
        Err(SsdError::TooLarge { .. })
    ));
    drop(s);
    let e = SsdStore::open(dir.path(), 128 << 10, EngineKind::Pread, 4, 1 << 20)
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("start with that size"), "{e}");
}

async fn many_concurrent_records_all_come_back(kind: EngineKind) {
    let dir = TempDir::new();
    let cap = 128 << 20;
    let (s, _) = open(&dir, cap, kind).await;
    let keys: Vec<String> = (0..96).map(|i| format!("m/1048576/{i}")).collect();
    for round in keys.chunks(32) {
        futures::future::join_all(round.iter().enumerate().map(|(i, key)| {
            let s = s.clone();
            async move {
                let v = value(i as u8, 1 << 20);
                let mut r = s.reserve(&k(key), v.len() as u64).unwrap();
                s.evict_victims(&mut r);
                let buf = s.encode(&r, &k(key), 7, &v);
                s.write(r, buf, &k(key), 7, v.len() as u64).await.unwrap();
            }
        }))
        .await;
    }
    assert_eq!(s.stats().records, 96);
    drop(s);
    let (s, n) = open(&dir, cap, kind).await;
    assert_eq!(n, 96, "every record written is found again");
    for (i, key) in keys.iter().enumerate() {
        let v = s.read(&k(key), 7, 1 << 20).await.unwrap();
        assert_eq!(&v[..], &value((i % 32) as u8, 1 << 20)[..], "{key}");
    }
}

#[tokio::test]
async fn many_concurrent_records_all_come_back_uring() {
    many_concurrent_records_all_come_back(EngineKind::Uring).await;
}

#[tokio::test]
async fn many_concurrent_records_all_come_back_pread() {
    many_concurrent_records_all_come_back(EngineKind::Pread).await;
}

/// Versions and races on the ring: a late write of an older version never replaces a newer one,
/// a replaced or deleted record does not come back after a reopen, a reservation given up after
/// its victims were evicted leaves no resurrectable header and hides no later record, and a
/// delete of a victim while a reservation writes over it does not damage the new record.
#[tokio::test]
async fn versions_and_races_on_the_ring_survive_a_reopen() {
    let dir = TempDir::new();
    // Three records of four blocks each (one-byte keys, values of 16 KiB - 65 bytes).
    const LEN: usize = 16384 - 65;
    let cap = 12 * 4096 + 4096;
    let v = |seed| value(seed, LEN);
    let (s, _) = open(&dir, cap, EngineKind::Uring).await;

    // A late write of an older version: blocks 0-4 (x v5, stale) and 4-8 (x v9).
    let (mut r_old, mut r_new) = (
        s.reserve(&k("x"), LEN as u64).unwrap(),
        s.reserve(&k("x"), LEN as u64).unwrap(),
    );
    s.evict_victims(&mut r_old);
    s.evict_victims(&mut r_new);
    let b_new = s.encode(&r_new, &k("x"), 9, &v(9));
    s.write(r_new, b_new, &k("x"), 9, LEN as u64).await.unwrap();
    let b_old = s.encode(&r_old, &k("x"), 5, &v(5));
    s.write(r_old, b_old, &k("x"), 5, LEN as u64).await.unwrap();
    assert_eq!(
        &s.read(&k("x"), 9, LEN as u64).await.unwrap()[..],
        &v(9)[..]
    );
    assert!(s.read(&k("x"), 5, LEN as u64).await.is_err());

    // y v1 at 8-12, y v2 at 0-4 (wrapped; x v5 there was garbage), then v2 deleted.
    assert!(put(&s, "y", 1, &v(1)).await.is_empty());
    assert!(put(&s, "y", 2, &v(2)).await.is_empty());
    assert_eq!(s.delete(&k("y"), 2, None).await.unwrap(), Dropped::Gone);
    // z goes to 4-8 where x v9 lives: evicted, then the reservation is given up.
    let mut r = s.reserve(&k("z"), LEN as u64).unwrap();
    assert_eq!(r.victims.len(), 1);
    assert_eq!(r.victims[0].key, k("x"));
    s.evict_victims(&mut r);
    s.abandon(r).await;
    // w goes to 8-12, after the abandoned region.
    assert!(put(&s, "w", 3, &v(3)).await.is_empty());
    s.sync().await.unwrap();
    drop(s);

    let (s, n) = open(&dir, cap, EngineKind::Uring).await;
    let keys: Vec<String> = s.records().iter().map(|r| r.key.to_string()).collect();
    assert_eq!(
        (n, keys),
        (1, vec!["w".to_string()]),
        "only w may come back"
    );
    assert_eq!(
        &s.read(&k("w"), 3, LEN as u64).await.unwrap()[..],
        &v(3)[..]
    );

    // p at 0-4, r at 4-8, then q at 8-12 over w, which is deleted meanwhile.
    put(&s, "p", 4, &v(4)).await;
    put(&s, "r", 5, &v(5)).await;
    let mut r = s.reserve(&k("q"), LEN as u64).unwrap();
    assert_eq!(r.victims.len(), 1);
    // Its header lies under q's write: not gone until that lands (the master keeps its
    // tombstone meanwhile).
    assert_eq!(
        s.delete(&k("w"), 3, None).await.unwrap(),
        Dropped::Overwriting
    );
    s.evict_victims(&mut r);
    let b = s.encode(&r, &k("q"), 6, &v(6));
    s.write(r, b, &k("q"), 6, LEN as u64).await.unwrap();
    s.sync().await.unwrap();
    drop(s);
    let (s, n) = open(&dir, cap, EngineKind::Uring).await;
    assert_eq!(n, 3);
    assert_eq!(
        &s.read(&k("q"), 6, LEN as u64).await.unwrap()[..],
        &v(6)[..]
    );
    assert!(s.read(&k("w"), 3, LEN as u64).await.is_err());

    // x over p, which is deleted meanwhile (its header lies in x's region, so the delete leaves
    // it), and then x is given up before its victims were evicted (telling the master failed):
    // p must not come back either.
    let r = s.reserve(&k("x"), LEN as u64).unwrap();
    let victims: Vec<_> = r.victims.iter().map(|v| v.key.clone()).collect();
    assert_eq!(victims, vec![k("p")]);
    assert_eq!(
        s.delete(&k("p"), 4, None).await.unwrap(),
        Dropped::Overwriting
    );
    s.abandon(r).await;
    s.sync().await.unwrap();
    drop(s);
    let (s, n) = open(&dir, cap, EngineKind::Uring).await;
    let keys: Vec<String> = s.records().iter().map(|r| r.key.to_string()).collect();
    assert_eq!(n, 2, "only r and q: {keys:?}");
    assert!(s.read(&k("p"), 4, LEN as u64).await.is_err());
}

/// The data file holds every tenant's offloaded keys and values: only the owner's user may
/// read it, and a file left readable by an older owner is narrowed on open.
#[tokio::test]
async fn the_data_file_and_a_new_directory_are_the_owners_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let tier = dir.path().join("tier");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let data = tier.join(DATA_FILE);
    {
        let _s = SsdStore::open(&tier, 128 << 10, EngineKind::Pread, 4, 1 << 20)
            .await
            .unwrap();
        assert_eq!(mode(&tier), 0o700);
        assert_eq!(mode(&data), 0o600);
    }
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _s = SsdStore::open(&tier, 128 << 10, EngineKind::Pread, 4, 1 << 20)
        .await
        .unwrap();
    assert_eq!(mode(&data), 0o600);
}

/// A read of the right version with a wrong length is refused without reporting the record lost
/// (the master would drop a good disk copy); a read of a version that is not there is reported.
#[tokio::test]
async fn a_read_of_the_wrong_length_does_not_report_the_record_lost() {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 4 << 20, EngineKind::Pread).await;
    put(&s, "a", 1, &value(1, 10_000)).await;
    assert!(matches!(
        s.read(&k("a"), 1, 9_999).await,
        Err(SsdError::NotFound { .. })
    ));
    assert!(s.take_lost().is_empty());
    assert!(s.read(&k("a"), 2, 10_000).await.is_err());
    let lost = s.take_lost();
    assert_eq!((lost.len(), lost[0].put_id), (1, 2));
    assert_eq!(
        &s.read(&k("a"), 1, 10_000).await.unwrap()[..],
        &value(1, 10_000)[..]
    );
}

/// A version found missing that is written before the loss is reported (offloaded again) is not
/// reported lost: the master, told of the new record meanwhile, would drop that good copy. A
/// corrupt record replaced meanwhile is not reported either.
#[tokio::test]
async fn a_record_written_after_a_missed_read_is_not_reported_lost() {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 4 << 20, EngineKind::Pread).await;
    assert!(s.read(&k("a"), 1, 10_000).await.is_err());
    put(&s, "a", 1, &value(1, 10_000)).await;
    assert!(s.take_lost().is_empty(), "a record of it is here now");
    assert!(s.read(&k("b"), 1, 10_000).await.is_err());
    let lost = s.take_lost();
    assert_eq!((lost.len(), lost[0].key.as_str()), (1, "b"));

    // A corrupt record (its file cut short under it), then written again whole.
    let path = dir.path().join(DATA_FILE);
    let whole = std::fs::read(&path).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    for _ in 0..3 {
        assert!(s.read(&k("a"), 1, 10_000).await.is_err());
    }
    std::fs::write(&path, &whole).unwrap();
    put(&s, "a", 1, &value(1, 10_000)).await;
    assert!(s.take_lost().is_empty(), "the corrupt record was replaced");
}

/// A value read from the SSD and queued as a reply holds read-budget permits until it is sent:
/// the replies are sent at once, so a disk read behind it in a pipelined batch never waits for
/// permits its own connection holds.
#[tokio::test]
async fn a_queued_disk_value_is_sent_without_waiting_for_the_batch() {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 4 << 20, EngineKind::Pread).await;
    put(&s, "a", 1, &value(1, 10_000)).await;
    let mut replies = crate::replies::Replies::default();
    replies.push_bytes(b"header");
    assert!(!replies.full());
    replies.push_disk(s.read(&k("a"), 1, 10_000).await.unwrap());
    assert!(replies.full());
    let mut sent = Vec::new();
    replies.flush(&mut sent).await.unwrap();
    assert_eq!(sent.len(), 6 + 10_000);
    assert!(!replies.full());
}

/// A record whose reads keep failing (here the file was cut short under it: every read ends
/// early) is reported lost after a few reads in a row, as a corrupt one, so the master stops
/// pointing at it; fewer are not, and a read that succeeds starts the count again.
async fn a_record_that_keeps_failing_to_read_is_reported_lost(kind: EngineKind) {
    let dir = TempDir::new();
    let (s, _) = open(&dir, 4 << 20, kind).await;
    put(&s, "a", 1, &value(1, 10_000)).await;
    let path = dir.path().join(DATA_FILE);
    let whole = std::fs::read(&path).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let cut = || file.set_len(4096).unwrap(); // the file's header block only
    cut();
    for _ in 0..2 {
        assert!(s.read(&k("a"), 1, 10_000).await.is_err());
    }
    assert!(s.take_lost().is_empty(), "two failures may be passing");
    std::fs::write(&path, &whole).unwrap();
    assert_eq!(
        &s.read(&k("a"), 1, 10_000).await.unwrap()[..],
        &value(1, 10_000)[..]
    );
    cut();
    for _ in 0..2 {
        assert!(s.read(&k("a"), 1, 10_000).await.is_err());
    }
    assert!(
        s.take_lost().is_empty(),
        "the good read started the count again"
    );
    assert!(s.read(&k("a"), 1, 10_000).await.is_err());
    let lost = s.take_lost();
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!((lost[0].key.as_str(), lost[0].put_id), ("a", 1));
    assert!(lost[0].corrupt_seq.is_some(), "dropped here too");
}

#[tokio::test]
async fn a_record_that_keeps_failing_to_read_is_reported_lost_pread() {
    a_record_that_keeps_failing_to_read_is_reported_lost(EngineKind::Pread).await;
}

#[tokio::test]
async fn a_record_that_keeps_failing_to_read_is_reported_lost_uring() {
    a_record_that_keeps_failing_to_read_is_reported_lost(EngineKind::Uring).await;
}

/// The pread engine over the tier's file, except that record writes (larger than one block)
/// fail while `fail` is set; header zeroing (one block) still works.
struct FailingRecordWrites {
    inner: std::sync::Arc<dyn super::DiskEngine>,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl super::DiskEngine for FailingRecordWrites {
    fn write_at(
        &self,
        buf: super::AlignedBuf,
        offset: u64,
    ) -> futures::future::BoxFuture<'static, (super::AlignedBuf, std::io::Result<()>)> {
        if buf.len() > super::ALIGN && self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            // A short write, then an error: the record's first block (its header) lands.
            let mut head = super::AlignedBuf::with_capacity(super::ALIGN);
            head.set_len(super::ALIGN);
            head.copy_from_slice(&buf[..super::ALIGN]);
            let inner = self.inner.clone();
            return Box::pin(async move {
                let (_, landed) = inner.write_at(head, offset).await;
                landed.expect("the first block lands");
                (buf, Err(std::io::Error::other("injected EIO")))
            });
        }
        self.inner.write_at(buf, offset)
    }
    fn read_at(
        &self,
        buf: super::AlignedBuf,
        offset: u64,
    ) -> futures::future::BoxFuture<'static, (super::AlignedBuf, std::io::Result<()>)> {
        self.inner.read_at(buf, offset)
    }
    fn sync(&self) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
        self.inner.sync()
    }
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
}

/// A record write that fails gives up the records in its way (the master was told they are
/// gone): their headers are zeroed, so a restart does not bring them back. Writes that keep
/// failing pause offloads before they give up more records.
/// A record write that fails after its header landed (a short write, then an error) zeroes
/// that header, also where no earlier record lay (free space): before, a restart registered the
/// failed record, whose reads then failed their checksum (and the master, counting the disk
/// copy, could have let the object's memory go).
#[tokio::test]
async fn a_failed_record_write_does_not_come_back_at_a_restart() {
    let dir = TempDir::new();
    let cap = (1 << 20) + 4096;
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let engine = move |file| {
        let inner = super::open_engine(EngineKind::Pread, file, 16)?;
        Ok(std::sync::Arc::new(FailingRecordWrites { inner, fail })
            as std::sync::Arc<dyn super::DiskEngine>)
    };
    let (s, _) = SsdStore::open_with(dir.path(), cap, engine, 64 << 20)
        .await
        .unwrap();
    let r = s.reserve(&k("new"), 65536).unwrap();
    assert!(r.victims.is_empty(), "free space");
    let buf = s.encode(&r, &k("new"), 999, &value(7, 65536));
    assert!(s.write(r, buf, &k("new"), 999, 65536).await.is_err());
    drop(s);
    let (_, n) = open(&dir, cap, EngineKind::Pread).await;
    assert_eq!(n, 0, "the failed record came back");
}

#[tokio::test]
async fn a_failed_record_write_does_not_bring_its_victims_back_at_a_restart() {
    let dir = TempDir::new();
    let cap = (1 << 20) + 4096;
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = fail.clone();
    let engine = move |file| {
        let inner = super::open_engine(EngineKind::Pread, file, 16)?;
        Ok(std::sync::Arc::new(FailingRecordWrites { inner, fail: f })
            as std::sync::Arc<dyn super::DiskEngine>)
    };
    let (s, _) = SsdStore::open_with(dir.path(), cap, engine, 64 << 20)
        .await
        .unwrap();
    for i in 0..15u8 {
        put(&s, &format!("k{i}"), 100 + i as u64, &value(i, 65536)).await;
    }
    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    for (i, victim) in ["k0", "k1", "k2"].into_iter().enumerate() {
        let mut r = s.reserve(&k("new"), 65536).unwrap();
        assert_eq!(r.victims[0].key, k(victim));
        s.evict_victims(&mut r);
        let buf = s.encode(&r, &k("new"), 999, &value(77, 65536));
        assert!(s.write(r, buf, &k("new"), 999, 65536).await.is_err(), "{i}");
    }
    // Three in a row: offloads pause, and k3 stays.
    assert!(matches!(
        s.reserve(&k("new"), 65536),
        Err(SsdError::Failing { failures: 3 })
    ));
    assert!(s.read(&k("k3"), 103, 65536).await.is_ok());
    drop(s);
    let (s, n) = open(&dir, cap, EngineKind::Pread).await;
    assert_eq!(n, 12, "the three given up stay gone");
    for i in 0..3u8 {
        assert!(s
            .read(&k(&format!("k{i}")), 100 + i as u64, 65536)
            .await
            .is_err());
    }
    let v = s.read(&k("k3"), 103, 65536).await.unwrap();
    assert_eq!(&v[..], &value(3, 65536)[..]);
}

/// A record is kept until a reservation under way evicts it (given up without evicting, the
/// reservation leaves it readable); a registration racing an offload checks `keeps` after each
/// chunk, and the offload tells the master again after it evicts.
#[tokio::test]
async fn a_record_is_kept_until_evicted() {
    let dir = TempDir::new();
    let cap = (4 << 16) + 4096;
    let (s, _) = open(&dir, cap, EngineKind::Pread).await;
    for i in 0..4u8 {
        put(&s, &format!("k{i}"), 100 + i as u64, &value(i, 60_000)).await;
    }
    assert!(s.keeps(&k("k0"), 100));
    assert!(!s.keeps(&k("k0"), 99), "another version");
    let r = s.reserve(&k("new"), 60_000).unwrap();
    assert_eq!(r.victims[0].key, k("k0"));
    assert!(s.keeps(&k("k0"), 100), "not taken yet");
    s.abandon(r).await;
    assert!(
        s.keeps(&k("k0"), 100),
        "given up without evicting: still readable"
    );
    // The next reservation starts after the one given up: it takes k1.
    let mut r = s.reserve(&k("new"), 60_000).unwrap();
    assert_eq!(r.victims[0].key, k("k1"));
    s.evict_victims(&mut r);
    assert!(!s.keeps(&k("k1"), 101));
    s.abandon(r).await;
    assert!(!s.keeps(&k("k1"), 101), "evicted");
    assert!(s.keeps(&k("k0"), 100) && s.keeps(&k("k2"), 102));
}

/// A reservation that starts inside a live record (an earlier one there was given up without
/// evicting it: telling the master failed) takes that record as a victim whose header lies
/// before the region. Evicted, then given up, that header is zeroed too: before, the record the
/// master was told is gone came back at a restart.
#[tokio::test]
async fn a_victim_whose_header_lies_before_the_region_does_not_come_back() {
    let dir = TempDir::new();
    let cap = (4 << 16) + 4096;
    let (s, _) = open(&dir, cap, EngineKind::Pread).await;
    for i in 0..4u8 {
        put(&s, &format!("k{i}"), 100 + i as u64, &value(i, 60_000)).await;
    }
    // Given up without evicting k0 (it stays live), leaving the head inside k0.
    let r0 = s.reserve(&k("x"), 20_000).unwrap();
    assert_eq!(r0.victims[0].key, k("k0"));
    s.abandon(r0).await;
    let mut r1 = s.reserve(&k("y"), 20_000).unwrap();
    assert_eq!(r1.victims[0].key, k("k0"));
    // The region starts inside k0 (its header lies before it).
    s.evict_victims(&mut r1);
    s.abandon(r1).await;
    drop(s);
    let (s, n) = open(&dir, cap, EngineKind::Pread).await;
    assert_eq!(n, 3, "the evicted k0 came back");
    assert!(s.read(&k("k0"), 100, 60_000).await.is_err());
    assert!(s.read(&k("k1"), 101, 60_000).await.is_ok());
}
