//! The same-host path: when a peer runs on this host (same boot, same pid namespace), its bytes
//! move with one `process_vm_readv`/`writev` copy instead of two socket copies. The target still
//! decides: before copying, the caller sends the ranges (`PeerGrant`) and the target checks them
//! against its regions and holds them until the caller says it is done (`PeerRelease`), so
//! unregistering waits for the copy as it does for a TCP transfer. If the OS refuses the copy
//! (no permission to access the other process), the peer counts as remote from then on.
//!
//! When the granted ranges lie in one of the target's managed buffers, which live in memory
//! files, the target says which file, and the caller maps it once (`pidfd_getfd`, the same
//! permission as `process_vm_readv`) and copies with `memcpy`: about twice the kernel's
//! page-by-page copy. The mapping is kept for later grants of the same file; a grant says how
//! many of the target's files were freed so far, and when that changes the caller drops the
//! mappings of that target the grant does not name (so a freed buffer's pages go back to the
//! OS on the next grant, not when the caller exits).

use std::{
    collections::{hash_map::Entry, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use mooncake_common::{
    wire::{self, Op},
    Code,
};
use parking_lot::Mutex;
use tokio::{net::TcpStream, time::Instant};

use crate::{
    idle::IdleConns,
    memory::{self, Mapping, Pidfd},
    peers::{self, Hello},
    regions::{FileRange, MemoryFile, Use},
    EngineError,
};

/// (local address, remote address, length) of one copy.
type Pair = (u64, u64, u64);

/// The most peers' memory files a caller keeps mapped; past it, every other mapping is dropped
/// (each is made again on its next grant).
const MAX_MAPPINGS: usize = 64;
/// The most peers remembered as refusing mappings; past it, they are forgotten (and tried again).
const MAX_REFUSED: usize = 1024;

/// A target's answer to `PeerGrant`: the process that granted, and, when the caller asked
/// (`wire::PEER_GRANT_FILES`; a caller of an older release gets the pid alone), where each
/// range lies.
#[derive(Debug, PartialEq, Eq)]
pub struct Grant {
    pub pid: u64,
    /// Per range asked, in order, where it lies in a memory file (None: in ordinary memory);
    /// empty in an answer of the pid alone.
    pub files: Vec<Option<FileRange>>,
    /// How many of the target's memory-file regions were removed so far.
    pub files_removed: u64,
}

impl Grant {
    /// The pid alone (8 bytes), or with `files`: the pid, the count of files removed, and
    /// (file id, 0 for ordinary memory | descriptor | file length | offset) per range.
    pub fn encode(&self, with_files: bool) -> Vec<u8> {
        let mut out = self.pid.to_le_bytes().to_vec();
        if with_files {
            out.extend(self.files_removed.to_le_bytes());
            for f in &self.files {
                let words = match f {
                    Some(f) => [f.file.id, f.file.fd as u64, f.file_len, f.offset],
                    None => [0; 4],
                };
                out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
            }
        }
        out
    }

    /// The answer to a grant of `ranges` ranges; None when it is not of a known shape.
    pub fn decode(body: &[u8], ranges: usize) -> Option<Grant> {
        let word = |i: usize| u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().expect("8"));
        if body.len() == 8 {
            return Some(Grant {
                pid: word(0),
                files: Vec::new(),
                files_removed: 0,
            });
        }
        if ranges == 0 || body.len() != 16 + 32 * ranges {
            return None;
        }
        let files = (0..ranges)
            .map(|r| {
                let at = 2 + 4 * r;
                if word(at) == 0 {
                    return Some(None);
                }
                Some(Some(FileRange {
                    file: MemoryFile {
                        id: word(at),
                        fd: i32::try_from(word(at + 1)).ok()?,
                    },
                    file_len: word(at + 2),
                    offset: word(at + 3),
                }))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Grant {
            pid: word(0),
            files,
            files_removed: word(1),
        })
    }

    /// The one memory file every range lies in, if there is one.
    fn single_file(&self) -> Option<&FileRange> {
        let first = self.files.first()?.as_ref()?;
        (self.files.iter())
            .all(|f| f.as_ref().is_some_and(|f| f.file == first.file))
            .then_some(first)
    }
}

/// The memory files of one peer (one incarnation) this caller mapped.
struct PeerFiles {
    pid: i32,
    /// Tells when the process exits, and takes its descriptors.
    pidfd: Pidfd,
    /// The `files_removed` of its last grant.
    removed_seen: u64,
    by_id: HashMap<u64, Arc<Mapping>>,
}

/// Peers' memory files mapped by an engine's callers. A mapping keeps its file's pages alive,
/// so mappings go as soon as the caller learns they are not needed: the peer freed files (its
/// `files_removed` moved: those its grant does not name go), the peer's process exited, or
/// another engine answers from the same process (checked on every grant).
#[derive(Default)]
pub struct Mappings {
    /// By the peer's incarnation.
    by_peer: HashMap<u64, PeerFiles>,
    /// Peers whose files the OS refuses to hand over: copied with `process_vm` instead.
    refused: HashSet<u64>,
}

impl Mappings {
    /// The mapping of the one file all of `grant`'s ranges lie in, made if needed; None when
    /// they do not lie in one file, or it cannot be mapped. Mappings let go of are moved to
    /// `evicted`, for the caller to drop (unmap) once the lock is released.
    fn get(
        &mut self,
        incarnation: u64,
        pid: i32,
        grant: &Grant,
        evicted: &mut Vec<Arc<Mapping>>,
    ) -> Option<Arc<Mapping>> {
        self.let_go(incarnation, pid, grant, evicted);
        let file = grant.single_file()?;
        if self.refused.contains(&incarnation) {
            return None;
        }
        let id = file.file.id;
        let cached = (self.by_peer.get(&incarnation)).and_then(|p| p.by_id.get(&id));
        if let Some(m) = cached {
            return Some(m.clone());
        }
        if self.by_peer.values().map(|p| p.by_id.len()).sum::<usize>() >= MAX_MAPPINGS {
            for p in self.by_peer.values_mut() {
                evicted.extend(p.by_id.drain().map(|(_, m)| m));
            }
        }
        let peer = match self.by_peer.entry(incarnation) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => match Pidfd::open(pid) {
                Ok(pidfd) => v.insert(PeerFiles {
                    pid,
                    pidfd,
                    removed_seen: grant.files_removed,
                    by_id: HashMap::new(),
                }),
                Err(e) => return cannot_map(&mut self.refused, incarnation, pid, e),
            },
        };
        match peer.pidfd.map_file(file.file.fd, file.file_len) {
            Ok(m) => {
                let m = Arc::new(m);
                peer.by_id.insert(id, m.clone());
                Some(m)
            }
            Err(e) => cannot_map(&mut self.refused, incarnation, pid, e),
        }
    }

    /// Moves to `evicted` the mappings a grant from `incarnation` (process `pid`) shows are no
    /// longer needed: those of peers whose process exited or that another engine of the same
    /// process replaced, and this peer's files that it freed since its last grant.
    fn let_go(
        &mut self,
        incarnation: u64,
        pid: i32,
        grant: &Grant,
        evicted: &mut Vec<Arc<Mapping>>,
    ) {
        self.by_peer.retain(|&inc, p| {
            let gone = p.pidfd.exited() || (p.pid == pid && inc != incarnation);
            if gone {
                evicted.extend(p.by_id.drain().map(|(_, m)| m));
            }
            !gone
        });
        if let Some(p) = self.by_peer.get_mut(&incarnation) {
            if p.removed_seen != grant.files_removed {
                p.removed_seen = grant.files_removed;
                let named: HashSet<u64> = grant.files.iter().flatten().map(|f| f.file.id).collect();
                let freed = p.by_id.extract_if(|id, _| !named.contains(id));
                evicted.extend(freed.map(|(_, m)| m));
            }
        }
        if self.refused.len() > MAX_REFUSED {
            self.refused.clear();
        }
    }
}

/// A mapping that could not be made: the batch is copied with `process_vm`, and so are the peer's
/// later ones where the OS refuses (rather than lacking memory or descriptors now).
fn cannot_map(
    refused: &mut HashSet<u64>,
    incarnation: u64,
    pid: i32,
    e: std::io::Error,
) -> Option<Arc<Mapping>> {
    let permanent = matches!(
        e.raw_os_error(),
        Some(libc::EPERM | libc::EACCES | libc::ENOSYS)
    );
    if permanent {
        refused.insert(incarnation);
    }
    tracing::info!(pid, error = %e, permanent, "cannot map a same-host peer's managed buffer; copying with process_vm instead");
    None
}

/// Copies shorter than this run on the calling task; longer ones on a blocking thread.
const INLINE_COPY: u64 = 1 << 20;
/// Copies of at least this many bytes are split over two threads (one core copies about half
/// of what two do from memory that is not in cache).
const TWO_THREADS: u64 = 8 << 20;

/// How a copy reaches the target's memory.
enum Via {
    Process(i32),
    /// A mapping of the target's memory file; pairs give offsets in it as remote addresses.
    File(Arc<Mapping>),
}

impl Via {
    fn copy(&self, read: bool, pairs: &[Pair]) -> std::io::Result<()> {
        match self {
            Via::Process(pid) => memory::copy_with_process(*pid, read, pairs),
            Via::File(m) => m.copy(read, pairs),
        }
    }
}

/// Copies `pairs`, on two threads when there is enough to copy.
fn copy(via: &Via, read: bool, pairs: Vec<Pair>) -> std::io::Result<()> {
    let total: u64 = pairs.iter().map(|p| p.2).sum();
    if total < TWO_THREADS {
        return via.copy(read, &pairs);
    }
    let (first, second) = split_half(pairs, total / 2);
    std::thread::scope(|sc| {
        let other = sc.spawn(|| via.copy(read, &second));
        let mine = via.copy(read, &first);
        let theirs = other
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("a copy thread panicked")));
        mine.and(theirs)
    })
}

/// Splits (local, remote, length) pairs into the first `at` bytes and the rest, cutting the
/// pair that straddles the boundary in two.
fn split_half(pairs: Vec<Pair>, at: u64) -> (Vec<Pair>, Vec<Pair>) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut seen = 0u64;
    for (l, r, n) in pairs {
        if seen >= at {
            second.push((l, r, n));
        } else if seen + n <= at {
            first.push((l, r, n));
        } else {
            let k = at - seen;
            first.push((l, r, k));
            second.push((l + k, r + k, n - k));
        }
        seen += n;
    }
    (first, second)
}

/// This host and pid namespace: peers that report the same can reach this process's memory.
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{}/{}", boot.trim(), pidns)
}

#[derive(Clone, Copy)]
enum Kind {
    /// On this host, process `pid`.
    Local(i32),
    Remote,
}

pub struct SameHost {
    identity: String,
    timeout: Duration,
    /// Peers the OS refused copies with: TCP from then on.
    copy_refused: Mutex<HashSet<String>>,
    /// Idle control connections per peer.
    idle: IdleConns<TcpStream>,
    mappings: Arc<Mutex<Mappings>>,
}

/// How a same-host attempt ended: done, or not usable (the caller's uses come back for TCP).
pub enum Outcome {
    /// Copied; `mapped` when through a mapping of the target's memory file. The uses come back
    /// too, held until the copy ended.
    Done {
        mapped: bool,
        uses: Vec<Use>,
    },
    NotLocal(Vec<Use>),
}

/// The most ranges one grant lists: its answer (16 + 32 bytes a range) stays under the 1 MiB
/// a caller takes, and the request (16 bytes a range) under the target's `MAX_GRANT`. A batch
/// of more goes in several grants, one after another (under the call's one deadline, which
/// only the exchanges count).
pub const GRANT_RANGES: usize = 30 << 10;
const _: () = assert!(16 + 32 * GRANT_RANGES < 1 << 20);

impl SameHost {
    pub fn new(timeout: Duration, mappings: Arc<Mutex<Mappings>>) -> Self {
        SameHost {
            identity: host_identity(),
            timeout,
            copy_refused: Mutex::new(HashSet::new()),
            idle: IdleConns::default(),
            mappings,
        }
    }

    fn fail(target: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Invalid(format!("same-host transfer with {target}: {e}"))
    }

    async fn connect(&self, target: &str) -> std::io::Result<TcpStream> {
        if let Some(s) = self.idle.take(target) {
            return Ok(s);
        }
        let s = TcpStream::connect(target).await?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Whether `target`, met as `hello`, is a process on this host (unless the OS refused
    /// copies with it before).
    fn kind(&self, target: &str, hello: &Hello) -> Kind {
        if self.copy_refused.lock().contains(target) {
            return Kind::Remote;
        }
        match i32::try_from(hello.pid) {
            Ok(pid) if hello.identity == self.identity.as_bytes() => Kind::Local(pid),
            _ => Kind::Remote,
        }
    }

    /// Copies `pairs` (local, remote, length) with `target` if it runs on this host. `uses`
    /// hold the local ranges; they and the control connection (whose closing would let the
    /// target release its ranges) go with the copy, so even a caller that stops waiting leaves
    /// both held until the copy has ended. Only the exchanges with the target are timed: they
    /// end by `deadline` (a release that misses it closes the connection, which releases too).
    pub async fn transfer(
        &self,
        target: &str,
        hello: &Hello,
        read: bool,
        mut pairs: Vec<(u64, u64, u64)>,
        mut uses: Vec<Use>,
        deadline: Instant,
    ) -> Result<Outcome, EngineError> {
        let mut all_mapped = true;
        loop {
            let rest = pairs.split_off(pairs.len().min(GRANT_RANGES));
            // A part that cannot go this way sends the whole batch over TCP: copying the parts
            // done so far again moves the same bytes to the same places.
            match self
                .transfer_granted(target, hello, read, pairs, uses, deadline)
                .await?
            {
                Outcome::Done { mapped, uses: back } => {
                    all_mapped &= mapped;
                    uses = back;
                }
                not_local => return Ok(not_local),
            }
            if rest.is_empty() {
                return Ok(Outcome::Done {
                    mapped: all_mapped,
                    uses,
                });
            }
            pairs = rest;
        }
    }

    /// `transfer` of at most `GRANT_RANGES` pairs: one grant, the copy, the release.
    async fn transfer_granted(
        &self,
        target: &str,
        hello: &Hello,
        read: bool,
        pairs: Vec<(u64, u64, u64)>,
        uses: Vec<Use>,
        deadline: Instant,
    ) -> Result<Outcome, EngineError> {
        let Kind::Local(pid) = self.kind(target, hello) else {
            return Ok(Outcome::NotLocal(uses));
        };
        let after = self.timeout;
        let timed = |what: &'static str| {
            move |_| Self::fail(target, format!("{what} timed out after {after:?}"))
        };
        let ranges: Vec<u8> = pairs
            .iter()
            .flat_map(|&(_, r, n)| r.to_le_bytes().into_iter().chain(n.to_le_bytes()))
            .collect();
        let grant = async {
            let mut s = self.connect(target).await?;
            let (op, inc) = (Op::PeerGrant, hello.incarnation);
            let r = peers::call(&mut s, op, wire::PEER_GRANT_FILES, inc, target, &ranges).await?;
            Ok::<_, std::io::Error>((s, r))
        };
        let (s, granted) = tokio::time::timeout_at(deadline, grant)
            .await
            .map_err(timed("the grant"))?
            .map_err(|e| Self::fail(target, e))?;
        let grant = match granted {
            // The process that granted is the one the copy goes to (a restarted peer refuses the
            // grant for its incarnation); any other answer sends this batch over TCP.
            Ok(body) => match Grant::decode(&body, pairs.len()) {
                Some(g) if g.pid == u64::from(pid as u32) => g,
                _ => return Ok(Outcome::NotLocal(uses)),
            },
            // Device memory on the target: over TCP, where the target stages it.
            Err((status, _)) if status == Code::UnavailableInCurrentStatus.as_i32() => {
                self.idle.put(target, s);
                return Ok(Outcome::NotLocal(uses));
            }
            Err((code, refused)) => return Err(peers::refused(target, code, &refused)),
        };
        let total: u64 = pairs.iter().map(|p| p.2).sum();
        let mappings = self.mappings.clone();
        let incarnation = hello.incarnation;
        // Maps the target's file if need be (a first mapping may take milliseconds: it goes
        // with the copy, on a blocking thread when the copy does), then copies.
        let run = move || {
            let mut evicted = Vec::new();
            let mapping = if grant.files.is_empty() {
                None
            } else {
                mappings.lock().get(incarnation, pid, &grant, &mut evicted)
            };
            // Unmapped here, out of the lock (on a blocking thread, but for short copies).
            drop(evicted);
            let (via, pairs) = match mapping {
                Some(m) => {
                    let at_offsets = (pairs.iter().zip(grant.files.iter().flatten()))
                        .map(|(&(l, _, n), f)| (l, f.offset, n))
                        .collect();
                    (Via::File(m), at_offsets)
                }
                None => (Via::Process(pid), pairs),
            };
            let mapped = matches!(via, Via::File(_));
            (copy(&via, read, pairs), mapped)
        };
        let ((copied, mapped), mut s, uses) = if total < INLINE_COPY {
            // A short copy: here, without a thread hop (it cannot be interrupted either way).
            (run(), s, uses)
        } else {
            tokio::task::spawn_blocking(move || (run(), s, uses))
                .await
                .map_err(|e| Self::fail(target, e))?
        };
        let released = tokio::time::timeout_at(
            deadline,
            peers::call(&mut s, Op::PeerRelease, 0, 0, target, &[]),
        )
        .await
        .map_err(timed("the release"));
        if matches!(released, Ok(Ok(Ok(_)))) {
            self.idle.put(target, s);
        }
        match copied {
            Ok(()) => Ok(Outcome::Done { mapped, uses }),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                tracing::info!(%target, "the OS refuses same-host copies with this peer; using TCP");
                self.copy_refused.lock().insert(target.to_string());
                Ok(Outcome::NotLocal(uses))
            }
            // The process may have gone; a new one behind its name refuses the next call's grant.
            Err(e) => Err(Self::fail(target, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_answer_round_trips_and_a_misshapen_one_is_refused() {
        let range = |id, offset| FileRange {
            file: MemoryFile { fd: 9, id },
            file_len: 1 << 20,
            offset,
        };
        let grant = Grant {
            pid: 7,
            files: vec![Some(range(1, 0)), Some(range(1, 4096))],
            files_removed: 5,
        };
        // To a caller that did not ask (an older release): the pid alone, as it expects.
        let plain = grant.encode(false);
        assert_eq!(plain, 7u64.to_le_bytes());
        let got = Grant::decode(&plain, 2).unwrap();
        assert_eq!((got.pid, got.files.len()), (7, 0));
        let body = grant.encode(true);
        assert_eq!(body.len(), 16 + 2 * 32);
        assert_eq!(Grant::decode(&body, 2).as_ref(), Some(&grant));
        assert_eq!(grant.single_file(), Some(&range(1, 0)));
        // Ordinary memory among the ranges: no single file.
        let mixed = Grant {
            files: vec![Some(range(1, 0)), None],
            ..grant
        };
        assert_eq!(Grant::decode(&mixed.encode(true), 2).as_ref(), Some(&mixed));
        assert_eq!(mixed.single_file(), None);
        let two = Grant {
            files: vec![Some(range(1, 0)), Some(range(2, 0))],
            ..mixed
        };
        assert_eq!(two.single_file(), None);
        // Answers for another number of ranges, or cut short, are not taken for a grant.
        assert_eq!(Grant::decode(&body, 3), None);
        assert_eq!(Grant::decode(&body[..body.len() - 1], 2), None);
        assert_eq!(Grant::decode(&[], 0), None);
    }

    #[test]
    fn split_half_cuts_at_the_byte() {
        let (a, b) = split_half(vec![(0, 100, 10), (10, 110, 10), (20, 120, 10)], 15);
        assert_eq!(a, vec![(0, 100, 10), (10, 110, 5)]);
        assert_eq!(b, vec![(15, 115, 5), (20, 120, 10)]);
        let (a, b) = split_half(vec![(0, 0, 8)], 4);
        assert_eq!((a, b), (vec![(0, 0, 4)], vec![(4, 4, 4)]));
        let (a, b) = split_half(vec![(0, 0, 4), (4, 4, 4)], 4);
        assert_eq!((a, b), (vec![(0, 0, 4)], vec![(4, 4, 4)]));
    }
}
