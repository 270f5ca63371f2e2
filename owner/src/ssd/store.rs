//! Where objects live on the SSD: one preallocated file used as a ring log. Records are appended
//! at the head; when the head comes round again, the records in its way are the oldest and are
//! evicted (the caller tells the master before they are overwritten). An index maps each key to
//! its newest record; reads verify the record's key, version, length and checksums before a byte
//! is handed out. On open, the file is scanned and every valid newest record is indexed again.
//! I/O goes through a `DiskEngine`; this module decides offsets and formats, never sockets.

use std::{
    collections::{BTreeMap, HashMap},
    ops::Range,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use mooncake_common::{Code, ObjectKey};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{
    bufpool::BufPool,
    record::{self, align_up, RecordHeader, Superblock, HEADER_LEN},
    AlignedBuf, DiskEngine, EngineKind, ALIGN,
};

/// The data file inside the SSD directory.
pub const DATA_FILE: &str = "mooncake-ssd.data";
/// Bytes read at a time while scanning the file on open.
const SCAN_CHUNK: usize = 4 << 20;

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
}

impl SsdError {
    pub fn code(&self) -> Code {
        match self {
            SsdError::Io(_) | SsdError::Busy => Code::TransferFail,
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
}

struct Ring {
    head: u64,
    next_seq: u64,
    /// Live records by offset: the key each one belongs to and its length.
    by_offset: BTreeMap<u64, (ObjectKey, u64)>,
    by_key: HashMap<ObjectKey, Loc>,
    used: u64,
    /// Regions being written (or zeroed): never handed out again until the write ends.
    inflight: BTreeMap<u64, u64>,
}

/// Space for one record, taken at the head. The records listed in `victims` are in its way:
/// tell the master they go, then `evict_victims`, then write.
pub struct Reservation {
    offset: u64,
    len: u64,
    seq: u64,
    pub victims: Vec<(ObjectKey, u64)>,
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SsdStats {
    pub capacity: u64,
    pub used: u64,
    pub records: u64,
    pub written_bytes: u64,
    pub read_bytes: u64,
    pub corrupt_reads: u64,
    pub evicted_records: u64,
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
    /// Records a read found corrupt, for the worker to drop (and tell the master about).
    found_corrupt: Mutex<Vec<(ObjectKey, u64)>>,
    written: AtomicU64,
    read: AtomicU64,
    corrupt: AtomicU64,
    evicted: AtomicU64,
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
        let end = capacity / ALIGN as u64 * ALIGN as u64;
        if end < 2 * ALIGN as u64 {
            return Err(SsdError::TooLarge {
                len: 2 * ALIGN as u64,
                capacity,
            });
        }
        std::fs::create_dir_all(dir)?;
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
        let engine = super::open_engine(kind, file, queue_depth)?;
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
            found_corrupt: Mutex::new(Vec::new()),
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        };
        let recovered = if found {
            store.scan().await?
        } else {
            Vec::new()
        };
        tracing::info!(path = %store.path.display(), capacity = end, engine = %store.engine.kind(),
            records = recovered.len(), "ssd tier open");
        Ok((Arc::new(store), recovered))
    }

    pub fn engine_kind(&self) -> EngineKind {
        self.engine.kind()
    }

    /// Reads the whole file's headers (skipping values) and rebuilds the index from the newest
    /// record of each key; the head goes after the newest record of all.
    async fn scan(&self) -> Result<Vec<Recovered>, SsdError> {
        let mut newest: HashMap<ObjectKey, (u64, RecordHeader)> = HashMap::new();
        let mut pos = ALIGN as u64;
        let mut buf = zeroed(SCAN_CHUNK);
        while pos < self.end {
            let n = (SCAN_CHUNK as u64).min(self.end - pos) as usize;
            buf.set_len(n);
            let (b, res) = self.engine.read_at(buf, pos).await;
            buf = b;
            res?;
            let mut i = 0usize;
            while i < n {
                let block = &buf[i..n];
                match record::key_len_of(block) {
                    Some(kl) if HEADER_LEN + kl > block.len() => break, // read it whole next
                    Some(_) => {
                        if let Some(h) = record::decode_header(block, self.file_id) {
                            let at = pos + i as u64;
                            let len = h.record_len();
                            if at + len <= self.end {
                                let newer = newest.get(&h.key).is_none_or(|(_, o)| o.seq < h.seq);
                                if newer {
                                    newest.insert(h.key.clone(), (at, h));
                                }
                                i += len as usize;
                                continue;
                            }
                        }
                    }
                    None => {}
                }
                i += ALIGN;
            }
            pos += i as u64;
        }
        let mut ring = self.ring.lock();
        let mut out = Vec::with_capacity(newest.len());
        let mut last: Option<(u64, u64)> = None; // (seq, end of record)
        for (key, (offset, h)) in newest {
            let len = h.record_len();
            if last.is_none_or(|(seq, _)| seq < h.seq) {
                last = Some((h.seq, offset + len));
            }
            ring.next_seq = ring.next_seq.max(h.seq + 1);
            ring.by_offset.insert(offset, (key.clone(), len));
            ring.used += len;
            ring.by_key.insert(
                key.clone(),
                Loc {
                    offset,
                    len,
                    value_len: h.value_len,
                    put_id: h.put_id,
                    seq: h.seq,
                },
            );
            out.push(Recovered {
                key,
                value_len: h.value_len,
                put_id: h.put_id,
            });
        }
        if let Some((_, end)) = last {
            ring.head = if end >= self.end { ALIGN as u64 } else { end };
        }
        Ok(out)
    }

    /// Takes space for a record at the head, wrapping at the end of the file. The live records
    /// in the way become `victims`; a region still being written is never taken (`Busy`).
    pub fn reserve(&self, key: &ObjectKey, value_len: u64) -> Result<Reservation, SsdError> {
        let len = record::record_len(key.as_str().len(), value_len);
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
        let overlaps = |m: &BTreeMap<u64, u64>| {
            m.range(..stop)
                .next_back()
                .is_some_and(|(s, l)| s + l > offset)
        };
        if overlaps(&ring.inflight) {
            return Err(SsdError::Busy);
        }
        let victims: Vec<(ObjectKey, u64)> = ring
            .by_offset
            .range(..stop)
            .rev()
            .take_while(|(s, (_, l))| *s + *l > offset)
            .filter_map(|(_, (k, _))| ring.by_key.get(k).map(|loc| (k.clone(), loc.put_id)))
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
        })
    }

    /// Forgets the records a reservation overwrites (after the master was told).
    pub fn evict_victims(&self, r: &Reservation) {
        let mut ring = self.ring.lock();
        let stop = r.offset + r.len;
        let gone: Vec<u64> = ring
            .by_offset
            .range(..stop)
            .rev()
            .take_while(|(s, (_, l))| *s + *l > r.offset)
            .map(|(s, _)| *s)
            .collect();
        for s in gone {
            let (key, len) = ring.by_offset.remove(&s).expect("listed above");
            ring.used -= len;
            if ring.by_key.get(&key).is_some_and(|l| l.offset == s) {
                ring.by_key.remove(&key);
            }
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Gives a reservation up without writing; the records in its way stay readable.
    pub fn abandon(&self, r: Reservation) {
        self.ring.lock().inflight.remove(&r.offset);
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
        let mut ring = self.ring.lock();
        ring.inflight.remove(&r.offset);
        res?;
        self.written.fetch_add(r.len, Ordering::Relaxed);
        if let Some(old) = ring.by_key.remove(key) {
            ring.by_offset.remove(&old.offset);
            ring.used -= old.len;
        }
        ring.by_offset.insert(r.offset, (key.clone(), r.len));
        ring.used += r.len;
        ring.by_key.insert(
            key.clone(),
            Loc {
                offset: r.offset,
                len: r.len,
                value_len,
                put_id,
                seq: r.seq,
            },
        );
        Ok(())
    }

    /// Reads and verifies version `put_id` of `key`, of `value_len` bytes.
    pub async fn read(
        &self,
        key: &ObjectKey,
        put_id: u64,
        value_len: u64,
    ) -> Result<DiskValue, SsdError> {
        let loc = match self.ring.lock().by_key.get(key) {
            Some(l) if l.put_id == put_id && l.value_len == value_len => l.clone(),
            _ => return Err(SsdError::NotFound { key: key.clone() }),
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
            return Err(e.into());
        }
        let buf = scopeguard(buf, &self.bufs);
        self.read.fetch_add(loc.len, Ordering::Relaxed);
        let corrupt = |why: &str| {
            self.corrupt.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%key, offset = loc.offset, why, "corrupt record on the ssd tier");
            self.found_corrupt.lock().push((key.clone(), put_id));
            SsdError::Corrupt {
                key: key.clone(),
                why: why.to_string(),
            }
        };
        let Some(h) = record::decode_header(&buf, self.file_id) else {
            return Err(corrupt("bad header"));
        };
        if h.key != *key || h.seq != loc.seq || h.value_len != value_len {
            return Err(corrupt("header names another record"));
        }
        let range = h.value_offset()..h.value_offset() + value_len as usize;
        if crc32c::crc32c(&buf[range.clone()]) != h.value_crc {
            return Err(corrupt("value checksum mismatch"));
        }
        Ok(DiskValue {
            buf: Some(buf.into_inner()),
            range,
            bufs: self.bufs.clone(),
            _permit: permit,
        })
    }

    /// Drops version `put_id` of `key` and zeroes its header on disk, so a restart does not
    /// bring it back. Returns whether there was such a record.
    pub async fn delete(&self, key: &ObjectKey, put_id: u64) -> Result<bool, SsdError> {
        let offset = {
            let mut ring = self.ring.lock();
            match ring.by_key.get(key) {
                Some(l) if l.put_id == put_id => {
                    let l = ring.by_key.remove(key).expect("checked above");
                    ring.by_offset.remove(&l.offset);
                    ring.used -= l.len;
                    // Held like a write until the header is zeroed: nobody reuses it meanwhile.
                    ring.inflight.insert(l.offset, ALIGN as u64);
                    l.offset
                }
                _ => return Ok(false),
            }
        };
        let (_, res) = self.engine.write_at(zeroed(ALIGN), offset).await;
        self.ring.lock().inflight.remove(&offset);
        res?;
        Ok(true)
    }

    /// Records found corrupt since the last call (each once).
    pub fn take_corrupt(&self) -> Vec<(ObjectKey, u64)> {
        let mut found = std::mem::take(&mut *self.found_corrupt.lock());
        found.sort();
        found.dedup();
        found
    }

    /// The master gave a recovered record a new version: reads must name that one.
    pub fn set_put_id(&self, key: &ObjectKey, old: u64, new: u64) {
        if let Some(l) = self.ring.lock().by_key.get_mut(key) {
            if l.put_id == old {
                l.put_id = new;
            }
        }
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

    pub fn stats(&self) -> SsdStats {
        let ring = self.ring.lock();
        SsdStats {
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

fn scopeguard(buf: AlignedBuf, pool: &BufPool) -> Pooled<'_> {
    Pooled {
        buf: Some(buf),
        pool,
    }
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
