//! The TCP data plane: reads and writes of (offset, length) ranges of the pool, each checked
//! against the segment, with payloads moved straight between the socket and the pool. A bad frame
//! gets an error reply (and, when the stream cannot be resynchronised, a closed connection); it
//! never takes the server down or touches memory outside the segment.

use std::{io, sync::Arc, time::Duration};

use mooncake_common::{
    auth::{admit_tcp, Access, Admission, AUTH_REQUIRED, CLUSTER},
    data_socket,
    tenant::Tenant,
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code, ObjectKey, Stamp,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    net::{TcpListener, TcpStream},
    sync::watch,
};

use crate::{
    catalog::Catalog,
    pool::{MemoryPool, Supersession},
    replies::Replies,
    seals::{Denied, Gate, Seals},
    ssd::SsdStore,
};

/// Serves connections until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    pool: Arc<MemoryPool>,
    catalog: Arc<Catalog>,
    ssd: Option<Arc<SsdStore>>,
    gate: Option<Arc<Gate>>,
    frame_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((mut stream, peer)) => {
                    let (pool, catalog, ssd, stop) = (pool.clone(), catalog.clone(), ssd.clone(), stop.clone());
                    let gate = gate.clone();
                    tokio::spawn(async move {
                        let keyring = gate.as_ref().map(|g| &g.keyring);
                        let served = match admit_tcp(&mut stream, keyring, frame_timeout).await {
                            Ok(Admission::Unauthenticated) => refuse(stream, frame_timeout).await,
                            Ok(admitted) => match scope_of(admitted) {
                                Ok(tenant) => Connection::new(stream, pool, catalog, ssd, gate, frame_timeout, tenant).run(stop).await,
                                Err(e) => Err(e),
                            },
                            Err(e) => Err(e),
                        };
                        if let Err(e) = served {
                            tracing::debug!(%peer, error = %e, "data-plane connection closed");
                        }
                    });
                }
                Err(e) => {
                    // Out of fds or similar: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// The tenant whose keys alone a connection may touch: its peer's, when it proved a tenant's
/// token (the seals it carries then must be for that tenant's keys, as the master's calls are:
/// a seal seen on the wire is not a bearer token for another tenant); None for the cluster's
/// secret and for an owner without one.
fn scope_of(admitted: Admission) -> io::Result<Option<Tenant>> {
    match admitted {
        Admission::Authenticated(id) if id != CLUSTER => Tenant::parse(&id)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e)),
        _ => Ok(None),
    }
}

/// Answers the first request of a peer that did not authenticate with `Code::Unauthenticated`
/// and the reason, then closes. A small request is read whole first, and after the answer the
/// rest (up to 1 MiB) is drained behind a FIN, so that closing does not reset the connection
/// before the peer has read the answer; a peer that sent more than that may still see a reset.
async fn refuse(mut stream: TcpStream, timeout: Duration) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    within(timeout, "send its first request", async {
        let mut h = [0u8; wire::REQUEST_HEADER_LEN];
        stream.read_exact(&mut h).await?;
        let header =
            RequestHeader::decode(&h).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if header.body_len() <= 1 << 20 {
            // Read as it arrives: the length is the unauthenticated peer's word.
            mooncake_common::body::read_new_body(&mut stream, header.body_len() as usize).await?;
        }
        let why = AUTH_REQUIRED.as_bytes();
        let answer = ResponseHeader {
            op: header.op,
            status: Code::Unauthenticated.as_i32(),
            request_id: header.request_id,
            length: why.len() as u64,
        };
        stream.write_all(&answer.encode()).await?;
        stream.write_all(why).await?;
        stream.flush().await?;
        // Closed gently: the peer's other requests (a batch) are read and dropped after a FIN,
        // up to 1 MiB, so closing with them unread does not reset the connection before the
        // peer has read the answer.
        stream.shutdown().await?;
        let mut sink = vec![0u8; 64 << 10];
        let mut left = 1usize << 20;
        while left > 0 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        Ok(())
    })
    .await
}

/// Runs `io` under `timeout`; running out is an error naming what the peer did not do.
async fn within<T>(
    timeout: Duration,
    what: &str,
    io: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    tokio::time::timeout(timeout, io).await.unwrap_or_else(|_| {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("peer did not {what} within {timeout:?}"),
        ))
    })
}

/// Size of a connection's read buffer.
const READ_BUF: usize = 64 << 10;

/// How long answers already queued may take to go out before a failing connection closes.
const FLUSH_BEFORE_CLOSE: Duration = Duration::from_secs(1);

struct Connection {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    replies: Replies,
    pool: Arc<MemoryPool>,
    catalog: Arc<Catalog>,
    ssd: Option<Arc<SsdStore>>,
    /// The master's seals every access must carry (a cluster with a secret).
    gate: Option<Arc<Gate>>,
    /// The tenant whose keys alone this connection may touch (see `scope_of`).
    tenant: Option<Tenant>,
    frame_timeout: Duration,
    key_buf: Vec<u8>,
}

/// Forgets what a range held unless the write into it finished. Declared after the range's write
/// guard, so on drop it runs before the guard lets readers in.
struct ForgetUnlessFinished<'a> {
    catalog: &'a Catalog,
    offset: u64,
    len: u64,
    finished: bool,
}

impl Drop for ForgetUnlessFinished<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.catalog.forget(self.offset, self.len);
        }
    }
}

/// Why a request was refused while the connection stays usable.
struct Refusal {
    code: Code,
    message: String,
}

impl Connection {
    fn new(
        stream: TcpStream,
        pool: Arc<MemoryPool>,
        catalog: Arc<Catalog>,
        ssd: Option<Arc<SsdStore>>,
        gate: Option<Arc<Gate>>,
        frame_timeout: Duration,
        tenant: Option<Tenant>,
    ) -> Self {
        if let Err(e) = data_socket::tune(&stream) {
            tracing::debug!(error = %e, "data-plane socket options not set");
        }
        let (r, w) = stream.into_split();
        Connection {
            reader: BufReader::with_capacity(READ_BUF, r),
            writer: w,
            replies: Replies::default(),
            pool,
            catalog,
            ssd,
            gate,
            tenant,
            frame_timeout,
            key_buf: Vec::with_capacity(256),
        }
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) -> io::Result<()> {
        loop {
            if self.reader.buffer().is_empty() {
                // Waiting for the next frame is unbounded (idle connections are fine).
                tokio::select! {
                    r = self.reader.fill_buf() => match r {
                        Ok([]) => return Ok(()),
                        Ok(_) => {}
                        Err(e) => return Err(e),
                    },
                    _ = stop.changed() => return Ok(()),
                }
            } else if stop.has_changed().unwrap_or(true) {
                // Stopping between two frames of a batch: the answers to the frames handled
                // (writes recorded, reads done) still go out, so the client does not count
                // them failed.
                let flush = self.replies.flush(&mut self.writer);
                let _ = tokio::time::timeout(FLUSH_BEFORE_CLOSE, flush).await;
                return Ok(());
            }
            // Once a frame starts, the rest of it must arrive within the frame timeout. A frame
            // already whole in the buffer (a pipelining client's batch) needs no timer.
            let timeout = self.frame_timeout;
            let handled = if self.frame_buffered() {
                self.frame().await
            } else {
                within(timeout, "finish a frame", self.frame()).await
            };
            let keep = match handled {
                Ok(keep) => keep,
                Err(e) => {
                    // The answers to the requests before this one are whole: they go out before
                    // the connection closes, so the client does not count them failed.
                    let flush = self.replies.flush(&mut self.writer);
                    let _ = tokio::time::timeout(FLUSH_BEFORE_CLOSE, flush).await;
                    return Err(e);
                }
            };
            // A pipelining client has more requests buffered already: answer them all, then
            // send once. With nothing buffered the peer is waiting for this answer.
            if !keep || self.reader.buffer().is_empty() || self.replies.full() {
                within(
                    timeout,
                    "take its answers",
                    self.replies.flush(&mut self.writer),
                )
                .await?;
            }
            if !keep {
                return Ok(());
            }
        }
    }

    /// Whether the next frame is already whole in the buffer (or is refused without waiting
    /// for more). Disk reads wait on the SSD, so they always run under the frame timeout.
    fn frame_buffered(&self) -> bool {
        let b = self.reader.buffer();
        let Some(hb) = b.first_chunk::<{ wire::REQUEST_HEADER_LEN }>() else {
            return false;
        };
        let Ok(h) = RequestHeader::decode(hb) else {
            return true;
        };
        let payload = match h.op {
            Op::Write | Op::PeerWrite | Op::PeerGrant => h.length,
            Op::ReadDisk => return false,
            _ => 0,
        };
        let need = (wire::REQUEST_HEADER_LEN as u64)
            .saturating_add(h.key_len as u64)
            .saturating_add(payload);
        (b.len() as u64) >= need
    }

    /// Handles one frame, queueing its answer. Returns false when the connection must close
    /// (the stream cannot be trusted to be at a frame boundary).
    async fn frame(&mut self) -> io::Result<bool> {
        let mut header = [0u8; wire::REQUEST_HEADER_LEN];
        self.reader.read_exact(&mut header).await?;
        let h = match RequestHeader::decode(&header) {
            Ok(h) => h,
            Err(e) => {
                self.reply_error(Op::Ping, 0, Code::InvalidParams, &e.to_string());
                return Ok(false);
            }
        };
        self.key_buf.resize(h.key_len as usize, 0);
        self.reader.read_exact(&mut self.key_buf).await?;
        let key = match h.op {
            Op::Ping => None,
            _ => match ObjectKey::from_bytes(&self.key_buf) {
                Ok(k) => Some(k),
                Err(e) => {
                    let payload = matches!(h.op, Op::Write | Op::PeerWrite | Op::PeerGrant);
                    if payload && !self.drain(h.length).await? {
                        return Ok(false);
                    }
                    self.reply_error(
                        h.op,
                        h.request_id,
                        Code::InvalidParams,
                        &format!("bad key: {e}"),
                    );
                    return Ok(true);
                }
            },
        };
        let outcome = match (h.op, key) {
            (Op::Write, Some(key)) => self.write(&h, key).await?,
            (Op::Read, Some(key)) => self.read(&h, &key).await?,
            (Op::ReadDisk, Some(key)) => self.read_disk(&h, &key).await?,
            (
                Op::PeerWrite
                | Op::PeerRead
                | Op::PeerRegions
                | Op::PeerHello
                | Op::PeerGrant
                | Op::PeerRelease,
                _,
            ) => {
                if matches!(h.op, Op::PeerWrite | Op::PeerGrant) && !self.drain(h.length).await? {
                    return Ok(false);
                }
                Err(Refusal {
                    code: Code::InvalidParams,
                    message: "this is a store owner's data port, not a transfer engine".into(),
                })
            }
            _ => Ok(()),
        };
        match outcome {
            Ok(()) => {
                if !matches!(h.op, Op::Read | Op::ReadDisk) {
                    let ok = ResponseHeader {
                        op: h.op,
                        status: 0,
                        request_id: h.request_id,
                        length: 0,
                    };
                    self.replies.push_bytes(&ok.encode());
                }
            }
            Err(r) => self.reply_error(h.op, h.request_id, r.code, &r.message),
        }
        Ok(true)
    }

    async fn write(
        &mut self,
        h: &RequestHeader,
        key: ObjectKey,
    ) -> io::Result<Result<(), Refusal>> {
        if let Err(d) = self.sealed(Access::Write, h, &key) {
            return self.drain_then(h.length, d).await;
        }
        // (Only a grant seen before can have been written: the usual write, of a grant newer
        // than any seen, looks nothing up.)
        if self.catalog.newest_grant() >= h.grant
            && self.catalog.holds(h.offset, h.length, &key, h.grant)
        {
            // Written whole under this grant already: a retry whose answer was lost, or a
            // replay of the grant's seal (it lives for the put's discard timeout, past the
            // put's end). A version's bytes never change once written: they stay as they are,
            // and the write is answered as done.
            if !self.drain(h.length).await? {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a write longer than the pool",
                ));
            }
            return Ok(Ok(()));
        }
        let pool = self.pool.clone();
        let catalog = self.catalog.clone();
        catalog.saw_grant(h.grant);
        // An older grant's write still in the way is superseded and waited for (see `pool`).
        // Half the frame's time at most: the wait runs under the frame timer, and the rest is
        // for the payload (after the range is taken, or drained after a refusal), so a range
        // held too long ends in a refusal the client reads, not in a connection cut mid-frame.
        let patience = self.frame_timeout / 2;
        let refused = |e: &dyn std::fmt::Display| Refusal {
            code: Code::TransferFail,
            message: e.to_string(),
        };
        let mut guard = match pool
            .write_range_granted(h.offset, h.length, h.grant, patience)
            .await
        {
            Ok(g) => g,
            Err(e) => {
                let refusal = Refusal {
                    code: e.code(),
                    message: e.to_string(),
                };
                return self.drain_then(h.length, refusal).await;
            }
        };
        // While the guard is held nobody else records over the range: if a newer grant's bytes
        // are already there, this write is stale and must not land. Every write notes its grant
        // before it records, so while no newer grant was ever seen (the usual case: grants
        // arrive in increasing order) there is nothing to look up.
        let newer = if catalog.newest_grant() > h.grant {
            catalog.newer_than(h.offset, h.length, h.grant)
        } else {
            None
        };
        if let Some(newer) = newer {
            drop(guard);
            let why = format!(
                "range [{}, +{}) already holds put {newer}, newer than this write's put {}; the write is stale",
                h.offset, h.length, h.grant
            );
            return self.drain_then(h.length, refused(&why)).await;
        }
        // While the guard is held no reader overlaps the range. The range names the new key
        // only once every byte landed; a write that fails, is superseded or is cancelled part-way
        // makes it name nothing before the guard lets readers in (the forget runs first on
        // drop), so a read never returns a torn or foreign value: it is refused instead.
        let mut unfinished = ForgetUnlessFinished {
            catalog: &catalog,
            offset: h.offset,
            len: h.length,
            finished: false,
        };
        let supersession = guard.supersession();
        let left = self.receive_into(&mut guard, supersession).await?;
        if left > 0 {
            drop(unfinished);
            drop(guard);
            let why = format!(
                "the write of put {} was superseded by a newer grant of its range",
                h.grant
            );
            return self.drain_then(left, refused(&why)).await;
        }
        if self.gate.is_some() && lapsed(&h.seal) {
            // The seal was good when the frame began: its payload came late (a stalled writer,
            // whose put was revoked or discarded meanwhile). Recorded now, it would outlive the
            // master's last note that the put is gone, for a later master to adopt.
            drop(unfinished);
            drop(guard);
            let why = format!(
                "the write of put {} ended after its seal lapsed; start the put again",
                h.grant
            );
            return Ok(Err(refused(&why)));
        }
        catalog.record(
            h.offset,
            h.length,
            key,
            Stamp::from_flags(h.grant, h.flags),
            h.grant,
        );
        unfinished.finished = true;
        Ok(Ok(()))
    }

    /// Whether the request carries the master's seal on exactly this access, for a key of the
    /// connection's tenant (always, in a cluster without a secret).
    fn sealed(&self, access: Access, h: &RequestHeader, key: &ObjectKey) -> Result<(), Refusal> {
        let Some(gate) = &self.gate else {
            return Ok(());
        };
        if let Some(tenant) = self.tenant.as_ref().filter(|t| !t.owns(key.as_str())) {
            return Err(Refusal {
                code: Code::PermissionDenied,
                message: format!(
                    "this connection proved tenant {tenant}'s token and the key is tenant {:?}'s: \
                     a seal is good only on its own tenant's connections",
                    mooncake_common::tenant::tenant_of(key.as_str())
                ),
            });
        }
        gate.seals
            .check(
                access,
                key,
                h.offset,
                h.length,
                h.grant,
                &h.seal,
                // Read per frame: a peer that never lets the read buffer run empty must not
                // keep the clock where its connection started.
                Seals::now(),
            )
            .map_err(|Denied(code, message)| Refusal { code, message })
    }

    /// Consumes `len` payload bytes so the connection stays at a frame boundary, then refuses.
    async fn drain_then(&mut self, len: u64, refusal: Refusal) -> io::Result<Result<(), Refusal>> {
        if !self.drain(len).await? {
            return Err(io::Error::new(io::ErrorKind::InvalidData, refusal.message));
        }
        Ok(Err(refusal))
    }

    async fn read(
        &mut self,
        h: &RequestHeader,
        key: &ObjectKey,
    ) -> io::Result<Result<(), Refusal>> {
        if let Err(d) = self.sealed(Access::Read, h, key) {
            return Ok(Err(d));
        }
        if let Err(e) = self.pool.check_range(h.offset, h.length) {
            return Ok(Err(Refusal {
                code: Code::InvalidParams,
                message: e.to_string(),
            }));
        }
        // Take the range first, then check what it holds: no write can start in between.
        let guard = match self.pool.read_range_owned(h.offset, h.length) {
            Ok(g) => g,
            Err(e) => {
                return Ok(Err(Refusal {
                    code: e.code(),
                    message: e.to_string(),
                }))
            }
        };
        if !self.catalog.holds(h.offset, h.length, key, h.grant) {
            return Ok(Err(Refusal {
                code: Code::ObjectNotFound,
                message: format!(
                    "range at offset {} does not hold version {} of key {key}",
                    h.offset, h.grant
                ),
            }));
        }
        let ok = ResponseHeader {
            op: Op::Read,
            status: 0,
            request_id: h.request_id,
            length: h.length,
        };
        self.replies.push_bytes(&ok.encode());
        self.replies.push_pool(guard);
        Ok(Ok(()))
    }

    /// Serves a value from the SSD tier: read into a buffer (within the tier's read budget, so a
    /// huge batch waits instead of exhausting memory), verified, then sent.
    async fn read_disk(
        &mut self,
        h: &RequestHeader,
        key: &ObjectKey,
    ) -> io::Result<Result<(), Refusal>> {
        if let Err(d) = self.sealed(Access::Read, h, key) {
            return Ok(Err(d));
        }
        let Some(ssd) = &self.ssd else {
            return Ok(Err(Refusal {
                code: Code::ObjectNotFound,
                message: "this owner has no ssd tier".into(),
            }));
        };
        let value = match ssd.read(key, h.grant, h.length).await {
            Ok(v) => v,
            Err(e) => {
                return Ok(Err(Refusal {
                    code: e.code(),
                    message: e.to_string(),
                }))
            }
        };
        let ok = ResponseHeader {
            op: Op::ReadDisk,
            status: 0,
            request_id: h.request_id,
            length: h.length,
        };
        self.replies.push_bytes(&ok.encode());
        self.replies.push_disk(value);
        Ok(Ok(()))
    }

    /// Fills `dst` (a range of the pool) from the stream: what is buffered with streaming stores,
    /// and a large remainder straight from the socket (no stop in the buffer). Stops early when
    /// the write is superseded; returns how many payload bytes it left unread (0: all landed).
    /// Only a wait on the socket listens for a supersession; between copies of what already
    /// arrived the check is one atomic load.
    async fn receive_into(
        &mut self,
        mut dst: &mut [u8],
        supersession: Supersession<'_>,
    ) -> io::Result<u64> {
        while !dst.is_empty() {
            if supersession.is_superseded() {
                return Ok(dst.len() as u64);
            }
            let buffered = self.reader.buffer();
            if !buffered.is_empty() {
                let n = buffered.len().min(dst.len());
                mooncake_common::memcopy::copy_streaming(&mut dst[..n], &buffered[..n]);
                self.reader.consume(n);
                dst = &mut std::mem::take(&mut dst)[n..];
                continue;
            }
            // Nothing buffered: wait for the peer, or for a newer grant of the range.
            let direct = dst.len() >= wire::DIRECT_RECEIVE;
            let wait = async {
                if direct {
                    // The buffer is empty: reading past it skips nothing.
                    self.reader.get_mut().read(dst).await
                } else {
                    self.reader.fill_buf().await.map(|b| b.len())
                }
            };
            let n = tokio::select! {
                biased;
                _ = supersession.superseded() => return Ok(dst.len() as u64),
                n = wait => n?,
            };
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            if direct {
                dst = &mut std::mem::take(&mut dst)[n..];
            }
        }
        Ok(0)
    }

    /// Reads and discards `len` payload bytes; false if that is more than a sane frame carries.
    async fn drain(&mut self, len: u64) -> io::Result<bool> {
        if len > self.pool.len() {
            return Ok(false);
        }
        let copied =
            tokio::io::copy(&mut (&mut self.reader).take(len), &mut tokio::io::sink()).await?;
        if copied != len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(true)
    }

    /// Queues a refusal (sent with the other answers).
    fn reply_error(&mut self, op: Op, request_id: u64, code: Code, message: &str) {
        let mut msg = message.as_bytes();
        msg = &msg[..msg.len().min(wire::MAX_ERROR_MESSAGE as usize)];
        let h = ResponseHeader {
            op,
            status: code.as_i32(),
            request_id,
            length: msg.len() as u64,
        };
        self.replies.push_bytes(&h.encode());
        self.replies.push_bytes(msg);
    }
}

/// Whether `seal` has lapsed by now (with the owner's allowance for clock skew).
pub(crate) fn lapsed(seal: &mooncake_common::auth::Seal) -> bool {
    seal.expiry_us() < Seals::now()
}
