//! Large batches on several threads. A TCP receive (or send) costs a kernel copy of every byte on
//! the thread that makes the call, so one thread caps a batch at what one core copies. A batch of
//! several MiB to one owner is therefore split into one chunk per connection, and each chunk is
//! driven by its own scoped thread with a small runtime of its own; the calling thread waits for
//! them (scoped threads, so the caller's buffers are borrowed soundly, and every thread is joined
//! before the batch returns). Connections move between runtimes as plain sockets.

use std::{future::Future, io, net::TcpStream as StdStream, sync::Arc, thread};

use mooncake_common::{transport::TransferError, SegmentName};
use tokio::{net::TcpStream, runtime::RuntimeFlavor, sync::OwnedSemaphorePermit, time::Instant};

use super::{fail_all, Checkout, Conn, OwnerConns, TcpTransport};

/// Bytes each thread should have at least for a batch to be worth threads (each batch starts its
/// threads and their runtimes). Measured on loopback (2 cores), batches of 8-16 MiB moved 10-40 %
/// faster on one thread than on two with 4 MiB here.
pub(super) const BYTES_PER_THREAD: u64 = 16 << 20;

type Results = Vec<Result<(), TransferError>>;
type ChunkResult = (Results, Option<Checkout>);

/// A checked-out connection taken off its runtime's reactor, to be driven by another runtime.
struct Detached {
    owner: Arc<OwnerConns>,
    permit: OwnedSemaphorePermit,
    stream: StdStream,
    next_id: u64,
    rbuf: Box<[u8]>,
    rpos: usize,
    rend: usize,
    deadline: Instant,
}

impl Checkout {
    fn detach(mut self) -> io::Result<Detached> {
        let conn = self.conn.take().expect("checked out");
        Ok(Detached {
            owner: self.owner.clone(),
            permit: self._permit,
            stream: conn.stream.into_std()?,
            next_id: conn.next_id,
            rbuf: conn.rbuf,
            rpos: conn.rpos,
            rend: conn.rend,
            deadline: self.deadline,
        })
    }
}

impl Detached {
    /// Registers the socket with the runtime this runs in.
    fn attach(self) -> io::Result<Checkout> {
        Ok(Checkout {
            owner: self.owner,
            conn: Some(Conn {
                stream: TcpStream::from_std(self.stream)?,
                next_id: self.next_id,
                rbuf: self.rbuf,
                rpos: self.rpos,
                rend: self.rend,
            }),
            _permit: self.permit,
            deadline: self.deadline,
        })
    }
}

impl TcpTransport {
    /// How many threads a batch of `items` items and `bytes` bytes is worth (1: stay on the
    /// caller's runtime).
    pub(super) fn threads_for(&self, items: usize, bytes: u64) -> usize {
        let threads = ((bytes / BYTES_PER_THREAD) as usize)
            .min(self.config.transfer_threads)
            .min(self.config.connections_per_owner)
            .min(items)
            .max(1);
        let flavor = || tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
        if threads > 1
            && !self.config.dedicated_runtime
            && matches!(flavor(), Ok(RuntimeFlavor::CurrentThread))
        {
            // Blocking this thread would stall every other task of its runtime.
            return 1;
        }
        threads
    }

    /// Takes `n` connections to `target` at once, by `deadline`.
    async fn checkout_many(
        &self,
        target: &SegmentName,
        n: usize,
        deadline: Instant,
    ) -> Vec<Result<Checkout, TransferError>> {
        let owner = self.owner(target);
        let mut rest = match self.permits(target, &owner, n, deadline).await {
            Ok(p) => Some(p),
            Err(e) => return (0..n).map(|_| Err(e.duplicate())).collect(),
        };
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let all = rest.as_mut().expect("permits left");
            let permit = if i + 1 < n {
                all.split(1).expect("one permit per connection")
            } else {
                rest.take().expect("the last permit")
            };
            out.push(self.take(target, owner.clone(), permit, deadline).await);
        }
        out
    }

    /// Runs `work` on every chunk, each on a connection of its own and a thread of its own, and
    /// returns the chunks' results in order. Connections fit for reuse go back to the pool.
    pub(super) async fn on_threads<C, F, Fut>(
        &self,
        target: &SegmentName,
        chunks: Vec<(usize, C)>,
        deadline: Instant,
        work: F,
    ) -> Vec<Results>
    where
        C: Send,
        F: Fn(Checkout, C) -> Fut + Sync,
        Fut: Future<Output = ChunkResult>,
    {
        let checkouts = self.checkout_many(target, chunks.len(), deadline).await;
        let mut jobs = Vec::with_capacity(chunks.len());
        let mut results: Vec<Option<Results>> = Vec::new();
        for ((len, chunk), checkout) in chunks.into_iter().zip(checkouts) {
            let detached = checkout.and_then(|c| {
                c.detach().map_err(|source| TransferError::Io {
                    target: target.clone(),
                    source,
                })
            });
            match detached {
                Ok(d) => {
                    jobs.push((results.len(), len, d, chunk));
                    results.push(None);
                }
                Err(e) => results.push(Some(fail_all(len, &e))),
            }
        }
        let work = &work;
        let done: Vec<(usize, Results, Option<Detached>)> = block_outside(|| {
            thread::scope(|s| {
                let handles: Vec<_> = jobs
                    .into_iter()
                    .map(|(slot, len, d, chunk)| {
                        let spawned = thread::Builder::new()
                            .name("mooncake-xfer".into())
                            .spawn_scoped(s, move || run_chunk(target, len, d, chunk, work));
                        (slot, len, spawned)
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|(slot, len, h)| {
                        let (res, back) = match h {
                            Ok(h) => h.join().expect("transfer thread panicked"),
                            Err(source) => (
                                fail_all(
                                    len,
                                    &TransferError::Io {
                                        target: target.clone(),
                                        source,
                                    },
                                ),
                                None,
                            ),
                        };
                        (slot, res, back)
                    })
                    .collect()
            })
        });
        for (slot, res, back) in done {
            results[slot] = Some(res);
            if let Some(Ok(c)) = back.map(Detached::attach) {
                c.give_back();
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every chunk ran"))
            .collect()
    }
}

/// One chunk on the current (fresh) thread: a runtime of its own drives the exchange.
fn run_chunk<C, F, Fut>(
    target: &SegmentName,
    len: usize,
    d: Detached,
    chunk: C,
    work: &F,
) -> (Results, Option<Detached>)
where
    F: Fn(Checkout, C) -> Fut,
    Fut: Future<Output = ChunkResult>,
{
    let io_err = |source| {
        fail_all(
            len,
            &TransferError::Io {
                target: target.clone(),
                source,
            },
        )
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return (io_err(e), None),
    };
    rt.block_on(async move {
        let checkout = match d.attach() {
            Ok(c) => c,
            Err(e) => return (io_err(e), None),
        };
        let (res, back) = work(checkout, chunk).await;
        (res, back.and_then(|c| c.detach().ok()))
    })
}

/// Runs blocking `f` from async code: on a multi-threaded runtime the worker hands its other
/// tasks off first; elsewhere (a dedicated current-thread runtime, whose caller waits anyway) it
/// just runs.
fn block_outside<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}
