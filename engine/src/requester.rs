//! The caller's side of transfers: a transport (TCP connections to peers, made on the runtime
//! that uses them) and the same-host path, checking that the caller's buffers lie in regions its
//! engine registered. An engine has one; `TransferEngine::requester` makes more for callers on
//! other runtimes.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use mooncake_client::{
    device::{DeviceError, DeviceMemory, Staging},
    transport::tcp::{TcpConfig, TcpTransport},
};
use mooncake_common::{
    transport::{ReadItem, TransferError, WriteItem},
    ObjectKey, SegmentName, Stamp,
};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::{
    directory::Directory,
    local::{Mappings, Outcome, SameHost},
    peers::{self, Hello, Known, Peers},
    regions::{Regions, Use},
    small::{self, Dir, Small},
    EngineConfig, EngineError, TransferOp, TransferRequest,
};

/// Batches smaller than this go over TCP even to a peer on this host: the grant's round trip
/// costs more than the socket copies.
const SAME_HOST_MIN: u64 = 128 << 10;

/// A peer as an engine knew it when a call was made (see `Requester::transfer_as`): the
/// process met, or that it restarted since.
#[derive(Clone)]
pub struct MetPeer(Known);

/// Batches this engine moved, by path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub same_host_batches: u64,
    /// Of the same-host batches, those copied through a mapping of the target's managed buffer.
    pub mapped_batches: u64,
    pub tcp_batches: u64,
}

/// Batches moved, shared by an engine's requesters.
#[derive(Default)]
pub struct Counters {
    same_host: AtomicU64,
    mapped: AtomicU64,
    tcp: AtomicU64,
}

impl Counters {
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            same_host_batches: self.same_host.load(Ordering::Relaxed),
            mapped_batches: self.mapped.load(Ordering::Relaxed),
            tcp_batches: self.tcp.load(Ordering::Relaxed),
        }
    }
}

/// What an engine's requesters share: the batches moved, the peers met, and the peers' memory
/// files mapped.
pub struct Shared {
    pub counters: Arc<Counters>,
    pub peers: Arc<Peers>,
    pub mappings: Arc<Mutex<Mappings>>,
}

pub struct Requester {
    regions: Arc<Regions>,
    /// With etcd metadata: peers' names to their session names.
    directory: Option<Arc<Directory>>,
    transport: TcpTransport,
    same_host: Option<SameHost>,
    /// Single small transfers on blocking sockets; only for a dedicated runtime's calls, whose
    /// thread waits for them anyway.
    small: Option<Small>,
    counters: Arc<Counters>,
    peers: Arc<Peers>,
}

impl Requester {
    pub(crate) fn new(
        regions: Arc<Regions>,
        config: &EngineConfig,
        shared: Shared,
        dedicated_runtime: bool,
        directory: Option<Arc<Directory>>,
    ) -> Self {
        Requester {
            regions,
            directory,
            transport: TcpTransport::new(TcpConfig {
                connect_timeout: config.connect_timeout,
                transfer_timeout: config.transfer_timeout,
                connections_per_owner: config.connections_per_peer.max(1),
                transfer_threads: config.transfer_threads.max(1),
                dedicated_runtime,
                credential: None,
            }),
            same_host: config
                .same_host
                .then(|| SameHost::new(config.transfer_timeout, shared.mappings)),
            small: dedicated_runtime.then(|| Small::new(config.transfer_timeout)),
            counters: shared.counters,
            peers: shared.peers,
        }
    }

    /// The regions `target` registered, for a caller that addresses its memory by them: the
    /// peer is met afresh first, so later calls name the process these addresses are of (and
    /// a peer marked restarted takes calls again). Met before its regions are asked: should it
    /// restart in between, calls name the older process and are refused, never served at
    /// another process's addresses.
    pub async fn peer_regions(&self, target: &str) -> Result<Vec<(u64, u64)>, EngineError> {
        let deadline = self.transport.deadline();
        let session = self.session_of(target).await?;
        let r = async {
            self.peers.meet(target, &session, deadline).await?;
            self.regions_of_session(&session, deadline).await
        }
        .await;
        self.forget_on_failure(target, &r);
        r
    }

    /// Whether `target` answers (with its regions), leaving what this engine knows of it as
    /// it is: a probe does not learn addresses, so it does not clear a restart mark.
    pub async fn probe(&self, target: &str) -> Result<(), EngineError> {
        let deadline = self.transport.deadline();
        let session = self.session_of(target).await?;
        let r = self.regions_of_session(&session, deadline).await.map(drop);
        self.forget_on_failure(target, &r);
        r
    }

    /// A peer's session name: its name itself, or what etcd says it is.
    async fn session_of(&self, target: &str) -> Result<String, EngineError> {
        match &self.directory {
            Some(d) => d.resolve(target).await,
            None => Ok(target.to_string()),
        }
    }

    /// After a failure the peer's etcd entry is read again next time (it may have restarted).
    fn forget_on_failure<T>(&self, target: &str, r: &Result<T, EngineError>) {
        if let (Err(_), Some(d)) = (r, &self.directory) {
            d.forget(target);
        }
    }

    async fn regions_of_session(
        &self,
        target: &str,
        deadline: Instant,
    ) -> Result<Vec<(u64, u64)>, EngineError> {
        let (segment, key) = peer(target)?;
        self.transport
            .peer_regions(&segment, &key, deadline)
            .await
            .map_err(|source| EngineError::Transfer {
                target: target.to_string(),
                source,
            })
    }

    /// Moves every request of `batch` between this process and `target`; all or an error (the
    /// first failure). Local buffers must lie in regions this engine registered; the peer
    /// checks its own side. Every exchange with the peer (asking whether it is on this host,
    /// waiting for a connection, connecting, the transfer) ends by one deadline, the transfer
    /// timeout from the call's start.
    pub async fn transfer(
        &self,
        target: &str,
        op: TransferOp,
        batch: &[TransferRequest],
    ) -> Result<(), EngineError> {
        self.transfer_as(target, op, batch, self.met(target)).await
    }

    /// `target` as this engine knows it now, for a call made now and run later (`transfer_as`).
    pub fn met(&self, target: &str) -> Option<MetPeer> {
        self.peers.known(target).map(MetPeer)
    }

    /// `transfer` of a call made when `target` was known as `met` (None: not met yet). Every
    /// try names that incarnation, so a call made before the peer restarted never moves bytes
    /// with its successor, even when the caller has met the successor before this one ran. Not
    /// met yet, the peer is met by the first try; known to have restarted, the call fails so
    /// at once (see `peers`).
    pub async fn transfer_as(
        &self,
        target: &str,
        op: TransferOp,
        batch: &[TransferRequest],
        met: Option<MetPeer>,
    ) -> Result<(), EngineError> {
        let deadline = self.transport.deadline();
        let session = self.session_of(target).await?;
        let mut met = met.map(|m| m.0.hello(target)).transpose()?;
        let mut r = self
            .transfer_to_session(target, &session, op, batch, deadline, &mut met)
            .await;
        if let (Err(_), Some(d)) = (&r, &self.directory) {
            // The name may have moved (its engine restarted on another port): looked up again,
            // a new session gets this call once more, by the same deadline. A restarted engine
            // refuses it all the same, but the caller hears so now, not one failure later.
            d.forget(target);
            if let Ok(now) = d.resolve(target).await {
                if now != session {
                    r = self
                        .transfer_to_session(target, &now, op, batch, deadline, &mut met)
                        .await;
                }
            }
        }
        self.forget_on_failure(target, &r);
        r
    }

    /// Host staging for the requests whose local memory is a device's: filled from the device
    /// for a write, empty for a read (see `stage_in`). None for host memory.
    async fn stage_out(
        &self,
        op: TransferOp,
        batch: &[TransferRequest],
        uses: &[Use],
    ) -> Result<Vec<Option<Staging>>, EngineError> {
        let mut out = Vec::with_capacity(batch.len());
        let mut copies = Vec::new();
        for (i, (r, u)) in batch.iter().zip(uses).enumerate() {
            match u.device() {
                None => out.push(None),
                Some(d) => {
                    let staging = d.staging(r.len as usize).map_err(device_err)?;
                    if op == TransferOp::Write {
                        // The copy holds its range: it may outlive a caller that stops waiting.
                        copies.push((i, d.clone(), r.local as usize, staging, u.clone()));
                        out.push(None);
                    } else {
                        out.push(Some(staging));
                    }
                }
            }
        }
        if !copies.is_empty() {
            let filled = tokio::task::spawn_blocking(move || {
                copies
                    .into_iter()
                    .map(|(i, d, from, mut st, _held)| {
                        d.copy_to_host(from, st.bytes_mut()).map(|()| (i, st))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|e| EngineError::Invalid(format!("a device copy panicked: {e}")))?
            .map_err(device_err)?;
            for (i, st) in filled {
                out[i] = Some(st);
            }
        }
        Ok(out)
    }

    /// After a read: the staged bytes into the devices they belong to.
    async fn stage_in(
        &self,
        batch: &[TransferRequest],
        uses: &[Use],
        stagings: Vec<Option<Staging>>,
    ) -> Result<(), EngineError> {
        let copies: Vec<(Arc<dyn DeviceMemory>, usize, Staging, Use)> = batch
            .iter()
            .zip(uses)
            .zip(stagings)
            .filter_map(|((r, u), st)| {
                Some((u.device()?.clone(), r.local as usize, st?, u.clone()))
            })
            .collect();
        if copies.is_empty() {
            return Ok(());
        }
        tokio::task::spawn_blocking(move || {
            copies
                .into_iter()
                .try_for_each(|(d, to, st, _held)| d.copy_from_host(st.bytes(), to))
        })
        .await
        .map_err(|e| EngineError::Invalid(format!("a device copy panicked: {e}")))?
        .map_err(device_err)
    }

    /// `transfer` to the peer the caller names `name`, now at `session`, as `met` (the peer as
    /// this call met it before; set here when it had not). A peer that refuses the call for
    /// naming an earlier incarnation is marked restarted (see `peers`).
    async fn transfer_to_session(
        &self,
        name: &str,
        session: &str,
        op: TransferOp,
        batch: &[TransferRequest],
        deadline: Instant,
        met: &mut Option<Arc<Hello>>,
    ) -> Result<(), EngineError> {
        let addressed = peer(session)?;
        // Hold every local range for the whole call: unregistering waits for it.
        let uses: Vec<Use> = batch
            .iter()
            .map(|r| self.regions.lookup(r.local, r.len))
            .collect::<Result<_, _>>()?;
        if let Some(r) = batch.iter().find(|r| r.len == 0) {
            return Err(EngineError::Invalid(format!(
                "a transfer of 0 bytes at {:#x}",
                r.local
            )));
        }
        let hello = match met {
            Some(h) => h.clone(),
            None => met
                .insert(self.peers.hello(name, session, deadline).await?)
                .clone(),
        };
        let r = self
            .move_bytes(addressed, &hello, op, batch, uses, deadline)
            .await;
        match r {
            Err(EngineError::Restarted { .. }) => {
                self.peers.restarted(name, hello.incarnation);
                Err(EngineError::Restarted {
                    target: name.to_string(),
                })
            }
            r => r,
        }
    }

    /// Moves `batch` with the peer at a session (as the transport's target and its requests'
    /// key), met as `hello`, over the path that suits it.
    async fn move_bytes(
        &self,
        (segment, key): (SegmentName, ObjectKey),
        hello: &Hello,
        op: TransferOp,
        batch: &[TransferRequest],
        mut uses: Vec<Use>,
        deadline: Instant,
    ) -> Result<(), EngineError> {
        let target = segment.as_str();
        let total: u64 = batch.iter().map(|r| r.len).sum();
        // Below SAME_HOST_MIN bytes the grant's round trip costs more than the socket copies.
        // A device's memory cannot be copied process to process: staged over TCP instead.
        let on_device = uses.iter().any(|u| u.device().is_some());
        if let (Some(small), [r], [u]) = (&self.small, batch, uses.as_slice()) {
            if r.len <= small::MAX && !on_device {
                let dir = match op {
                    TransferOp::Write => Dir::Write(u.bytes(r.local, r.len)),
                    TransferOp::Read => Dir::Read(u.bytes_mut(r.local, r.len)),
                };
                small.transfer(
                    target,
                    hello.incarnation,
                    r.remote,
                    dir,
                    deadline.into_std(),
                )?;
                self.counters.tcp.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        if let Some(local) =
            (self.same_host.as_ref()).filter(|_| total >= SAME_HOST_MIN && !on_device)
        {
            let pairs = batch.iter().map(|r| (r.local, r.remote, r.len)).collect();
            match local
                .transfer(target, hello, op == TransferOp::Read, pairs, uses, deadline)
                .await?
            {
                Outcome::Done { mapped, .. } => {
                    self.counters.same_host.fetch_add(1, Ordering::Relaxed);
                    if mapped {
                        self.counters.mapped.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Outcome::NotLocal(back) => uses = back,
            }
        }
        // Every request names the incarnation the peer was met as.
        let stamp = Stamp {
            put_id: hello.incarnation,
            replica_num: 1,
            soft_pin: false,
            hard_pin: false,
        };
        // Device memory goes through host staging buffers, one per request that needs one.
        let mut stagings = self.stage_out(op, batch, &uses).await?;
        let results = match op {
            TransferOp::Write => {
                let parts: Vec<[&[u8]; 1]> = batch
                    .iter()
                    .zip(&uses)
                    .zip(&stagings)
                    .map(|((r, u), st)| match st {
                        Some(st) => [st.bytes()],
                        None => [u.bytes(r.local, r.len)],
                    })
                    .collect();
                let items: Vec<WriteItem<'_>> = batch
                    .iter()
                    .zip(&parts)
                    .map(|(r, p)| WriteItem {
                        key: &key,
                        offset: r.remote,
                        stamp,
                        seal: Default::default(),
                        parts: p,
                    })
                    .collect();
                self.transport
                    .peer_write_batch(&segment, &items, deadline)
                    .await
            }
            TransferOp::Read => {
                let mut parts: Vec<[&mut [u8]; 1]> = batch
                    .iter()
                    .zip(&uses)
                    .zip(stagings.iter_mut())
                    .map(|((r, u), st)| match st {
                        Some(st) => [st.bytes_mut()],
                        None => [u.bytes_mut(r.local, r.len)],
                    })
                    .collect();
                let mut items: Vec<ReadItem<'_, '_>> = batch
                    .iter()
                    .zip(parts.iter_mut())
                    .map(|(r, p)| ReadItem {
                        key: &key,
                        offset: r.remote,
                        put_id: hello.incarnation,
                        seal: Default::default(),
                        parts: p,
                    })
                    .collect();
                self.transport
                    .peer_read_batch(&segment, &mut items, deadline)
                    .await
            }
        };
        self.counters.tcp.fetch_add(1, Ordering::Relaxed);
        match results.into_iter().find_map(Result::err) {
            None if op == TransferOp::Read => self.stage_in(batch, &uses, stagings).await,
            None => Ok(()),
            Some(TransferError::Remote { code, message, .. }) if code == peers::RESTARTED => {
                Err(peers::refused(target, code.as_i32(), &message))
            }
            Some(source) => Err(EngineError::Transfer {
                target: target.to_string(),
                source,
            }),
        }
    }
}

fn device_err(e: DeviceError) -> EngineError {
    EngineError::Invalid(format!("device copy: {e}"))
}

/// A peer's session name as the transport's target and the key its requests carry.
fn peer(target: &str) -> Result<(SegmentName, ObjectKey), EngineError> {
    let bad = |e: &dyn std::fmt::Display| {
        EngineError::Invalid(format!("peer {target:?} is not host:port ({e})"))
    };
    let segment = SegmentName::parse(target).map_err(|e| bad(&e))?;
    let key = ObjectKey::new(target).map_err(|e| bad(&e))?;
    Ok((segment, key))
}
