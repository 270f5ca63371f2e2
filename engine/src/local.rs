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
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use mooncake_common::{wire::Op, Code};
use parking_lot::Mutex;
use tokio::{net::TcpStream, time::Instant};

use crate::{
    memory::{self, Mapping},
    peers::{self, Hello},
    regions::{FileRange, MemoryFile, Use},
    EngineError,
};

/// (local address, remote address, length) of one copy.
type Pair = (u64, u64, u64);

/// The most peers' memory files a caller keeps mapped; past it, mappings no grant of the moment
/// names are dropped.
const MAX_MAPPINGS: usize = 64;

/// A target's answer to `PeerGrant`: the process that granted, and, when every range lies in a
/// memory file, where (in the order the ranges were asked).
#[derive(Debug, PartialEq, Eq)]
pub struct Grant {
    pub pid: u64,
    pub files: Option<Vec<FileRange>>,
    /// How many of the target's memory-file regions were removed so far.
    pub files_removed: u64,
}

impl Grant {
    /// The pid alone (8 bytes, what a target without memory files answers), or the pid, the
    /// count of files removed, and (file id, descriptor, file length, offset) per range.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.pid.to_le_bytes().to_vec();
        if let Some(files) = self.files.as_ref().filter(|f| !f.is_empty()) {
            out.extend(self.files_removed.to_le_bytes());
            for f in files {
                for v in [f.file.id, f.file.fd as u64, f.file_len, f.offset] {
                    out.extend(v.to_le_bytes());
                }
            }
        }
        out
    }

    /// The answer to a grant of `ranges` ranges; None when it is not of that shape.
    pub fn decode(body: &[u8], ranges: usize) -> Option<Grant> {
        let word = |i: usize| u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().expect("8"));
        if body.len() == 8 {
            return Some(Grant {
                pid: word(0),
                files: None,
                files_removed: 0,
            });
        }
        if ranges == 0 || body.len() != 16 + 32 * ranges {
            return None;
        }
        let files = (0..ranges)
            .map(|r| {
                let at = 2 + 4 * r;
                Some(FileRange {
                    file: MemoryFile {
                        id: word(at),
                        fd: i32::try_from(word(at + 1)).ok()?,
                    },
                    file_len: word(at + 2),
                    offset: word(at + 3),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Grant {
            pid: word(0),
            files: Some(files),
            files_removed: word(1),
        })
    }
}

/// Peers' memory files this caller mapped.
#[derive(Default)]
struct Mappings {
    /// By (the peer's incarnation, its file id).
    by_file: HashMap<(u64, u64), Arc<Mapping>>,
    /// Per peer incarnation, the `files_removed` of its last grant.
    removed_seen: HashMap<u64, u64>,
    /// Peers whose files could not be mapped (the OS refused): copied with `process_vm` instead.
    refused: HashSet<u64>,
}

impl Mappings {
    /// The mapping of the one file that all of `files` lie in, making it if needed; None when
    /// the ranges span several files or the file cannot be mapped.
    fn get(
        &mut self,
        incarnation: u64,
        pid: i32,
        files: &[FileRange],
        files_removed: u64,
    ) -> Option<Arc<Mapping>> {
        let first = files.first()?;
        if self.refused.contains(&incarnation) || files.iter().any(|f| f.file != first.file) {
            return None;
        }
        if self.removed_seen.insert(incarnation, files_removed) != Some(files_removed) {
            // Some of this peer's files were freed since: keep only the one in use now.
            (self.by_file).retain(|&(inc, id), _| inc != incarnation || id == first.file.id);
        }
        let key = (incarnation, first.file.id);
        if let Some(m) = self.by_file.get(&key) {
            return Some(m.clone());
        }
        match Mapping::of_peer_file(pid, first.file.fd, first.file_len) {
            Ok(m) => {
                if self.by_file.len() >= MAX_MAPPINGS {
                    self.by_file.clear();
                }
                let m = Arc::new(m);
                self.by_file.insert(key, m.clone());
                Some(m)
            }
            Err(e) => {
                tracing::info!(pid, error = %e, "cannot map a same-host peer's managed buffer; copying with process_vm instead");
                self.refused.insert(incarnation);
                None
            }
        }
    }
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
            Via::File(m) => {
                m.copy(read, pairs);
                Ok(())
            }
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
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    mappings: Arc<Mutex<Mappings>>,
}

/// How a same-host attempt ended: done, or not usable (the caller's uses come back for TCP).
pub enum Outcome {
    /// Copied; `mapped` when through a mapping of the target's memory file.
    Done {
        mapped: bool,
    },
    NotLocal(Vec<Use>),
}

impl SameHost {
    pub fn new(timeout: Duration) -> Self {
        SameHost {
            identity: host_identity(),
            timeout,
            copy_refused: Mutex::new(HashSet::new()),
            idle: Mutex::new(HashMap::new()),
            mappings: Arc::default(),
        }
    }

    fn fail(target: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Invalid(format!("same-host transfer with {target}: {e}"))
    }

    async fn connect(&self, target: &str) -> std::io::Result<TcpStream> {
        if let Some(s) = self.idle.lock().get_mut(target).and_then(Vec::pop) {
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
            let r = peers::call(&mut s, Op::PeerGrant, hello.incarnation, target, &ranges).await?;
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
                self.idle
                    .lock()
                    .entry(target.to_string())
                    .or_default()
                    .push(s);
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
            let file = (grant.files.as_ref()).and_then(|f| {
                let m = mappings
                    .lock()
                    .get(incarnation, pid, f, grant.files_removed)?;
                Some((m, f))
            });
            let (via, pairs) = match file {
                Some((m, files)) => {
                    let inside =
                        |off: u64, n: u64| off.checked_add(n).is_some_and(|e| e <= m.len());
                    if !(pairs.iter().zip(files)).all(|(p, f)| inside(f.offset, p.2)) {
                        let e =
                            std::io::Error::other("the target granted a range outside its buffer");
                        return (Err(e), true);
                    }
                    let at_offsets = (pairs.iter().zip(files))
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
            peers::call(&mut s, Op::PeerRelease, 0, target, &[]),
        )
        .await
        .map_err(timed("the release"));
        if matches!(released, Ok(Ok(Ok(_)))) {
            self.idle
                .lock()
                .entry(target.to_string())
                .or_default()
                .push(s);
        }
        match copied {
            Ok(()) => Ok(Outcome::Done { mapped }),
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
        let plain = Grant {
            pid: 42,
            files: None,
            files_removed: 0,
        };
        assert_eq!(plain.encode().len(), 8, "what an older caller expects");
        assert_eq!(Grant::decode(&plain.encode(), 3), Some(plain));
        let range = |id, offset| FileRange {
            file: MemoryFile { fd: 9, id },
            file_len: 1 << 20,
            offset,
        };
        let filed = Grant {
            pid: 7,
            files: Some(vec![range(1, 0), range(1, 4096)]),
            files_removed: 5,
        };
        let body = filed.encode();
        assert_eq!(body.len(), 16 + 2 * 32);
        assert_eq!(Grant::decode(&body, 2), Some(filed));
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
