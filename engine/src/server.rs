//! The target side: serves peers' reads and writes of this process's registered regions over the
//! store's data-plane framing (`common::wire`, ops `PeerRead`, `PeerWrite`, `PeerRegions`).
//! Every request is checked before a byte moves: the key must name this engine (a connection
//! that reached another process is refused) and the range must lie inside one registered region,
//! held for the request's duration. Refusals keep the stream usable and are logged with the peer.

use std::{io::IoSlice, net::SocketAddr, sync::Arc, time::Duration};

use mooncake_client::device::DeviceMemory;
use mooncake_common::{
    data_socket,
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::watch,
};

use crate::{
    local::Grant,
    peers::{self, Hello},
    regions::{Regions, Use},
};

/// What a connection needs from its engine.
pub struct Served {
    pub regions: Arc<Regions>,
    /// This process's host identity (see `local::host_identity`), for `PeerHello`.
    pub identity: String,
    /// This engine's session name, which every request's key must carry.
    pub name: String,
    /// Once a frame has started, the rest of it (and its answer) must move within this.
    pub frame_timeout: Duration,
    /// Drawn at start; reads, writes and grants must carry it (see `peers`).
    pub incarnation: u64,
    /// The longest a same-host peer may hold a grant: past it, its connection is closed and
    /// the ranges go (a peer whose copy takes that long is stuck; without a bound, any client
    /// of the port could keep a region from ever being unregistered).
    pub grant_patience: Duration,
}

/// Accepts peers until `stop` changes.
pub async fn serve(listener: TcpListener, served: Arc<Served>, mut stop: watch::Receiver<bool>) {
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "transfer engine: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        if let Err(e) = data_socket::tune(&stream) {
            tracing::debug!(%peer, error = %e, "transfer engine: socket options not set");
        }
        let conn = Connection::new(stream, peer, served.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.run(stop).await {
                tracing::debug!(%peer, error = %e, "transfer engine: connection ended");
            }
        });
    }
}

const READ_BUF: usize = 64 << 10;
/// Answers shorter than this are copied into the reply buffer (coalesced with others).
const SMALL_ANSWER: usize = 8 << 10;
/// The refusal of a same-host grant that touches device memory (the caller then uses TCP).
pub const DEVICE_MEMORY: &str = "device memory: copy it over TCP, staged";

/// Runs a device copy (which may block) on a blocking thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| std::io::Error::other(format!("a device copy panicked: {e}")))
}

/// A host buffer of `len` bytes to stage a device's bytes through.
fn staging(
    device: &dyn DeviceMemory,
    len: u64,
) -> std::io::Result<mooncake_client::device::Staging> {
    device
        .staging(len as usize)
        .map_err(|e| std::io::Error::other(e.to_string()))
}
/// The most ranges one same-host grant may list (16 bytes each).
const MAX_GRANT: u64 = 16 << 16;

struct Connection {
    reader: BufReader<OwnedReadHalf>,
    writer: BufWriter<OwnedWriteHalf>,
    peer: SocketAddr,
    /// This end's address: a grant goes only to a peer connecting from it (the same host).
    local: Option<SocketAddr>,
    served: Arc<Served>,
    key: Vec<u8>,
    /// Ranges a same-host peer is copying (`PeerGrant` until `PeerRelease`), and until when
    /// they may be held.
    held: Vec<crate::regions::Use>,
    held_until: Option<tokio::time::Instant>,
    /// The engine is stopping: only a release of the held grant is answered.
    stopping: bool,
    /// The last request carried a large payload: the next header is read alone, straight from
    /// the socket, so that the payload behind it lands in place instead of in the buffer.
    direct: bool,
}

/// A request header, and how much of it was read before its frame started.
struct Head {
    bytes: [u8; wire::REQUEST_HEADER_LEN],
    read: usize,
}

/// Fills `dst` (part of a request before its payload): `alone`, straight from the socket, reading
/// nothing past it (the buffer is empty then); otherwise through the buffer.
async fn read_head(
    reader: &mut BufReader<OwnedReadHalf>,
    alone: bool,
    dst: &mut [u8],
) -> std::io::Result<()> {
    if alone {
        reader.get_mut().read_exact(dst).await?;
    } else {
        reader.read_exact(dst).await?;
    }
    Ok(())
}

impl Connection {
    fn new(stream: TcpStream, peer: SocketAddr, served: Arc<Served>) -> Self {
        let local = stream.local_addr().ok();
        let (r, w) = stream.into_split();
        Connection {
            reader: BufReader::with_capacity(READ_BUF, r),
            writer: BufWriter::with_capacity(READ_BUF, w),
            peer,
            local,
            served,
            key: Vec::with_capacity(64),
            held: Vec::new(),
            held_until: None,
            stopping: false,
            direct: false,
        }
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) -> std::io::Result<()> {
        loop {
            let mut head = Head {
                bytes: [0; wire::REQUEST_HEADER_LEN],
                read: 0,
            };
            if self.reader.buffer().is_empty() && self.direct {
                // A header already here needs no wait (and answers wait for the next flush).
                match self.reader.get_ref().try_read(&mut head.bytes) {
                    Ok(0) => return Ok(()),
                    Ok(n) => head.read = n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            if head.read == 0 && self.reader.buffer().is_empty() {
                // Nothing more pipelined: the peer waits for what was answered so far.
                self.flush().await?;
                // A same-host grant is held until its release or until the connection closes,
                // even while the engine stops: the peer's copy cannot be interrupted, so its
                // ranges never go under it (unregistering then reports them still in use).
                let stopping = *stop.borrow();
                if stopping && self.held.is_empty() {
                    return Ok(());
                }
                let idle = self.held.is_empty();
                let held_until = self.held_until.unwrap_or_else(tokio::time::Instant::now);
                let overheld = async {
                    tokio::time::sleep_until(held_until).await;
                    tracing::warn!(peer = %self.peer, patience = ?self.served.grant_patience,
                        "transfer engine: a same-host peer held its grant too long; closing its connection");
                };
                if self.direct {
                    tokio::select! {
                        r = self.reader.get_mut().read(&mut head.bytes) => match r? {
                            0 => return Ok(()),
                            n => head.read = n,
                        },
                        _ = stop.changed(), if idle && !stopping => return Ok(()),
                        _ = overheld, if !idle => return Ok(()),
                    }
                } else {
                    tokio::select! {
                        r = self.reader.fill_buf() => if r?.is_empty() { return Ok(()) },
                        _ = stop.changed(), if idle && !stopping => return Ok(()),
                        _ = overheld, if !idle => return Ok(()),
                    }
                }
            }
            self.stopping = *stop.borrow();
            let timeout = self.served.frame_timeout;
            match tokio::time::timeout(timeout, self.frame(head)).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    self.flush().await?;
                    return Ok(());
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("a frame took longer than {timeout:?}"),
                    ))
                }
            }
        }
    }

    /// Sends what was answered so far, by the held grant's deadline (else within the frame
    /// timeout); past it, an error that closes the connection and releases the grant. A peer
    /// that sends requests and never reads their answers fills the socket's buffers: without a
    /// deadline the flush would wait for ever, and the deadline of a grant, checked only after
    /// it, would never come, so any client of the port could pin a region.
    async fn flush(&mut self) -> std::io::Result<()> {
        let deadline = (self.held_until)
            .unwrap_or_else(|| tokio::time::Instant::now() + self.served.frame_timeout);
        match tokio::time::timeout_at(deadline, self.writer.flush()).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(peer = %self.peer, held = !self.held.is_empty(),
                    "transfer engine: a peer did not read its answers in time; closing its connection");
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the peer did not read its answers in time",
                ))
            }
        }
    }

    /// One request and its answer. Returns false when the connection must close (the stream is
    /// no longer at a frame boundary).
    async fn frame(&mut self, mut head: Head) -> std::io::Result<bool> {
        // A frame started straight from the socket (the buffer is empty) goes on the same way.
        let alone = head.read > 0;
        read_head(&mut self.reader, alone, &mut head.bytes[head.read..]).await?;
        let h = match RequestHeader::decode(&head.bytes) {
            Ok(h) => h,
            Err(e) => {
                self.refuse(Op::Ping, 0, &e.to_string(), Code::InvalidParams)
                    .await?;
                return Ok(false);
            }
        };
        self.key.resize(h.key_len as usize, 0);
        read_head(&mut self.reader, alone, &mut self.key).await?;
        self.direct = h.op == Op::PeerWrite && h.length >= wire::DIRECT_RECEIVE as u64;
        let payload_in = matches!(h.op, Op::PeerWrite | Op::Write | Op::PeerGrant);
        if h.op != Op::Ping && self.key != self.served.name.as_bytes() {
            let msg = format!(
                "this is transfer engine {}, not {}",
                self.served.name,
                String::from_utf8_lossy(&self.key)
            );
            return self.refuse_frame(&h, payload_in, &msg).await;
        }
        let touches_memory = matches!(h.op, Op::PeerRead | Op::PeerWrite | Op::PeerGrant);
        if touches_memory && h.grant != self.served.incarnation {
            let (msg, code) = if h.grant == 0 {
                // Engines from before incarnations send 0: an older release, not a restart.
                let msg = format!(
                    "transfer engine {} needs callers to name its incarnation (learnt with \
                     PeerHello), and the caller named none: its engine is an older release. \
                     Run the same release on both sides",
                    self.served.name
                );
                (msg, Code::InvalidParams)
            } else {
                let msg = format!(
                    "transfer engine {} is incarnation {:#x}, not {:#x}: it restarted since the \
                     caller met it",
                    self.served.name, self.served.incarnation, h.grant
                );
                (msg, peers::RESTARTED)
            };
            return self.refuse_frame_with(&h, payload_in, &msg, code).await;
        }
        if self.stopping && h.op != Op::PeerRelease {
            let msg = format!(
                "transfer engine {} is stopping: it answers only the release of a grant",
                self.served.name
            );
            return self
                .refuse_frame_with(&h, payload_in, &msg, Code::UnavailableInCurrentStatus)
                .await;
        }
        match h.op {
            Op::Ping => self.ok(&h, 0).await?,
            Op::PeerWrite => match self.served.regions.lookup(h.offset, h.length) {
                Ok(usage) => match usage.device().cloned() {
                    None => {
                        self.read_payload(usage.bytes_mut(h.offset, h.length))
                            .await?;
                        self.ok(&h, 0).await?;
                    }
                    Some(device) => {
                        // Device memory: through a host staging buffer and the device's copy.
                        let mut staging = staging(&*device, h.length)?;
                        self.read_payload(staging.bytes_mut()).await?;
                        let to = h.offset as usize;
                        // The copy holds the range: a copy that outlives this request (its
                        // deadline passed) still keeps the region from being unregistered.
                        let copied = blocking(move || {
                            let done = device.copy_from_host(staging.bytes(), to);
                            drop(usage);
                            done
                        })
                        .await?;
                        if let Err(e) = copied {
                            return self.refuse_frame(&h, false, &e.to_string()).await;
                        }
                        self.ok(&h, 0).await?;
                    }
                },
                Err(e) => return self.refuse_frame(&h, true, &e.to_string()).await,
            },
            Op::PeerRead => match self.served.regions.lookup(h.offset, h.length) {
                Ok(usage) => match usage.device().cloned() {
                    None => self.answer(&h, usage.bytes(h.offset, h.length)).await?,
                    Some(device) => {
                        let mut staging = staging(&*device, h.length)?;
                        let from = h.offset as usize;
                        let copied = blocking(move || {
                            let done = device.copy_to_host(from, staging.bytes_mut());
                            drop(usage);
                            done.map(|()| staging)
                        })
                        .await?;
                        match copied {
                            Ok(staging) => self.answer(&h, staging.bytes()).await?,
                            Err(e) => return self.refuse_frame(&h, false, &e.to_string()).await,
                        }
                    }
                },
                Err(e) => return self.refuse_frame(&h, false, &e.to_string()).await,
            },
            Op::PeerRegions => {
                let list = self.served.regions.list();
                self.ok(&h, list.len() as u64 * 16).await?;
                for (a, l) in list {
                    self.writer.write_all(&a.to_le_bytes()).await?;
                    self.writer.write_all(&l.to_le_bytes()).await?;
                }
            }
            Op::PeerHello => {
                let hello = Hello {
                    pid: u64::from(std::process::id()),
                    incarnation: self.served.incarnation,
                    identity: self.served.identity.as_bytes().to_vec(),
                }
                .encode();
                self.ok(&h, hello.len() as u64).await?;
                self.writer.write_all(&hello).await?;
            }
            Op::PeerGrant => {
                self.held.clear();
                self.held_until = None;
                if h.length % 16 != 0 || h.length > MAX_GRANT {
                    let msg = format!("a grant of {} bytes of ranges", h.length);
                    return self.refuse_frame(&h, true, &msg).await;
                }
                if self.local.is_none_or(|l| l.ip() != self.peer.ip()) {
                    let msg = format!(
                        "a grant is for a peer on this host, and {} connects from elsewhere: copy over TCP",
                        self.peer
                    );
                    return self.refuse_frame(&h, true, &msg).await;
                }
                let mut raw = vec![0u8; h.length as usize];
                self.reader.read_exact(&mut raw).await?;
                let uses: Result<Vec<_>, _> = raw
                    .chunks_exact(16)
                    .map(|c| {
                        let a = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
                        let l = u64::from_le_bytes(c[8..].try_into().expect("8 bytes"));
                        self.served.regions.lookup(a, l)
                    })
                    .collect();
                match uses {
                    Ok(uses) if uses.iter().any(|u| u.device().is_some()) => {
                        // A device's memory cannot be copied process to process: the caller
                        // goes over TCP, where this side stages it.
                        let code = Code::UnavailableInCurrentStatus;
                        self.refuse(Op::PeerGrant, h.request_id, DEVICE_MEMORY, code)
                            .await?;
                    }
                    Ok(uses) => {
                        // Which process granted (the caller copies with exactly this one), and,
                        // when every range lies in a managed buffer's memory file, where.
                        let answer = Grant {
                            pid: u64::from(std::process::id()),
                            files: uses.iter().map(Use::file_range).collect(),
                            files_removed: self.served.regions.files_removed(),
                        }
                        .encode(h.flags & wire::PEER_GRANT_FILES != 0);
                        self.held = uses;
                        self.held_until =
                            Some(tokio::time::Instant::now() + self.served.grant_patience);
                        self.ok(&h, answer.len() as u64).await?;
                        self.writer.write_all(&answer).await?;
                    }
                    Err(e) => return self.refuse_frame(&h, false, &e.to_string()).await,
                }
            }
            Op::PeerRelease => {
                self.held.clear();
                self.held_until = None;
                self.ok(&h, 0).await?;
            }
            Op::Write | Op::Read | Op::ReadDisk => {
                let msg = "this is a transfer engine, not a store owner";
                return self.refuse_frame(&h, payload_in, msg).await;
            }
        }
        Ok(true)
    }

    /// Fills `dst` with a request's payload: first what is buffered, then a remainder of
    /// `wire::DIRECT_RECEIVE` or more straight from the socket. Through the buffer, the tail of every
    /// large payload (whatever the last receive left short of a full buffer) was copied twice.
    async fn read_payload(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let buffered = self.reader.buffer();
        let n = buffered.len().min(dst.len());
        dst[..n].copy_from_slice(&buffered[..n]);
        self.reader.consume(n);
        let rest = &mut dst[n..];
        if rest.len() >= wire::DIRECT_RECEIVE {
            // The buffer is empty (it held less than `dst`): nothing is skipped.
            self.reader.get_mut().read_exact(rest).await?;
        } else {
            self.reader.read_exact(rest).await?;
        }
        Ok(())
    }

    /// A read's answer: its header and `payload`. A large payload goes out in one vectored
    /// write with its header (not the header alone, then the payload: a 24-byte segment per
    /// answer costs both sides a wake-up).
    async fn answer(&mut self, h: &RequestHeader, payload: &[u8]) -> std::io::Result<()> {
        let header = ResponseHeader {
            op: h.op,
            status: 0,
            request_id: h.request_id,
            length: payload.len() as u64,
        }
        .encode();
        if payload.len() < SMALL_ANSWER {
            self.writer.write_all(&header).await?;
            return self.writer.write_all(payload).await;
        }
        let mut bufs = [IoSlice::new(&header), IoSlice::new(payload)];
        let mut slices: &mut [IoSlice<'_>] = &mut bufs;
        while !slices.is_empty() {
            let n = self.writer.write_vectored(slices).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut slices, n);
        }
        Ok(())
    }

    async fn ok(&mut self, h: &RequestHeader, length: u64) -> std::io::Result<()> {
        let r = ResponseHeader {
            op: h.op,
            status: 0,
            request_id: h.request_id,
            length,
        };
        self.writer.write_all(&r.encode()).await
    }

    /// Refuses one request as invalid, skipping its payload so the stream stays in step.
    async fn refuse_frame(
        &mut self,
        h: &RequestHeader,
        payload_in: bool,
        msg: &str,
    ) -> std::io::Result<bool> {
        self.refuse_frame_with(h, payload_in, msg, Code::InvalidParams)
            .await
    }

    /// `refuse_frame` with the code `code`.
    async fn refuse_frame_with(
        &mut self,
        h: &RequestHeader,
        payload_in: bool,
        msg: &str,
        code: Code,
    ) -> std::io::Result<bool> {
        tracing::warn!(peer = %self.peer, op = ?h.op, addr = format_args!("{:#x}", h.offset),
            len = h.length, "transfer engine refused a request: {msg}");
        if payload_in {
            let mut left = h.length;
            let mut sink = [0u8; 8192];
            while left > 0 {
                let n = (left as usize).min(sink.len());
                self.reader.read_exact(&mut sink[..n]).await?;
                left -= n as u64;
            }
        }
        self.refuse(h.op, h.request_id, msg, code).await?;
        Ok(true)
    }

    async fn refuse(
        &mut self,
        op: Op,
        request_id: u64,
        msg: &str,
        code: Code,
    ) -> std::io::Result<()> {
        let msg = &msg.as_bytes()[..msg.len().min(wire::MAX_ERROR_MESSAGE as usize)];
        let r = ResponseHeader {
            op,
            status: code.as_i32(),
            request_id,
            length: msg.len() as u64,
        };
        self.writer.write_all(&r.encode()).await?;
        self.writer.write_all(msg).await
    }
}
