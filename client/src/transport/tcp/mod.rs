//! The TCP data transport: a small pool of connections per owner, one request in flight per
//! connection, payloads sent from and received into the caller's memory with no staging copy.
//! Every call has one deadline, the transfer timeout from its start: waiting for a free
//! connection, connecting and the exchange all end by it, so calls queued behind a silent owner
//! fail together instead of one deadline after another. A connection that saw any error is
//! dropped, never reused.

use std::{
    collections::HashMap,
    io::{self, IoSlice},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use futures::future::{join_all, BoxFuture};
use mooncake_common::{
    auth::{prove, AuthError, Credential, Seal},
    data_socket,
    transport::{parts_len, DataTransport, ReadItem, TransferError, WriteItem},
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code, ObjectKey, SegmentName,
};
use parking_lot::Mutex;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

mod scatter;
mod threads;

#[derive(Debug, Clone)]
pub struct TcpConfig {
    pub connect_timeout: Duration,
    pub transfer_timeout: Duration,
    pub connections_per_owner: usize,
    /// Threads one large batch to one owner may use (each drives one connection); 1 keeps
    /// every transfer on the caller's runtime.
    pub transfer_threads: usize,
    /// A current-thread runtime that polls these transfers runs nothing else, so a large batch
    /// may block it while its threads work. Otherwise batches on such a runtime stay on it (a
    /// multi-threaded runtime hands its other tasks to another thread first).
    pub dedicated_runtime: bool,
    /// Proved on every new connection (owners with a keyring refuse connections without it).
    pub credential: Option<Credential>,
}

pub struct TcpTransport {
    config: TcpConfig,
    owners: Mutex<HashMap<SegmentName, Arc<OwnerConns>>>,
}

struct OwnerConns {
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Conn>>,
    /// Whether the owner is on this host, as its last new connection showed.
    same_host: AtomicBool,
}

struct Conn {
    stream: TcpStream,
    next_id: u64,
    /// Bytes received and not consumed yet: the answers to a batch of small requests arrive
    /// many per `recv`, so they are read through this instead of two syscalls per answer.
    rbuf: Box<[u8]>,
    rpos: usize,
    rend: usize,
}

impl Conn {
    /// False once the owner closed it, or sent bytes nobody asked for (an idle connection
    /// holds none, so the stream would be out of step).
    fn is_open(&self) -> bool {
        self.rpos == self.rend && data_socket::idle_and_open(&self.stream)
    }
}

/// Size of a connection's receive buffer; reads at least half as large bypass it.
const RECV_BUF: usize = 64 << 10;

/// A connection taken from an owner's pool, with its slot and the deadline of the call that took
/// it. Dropped without `give_back`, the connection is closed and the slot freed.
struct Checkout {
    owner: Arc<OwnerConns>,
    conn: Option<Conn>,
    _permit: OwnedSemaphorePermit,
    deadline: Instant,
}

impl Checkout {
    fn give_back(mut self) {
        if let Some(c) = self.conn.take() {
            self.owner.idle.lock().push(c);
        }
    }
}

impl TcpTransport {
    pub fn new(config: TcpConfig) -> Self {
        TcpTransport {
            config,
            owners: Mutex::new(HashMap::new()),
        }
    }

    fn owner(&self, target: &SegmentName) -> Arc<OwnerConns> {
        let mut owners = self.owners.lock();
        if let Some(o) = owners.get(target) {
            return o.clone();
        }
        // An owner not met before is often an old one restarted on another port: the idle
        // connections their owners closed go now, so that departed owners do not keep sockets
        // for the life of the client. The entries stay (their slots and what they learned).
        for o in owners.values() {
            o.idle.lock().retain(Conn::is_open);
        }
        let o = Arc::new(OwnerConns {
            permits: Arc::new(Semaphore::new(self.config.connections_per_owner)),
            idle: Mutex::new(Vec::new()),
            same_host: AtomicBool::new(false),
        });
        owners.insert(target.clone(), o.clone());
        o
    }

    /// Connections to `target` open and waiting in the pool now (every connection of a
    /// finished batch is back there, unless it failed).
    pub fn idle_connections(&self, target: &SegmentName) -> usize {
        self.owner(target).idle.lock().len()
    }

    /// The deadline of a call starting now.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.config.transfer_timeout
    }

    fn timed_out(&self, target: &SegmentName) -> TransferError {
        TransferError::Timeout {
            target: target.clone(),
            after: self.config.transfer_timeout,
        }
    }

    /// Slots for `n` connections to `target` (all in one step, so two batches never hold part
    /// of what each other waits for), waited for until `deadline`.
    async fn permits(
        &self,
        target: &SegmentName,
        owner: &OwnerConns,
        n: usize,
        deadline: Instant,
    ) -> Result<OwnedSemaphorePermit, TransferError> {
        let acquire = owner.permits.clone().acquire_many_owned(n as u32);
        match tokio::time::timeout_at(deadline, acquire).await {
            Ok(permit) => Ok(permit.expect("semaphore never closed")),
            Err(_) => Err(self.timed_out(target)),
        }
    }

    /// Takes an idle connection to `target`, or opens one, once fewer than the limit are busy.
    async fn checkout(
        &self,
        target: &SegmentName,
        deadline: Instant,
    ) -> Result<Checkout, TransferError> {
        let owner = self.owner(target);
        let permit = self.permits(target, &owner, 1, deadline).await?;
        self.take(target, owner, permit, deadline).await
    }

    /// Under a slot already held: an idle connection of the pool, or a new one.
    async fn take(
        &self,
        target: &SegmentName,
        owner: Arc<OwnerConns>,
        permit: OwnedSemaphorePermit,
        deadline: Instant,
    ) -> Result<Checkout, TransferError> {
        // An idle connection the owner closed meanwhile (it restarted, say, on the same port)
        // is dropped, not used: its write would pass and its read fail the whole chunk.
        let pooled = loop {
            let Some(c) = owner.idle.lock().pop() else {
                break None;
            };
            if c.is_open() {
                break Some(c);
            }
        };
        let conn = match pooled {
            Some(c) => c,
            None => {
                let c = self.connect(target, deadline).await?;
                owner
                    .same_host
                    .store(data_socket::same_host(&c.stream), Ordering::Relaxed);
                c
            }
        };
        Ok(Checkout {
            owner,
            conn: Some(conn),
            _permit: permit,
            deadline,
        })
    }

    /// Runs one exchange under the transfer deadline; the connection goes back to the pool only
    /// if the exchange left it at a frame boundary (success or a refusal).
    async fn exchange<T>(
        &self,
        target: &SegmentName,
        checkout: Checkout,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, TransferError>,
    ) -> Result<T, TransferError> {
        let (result, reusable) = self.exchange_keep(target, checkout, f).await;
        if let Some(c) = reusable {
            c.give_back();
        }
        result
    }

    /// `exchange`, handing the connection back to the caller when it is fit for reuse.
    async fn exchange_keep<T>(
        &self,
        target: &SegmentName,
        mut checkout: Checkout,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, TransferError>,
    ) -> (Result<T, TransferError>, Option<Checkout>) {
        let deadline = checkout.deadline;
        let conn = checkout.conn.as_mut().expect("checked out");
        match tokio::time::timeout_at(deadline, f(conn)).await {
            Ok(Ok(v)) => (Ok(v), Some(checkout)),
            Ok(Err(e @ TransferError::Remote { .. })) => (Err(e), Some(checkout)),
            Ok(Err(e)) => (Err(e), None),
            Err(_) => (Err(self.timed_out(target)), None),
        }
    }

    /// Opens a connection: within the connect timeout, and by the call's deadline.
    async fn connect(
        &self,
        target: &SegmentName,
        deadline: Instant,
    ) -> Result<Conn, TransferError> {
        let err = |source| TransferError::Connect {
            target: target.clone(),
            source,
        };
        let until = deadline.min(Instant::now() + self.config.connect_timeout);
        let stream = match tokio::time::timeout_at(until, TcpStream::connect(target.as_str())).await
        {
            Ok(r) => r.map_err(err)?,
            Err(_) if until == deadline => return Err(self.timed_out(target)),
            Err(_) => {
                return Err(err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connect timed out",
                )))
            }
        };
        data_socket::tune(&stream).map_err(err)?;
        let mut stream = stream;
        prove(
            &mut stream,
            self.config.credential.as_ref(),
            until.saturating_duration_since(Instant::now()),
        )
        .await
        .map_err(|e| match e {
            // The handshake did not finish (a silent or restarting owner, the deadline): a
            // connection that failed, not the owner's refusal.
            AuthError::Io(source)
                if source.kind() == io::ErrorKind::TimedOut && until == deadline =>
            {
                self.timed_out(target)
            }
            AuthError::Io(source) => err(source),
            e => TransferError::Remote {
                target: target.clone(),
                code: e.code(),
                message: e.to_string(),
            },
        })?;
        Ok(Conn {
            stream,
            next_id: 1,
            rbuf: vec![0u8; RECV_BUF].into_boxed_slice(),
            rpos: 0,
            rend: 0,
        })
    }
}

impl Conn {
    /// Fills `dst`: first from what is buffered, then from the socket, large reads straight into
    /// `dst` (no staging copy), small ones through the buffer.
    async fn read_exact(&mut self, dst: &mut [u8]) -> io::Result<()> {
        self.read_exact_capped(dst, RECV_BUF).await
    }

    /// `read_exact`, buffering at most `cap` bytes per receive: a header followed by a large
    /// payload is read alone, so the payload lands in the caller's memory without a stop in the
    /// buffer.
    async fn read_exact_capped(&mut self, dst: &mut [u8], cap: usize) -> io::Result<()> {
        let n = (self.rend - self.rpos).min(dst.len());
        dst[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        let mut dst = &mut dst[n..];
        if dst.is_empty() {
            return Ok(());
        }
        // The buffer is empty now.
        (self.rpos, self.rend) = (0, 0);
        if dst.len() >= RECV_BUF / 2 {
            self.stream.read_exact(dst).await?;
            return Ok(());
        }
        let cap = cap.clamp(dst.len(), RECV_BUF);
        while !dst.is_empty() {
            let got = self.stream.read(&mut self.rbuf[self.rend..cap]).await?;
            if got == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.rend += got;
            let n = (self.rend - self.rpos).min(dst.len());
            dst[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
            self.rpos += n;
            dst = &mut dst[n..];
        }
        Ok(())
    }

    /// Sends one request; returns its id.
    async fn send(&mut self, frame: Frame<'_>) -> io::Result<u64> {
        self.send_pipelined(std::iter::once(frame)).await
    }

    /// Reads a response header (that of a payload of `expect` bytes, `u64::MAX`: any); on a
    /// refusal, also its message. An answer of another length is an error: what the stream
    /// carries after it would be read as the next answer.
    async fn receive(
        &mut self,
        target: &SegmentName,
        op: Op,
        request_id: u64,
        expect: u64,
    ) -> Result<ResponseHeader, TransferError> {
        let io_err = |source| TransferError::Io {
            target: target.clone(),
            source,
        };
        let mut hb = [0u8; wire::RESPONSE_HEADER_LEN];
        let cap = if expect >= (RECV_BUF / 2) as u64 {
            hb.len()
        } else {
            RECV_BUF
        };
        self.read_exact_capped(&mut hb, cap).await.map_err(io_err)?;
        let h = ResponseHeader::decode(&hb).map_err(|source| TransferError::Protocol {
            target: target.clone(),
            source,
        })?;
        if h.request_id != request_id || (h.op != op && h.status == 0) {
            return Err(io_err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "response {} does not match request {request_id}",
                    h.request_id
                ),
            )));
        }
        if h.status != 0 {
            let mut msg = vec![0u8; h.length as usize];
            self.read_exact(&mut msg).await.map_err(io_err)?;
            return Err(TransferError::Remote {
                target: target.clone(),
                code: h.code(),
                message: String::from_utf8_lossy(&msg).into_owned(),
            });
        }
        if expect != u64::MAX && h.length != expect {
            return Err(io_err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("owner sent {} bytes, {expect} were asked for", h.length),
            )));
        }
        Ok(h)
    }
}

async fn write_all_vectored(
    stream: &mut TcpStream,
    mut slices: &mut [IoSlice<'_>],
) -> io::Result<()> {
    // writev takes at most IOV_MAX (1024) buffers per call.
    const MAX_IOV: usize = 512;
    while !slices.is_empty() {
        let end = slices.len().min(MAX_IOV);
        let n = stream.write_vectored(&slices[..end]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Bytes per connection below which a batch is not spread over more connections.
const BYTES_PER_CONNECTION: u64 = 1 << 20;

/// Which way a batch's payloads flow.
#[derive(Clone, Copy, PartialEq)]
enum Flow {
    /// To the owner: the caller sends.
    Writes,
    /// From the owner: the owner sends, the caller receives.
    Reads,
}

impl TcpTransport {
    /// Into how many contiguous chunks (one connection each) a batch on one thread is split.
    ///
    /// Reads from an owner on this host take one connection. The caller's one thread receives
    /// them all either way, and more connections only spread the owner's sending over more of
    /// its threads; on loopback the sending core also runs the receiver's protocol work, so
    /// those threads compete for the cores with the receiving caller. Measured here (2 cores,
    /// kvbench over TCP, 2 interleaved rounds): gets of 256 KiB x8 2.49-2.69 -> 3.30-3.37 GiB/s,
    /// 1 MiB x8 3.10-3.12 -> 3.65-4.03, 64 KiB x64 2.93-2.94 -> 3.63-3.71. Between hosts the
    /// receiver's protocol work is its own (and spreads over its cores by flow), so batches
    /// keep spreading by size, as writes do everywhere.
    fn fan_out(&self, owner: &OwnerConns, flow: Flow, items: usize, bytes: u64) -> usize {
        if flow == Flow::Reads && owner.same_host.load(Ordering::Relaxed) {
            return 1;
        }
        ((bytes / BYTES_PER_CONNECTION) as usize + 1)
            .min(self.config.connections_per_owner)
            .min(items)
            .max(1)
    }

    /// Sends every write of `items` on one connection back to back, then reads the answers:
    /// one round trip for the chunk instead of one per object (per window: see `windows`).
    async fn pipelined_writes(
        &self,
        target: &SegmentName,
        checkout: Checkout,
        items: &[WriteItem<'_>],
        op: Op,
    ) -> (Vec<Result<(), TransferError>>, Option<Checkout>) {
        let n = items.len();
        let mut out = Vec::with_capacity(n);
        let (res, reusable) = self
            .exchange_keep(target, checkout, async |conn: &mut Conn| {
                let io_err = |source| TransferError::Io {
                    target: target.clone(),
                    source,
                };
                // An answer may be a refusal with its message.
                let sizes = items
                    .iter()
                    .map(|it| (request_bytes(it.key) + it.len(), answer_bytes(0)));
                for window in windows(sizes) {
                    let items = &items[window];
                    let first = conn
                        .send_pipelined(items.iter().map(|it| Frame::write(op, it)))
                        .await
                        .map_err(io_err)?;
                    for i in 0..items.len() {
                        match conn.receive(target, op, first + i as u64, 0).await {
                            Ok(_) => out.push(Ok(())),
                            // A refusal keeps the stream in step; go on with the next answer.
                            Err(e @ TransferError::Remote { .. }) => out.push(Err(e)),
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            })
            .await;
        (answered(out, n, res), reusable)
    }

    /// Sends every read request of `items` back to back, then receives the payloads in order
    /// (per window: see `windows`). `op` is a memory read, or a disk read (where each item's
    /// offset is the object's version).
    async fn pipelined_reads(
        &self,
        target: &SegmentName,
        checkout: Checkout,
        items: &mut [ReadItem<'_, '_>],
        op: Op,
    ) -> (Vec<Result<(), TransferError>>, Option<Checkout>) {
        let n = items.len();
        let mut out: Vec<Result<(), TransferError>> = Vec::with_capacity(n);
        let (res, reusable) = self
            .exchange_keep(target, checkout, async |conn: &mut Conn| {
                let io_err = |source| TransferError::Io {
                    target: target.clone(),
                    source,
                };
                let all_lens: Vec<u64> = items.iter().map(|it| it.len()).collect();
                let sizes = items
                    .iter()
                    .zip(&all_lens)
                    .map(|(it, len)| (request_bytes(it.key), answer_bytes(*len)));
                for window in windows(sizes) {
                    let lens = &all_lens[window.clone()];
                    let items = &mut items[window];
                    let first = conn
                        .send_pipelined(
                            items
                                .iter()
                                .zip(lens)
                                .map(|(it, len)| Frame::read(op, it, *len)),
                        )
                        .await
                        .map_err(io_err)?;
                    // Small answers land by the dozen per receive, straight where they belong;
                    // from a refusal on (if any), one at a time through the buffer.
                    let small = lens.iter().all(|l| *l < (RECV_BUF / 2) as u64);
                    let landed = if small && conn.rpos == conn.rend {
                        conn.receive_scattered(target, op, first, items, lens)
                            .await?
                    } else {
                        0
                    };
                    out.extend((0..landed).map(|_| Ok(())));
                    for (i, (it, len)) in items.iter_mut().zip(lens).enumerate().skip(landed) {
                        match conn.receive(target, op, first + i as u64, *len).await {
                            Ok(h) if h.length == *len => {
                                for part in it.parts.iter_mut() {
                                    conn.read_exact(part).await.map_err(io_err)?;
                                }
                                out.push(Ok(()));
                            }
                            Ok(h) => {
                                return Err(io_err(io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    format!("owner sent {} bytes, {len} were asked for", h.length),
                                )))
                            }
                            Err(e @ TransferError::Remote { .. }) => out.push(Err(e)),
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            })
            .await;
        (answered(out, n, res), reusable)
    }
}

/// A pipelined batch's results: those of the items the owner answered, then, for the rest, the
/// error that ended the exchange (a connection that broke, the deadline), so items already
/// written or read are not reported failed. An owner that refused the caller's credential
/// closes the connection after its refusal: the rest fail with that refusal, not a broken pipe.
fn answered(
    mut out: Vec<Result<(), TransferError>>,
    n: usize,
    ended: Result<(), TransferError>,
) -> Vec<Result<(), TransferError>> {
    if let Err(e) = ended {
        let e = match out.last() {
            Some(Err(refusal @ TransferError::Remote { code, .. }))
                if *code == Code::Unauthenticated =>
            {
                refusal.duplicate()
            }
            _ => e,
        };
        out.truncate(n);
        while out.len() < n {
            out.push(Err(e.duplicate()));
        }
    }
    out
}

/// The most bytes the answer to a request for `len` bytes may take: the value, or a refusal
/// with its message, whichever is longer.
fn answer_bytes(len: u64) -> u64 {
    wire::RESPONSE_HEADER_LEN as u64 + len.max(wire::MAX_ERROR_MESSAGE)
}

/// Bytes a window of a pipelined batch may send, or be answered with, before the caller reads:
/// half a data socket's send buffer (see `data_socket`).
const WINDOW_BYTES: u64 = 512 << 10;

/// Bytes of a request for `key` without its payload.
fn request_bytes(key: &ObjectKey) -> u64 {
    (wire::REQUEST_HEADER_LEN + key.as_str().len()) as u64
}

/// Splits a pipelined batch, given each item's (request bytes, answer bytes), into windows the
/// caller sends and reads one after the other. An owner stops reading while it sends answers
/// the caller has not read yet, and the caller reads only once it has sent its window: if both
/// the requests and the answers outgrew the socket buffers, each would wait for the other until
/// a deadline. A window's requests or its answers therefore fit in one send buffer
/// (`WINDOW_BYTES`), so the caller's sending or the owner's answering never waits: reads of
/// many small values are cut by their requests, writes of many values by their answers (each
/// counted as a refusal with its message, `answer_bytes`: about 500 writes a window). A batch
/// of 8-64 values is one window.
fn windows(sizes: impl Iterator<Item = (u64, u64)>) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut sent, mut answered) = (0, 0u64, 0u64);
    let mut n = 0;
    for (i, (request, answer)) in sizes.enumerate() {
        n = i + 1;
        if i > start && sent + request > WINDOW_BYTES && answered + answer > WINDOW_BYTES {
            out.push(start..i);
            (start, sent, answered) = (i, 0, 0);
        }
        sent += request;
        answered += answer;
    }
    if n > start {
        out.push(start..n);
    }
    out
}

impl TcpTransport {
    /// How many threads (1: the caller's runtime only) and connections a batch to `target`
    /// gets.
    fn split_plan(
        &self,
        target: &SegmentName,
        flow: Flow,
        items: usize,
        bytes: u64,
    ) -> (usize, usize) {
        match self.threads_for(items, bytes) {
            1 => (1, self.fan_out(&self.owner(target), flow, items, bytes)),
            t => (t, t),
        }
    }

    /// Splits a batch of reads over connections by size and pipelines each chunk; a batch of
    /// several MiB goes over several threads.
    async fn spread_reads<'k, 'b>(
        &self,
        target: &SegmentName,
        items: &mut [ReadItem<'k, 'b>],
        op: Op,
        deadline: Instant,
    ) -> Vec<Result<(), TransferError>> {
        let bytes = items.iter().map(|i| i.len()).sum();
        let (threads, k) = self.split_plan(target, Flow::Reads, items.len(), bytes);
        let bounds = chunk_bounds(items.len(), k);
        let mut rest: &mut [ReadItem<'k, 'b>] = items;
        let mut chunks = Vec::with_capacity(k);
        for (a, b) in bounds {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(b - a);
            chunks.push((b - a, head));
            rest = tail;
        }
        let results = if threads > 1 {
            self.on_threads(target, chunks, deadline, |checkout, chunk| {
                self.pipelined_reads(target, checkout, chunk, op)
            })
            .await
        } else {
            join_all(chunks.into_iter().map(|(n, c)| async move {
                match self.checkout(target, deadline).await {
                    Ok(checkout) => keep(self.pipelined_reads(target, checkout, c, op).await),
                    Err(e) => fail_all(n, &e),
                }
            }))
            .await
        };
        results.into_iter().flatten().collect()
    }

    /// Splits a batch of writes like `spread_reads` does reads.
    async fn spread_writes(
        &self,
        target: &SegmentName,
        items: &[WriteItem<'_>],
        op: Op,
        deadline: Instant,
    ) -> Vec<Result<(), TransferError>> {
        let bytes = items.iter().map(|i| i.len()).sum();
        let (threads, k) = self.split_plan(target, Flow::Writes, items.len(), bytes);
        let chunks: Vec<(usize, &[WriteItem<'_>])> = chunk_bounds(items.len(), k)
            .into_iter()
            .map(|(a, b)| (b - a, &items[a..b]))
            .collect();
        let results = if threads > 1 {
            self.on_threads(target, chunks, deadline, |checkout, chunk| {
                self.pipelined_writes(target, checkout, chunk, op)
            })
            .await
        } else {
            join_all(chunks.into_iter().map(|(n, c)| async move {
                match self.checkout(target, deadline).await {
                    Ok(checkout) => keep(self.pipelined_writes(target, checkout, c, op).await),
                    Err(e) => fail_all(n, &e),
                }
            }))
            .await
        };
        results.into_iter().flatten().collect()
    }
}

/// The transfer engine's calls (see the `engine` crate): the same connections, pipelining and
/// threads as the store's, with address-based requests. Each item's key names the target
/// (`host:port`), its offset is the target's address, and the target checks every range against
/// the regions it registered.
impl TcpTransport {
    /// Every item is written or has failed by `deadline`.
    pub async fn peer_write_batch(
        &self,
        target: &SegmentName,
        items: &[WriteItem<'_>],
        deadline: Instant,
    ) -> Vec<Result<(), TransferError>> {
        self.spread_writes(target, items, Op::PeerWrite, deadline)
            .await
    }

    /// Every item is read or has failed by `deadline`.
    pub async fn peer_read_batch(
        &self,
        target: &SegmentName,
        items: &mut [ReadItem<'_, '_>],
        deadline: Instant,
    ) -> Vec<Result<(), TransferError>> {
        self.spread_reads(target, items, Op::PeerRead, deadline)
            .await
    }

    /// The target's registered regions, (address, length) each.
    pub async fn peer_regions(
        &self,
        target: &SegmentName,
        name: &ObjectKey,
        deadline: Instant,
    ) -> Result<Vec<(u64, u64)>, TransferError> {
        let checkout = self.checkout(target, deadline).await?;
        self.exchange(target, checkout, async |conn: &mut Conn| {
            let io_err = |source| TransferError::Io {
                target: target.clone(),
                source,
            };
            let frame = Frame::query(Op::PeerRegions, name);
            let id = conn.send(frame).await.map_err(io_err)?;
            let h = conn.receive(target, Op::PeerRegions, id, u64::MAX).await?;
            if h.length % 16 != 0 || h.length > wire::MAX_ERROR_MESSAGE * 1024 {
                return Err(io_err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a region list of {} bytes", h.length),
                )));
            }
            let mut raw = vec![0u8; h.length as usize];
            conn.read_exact(&mut raw).await.map_err(io_err)?;
            Ok(raw
                .chunks_exact(16)
                .map(|c| {
                    let (a, l) = c.split_at(8);
                    (
                        u64::from_le_bytes(a.try_into().expect("8 bytes")),
                        u64::from_le_bytes(l.try_into().expect("8 bytes")),
                    )
                })
                .collect())
        })
        .await
    }
}

/// Puts a connection fit for reuse back in its pool; returns the chunk's results.
fn keep(
    (results, reusable): (Vec<Result<(), TransferError>>, Option<Checkout>),
) -> Vec<Result<(), TransferError>> {
    if let Some(c) = reusable {
        c.give_back();
    }
    results
}

/// A connection-level failure, reported on every item it affected.
fn fail_all(n: usize, e: &TransferError) -> Vec<Result<(), TransferError>> {
    (0..n).map(|_| Err(e.duplicate())).collect()
}

/// One request as it goes on the wire: its header's fields, its key and its payload.
#[derive(Clone, Copy)]
struct Frame<'a> {
    op: Op,
    key: &'a ObjectKey,
    offset: u64,
    length: u64,
    flags: u16,
    grant: u64,
    seal: Seal,
    payload: &'a [&'a [u8]],
}

impl<'a> Frame<'a> {
    /// A store write, or a transfer engine's write to an address.
    fn write(op: Op, item: &WriteItem<'a>) -> Self {
        Frame {
            op,
            key: item.key,
            offset: item.offset,
            length: parts_len(item.parts),
            flags: item.stamp.flags(),
            grant: item.stamp.put_id,
            seal: item.seal,
            payload: item.parts,
        }
    }

    /// A memory or disk read of the item's `length` bytes.
    fn read(op: Op, item: &ReadItem<'a, '_>, length: u64) -> Self {
        Frame {
            op,
            key: item.key,
            offset: if op == Op::ReadDisk { 0 } else { item.offset },
            length,
            flags: 0,
            grant: item.put_id,
            seal: item.seal,
            payload: &[],
        }
    }

    /// A request about the target itself (no range, no payload).
    fn query(op: Op, key: &'a ObjectKey) -> Self {
        Frame {
            op,
            key,
            offset: 0,
            length: 0,
            flags: 0,
            grant: 0,
            seal: Seal::default(),
            payload: &[],
        }
    }
}

impl Conn {
    /// Sends `frames` back to back, in vectored writes; returns the first request's id (the
    /// others follow in order).
    async fn send_pipelined<'a>(
        &mut self,
        frames: impl Iterator<Item = Frame<'a>> + Clone,
    ) -> io::Result<u64> {
        let first = self.next_id;
        let headers: Vec<[u8; wire::REQUEST_HEADER_LEN]> = frames
            .clone()
            .enumerate()
            .map(|(i, f)| {
                RequestHeader {
                    op: f.op,
                    key_len: f.key.as_str().len() as u16,
                    flags: f.flags,
                    request_id: first + i as u64,
                    offset: f.offset,
                    length: f.length,
                    grant: f.grant,
                    seal: f.seal,
                }
                .encode()
            })
            .collect();
        self.next_id += headers.len() as u64;
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(headers.len() * 3);
        for (h, f) in headers.iter().zip(frames) {
            slices.push(IoSlice::new(h));
            slices.push(IoSlice::new(f.key.as_str().as_bytes()));
            slices.extend(f.payload.iter().map(|p| IoSlice::new(p)));
        }
        write_all_vectored(&mut self.stream, &mut slices).await?;
        Ok(first)
    }
}

/// Splits `n` items into `k` contiguous chunks of nearly equal size.
fn chunk_bounds(n: usize, k: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (n / k, n % k);
    let mut out = Vec::with_capacity(k);
    let mut start = 0;
    for i in 0..k {
        let len = base + usize::from(i < extra);
        out.push((start, start + len));
        start += len;
    }
    out
}

impl DataTransport for TcpTransport {
    fn write_batch<'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a [WriteItem<'a>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(self.spread_writes(target, items, Op::Write, self.deadline()))
    }

    fn read_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(self.spread_reads(target, items, Op::Read, self.deadline()))
    }

    fn read_disk_batch<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        items: &'a mut [ReadItem<'k, 'b>],
    ) -> BoxFuture<'a, Vec<Result<(), TransferError>>> {
        Box::pin(self.spread_reads(target, items, Op::ReadDisk, self.deadline()))
    }

    fn write<'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a WriteItem<'a>,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            let checkout = self.checkout(target, self.deadline()).await?;
            self.exchange(target, checkout, async |conn: &mut Conn| {
                let id = conn
                    .send(Frame::write(Op::Write, item))
                    .await
                    .map_err(|source| TransferError::Io {
                        target: target.clone(),
                        source,
                    })?;
                conn.receive(target, Op::Write, id, 0).await.map(|_| ())
            })
            .await
        })
    }

    fn read<'a, 'k: 'a, 'b: 'a>(
        &'a self,
        target: &'a SegmentName,
        item: &'a mut ReadItem<'k, 'b>,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            let checkout = self.checkout(target, self.deadline()).await?;
            let length = item.len();
            self.exchange(target, checkout, async |conn: &mut Conn| {
                let io_err = |source| TransferError::Io {
                    target: target.clone(),
                    source,
                };
                let id = conn
                    .send(Frame::read(Op::Read, item, length))
                    .await
                    .map_err(io_err)?;
                let h = conn.receive(target, Op::Read, id, length).await?;
                if h.length != length {
                    // The stream now carries a payload nobody reads: drop the connection.
                    return Err(io_err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("owner sent {} bytes, {length} were asked for", h.length),
                    )));
                }
                for part in item.parts.iter_mut() {
                    conn.read_exact(part).await.map_err(io_err)?;
                }
                Ok(())
            })
            .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelined_batches_go_in_windows_that_cannot_block_both_ways() {
        // A usual batch is one window, and so is an empty one (none).
        let reads = |n: usize, key: u64, len: u64| vec![(64 + key, 24 + len); n];
        assert_eq!(windows(reads(64, 100, 4096).into_iter()), vec![0..64]);
        assert!(windows(std::iter::empty()).is_empty());
        // Many reads of small values: cut by their requests (164 bytes each: 3196 fit).
        let w = windows(reads(10_000, 100, 4096).into_iter());
        assert_eq!(w[0], 0..3196);
        assert_eq!(w.last().unwrap().end, 10_000);
        assert!(w.windows(2).all(|p| p[0].end == p[1].start));
        // Large writes: one window until their answers (24 bytes each) fill one.
        let writes = vec![(64 + 100 + (4 << 20), 24); 30_000];
        let w = windows(writes.into_iter());
        assert_eq!(w[0], 0..21_845);
        assert_eq!(w[1], 21_845..30_000);
        // Each window's requests or answers fit in a send buffer.
        let mixed: Vec<(u64, u64)> = (0..5000u64)
            .map(|i| {
                if i % 2 == 0 {
                    (4160, 4120)
                } else {
                    (70 << 10, 24)
                }
            })
            .collect();
        for r in windows(mixed.iter().copied()) {
            let sent: u64 = mixed[r.clone()].iter().map(|x| x.0).sum();
            let answered: u64 = mixed[r.clone()].iter().map(|x| x.1).sum();
            assert!(sent <= WINDOW_BYTES || answered <= WINDOW_BYTES, "{r:?}");
        }
    }

    #[test]
    fn an_exchange_cut_short_keeps_the_answers_it_got() {
        let seg = SegmentName::parse("127.0.0.1:1").unwrap();
        let broke = || TransferError::Io {
            target: seg.clone(),
            source: io::Error::from(io::ErrorKind::BrokenPipe),
        };
        let refused = |code| TransferError::Remote {
            target: seg.clone(),
            code,
            message: "no".into(),
        };
        let codes = |r: Vec<Result<(), TransferError>>| {
            r.into_iter()
                .map(|r| r.err().map(|e| e.code()))
                .collect::<Vec<_>>()
        };
        // Answered items keep their results; the rest get the error that ended the exchange.
        let out = vec![Ok(()), Err(refused(Code::PermissionDenied))];
        assert_eq!(
            codes(answered(out, 4, Err(broke()))),
            [
                None,
                Some(Code::PermissionDenied),
                Some(Code::TransferFail),
                Some(Code::TransferFail)
            ]
        );
        // After a refusal of the credential (the owner closes), the rest get that refusal.
        let out = vec![Err(refused(Code::Unauthenticated))];
        assert_eq!(
            codes(answered(out, 3, Err(broke()))),
            [Some(Code::Unauthenticated); 3]
        );
        assert_eq!(codes(answered(vec![Ok(())], 1, Ok(()))), [None]);
    }

    fn transport() -> TcpTransport {
        TcpTransport::new(TcpConfig {
            connect_timeout: Duration::from_secs(1),
            transfer_timeout: Duration::from_secs(1),
            connections_per_owner: 4,
            transfer_threads: 1,
            dedicated_runtime: false,
            credential: None,
        })
    }

    /// An owner that accepts and never answers the handshake: the transfer fails as a
    /// connection that timed out (TRANSFER_FAIL), not as the owner's refusal with RPC_FAIL.
    #[tokio::test]
    async fn a_handshake_nobody_answers_is_a_timeout_not_a_refusal() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = SegmentName::parse(&listener.local_addr().unwrap().to_string()).unwrap();
        let held = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(10)).await;
            drop(s);
        });
        let t = TcpTransport::new(TcpConfig {
            credential: Some(Credential::new("cluster", b"secret").unwrap()),
            ..transport().config
        });
        let key = ObjectKey::new("k").unwrap();
        let parts: [&[u8]; 1] = [b"value"];
        let items = [WriteItem {
            key: &key,
            offset: 0,
            stamp: mooncake_common::Stamp::default(),
            seal: Default::default(),
            parts: &parts,
        }];
        let res = t.write_batch(&target, &items).await;
        let e = res[0].as_ref().unwrap_err();
        assert!(matches!(e, TransferError::Timeout { .. }), "{e}");
        assert_eq!(e.code(), mooncake_common::Code::TransferFail);
        held.abort();
    }

    #[test]
    fn batches_spread_by_size_except_reads_from_this_host() {
        let t = transport();
        let owner = t.owner(&SegmentName::parse("127.0.0.1:1").unwrap());
        let mib = 1u64 << 20;
        // Not known to be on this host (no connection yet, or a remote one): one connection a MiB
        // and one more, at most the pool's and one per item.
        for flow in [Flow::Reads, Flow::Writes] {
            assert_eq!(t.fan_out(&owner, flow, 6, 6 * mib), 4);
            assert_eq!(t.fan_out(&owner, flow, 2, 6 * mib), 2);
            assert_eq!(t.fan_out(&owner, flow, 64, mib / 2), 1);
        }
        owner.same_host.store(true, Ordering::Relaxed);
        assert_eq!(t.fan_out(&owner, Flow::Reads, 6, 6 * mib), 1);
        assert_eq!(t.fan_out(&owner, Flow::Writes, 6, 6 * mib), 4);
    }
}
