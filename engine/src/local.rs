//! The same-host path: when a peer runs on this host (same boot, same pid namespace), its bytes
//! move with one `process_vm_readv`/`writev` copy instead of two socket copies. The target still
//! decides: before copying, the caller sends the ranges (`PeerGrant`) and the target checks them
//! against its regions and holds them until the caller says it is done (`PeerRelease`), so
//! unregistering waits for the copy as it does for a TCP transfer. If the OS refuses the copy
//! (no permission to access the other process), the peer counts as remote from then on.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use mooncake_common::{wire::Op, Code};
use parking_lot::Mutex;
use tokio::{net::TcpStream, time::Instant};

use crate::{
    memory,
    peers::{self, Hello},
    regions::Use,
    EngineError,
};

/// (local address, remote address, length) of one copy.
type Pair = (u64, u64, u64);

/// Copies shorter than this run on the calling task; longer ones on a blocking thread.
const INLINE_COPY: u64 = 1 << 20;
/// Copies of at least this many bytes are split over two threads (one core copies about half
/// of what two do from memory that is not in cache).
const TWO_THREADS: u64 = 8 << 20;

/// Copies `pairs`, on two threads when there is enough to copy.
fn copy(pid: i32, read: bool, pairs: Vec<Pair>) -> std::io::Result<()> {
    let total: u64 = pairs.iter().map(|p| p.2).sum();
    if total < TWO_THREADS {
        return memory::copy_with_process(pid, read, &pairs);
    }
    let (first, second) = split_half(pairs, total / 2);
    std::thread::scope(|sc| {
        let other = sc.spawn(|| memory::copy_with_process(pid, read, &second));
        let mine = memory::copy_with_process(pid, read, &first);
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
}

/// How a same-host attempt ended: done, or not usable (the caller's uses come back for TCP).
pub enum Outcome {
    Done,
    NotLocal(Vec<Use>),
}

impl SameHost {
    pub fn new(timeout: Duration) -> Self {
        SameHost {
            identity: host_identity(),
            timeout,
            copy_refused: Mutex::new(HashSet::new()),
            idle: Mutex::new(HashMap::new()),
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
        match granted {
            // The process that granted is the one the copy goes to (a restarted peer refuses the
            // grant for its incarnation); any other answer sends this batch over TCP.
            Ok(body) if body.len() == 8 && body[..] == u64::from(pid as u32).to_le_bytes() => {}
            Ok(_) => return Ok(Outcome::NotLocal(uses)),
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
        }
        let total: u64 = pairs.iter().map(|p| p.2).sum();
        let (copied, mut s, uses) = if total < INLINE_COPY {
            // A short copy: here, without a thread hop (it cannot be interrupted either way).
            (memory::copy_with_process(pid, read, &pairs), s, uses)
        } else {
            tokio::task::spawn_blocking(move || (copy(pid, read, pairs), s, uses))
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
            Ok(()) => Ok(Outcome::Done),
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
