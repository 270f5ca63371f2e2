//! Where objects live on the SSD: one preallocated file used as a ring log. Records are appended
//! at the head; when the head comes round again, the records in its way are the oldest and are
//! evicted (the caller tells the master before they are overwritten). An index maps each key to
//! its newest record; reads verify the record's key, version, length and checksums before a byte
//! is handed out. A record that stops counting (deleted, superseded, evicted by a reservation
//! that was then given up) has its header zeroed unless newer data is already over it, so a
//! restart never brings it back. On open, `recover` finds every valid newest record again.
//! I/O goes through a `DiskEngine`; this module decides offsets and formats, never sockets.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    ops::Range,
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU32, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use mooncake_common::{Code, DiskStats, ObjectKey};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{
    bufpool::BufPool,
    record::{self, align_up, Superblock, HEADER_LEN},
    recover, AlignedBuf, DiskEngine, EngineKind, ALIGN,
};

/// The data file inside the SSD directory.
pub const DATA_FILE: &str = "mooncake-ssd.data";

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("ssd tier i/o failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("ssd tier at {path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{key} is not on the ssd tier (evicted from it, or another version)")]
    NotFound { key: ObjectKey },
    #[error("record of {key} on the ssd tier is corrupt: {why}")]
    Corrupt { key: ObjectKey, why: String },
    #[error("a record of {len} bytes does not fit an ssd tier of {capacity} bytes")]
    TooLarge { len: u64, capacity: u64 },
    #[error("the ssd tier's ring is busy with writes where the next record would go; retry")]
    Busy,
    #[error("the ssd tier's last {failures} writes failed: offloads pause (the records on it stay readable); check the disk and the owner's log")]
    Failing { failures: u32 },
}

impl SsdError {
    pub fn code(&self) -> Code {
        match self {
            SsdError::Io(_) | SsdError::Busy | SsdError::Failing { .. } => Code::TransferFail,
            SsdError::Format { .. } => Code::InternalError,
            SsdError::NotFound { .. } => Code::ObjectNotFound,
            SsdError::Corrupt { .. } => Code::ChecksumMismatch,
            SsdError::TooLarge { .. } => Code::InvalidParams,
        }
    }
}

/// Where a key's newest record is.
#[derive(Debug, Clone)]
struct Loc {
    offset: u64,
    len: u64,
    value_len: u64,
    put_id: u64,
    seq: u64,
    /// Reads of it that failed in a row (I/O errors).
    failed_reads: u32,
}

/// Reads of a record that fail in a row before it is taken as lost: a disk that keeps failing
/// one record would otherwise fail every read of it while the master points there.
const FAILED_READS_LOST: u32 = 3;

struct Ring {
    head: u64,
    next_seq: u64,
    /// Live records by offset: key, length and sequence number.
    by_offset: BTreeMap<u64, (ObjectKey, u64, u64)>,
    by_key: HashMap<ObjectKey, Loc>,
    used: u64,
    /// Regions being written (a reservation) or zeroed: nothing else is written there meanwhile.
    inflight: BTreeMap<u64, u64>,
}

fn overlaps<V>(m: &BTreeMap<u64, V>, start: u64, len: u64, len_of: impl Fn(&V) -> u64) -> bool {
    m.range(..start + len)
        .next_back()
        .is_some_and(|(s, v)| s + len_of(v) > start)
}

impl Ring {
    /// Whether `[start, start + len)` is being written or holds (part of) a live record.
    fn busy(&self, start: u64, len: u64) -> bool {
        overlaps(&self.inflight, start, len, |l| *l)
            || overlaps(&self.by_offset, start, len, |v| v.1)
    }

    fn unindex(&mut self, key: &ObjectKey) -> Option<Loc> {
        let loc = self.by_key.remove(key)?;
        self.by_offset.remove(&loc.offset);
        self.used -= loc.len;
        Some(loc)
    }

    fn index(&mut self, key: ObjectKey, loc: Loc) {
        self.by_offset
            .insert(loc.offset, (key.clone(), loc.len, loc.seq));
        self.used += loc.len;
        self.by_key.insert(key, loc);
    }
}

/// What `SsdStore::delete` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// No such record.
    NotFound,
    /// Its header is gone from disk.
    Gone,
    /// Its header lies under a write in flight, which overwrites it (or zeroes it, if given
    /// up); until then a crash could bring the record back.
    Overwriting,
}

/// A live record in the way of a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    pub key: ObjectKey,
    pub put_id: u64,
    offset: u64,
    seq: u64,
}

/// Space for one record, taken at the head. The records listed in `victims` are in its way:
/// tell the master they go, then `evict_victims`, then write (or `abandon`).
pub struct Reservation {
    offset: u64,
    len: u64,
    seq: u64,
    pub victims: Vec<Victim>,
    evicted: bool,
}

/// A record found on disk when the tier was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub key: ObjectKey,
    pub value_len: u64,
    pub put_id: u64,
}

/// A value read back and verified; holds its share of the read budget (and its buffer, which
/// goes back to the pool) until dropped.
pub struct DiskValue {
    buf: Option<AlignedBuf>,
    range: Range<usize>,
    bufs: Arc<BufPool>,
    _permit: OwnedSemaphorePermit,
}

impl std::ops::Deref for DiskValue {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf.as_ref().expect("held until drop")[self.range.clone()]
    }
}

impl Drop for DiskValue {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.bufs.give(b);
        }
    }
}

/// Records the master should stop pointing at: reads found them missing (the master's disk
/// replica is a ghost) or corrupt (`seq` set: also drop the record here).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lost {
    pub key: ObjectKey,
    pub put_id: u64,
    pub corrupt_seq: Option<u64>,
}

pub struct SsdStore {
    engine: Arc<dyn DiskEngine>,
    path: PathBuf,
    file_id: u64,
    /// Size of the file; records live in `[ALIGN, end)`.
    end: u64,
    ring: Mutex<Ring>,
    read_budget: Arc<Semaphore>,
    read_budget_bytes: u64,
    bufs: Arc<BufPool>,
    lost: Mutex<Vec<Lost>>,
    written: AtomicU64,
    read: AtomicU64,
    corrupt: AtomicU64,
    evicted: AtomicU64,
    failing: Failing,
}

/// Record writes that failed in a row. Past a few, reservations are refused for a while: each
/// one gives up the records in its way (the master is told they are gone) before its write
/// fails too, so a dead disk or a stopped engine would otherwise empty the tier's index one
/// offload at a time while the records stay on disk. One reservation goes ahead per pause, to
/// find out whether writes work again.
#[derive(Default)]
struct Failing {
    in_a_row: AtomicU32,
    /// When the pause after the last failure ends.
    until: Mutex<Option<Instant>>,
}

/// Failed writes in a row after which offloads pause.
const FAILURES_TO_PAUSE: u32 = 3;
/// How long they pause.
const FAILURE_PAUSE: Duration = Duration::from_secs(10);

impl Failing {
    fn failed(&self) {
        let n = self.in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= FAILURES_TO_PAUSE {
            *self.until.lock() = Some(Instant::now() + FAILURE_PAUSE);
            tracing::warn!(failures = n, pause = ?FAILURE_PAUSE, "ssd tier writes keep failing: offloads pause");
        }
    }

    fn succeeded(&self) {
        if self.in_a_row.swap(0, Ordering::Relaxed) > 0 {
            *self.until.lock() = None;
        }
    }

    /// The failures in a row, while reservations are refused.
    fn refusing(&self) -> Option<u32> {
        let n = self.in_a_row.load(Ordering::Relaxed);
        if n < FAILURES_TO_PAUSE {
            return None;
        }
        let mut until = self.until.lock();
        match *until {
            Some(t) if Instant::now() < t => Some(n),
            // The pause is over: this one goes ahead, the next wait for its outcome.
            _ => {
                *until = Some(Instant::now() + FAILURE_PAUSE);
                None
            }
        }
    }
}

impl SsdStore {
    /// Opens (or creates) the tier in `dir` with `capacity` bytes, scans what is there and
    /// indexes every valid newest record. Reads in flight hold at most `read_budget` bytes.
    pub async fn open(
        dir: &Path,
        capacity: u64,
        kind: EngineKind,
        queue_depth: u32,
        read_budget: u64,
    ) -> Result<(Arc<SsdStore>, Vec<Recovered>), SsdError> {
        let engine = |file| super::open_engine(kind, file, queue_depth);
        Self::open_with(dir, capacity, engine, read_budget).await
    }

    /// `open`, with the engine `engine` makes over the tier's file.
    pub(super) async fn open_with(
        dir: &Path,
        capacity: u64,
        engine: impl FnOnce(std::fs::File) -> io::Result<Arc<dyn DiskEngine>>,
        read_budget: u64,
    ) -> Result<(Arc<SsdStore>, Vec<Recovered>), SsdError> {
        let end = capacity / ALIGN as u64 * ALIGN as u64;
        if end < 2 * ALIGN as u64 {
            return Err(SsdError::TooLarge {
                len: 2 * ALIGN as u64,
                capacity,
            });
        }
        // Holds every tenant's offloaded keys and values: the owner's user only (a directory
        // that exists already is the operator's to set).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let path = dir.join(DATA_FILE);
        let format = |message: String| SsdError::Format {
            path: path.clone(),
            message,
        };
        let existing = std::fs::metadata(&path).map(|m| m.len()).ok();
        if let Some(len) = existing.filter(|l| *l != 0 && *l != end) {
            return Err(format(format!(
                "the file holds a tier of {len} bytes, not {end}: start with that size, or \
                 remove the file to start empty"
            )));
        }
        let file = super::open_direct(&path, end)?;
        let engine = engine(file)?;
        let (buf, res) = engine.read_at(zeroed(ALIGN), 0).await;
        res?;
        let (file_id, found) = match Superblock::decode(&buf).map_err(format)? {
            Some(sb) if sb.capacity == end => (sb.file_id, true),
            Some(sb) => {
                return Err(format(format!(
                    "superblock says {} bytes, the file has {end}",
                    sb.capacity
                )))
            }
            None => (rand::random::<u64>() | 1, false),
        };
        if !found {
            let mut sb = zeroed(ALIGN);
            Superblock {
                file_id,
                capacity: end,
            }
            .encode(&mut sb);
            let (_, res) = engine.write_at(sb, 0).await;
            res?;
            engine.sync().await?;
        }
        let budget = read_budget.clamp(1 << 20, u32::MAX as u64 >> 1);
        let store = SsdStore {
            engine,
            path,
            file_id,
            end,
            ring: Mutex::new(Ring {
                head: ALIGN as u64,
                next_seq: 1,
                by_offset: BTreeMap::new(),
                by_key: HashMap::new(),
                used: 0,
                inflight: BTreeMap::new(),
            }),
            read_budget: Arc::new(Semaphore::new(budget as usize)),
            read_budget_bytes: budget,
            bufs: Arc::new(BufPool::new(64 << 20)),
            lost: Mutex::new(Vec::new()),
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            failing: Failing::default(),
        };
        let recovered = if found {
            store.recover().await?
        } else {
            Vec::new()
        };
        tracing::info!(path = %store.path.display(), capacity = end, engine = %store.engine.kind(),
            records = recovered.len(), "ssd tier open");
        Ok((Arc::new(store), recovered))
    }

    /// Indexes what the scan found, zeroes the headers that must not come back, and puts the
    /// head after the newest record.
    async fn recover(&self) -> Result<Vec<Recovered>, SsdError> {
        let scanned = recover::scan(&*self.engine, self.file_id, ALIGN as u64, self.end).await?;
        for at in &scanned.garbage {
            let (_, res) = self.engine.write_at(zeroed(ALIGN), *at).await;
            res?;
        }
        let mut ring = self.ring.lock();
        let mut out = Vec::with_capacity(scanned.live.len());
        let mut newest: Option<(u64, u64)> = None; // (seq, end of its record)
        for (offset, h) in scanned.live {
            let len = h.record_len();
            if newest.is_none_or(|(seq, _)| seq < h.seq) {
                newest = Some((h.seq, offset + len));
            }
            ring.next_seq = ring.next_seq.max(h.seq + 1);
            out.push(Recovered {
                key: h.key.clone(),
                value_len: h.value_len,
                put_id: h.put_id,
            });
            ring.index(
                h.key,
                Loc {
                    offset,
                    len,
                    value_len: h.value_len,
                    put_id: h.put_id,
                    seq: h.seq,
                    failed_reads: 0,
                },
            );
        }
        if let Some((_, end)) = newest {
            ring.head = if end >= self.end { ALIGN as u64 } else { end };
        }
        Ok(out)
    }

    /// Takes space for a record at the head, wrapping at the end of the file. The live records
    /// in the way become `victims`; a region still being written is never taken (`Busy`).
    pub fn reserve(&self, key: &ObjectKey, value_len: u64) -> Result<Reservation, SsdError> {
        let len = record::record_len(key.as_str().len(), value_len);
        if let Some(failures) = self.failing.refusing() {
            return Err(SsdError::Failing { failures });
        }
        let room = self.end - ALIGN as u64;
        if len > room {
            return Err(SsdError::TooLarge {
                len,
                capacity: room,
            });
        }
        let mut ring = self.ring.lock();
        let mut offset = ring.head;
        if offset + len > self.end {
            offset = ALIGN as u64;
        }
        let stop = offset + len;
        if overlaps(&ring.inflight, offset, len, |l| *l) {
            return Err(SsdError::Busy);
        }
        let victims: Vec<Victim> = ring
            .by_offset
            .range(..stop)
            .rev()
            .take_while(|(s, v)| *s + v.1 > offset)
            .filter_map(|(s, (k, _, seq))| {
                ring.by_key.get(k).map(|loc| Victim {
                    key: k.clone(),
                    put_id: loc.put_id,
                    offset: *s,
                    seq: *seq,
                })
            })
            .collect();
        ring.inflight.insert(offset, len);
        ring.head = if stop >= self.end { ALIGN as u64 } else { stop };
        let seq = ring.next_seq;
        ring.next_seq += 1;
        Ok(Reservation {
            offset,
            len,
            seq,
            victims,
            evicted: false,
        })
    }

    /// Forgets the records a reservation overwrites (after the master was told). A victim
    /// already gone (deleted, or replaced by a newer version) is left alone.
    pub fn evict_victims(&self, r: &mut Reservation) {
        let mut ring = self.ring.lock();
        for v in &r.victims {
            let same = ring.by_key.get(&v.key).is_some_and(|l| l.seq == v.seq);
            if same {
                ring.unindex(&v.key);
                self.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        r.evicted = true;
    }

    /// Gives a reservation up without writing. Victims not yet evicted stay readable. Victims
    /// that no longer count get their headers zeroed, so they cannot come back at a restart:
    /// all of them once evicted (the master was told they are gone; also one whose header lies
    /// before the region, see `zero_headers_before`), and any deleted meanwhile (a delete
    /// leaves a header inside a reservation under way).
    pub async fn abandon(&self, r: Reservation) {
        let inside: Vec<u64> = {
            let ring = self.ring.lock();
            r.victims
                .iter()
                .filter(|v| v.offset >= r.offset)
                .filter(|v| {
                    let indexed = ring
                        .by_key
                        .get(&v.key)
                        .is_some_and(|l| l.offset == v.offset && l.seq == v.seq);
                    r.evicted || !indexed
                })
                .map(|v| v.offset)
                .collect()
        };
        for at in inside {
            let (_, res) = self.engine.write_at(zeroed(ALIGN), at).await;
            if let Err(e) = res {
                tracing::warn!(error = %e, offset = at, "cannot zero a dropped record's header");
            }
        }
        self.ring.lock().inflight.remove(&r.offset);
        self.zero_headers_before(&r).await;
    }

    /// Zeroes the headers of `r`'s evicted victims that lie before its region: the region
    /// starts inside such a record (an earlier reservation there was given up without evicting
    /// it), which must not come back at a restart, written over or not. Outside the region, so
    /// only where nothing newer is being written or lives (see `zero_header`).
    async fn zero_headers_before(&self, r: &Reservation) {
        if !r.evicted {
            return;
        }
        for v in r.victims.iter().filter(|v| v.offset < r.offset) {
            let _ = self.zero_header(v.offset).await;
        }
    }

    /// The record for `value` in a buffer ready to write (every byte set, padding zeroed).
    pub fn encode(
        &self,
        r: &Reservation,
        key: &ObjectKey,
        put_id: u64,
        value: &[u8],
    ) -> AlignedBuf {
        // A reused buffer holds old bytes: every byte of the record is written below.
        let mut buf = self.bufs.take(r.len as usize);
        record::encode_header(&mut buf, self.file_id, r.seq, put_id, key, value);
        let at = HEADER_LEN + key.as_str().len();
        buf[at..at + value.len()].copy_from_slice(value);
        buf[at + value.len()..].fill(0);
        buf
    }

    /// Writes an encoded record into its reservation and indexes it; only then is it readable.
    /// A record of an older version than the one indexed (a late, stale offload) is not indexed
    /// and its header is zeroed; a record it replaces has its header zeroed.
    pub async fn write(
        &self,
        r: Reservation,
        buf: AlignedBuf,
        key: &ObjectKey,
        put_id: u64,
        value_len: u64,
    ) -> Result<(), SsdError> {
        let (buf, res) = self.engine.write_at(buf, r.offset).await;
        self.bufs.give(buf);
        if let Err(e) = res {
            self.failing.failed();
            // Part of the record may have landed, its header first: a restart must not find it
            // (its reservation is still in flight, so nobody else writes there meanwhile).
            let (_, zeroed) = self.engine.write_at(zeroed(ALIGN), r.offset).await;
            if let Err(z) = zeroed {
                tracing::warn!(error = %z, offset = r.offset, "cannot zero a failed record's header");
            }
            // The victims were given up (the master was told they are gone): their headers
            // must not bring them back at a restart.
            self.abandon(r).await;
            return Err(e.into());
        }
        self.failing.succeeded();
        let zero = {
            let mut ring = self.ring.lock();
            ring.inflight.remove(&r.offset);
            self.written.fetch_add(r.len, Ordering::Relaxed);
            match ring.by_key.get(key) {
                Some(old) if old.put_id > put_id => Some(r.offset),
                _ => {
                    let old = ring.unindex(key);
                    ring.index(
                        key.clone(),
                        Loc {
                            offset: r.offset,
                            len: r.len,
                            value_len,
                            put_id,
                            seq: r.seq,
                            failed_reads: 0,
                        },
                    );
                    old.map(|l| l.offset)
                }
            }
        };
        if let Some(at) = zero {
            // The older record's header left behind is logged; recovery takes the newer one.
            let _ = self.zero_header(at).await;
        }
        // Recovery would take such a victim for garbage (this newer record overlaps it), but
        // not once this record is dropped in turn.
        self.zero_headers_before(&r).await;
        Ok(())
    }

    /// Zeroes the header block at `at` of a record that no longer counts, unless newer data is
    /// being written or lives there (then its header is gone, or going: `Dropped::Overwriting`).
    /// An error means the header may still be on disk: a restart could bring the record back.
    async fn zero_header(&self, at: u64) -> io::Result<Dropped> {
        {
            let mut ring = self.ring.lock();
            if overlaps(&ring.inflight, at, ALIGN as u64, |l| *l) {
                return Ok(Dropped::Overwriting);
            }
            if ring.busy(at, ALIGN as u64) {
                return Ok(Dropped::Gone);
            }
            ring.inflight.insert(at, ALIGN as u64);
        }
        let (_, res) = self.engine.write_at(zeroed(ALIGN), at).await;
        self.ring.lock().inflight.remove(&at);
        if let Err(e) = &res {
            tracing::warn!(error = %e, offset = at, "cannot zero a dropped record's header");
        }
        res.map(|_| Dropped::Gone)
    }

    /// Reads and verifies version `put_id` of `key`, of `value_len` bytes. A record that is
    /// missing or fails its checks is remembered for `take_lost`.
    pub async fn read(
        &self,
        key: &ObjectKey,
        put_id: u64,
        value_len: u64,
    ) -> Result<DiskValue, SsdError> {
        let loc = match self.ring.lock().by_key.get(key) {
            Some(l) if l.put_id == put_id && l.value_len == value_len => l.clone(),
            // That version is here, of another length: the request is wrong, not the record
            // (which must not be reported lost).
            Some(l) if l.put_id == put_id => return Err(SsdError::NotFound { key: key.clone() }),
            _ => {
                self.lost.lock().push(Lost {
                    key: key.clone(),
                    put_id,
                    corrupt_seq: None,
                });
                return Err(SsdError::NotFound { key: key.clone() });
            }
        };
        let permits = loc.len.min(self.read_budget_bytes) as u32;
        let permit = self
            .read_budget
            .clone()
            .acquire_many_owned(permits)
            .await
            .expect("semaphore never closed");
        let (buf, res) = self
            .engine
            .read_at(self.bufs.take(loc.len as usize), loc.offset)
            .await;
        if let Err(e) = res {
            self.bufs.give(buf);
            self.read_failed(key, &loc, &e);
            return Err(e.into());
        }
        if loc.failed_reads > 0 {
            if let Some(l) = self.ring.lock().by_key.get_mut(key) {
                l.failed_reads = 0;
            }
        }
        let buf = Pooled {
            buf: Some(buf),
            pool: &self.bufs,
        };
        let check = || -> Result<Range<usize>, &'static str> {
            let h = record::decode_header(&buf, self.file_id).ok_or("bad header")?;
            if h.key != *key || h.seq != loc.seq || h.value_len != value_len {
                return Err("header names another record");
            }
            let range = h.value_offset()..h.value_offset() + value_len as usize;
            if crc32c::crc32c(&buf[range.clone()]) != h.value_crc {
                return Err("value checksum mismatch");
            }
            Ok(range)
        };
        match check() {
            Ok(range) => {
                self.read.fetch_add(loc.len, Ordering::Relaxed);
                Ok(DiskValue {
                    buf: Some(buf.into_inner()),
                    range,
                    bufs: self.bufs.clone(),
                    _permit: permit,
                })
            }
            Err(why) => {
                // Overwritten or deleted while it was read: it is gone, not corrupt.
                let still = self
                    .ring
                    .lock()
                    .by_key
                    .get(key)
                    .is_some_and(|l| l.seq == loc.seq);
                if !still {
                    return Err(SsdError::NotFound { key: key.clone() });
                }
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%key, offset = loc.offset, why, "corrupt record on the ssd tier");
                self.lost.lock().push(Lost {
                    key: key.clone(),
                    put_id,
                    corrupt_seq: Some(loc.seq),
                });
                Err(SsdError::Corrupt {
                    key: key.clone(),
                    why: why.to_string(),
                })
            }
        }
    }

    /// A read of the record at `loc` failed with `e`: after `FAILED_READS_LOST` in a row it is
    /// reported lost, as a corrupt one (the master stops pointing at it, and it is dropped here).
    fn read_failed(&self, key: &ObjectKey, loc: &Loc, e: &io::Error) {
        let failed = {
            let mut ring = self.ring.lock();
            match ring.by_key.get_mut(key) {
                Some(l) if l.seq == loc.seq => {
                    l.failed_reads += 1;
                    l.failed_reads
                }
                // Overwritten or deleted meanwhile: nothing to report.
                _ => return,
            }
        };
        if failed < FAILED_READS_LOST {
            tracing::warn!(%key, offset = loc.offset, error = %e, failed, "cannot read a record on the ssd tier");
            return;
        }
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%key, offset = loc.offset, error = %e, failed, "a record on the ssd tier keeps failing to read; reporting it lost");
        self.lost.lock().push(Lost {
            key: key.clone(),
            put_id: loc.put_id,
            corrupt_seq: Some(loc.seq),
        });
    }

    /// Drops version `put_id` of `key` (only the record with sequence number `seq`, if given)
    /// and zeroes its header on disk, so a restart does not bring it back. An error when its
    /// header could not be zeroed: the record is dropped here all the same, but a restart could
    /// bring it back.
    pub async fn delete(
        &self,
        key: &ObjectKey,
        put_id: u64,
        seq: Option<u64>,
    ) -> io::Result<Dropped> {
        let at = {
            let mut ring = self.ring.lock();
            match ring.by_key.get(key) {
                Some(l) if l.put_id == put_id && seq.is_none_or(|s| s == l.seq) => {
                    ring.unindex(key).expect("checked above").offset
                }
                _ => return Ok(Dropped::NotFound),
            }
        };
        self.zero_header(at).await
    }

    /// Records reads found missing or corrupt since the last call (each once), and still so: a
    /// version found missing that has a record by now (offloaded again since), or a corrupt
    /// record no longer indexed (replaced, or already reported gone), is not lost. The master
    /// would otherwise drop the good copy it was told of meanwhile.
    pub fn take_lost(&self) -> Vec<Lost> {
        let mut lost = std::mem::take(&mut *self.lost.lock());
        lost.sort();
        lost.dedup();
        let ring = self.ring.lock();
        lost.retain(|l| {
            let now = ring.by_key.get(&l.key);
            match l.corrupt_seq {
                None => now.is_none_or(|loc| loc.put_id != l.put_id),
                Some(seq) => now.is_some_and(|loc| loc.seq == seq),
            }
        });
        lost
    }

    /// Whether version `put_id` of `key` has a record here (one a reservation under way is
    /// about to take still counts: the reservation may be given up without taking it).
    pub fn keeps(&self, key: &ObjectKey, put_id: u64) -> bool {
        self.ring
            .lock()
            .by_key
            .get(key)
            .is_some_and(|l| l.put_id == put_id)
    }

    /// Every indexed record (for registering them at the master).
    pub fn records(&self) -> Vec<Recovered> {
        self.ring
            .lock()
            .by_key
            .iter()
            .map(|(k, l)| Recovered {
                key: k.clone(),
                value_len: l.value_len,
                put_id: l.put_id,
            })
            .collect()
    }

    pub async fn sync(&self) -> Result<(), SsdError> {
        Ok(self.engine.sync().await?)
    }

    pub fn stats(&self) -> DiskStats {
        let ring = self.ring.lock();
        DiskStats {
            capacity: self.end - ALIGN as u64,
            used: ring.used,
            records: ring.by_key.len() as u64,
            written_bytes: self.written.load(Ordering::Relaxed),
            read_bytes: self.read.load(Ordering::Relaxed),
            corrupt_reads: self.corrupt.load(Ordering::Relaxed),
            evicted_records: self.evicted.load(Ordering::Relaxed),
        }
    }

    /// Where the record of `key` sits in the file, for fault-injection tests.
    pub fn record_offset(&self, key: &ObjectKey) -> Option<u64> {
        self.ring.lock().by_key.get(key).map(|l| l.offset)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Transfer buffers allocated so far (the rest were reused).
    pub fn buffers_allocated(&self) -> u64 {
        self.bufs.allocated.load(Ordering::Relaxed)
    }
}

/// A buffer that goes back to the pool unless taken out with `into_inner`.
struct Pooled<'a> {
    buf: Option<AlignedBuf>,
    pool: &'a BufPool,
}

impl Pooled<'_> {
    fn into_inner(mut self) -> AlignedBuf {
        self.buf.take().expect("taken once")
    }
}

impl std::ops::Deref for Pooled<'_> {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("taken once")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}

/// A zero-filled buffer of `len` bytes (rounded up to the alignment).
fn zeroed(len: usize) -> AlignedBuf {
    let len = align_up(len as u64) as usize;
    let mut b = AlignedBuf::with_capacity(len);
    b.set_len(len);
    b
}
