//! The same-host transport: a local owner hands this client its pool's memfd over a Unix-domain
//! socket, and the client copies bytes itself. Each batch is one begin/end exchange with the owner
//! around the copies: the owner locks the ranges (and, for reads, checks they hold the keys), so
//! the guarantees are those of TCP with one memcpy instead of two socket copies.

#[allow(unsafe_code)]
mod mapping;

use std::{
    io::{self, Read, Write},
    os::{fd::AsFd, unix::net::UnixStream as StdUnixStream},
    path::Path,
    sync::Arc,
    time::Duration,
};

use mooncake_common::{
    auth::{authenticate_blocking, AuthError, Credential, AUTH_REQUIRED},
    data_socket::idle_and_open,
    local::{self, frame_header, FrameReader, FrameWriter, Item, LocalOp},
    transport::{parts_len, ReadItem, TransferError, WriteItem},
    Code, SegmentName,
};
use parking_lot::Mutex;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
    sync::Semaphore,
};

use mapping::OutOfRange;
pub use mapping::SharedPool;

/// Below this many bytes a batch is copied on the calling thread alone.
const PARALLEL_COPY_BYTES: u64 = 4 << 20;

/// Where to split `sizes` into two halves of about equal bytes, if the total is worth sharing
/// and `threads` allows a second thread.
fn split_point(sizes: impl Iterator<Item = u64> + Clone, threads: usize) -> Option<usize> {
    let total: u64 = sizes.clone().sum();
    if total < PARALLEL_COPY_BYTES || threads < 2 {
        return None;
    }
    let mut acc = 0;
    for (i, s) in sizes.enumerate() {
        acc += s;
        if acc * 2 >= total {
            return Some(i + 1);
        }
    }
    None
}

/// Copies a batch in, on two threads when it is large enough (one memcpy stream does not
/// saturate memory bandwidth).
fn copy_in_all(
    pool: &SharedPool,
    jobs: &[(u64, &[&[u8]])],
    threads: usize,
) -> Vec<Result<(), OutOfRange>> {
    let sizes = jobs.iter().map(|(_, parts)| parts_len(parts));
    let one = |js: &[(u64, &[&[u8]])]| {
        js.iter()
            .map(|(o, p)| pool.copy_in(*o, p))
            .collect::<Vec<_>>()
    };
    match split_point(sizes, threads) {
        Some(mid) if mid < jobs.len() => {
            let (a, b) = jobs.split_at(mid);
            std::thread::scope(|s| {
                let other = s.spawn(|| one(b));
                let mut out = one(a);
                out.extend(other.join().expect("copy thread panicked"));
                out
            })
        }
        _ => one(jobs),
    }
}

/// Copies a batch out, on two threads when it is large enough.
fn copy_out_all(
    pool: &SharedPool,
    jobs: &mut [(u64, &mut [&mut [u8]])],
    threads: usize,
) -> Vec<Result<(), OutOfRange>> {
    let sizes: Vec<u64> = jobs.iter().map(|(_, parts)| parts_len(parts)).collect();
    let one = |js: &mut [(u64, &mut [&mut [u8]])]| {
        js.iter_mut()
            .map(|(o, p)| pool.copy_out(*o, p))
            .collect::<Vec<_>>()
    };
    match split_point(sizes.into_iter(), threads) {
        Some(mid) if mid < jobs.len() => {
            let (a, b) = jobs.split_at_mut(mid);
            std::thread::scope(|s| {
                let other = s.spawn(|| one(b));
                let mut out = one(a);
                out.extend(other.join().expect("copy thread panicked"));
                out
            })
        }
        _ => one(jobs),
    }
}

/// How long a same-host owner may take, as over TCP: to answer a new connection (the proof
/// and hello included), and to finish one batch's exchange (the wait for a connection and the
/// copies included).
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub connect: Duration,
    pub transfer: Duration,
}

impl Deadlines {
    /// The same deadline for both.
    pub fn both(d: Duration) -> Deadlines {
        Deadlines {
            connect: d,
            transfer: d,
        }
    }
}

pub struct LocalOwner {
    segment: SegmentName,
    path: std::path::PathBuf,
    pool: SharedPool,
    idle: Mutex<Vec<UnixStream>>,
    permits: Arc<Semaphore>,
    deadlines: Deadlines,
    /// Threads a large batch's copies may use (1: the calling thread only).
    copy_threads: usize,
    /// Proved on every new connection to the owner's socket.
    credential: Option<Credential>,
}

/// The error of an exchange that lost its connection (a timeout, a broken or refused
/// connection), if one of `results` reports one: the exchanges after it are not tried.
fn broken(results: &[Result<(), TransferError>]) -> Option<TransferError> {
    results.iter().find_map(|r| match r {
        Err(
            e @ (TransferError::Timeout { .. }
            | TransferError::Io { .. }
            | TransferError::Connect { .. }),
        ) => Some(e.duplicate()),
        _ => None,
    })
}

/// Adds one exchange's `outcome` (of the items in `run`) to `results`: its results, or its
/// error for each of its items. An error of the `first` exchange is the whole call's.
fn gather(
    results: &mut Vec<Result<(), TransferError>>,
    first: bool,
    run: std::ops::Range<usize>,
    outcome: Result<Vec<Result<(), TransferError>>, TransferError>,
) -> Result<(), TransferError> {
    match outcome {
        Ok(r) => results.extend(r),
        Err(e) if first => return Err(e),
        Err(e) => results.extend(run.map(|_| Err(e.duplicate()))),
    }
    Ok(())
}

impl LocalOwner {
    /// Connects to the owner's socket, checks it serves `segment`, and maps its pool. Blocking:
    /// call it off the async workers.
    pub fn connect(
        path: &Path,
        segment: &SegmentName,
        deadlines: Deadlines,
        conns: usize,
        copy_threads: usize,
        credential: Option<Credential>,
    ) -> io::Result<LocalOwner> {
        Self::connect_mapped(
            path,
            segment,
            deadlines,
            conns,
            copy_threads,
            credential,
            None,
        )
    }

    /// `connect`, taking `mapped` (an earlier connection's mapping) instead of mapping the pool
    /// again when it maps the same one.
    #[allow(clippy::too_many_arguments)]
    pub fn connect_mapped(
        path: &Path,
        segment: &SegmentName,
        deadlines: Deadlines,
        conns: usize,
        copy_threads: usize,
        credential: Option<Credential>,
        mapped: Option<SharedPool>,
    ) -> io::Result<LocalOwner> {
        let (stream, fd, size) = hello(path, segment, deadlines.connect, credential.as_ref())?;
        let fd =
            fd.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "owner sent no memfd"))?;
        let pool = SharedPool::map_or_reuse(fd, size, mapped.as_ref())?;
        let first = UnixStream::from_std(stream)?;
        Ok(LocalOwner {
            segment: segment.clone(),
            path: path.to_path_buf(),
            pool,
            idle: Mutex::new(vec![first]),
            permits: Arc::new(Semaphore::new(conns.max(1))),
            deadlines,
            copy_threads,
            credential,
        })
    }

    /// The owner's pool as mapped here.
    pub fn pool(&self) -> &SharedPool {
        &self.pool
    }

    /// Whether the owner is surely gone: an idle connection to it was closed by the other end
    /// (or holds bytes nobody asked for). Its pool's mapping is then only memory held for
    /// nothing. False while every connection is in use.
    pub fn is_gone(&self) -> bool {
        self.idle.lock().iter().any(|s| !idle_and_open(s))
    }

    fn io_err(&self, source: io::Error) -> TransferError {
        TransferError::Io {
            target: self.segment.clone(),
            source,
        }
    }

    /// An idle connection still open: one the owner closed (it stopped, or restarted on the same
    /// socket) is dropped rather than failing the batch it would carry.
    fn idle_open(&self) -> Option<UnixStream> {
        let mut idle = self.idle.lock();
        while let Some(s) = idle.pop() {
            // Asked of the socket itself: tokio's `try_read` answers "would block" without a
            // system call while the runtime has not seen the socket readable, so a close not
            // processed yet passed as open (and the batch it carried failed).
            if idle_and_open(&s) {
                return Some(s);
            }
        }
        None
    }

    /// A connection to the owner, by `deadline` (the call's): an idle one, or a new one that
    /// the owner answers within the connect timeout too.
    async fn checkout(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<(tokio::sync::OwnedSemaphorePermit, UnixStream), TransferError> {
        // Every connection busy (an owner that stopped answering holds them all): waiting for
        // one is bounded like an exchange.
        let permit = tokio::time::timeout_at(deadline, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| TransferError::Timeout {
                target: self.segment.clone(),
                after: self.deadlines.transfer,
            })?
            .expect("semaphore never closed");
        let pooled = self.idle_open();
        let stream = match pooled {
            Some(s) => s,
            None => {
                let (path, segment, timeout, credential) = (
                    self.path.clone(),
                    self.segment.clone(),
                    self.deadlines.connect,
                    self.credential.clone(),
                );
                // A connect to an owner that accepts nothing blocks past the socket's timeouts;
                // the call does not wait for it longer than for an exchange.
                let connecting = tokio::task::spawn_blocking(move || {
                    hello(&path, &segment, timeout, credential.as_ref())
                });
                // By the connect timeout, or the call's deadline if that comes first.
                let connect_by = tokio::time::Instant::now() + timeout;
                let (by, limit) = if deadline < connect_by {
                    (deadline, self.deadlines.transfer)
                } else {
                    (connect_by, timeout)
                };
                let (std_stream, fd, size) = tokio::time::timeout_at(by, connecting)
                    .await
                    .map_err(|_| TransferError::Timeout {
                        target: self.segment.clone(),
                        after: limit,
                    })?
                    .map_err(|e| self.io_err(io::Error::other(e)))?
                    .map_err(|e| match e.kind() {
                        // A socket read past its timeout: the owner did not answer in time.
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                            TransferError::Timeout {
                                target: self.segment.clone(),
                                after: timeout,
                            }
                        }
                        _ => self.io_err(e),
                    })?;
                // The owner at this socket may have restarted since the pool was mapped (a fixed
                // port gives the new one the same segment and socket): its pool is another
                // memory file, and copies through the old mapping would miss it.
                let same = match fd {
                    Some(fd) => self.pool.maps(fd, size).map_err(|e| self.io_err(e))?,
                    None => false,
                };
                if !same {
                    return Err(TransferError::Connect {
                        target: self.segment.clone(),
                        source: io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            format!(
                                "the owner at {} restarted (its pool is a new memory file): connect again",
                                self.path.display()
                            ),
                        ),
                    });
                }
                UnixStream::from_std(std_stream).map_err(|e| self.io_err(e))?
            }
        };
        Ok((permit, stream))
    }

    /// Begin, copy, end: one exchange per batch in each direction (several, one after another,
    /// for a batch bigger than a frame). Results per item, in order.
    pub async fn write_batch(&self, items: &[WriteItem<'_>]) -> Vec<Result<(), TransferError>> {
        self.try_write_batch(items)
            .await
            .unwrap_or_else(|e| items.iter().map(|_| Err(e.duplicate())).collect())
    }

    /// `write_batch`, or the error that left it without a connection (nothing was sent). A
    /// batch too big for one frame goes as several exchanges, one after another, all by one
    /// deadline; after one that lost its connection, the rest fail with its error.
    pub async fn try_write_batch(
        &self,
        items: &[WriteItem<'_>],
    ) -> Result<Vec<Result<(), TransferError>>, TransferError> {
        let deadline = tokio::time::Instant::now() + self.deadlines.transfer;
        let runs = local::exchanges(items.iter().map(|i| i.key.as_str().len()));
        let mut results = Vec::with_capacity(items.len());
        for (n, run) in runs.into_iter().enumerate() {
            let outcome = match broken(&results) {
                Some(e) => Err(e),
                None => self.write_exchange(&items[run.clone()], deadline).await,
            };
            gather(&mut results, n == 0, run, outcome)?;
        }
        Ok(results)
    }

    /// One begin, copy, end exchange of a batch that fits a frame, by `deadline`.
    async fn write_exchange(
        &self,
        items: &[WriteItem<'_>],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Result<(), TransferError>>, TransferError> {
        let all = |e: &TransferError| items.iter().map(|_| Err(e.duplicate())).collect::<Vec<_>>();
        let (_permit, mut stream) = self.checkout(deadline).await?;
        let exchange = async {
            let mut w = FrameWriter::new(LocalOp::BeginWrite);
            w.u32(items.len() as u32);
            let lens: Vec<u64> = items.iter().map(|i| i.len()).collect();
            for (i, len) in items.iter().zip(&lens) {
                w.item(Item {
                    offset: i.offset,
                    len: *len,
                    grant: i.stamp.put_id,
                    flags: i.stamp.flags(),
                    seal: i.seal,
                    key: i.key.as_str(),
                });
            }
            let begun = self.call(&mut stream, w.finish(), items.len()).await?;
            let mut results: Vec<Result<(), TransferError>> = Vec::with_capacity(items.len());
            // Every begun item is ended, committed only if its copy succeeded.
            let mut ended: Vec<(usize, u64, u64, bool)> = Vec::new();
            let begun_items: Vec<(usize, &WriteItem<'_>)> = items
                .iter()
                .enumerate()
                .filter(|(i, _)| begun[*i] == 0)
                .collect();
            let mut copied = copy_in_all(
                &self.pool,
                &begun_items
                    .iter()
                    .map(|(_, it)| (it.offset, it.parts))
                    .collect::<Vec<_>>(),
                self.copy_threads,
            )
            .into_iter();
            for (idx, ((item, len), code)) in items.iter().zip(&lens).zip(&begun).enumerate() {
                if *code != 0 {
                    results.push(Err(self.refused(*code, "write")));
                    continue;
                }
                let copied = copied.next().expect("one result per begun item");
                ended.push((idx, item.offset, *len, copied.is_ok()));
                results.push(
                    copied.map_err(|e| self.refused(Code::InvalidParams.as_i32(), &e.to_string())),
                );
            }
            let mut end = FrameWriter::new(LocalOp::EndWrite);
            end.u32(ended.len() as u32);
            for (_, offset, len, commit) in &ended {
                end.u64(*offset).u64(*len).u8(*commit as u8);
            }
            let codes = self.call(&mut stream, end.finish(), ended.len()).await?;
            for ((idx, ..), code) in ended.iter().zip(codes) {
                if code != 0 && results[*idx].is_ok() {
                    results[*idx] = Err(self.refused(code, "write end"));
                }
            }
            Ok::<_, TransferError>(results)
        };
        let outcome = tokio::time::timeout_at(deadline, exchange).await;
        Ok(self.settle(stream, outcome, all))
    }

    pub async fn read_batch(
        &self,
        items: &mut [ReadItem<'_, '_>],
    ) -> Vec<Result<(), TransferError>> {
        let n = items.len();
        self.try_read_batch(items)
            .await
            .unwrap_or_else(|e| (0..n).map(|_| Err(e.duplicate())).collect())
    }

    /// `read_batch`, or the error that left it without a connection (nothing was asked). A
    /// batch too big for one frame goes as several exchanges, as `try_write_batch` says.
    pub async fn try_read_batch(
        &self,
        items: &mut [ReadItem<'_, '_>],
    ) -> Result<Vec<Result<(), TransferError>>, TransferError> {
        let deadline = tokio::time::Instant::now() + self.deadlines.transfer;
        let runs = local::exchanges(items.iter().map(|i| i.key.as_str().len()));
        let mut results = Vec::with_capacity(items.len());
        for (n, run) in runs.into_iter().enumerate() {
            let outcome = match broken(&results) {
                Some(e) => Err(e),
                None => self.read_exchange(&mut items[run.clone()], deadline).await,
            };
            gather(&mut results, n == 0, run, outcome)?;
        }
        Ok(results)
    }

    /// One begin, copy, end exchange of a batch that fits a frame, by `deadline`.
    async fn read_exchange(
        &self,
        items: &mut [ReadItem<'_, '_>],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Result<(), TransferError>>, TransferError> {
        let n = items.len();
        let all = |e: &TransferError| (0..n).map(|_| Err(e.duplicate())).collect::<Vec<_>>();
        let (_permit, mut stream) = self.checkout(deadline).await?;
        let exchange = async {
            let mut w = FrameWriter::new(LocalOp::BeginRead);
            w.u32(n as u32);
            let lens: Vec<u64> = items.iter().map(|i| i.len()).collect();
            for (i, len) in items.iter().zip(&lens) {
                w.item(Item {
                    offset: i.offset,
                    len: *len,
                    grant: i.put_id,
                    flags: 0,
                    seal: i.seal,
                    key: i.key.as_str(),
                });
            }
            let begun = self.call(&mut stream, w.finish(), n).await?;
            let mut results = Vec::with_capacity(n);
            let mut release = Vec::new();
            let mut jobs: Vec<(u64, &mut [&mut [u8]])> = Vec::new();
            for ((item, len), code) in items.iter_mut().zip(&lens).zip(&begun) {
                if *code == 0 {
                    release.push((item.offset, *len));
                    jobs.push((item.offset, &mut *item.parts));
                }
            }
            let mut copied = copy_out_all(&self.pool, &mut jobs, self.copy_threads).into_iter();
            for code in &begun {
                if *code != 0 {
                    results.push(Err(self.refused(*code, "read")));
                    continue;
                }
                let copied = copied.next().expect("one result per begun item");
                results.push(
                    copied.map_err(|e| self.refused(Code::InvalidParams.as_i32(), &e.to_string())),
                );
            }
            if !release.is_empty() {
                let mut end = FrameWriter::new(LocalOp::EndRead);
                end.u32(release.len() as u32);
                for (offset, len) in release {
                    end.u64(offset).u64(len);
                }
                stream
                    .write_all(&end.finish())
                    .await
                    .map_err(|e| self.io_err(e))?;
            }
            Ok::<_, TransferError>(results)
        };
        let outcome = tokio::time::timeout_at(deadline, exchange).await;
        Ok(self.settle(stream, outcome, all))
    }

    /// Ends a batch exchange: the connection goes back to the pool only after a complete
    /// exchange; a failure or the deadline is reported on every item.
    fn settle(
        &self,
        stream: UnixStream,
        outcome: Result<
            Result<Vec<Result<(), TransferError>>, TransferError>,
            tokio::time::error::Elapsed,
        >,
        all: impl Fn(&TransferError) -> Vec<Result<(), TransferError>>,
    ) -> Vec<Result<(), TransferError>> {
        match outcome {
            Ok(Ok(results)) => {
                self.idle.lock().push(stream);
                results
            }
            Ok(Err(e)) => all(&e),
            Err(_) => all(&TransferError::Timeout {
                target: self.segment.clone(),
                after: self.deadlines.transfer,
            }),
        }
    }

    /// Sends a request frame and reads the reply's per-item status codes.
    async fn call(
        &self,
        stream: &mut UnixStream,
        frame: Vec<u8>,
        n: usize,
    ) -> Result<Vec<i32>, TransferError> {
        stream.write_all(&frame).await.map_err(|e| self.io_err(e))?;
        let mut h = [0u8; 5];
        stream
            .read_exact(&mut h)
            .await
            .map_err(|e| self.io_err(e))?;
        let (len, _) = frame_header(h)
            .map_err(|e| self.io_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        let body = mooncake_common::body::read_new_body(stream, len)
            .await
            .map_err(|e| self.io_err(e))?;
        let mut r = FrameReader::new(&body);
        let bad = |e| self.io_err(io::Error::new(io::ErrorKind::InvalidData, e));
        let count = r.count().map_err(bad)?;
        if count != n {
            return Err(self.io_err(io::Error::new(
                io::ErrorKind::InvalidData,
                "owner answered a wrong number of items",
            )));
        }
        (0..n).map(|_| r.i32().map_err(bad)).collect()
    }

    fn refused(&self, code: i32, what: &str) -> TransferError {
        TransferError::Remote {
            target: self.segment.clone(),
            code: Code::from_i32(code),
            message: format!("same-host {what} refused"),
        }
    }
}

/// Opens a control connection: the credential's proof (with one), hello, then the owner's
/// answer with the pool size and its memfd.
fn hello(
    path: &Path,
    segment: &SegmentName,
    timeout: Duration,
    credential: Option<&Credential>,
) -> io::Result<(StdUnixStream, Option<std::os::fd::OwnedFd>, u64)> {
    let mut stream = StdUnixStream::connect(path)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    if let Some(credential) = credential {
        authenticate_blocking(&mut stream, credential).map_err(AuthError::into_io)?;
    }
    let mut w = FrameWriter::new(LocalOp::Hello);
    w.u8(local::VERSION).bytes(segment.as_str().as_bytes());
    stream.write_all(&w.finish())?;
    let mut buf = [0u8; 17];
    let (n, fd) = mapping::recv_with_fd(stream.as_fd(), &mut buf)?;
    if n < buf.len() {
        stream.read_exact(&mut buf[n..])?;
    }
    let (_, op) = frame_header(buf[..5].try_into().expect("5 bytes"))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut r = FrameReader::new(&buf[5..]);
    let status = r
        .i32()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let size = r
        .u64()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if op == LocalOp::Hello && status == Code::Unauthenticated.as_i32() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("owner at {}: {AUTH_REQUIRED}", path.display()),
        ));
    }
    if op == LocalOp::Hello && status == Code::PermissionDenied.as_i32() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "owner at {} does not share its pool with this client's tenant",
                path.display()
            ),
        ));
    }
    if op != LocalOp::Hello || status != 0 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("owner at {} does not serve {segment}", path.display()),
        ));
    }
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    stream.set_nonblocking(true)?;
    Ok((stream, fd, size))
}
