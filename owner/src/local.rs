//! The same-host path, owner side: a Unix-domain socket (file mode 0660, so only the owner's
//! user and group can connect) that hands local clients the pool's memfd and brackets their
//! copies with range locks and key-catalog updates. The owner never copies these bytes itself.

use std::{
    collections::HashMap,
    io,
    os::{fd::AsFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use mooncake_common::{
    local::{self, frame_header, FrameReader, FrameWriter, Item, LocalFrameError, LocalOp},
    Code, ObjectKey, SegmentName, Stamp,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::watch,
};

use mooncake_common::auth::{admit, starts_with_hello, Access, Admission, CLUSTER, HELLO_MAGIC};

use crate::{
    catalog::Catalog,
    fdpass,
    pool::{MemoryPool, RangeLock},
    seals::{Gate, Seals},
};

/// Binds the socket at `path`, replacing a stale file left by a dead owner. A socket listens
/// from the moment it is bound, with the mode the umask gives it, so it is bound inside a
/// directory only this user may enter, narrowed to 0660 there, and only then moved to `path`:
/// nobody outside the owner's user and group can connect in between (and be handed the pool).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::DirBuilderExt;
    use std::sync::atomic::{AtomicU32, Ordering};
    // One directory per bind, made here (owners of one process may bind at once), its path no
    // longer than a socket's file name here ("mooncake-*.sock"): socket paths have a limit.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let parent = path.parent().unwrap_or(Path::new("."));
    let private = parent.join(format!(
        ".m{:x}-{:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let bound = (|| {
        let at = private.join("s");
        let listener = UnixListener::bind(&at)?;
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o660))?;
        // Replaces a stale file left by a dead owner.
        std::fs::rename(&at, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    bound
}

pub struct LocalServer {
    pub pool: Arc<MemoryPool>,
    pub catalog: Arc<Catalog>,
    pub segment: SegmentName,
    pub frame_timeout: Duration,
    pub path: PathBuf,
    /// With one, a local client must prove the cluster's secret before it gets the pool's
    /// memfd, and every range it locks must carry the master's seal.
    pub gate: Option<Arc<Gate>>,
    /// Whether workers that proved a tenant's token (not the cluster's) get the pool's memfd.
    /// Mapping it exposes every tenant's bytes in the pool, so by default they are refused and
    /// use TCP, where every byte moves only under the master's seal.
    pub tenants_share_memory: bool,
}

impl LocalServer {
    /// Serves local clients until `stop`, then removes the socket file (also when dropped
    /// unfinished: an owner whose runtime ends without a shutdown leaves no file behind).
    pub async fn serve(self: Arc<Self>, listener: UnixListener, mut stop: watch::Receiver<bool>) {
        let _socket = RemovedOnDrop(self.path.clone());
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let me = self.clone();
                        let stop = stop.clone();
                        tokio::spawn(async move {
                            if let Err(e) = me.admitted_session(stream, stop).await {
                                tracing::debug!(error = %e, "local session closed");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "local accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = stop.changed() => break,
            }
        }
    }

    /// Admits a connection (see `mooncake_common::auth`), then serves it, or answers its hello
    /// with `Code::Unauthenticated` when it did not authenticate where the owner requires it,
    /// `Code::PermissionDenied` for a tenant's worker (unless tenants may share memory).
    async fn admitted_session(
        &self,
        mut stream: UnixStream,
        stop: watch::Receiver<bool>,
    ) -> io::Result<()> {
        let peer = match stream.peer_cred() {
            Ok(c) => format!("local pid {:?} uid {}", c.pid(), c.uid()),
            Err(_) => "a local peer".to_string(),
        };
        let hello = tokio::time::timeout(self.frame_timeout, peek_hello(&stream))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let refusal = match admit(
            &mut stream,
            hello,
            self.gate.as_ref().map(|g| &g.keyring),
            &peer,
            self.frame_timeout,
        )
        .await?
        {
            Admission::Unauthenticated => Code::Unauthenticated,
            Admission::Authenticated(id) if id != CLUSTER && !self.tenants_share_memory => {
                tracing::info!(%peer, tenant = %id, "a tenant's worker is refused the same-host path (it maps the whole pool); it uses TCP");
                Code::PermissionDenied
            }
            _ => return self.session(stream, stop).await,
        };
        // Its hello is answered with the refusal, and the connection closed.
        let refuse = async {
            let mut h = [0u8; 5];
            stream.read_exact(&mut h).await?;
            let (len, _) = frame_header(h).map_err(invalid)?;
            mooncake_common::body::read_new_body(&mut stream, len).await?;
            let mut w = FrameWriter::new(LocalOp::Hello);
            w.i32(refusal.as_i32()).u64(0);
            stream.write_all(&w.finish()).await
        };
        tokio::time::timeout(self.frame_timeout, refuse)
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
    }

    /// One client connection. Its locks live in `held` and are released when it ends; a write
    /// that never ended leaves its range naming no key (reads are refused).
    ///
    /// A client the owner gives up on (silent past the frame timeout, not reading its replies,
    /// or breaking the protocol) may still be copying: it maps the whole pool, and a stopped
    /// process resumes its copy where it was.
    /// - A reader's ranges go once its connection is closed: a copy still under way then fails
    ///   its end of the exchange (writing the end fails), so its bytes are never taken for the
    ///   object's, whatever a writer puts there next.
    /// - A writer's ranges stay locked until the client closes the connection (it ends, or
    ///   dies); the owner shuts its side, so that the client's end of the exchange fails and it
    ///   discards what it wrote. Released earlier, a late copy would land over whatever the
    ///   master had put in that range meanwhile (after removing the put, or its release
    ///   timeout), a committed object, unseen by any check.
    async fn session(&self, stream: UnixStream, stop: watch::Receiver<bool>) -> io::Result<()> {
        let mut held = Held::default();
        let mut stream = stream;
        let served = self.exchange(&mut stream, &mut held, stop.clone()).await;
        if served.is_err() && !held.writes.is_empty() {
            hold_until_closed(stream, held, stop).await;
        } else {
            // Closed before the ranges go (see above).
            drop(stream);
            drop(held);
        }
        served
    }

    /// Serves frames until the client closes (or the owner stops: `Ok`), or the owner gives up
    /// on it (`Err`).
    async fn exchange(
        &self,
        stream: &mut UnixStream,
        held: &mut Held,
        mut stop: watch::Receiver<bool>,
    ) -> io::Result<()> {
        let mut body = Vec::new();
        // Since when this client has held ranges without a break.
        let mut holding_since: Option<tokio::time::Instant> = None;
        loop {
            let mut h = [0u8; 5];
            // A client holding ranges has the frame timeout, from when it took them, to let
            // them all go (the end of its exchange): one that stalls (stopped, stuck) is told
            // its exchange failed. Counted from the first range taken, not re-armed by each
            // frame: a client sending other frames would otherwise keep its ranges for ever.
            holding_since = match (held.is_empty(), holding_since) {
                (true, _) => None,
                (false, None) => Some(tokio::time::Instant::now()),
                (false, since) => since,
            };
            let limit = holding_since.map(|since| {
                (since + self.frame_timeout).saturating_duration_since(tokio::time::Instant::now())
            });
            let next = tokio::select! {
                r = stream.read_exact(&mut h[..1]) => r.map(|_| true).unwrap_or(false),
                _ = stop.changed() => false,
                () = sleep_or_never(limit) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "a same-host client holding ranges went silent",
                    ));
                }
            };
            if !next {
                return Ok(());
            }
            let rest = async {
                stream.read_exact(&mut h[1..]).await?;
                let (len, op) = frame_header(h).map_err(invalid)?;
                mooncake_common::body::read_body(stream, len, &mut body).await?;
                Ok::<_, io::Error>(op)
            };
            let op = tokio::time::timeout(self.frame_timeout, rest)
                .await
                .map_err(|_| {
                    io::Error::new(io::ErrorKind::TimedOut, "peer did not finish a frame")
                })??;
            let mut r = FrameReader::new(&body);
            let reply = match op {
                LocalOp::Hello => {
                    let hello =
                        tokio::time::timeout(self.frame_timeout, self.hello(stream, &mut r));
                    hello.await.map_err(|_| not_read())??;
                    None
                }
                LocalOp::BeginWrite => Some(self.begin(&mut r, held, true).await.map_err(invalid)?),
                LocalOp::EndWrite => Some(self.end_write(&mut r, held).map_err(invalid)?),
                LocalOp::BeginRead => Some(self.begin(&mut r, held, false).await.map_err(invalid)?),
                LocalOp::EndRead => {
                    let n = r.count().map_err(invalid)?;
                    for _ in 0..n {
                        let range = (r.u64().map_err(invalid)?, r.u64().map_err(invalid)?);
                        held.release_read(range);
                    }
                    None
                }
            };
            if let Some(reply) = reply {
                // A client that does not read its reply (stopped before it did) is given up on
                // like one that does not send.
                tokio::time::timeout(self.frame_timeout, stream.write_all(&reply))
                    .await
                    .map_err(|_| not_read())??;
            }
        }
    }

    async fn hello(&self, stream: &mut UnixStream, r: &mut FrameReader<'_>) -> io::Result<()> {
        let version = r.u8().unwrap_or(0);
        let wanted = std::str::from_utf8(r.rest()).unwrap_or("");
        if version != local::VERSION || wanted != self.segment.as_str() {
            let mut w = FrameWriter::new(LocalOp::Hello);
            w.i32(Code::SegmentNotFound.as_i32()).u64(0);
            stream.write_all(&w.finish()).await?;
            return Err(invalid(LocalFrameError(
                "hello for another segment or protocol version",
            )));
        }
        let mut w = FrameWriter::new(LocalOp::Hello);
        w.i32(0).u64(self.pool.len());
        let frame = w.finish();
        let mut sent = 0;
        while sent < frame.len() {
            stream.writable().await?;
            // Through `try_io`, so a would-block clears the readiness `writable` waits on
            // (a raw `sendmsg` would leave it set, and this loop would spin).
            let res = if sent == 0 {
                stream.try_io(tokio::io::Interest::WRITABLE, || {
                    fdpass::send_with_fd(stream.as_fd(), &frame, self.pool.memfd())
                })
            } else {
                stream.try_write(&frame[sent..])
            };
            match res {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn begin(
        &self,
        r: &mut FrameReader<'_>,
        held: &mut Held,
        write: bool,
    ) -> Result<Vec<u8>, LocalFrameError> {
        let n = r.count()?;
        let op = if write {
            LocalOp::BeginWrite
        } else {
            LocalOp::BeginRead
        };
        let mut w = FrameWriter::new(op);
        w.u32(n as u32);
        let now = Seals::now();
        // One deadline for the frame: items waiting one after another on ranges in the way
        // answer within one frame timeout, not one each.
        let until = tokio::time::Instant::now() + self.frame_timeout;
        for _ in 0..n {
            let item = r.item()?;
            let (offset, len) = (item.offset, item.len);
            let access = if write { Access::Write } else { Access::Read };
            let code = match ObjectKey::from_bytes(item.key) {
                Err(_) => Code::InvalidParams,
                Ok(key) if !self.sealed(access, &key, &item, now) => Code::PermissionDenied,
                Ok(key) if write => {
                    self.catalog.saw_grant(item.grant);
                    let taken = self
                        .pool
                        .lock_range_granted(
                            offset,
                            len,
                            item.grant,
                            until.saturating_duration_since(tokio::time::Instant::now()),
                        )
                        .await;
                    match taken {
                        Err(e) => e.code(),
                        // Holding the range, nobody else records over it: a newer grant's bytes
                        // already there make this write stale; otherwise, as on TCP, the range
                        // stops naming its old key before any byte changes.
                        Ok(_) if self.catalog.claim(offset, len, item.grant).is_some() => {
                            Code::TransferFail
                        }
                        Ok(lock) => {
                            let stamp = Stamp::from_flags(item.grant, item.flags);
                            held.writes
                                .insert((offset, len), (lock, key, stamp, item.seal));
                            Code::Ok
                        }
                    }
                }
                Ok(key) => match self.pool.lock_range(offset, len) {
                    Err(e) => e.code(),
                    Ok(lock) if self.catalog.holds(offset, len, &key, item.grant) => {
                        held.hold_read((offset, len), lock);
                        Code::Ok
                    }
                    Ok(_) => Code::ObjectNotFound,
                },
            };
            w.i32(code.as_i32());
        }
        Ok(w.finish())
    }

    /// Whether the item carries the master's seal on exactly this access (always, in a cluster
    /// without a secret).
    fn sealed(&self, access: Access, key: &ObjectKey, item: &Item<&[u8]>, now: u64) -> bool {
        self.gate.as_ref().is_none_or(|g| {
            let (offset, len, grant) = (item.offset, item.len, item.grant);
            g.seals
                .check(access, key, offset, len, grant, &item.seal, now)
                .is_ok()
        })
    }

    fn end_write(
        &self,
        r: &mut FrameReader<'_>,
        held: &mut Held,
    ) -> Result<Vec<u8>, LocalFrameError> {
        let n = r.count()?;
        let mut w = FrameWriter::new(LocalOp::EndWrite);
        w.u32(n as u32);
        for _ in 0..n {
            let range = (r.u64()?, r.u64()?);
            let commit = r.u8()? != 0;
            let code = match held.writes.remove(&range) {
                Some((lock, key, stamp, seal)) => {
                    // Ended after its seal lapsed (see the data plane's write): not recorded.
                    if commit && self.gate.is_some() && crate::dataplane::lapsed(&seal) {
                        drop(lock);
                        Code::TransferFail
                    } else {
                        if commit {
                            self.catalog
                                .record(range.0, range.1, key, stamp, stamp.put_id);
                        }
                        drop(lock);
                        Code::Ok
                    }
                }
                None => Code::InvalidParams,
            };
            w.i32(code.as_i32());
        }
        Ok(w.finish())
    }
}

#[derive(Default)]
struct Held {
    /// Per range, its lock, key, stamp and seal (checked again when the write ends).
    writes: HashMap<(u64, u64), (RangeLock, ObjectKey, Stamp, mooncake_common::auth::Seal)>,
    /// Per range, a lock for each read of it begun and not ended.
    reads: HashMap<(u64, u64), Vec<RangeLock>>,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.reads.is_empty() && self.writes.is_empty()
    }

    fn hold_read(&mut self, range: (u64, u64), lock: RangeLock) {
        self.reads.entry(range).or_default().push(lock);
    }

    fn release_read(&mut self, range: (u64, u64)) {
        if let Some(locks) = self.reads.get_mut(&range) {
            locks.pop();
            if locks.is_empty() {
                self.reads.remove(&range);
            }
        }
    }
}

/// A file removed when this is dropped.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Keeps a given-up writer's ranges locked until it closes the connection (or the owner stops):
/// see `session`. What it still sends is read and dropped; its replies never come.
async fn hold_until_closed(mut stream: UnixStream, held: Held, mut stop: watch::Receiver<bool>) {
    tracing::warn!(
        read_ranges = held.reads.len(),
        writes = held.writes.len(),
        "a same-host writer was given up on: its exchange fails, and its ranges stay locked until it closes the connection (a copy it still makes must not land over a newer object)"
    );
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    loop {
        tokio::select! {
            r = stream.read(&mut sink) => match r {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            },
            _ = stop.changed() => break,
        }
    }
    tracing::info!("a given-up same-host writer closed its connection; its ranges are free");
    drop(held);
}

/// Sleeps for `limit`, or forever without one.
async fn sleep_or_never(limit: Option<Duration>) {
    match limit {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

fn invalid(e: LocalFrameError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Waits for a connection's first bytes and tells whether they open an auth hello (see
/// `mooncake_common::auth`), leaving them unread.
async fn peek_hello(stream: &UnixStream) -> io::Result<bool> {
    let mut first = [0u8; HELLO_MAGIC.len()];
    loop {
        stream.readable().await?;
        let n = match stream.try_io(tokio::io::Interest::READABLE, || {
            fdpass::peek(stream.as_fd(), &mut first)
        }) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if let Some(hello) = starts_with_hello(&first[..n]) {
            return Ok(hello);
        }
        // A proper prefix of the magic: the rest is on its way.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn not_read() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "peer did not read its reply")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};

    #[tokio::test]
    async fn the_socket_is_0660_at_its_path_with_nothing_left_beside_it() {
        let dir = std::env::temp_dir().join(format!("mc-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mooncake-x.sock");
        std::fs::write(&path, b"stale").unwrap();
        let listener = super::bind(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o660);
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "only the socket");
        let (connected, accepted) =
            tokio::join!(tokio::net::UnixStream::connect(&path), listener.accept());
        connected.unwrap();
        accepted.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
