//! The engine: its regions, the server peers reach it on, and the calls that move bytes between
//! this process's registered buffers and a peer's.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use mooncake_client::transport::tcp::{TcpConfig, TcpTransport};
use mooncake_common::{
    transport::{ReadItem, WriteItem},
    ObjectKey, SegmentName, Stamp,
};
use parking_lot::Mutex;
use tokio::{net::TcpListener, sync::watch};

use crate::{
    local::{self, Outcome, SameHost},
    memory,
    regions::{Regions, Use},
    server::{self, Served},
    EngineError,
};

/// Batches smaller than this go over TCP even to a peer on this host.
const SAME_HOST_MIN: u64 = 128 << 10;

/// How an engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The address peers reach this engine at (and it listens on); a port given with it is
    /// ignored, as Mooncake's engine does with P2PHANDSHAKE: a free one is picked.
    pub local_hostname: String,
    /// Deadline of one transfer call (Mooncake's `MC_TRANSFER_TIMEOUT`, 30 s by default).
    pub transfer_timeout: Duration,
    pub connect_timeout: Duration,
    /// Connections kept per peer.
    pub connections_per_peer: usize,
    /// Threads one large batch to one peer may use.
    pub transfer_threads: usize,
    /// Copy with peers on this host directly (`process_vm_readv`/`writev`, one copy) instead of
    /// over TCP; the binding turns it off with `MOONCAKE_SHM=0`.
    pub same_host: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            local_hostname: "127.0.0.1".into(),
            transfer_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(2),
            connections_per_peer: 8,
            transfer_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            same_host: true,
        }
    }
}

/// Which way a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferOp {
    /// From local buffers to the peer's memory.
    Write,
    /// From the peer's memory into local buffers.
    Read,
}

/// One transfer of a batch: `len` bytes between local `local` and the peer's `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// Batches this engine moved, by path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub same_host_batches: u64,
    pub tcp_batches: u64,
}

pub struct TransferEngine {
    same_host_batches: std::sync::atomic::AtomicU64,
    tcp_batches: std::sync::atomic::AtomicU64,
    name: String,
    port: u16,
    regions: Arc<Regions>,
    transport: TcpTransport,
    same_host: Option<SameHost>,
    config: EngineConfig,
    /// Buffers `allocate_managed` handed out: address -> length.
    managed: Mutex<HashMap<u64, u64>>,
    stop: watch::Sender<bool>,
}

impl TransferEngine {
    /// Starts serving on `config.local_hostname` (an IP address or a name that resolves to one)
    /// at a free port; the session name peers use is `host:port`.
    pub async fn start(config: EngineConfig) -> Result<Self, EngineError> {
        let host = host_part(&config.local_hostname).to_string();
        if host.is_empty() {
            return Err(EngineError::Invalid("local_hostname is empty".into()));
        }
        let bind_err = |source| EngineError::Bind {
            addr: host.clone(),
            source,
        };
        let ip: IpAddr = match host.trim_matches(['[', ']']).parse() {
            Ok(ip) => ip,
            Err(_) => tokio::net::lookup_host((host.as_str(), 0))
                .await
                .map_err(bind_err)?
                .next()
                .map(|a| a.ip())
                .ok_or_else(|| {
                    bind_err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "the name resolves to no address",
                    ))
                })?,
        };
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(bind_err)?;
        let port = listener.local_addr().map_err(bind_err)?.port();
        let name = match ip {
            IpAddr::V6(_) if !host.starts_with('[') && host.contains(':') => {
                format!("[{host}]:{port}")
            }
            _ => format!("{host}:{port}"),
        };
        let regions = Arc::new(Regions::default());
        let (stop, stopped) = watch::channel(false);
        let served = Arc::new(Served {
            regions: regions.clone(),
            identity: local::host_identity(),
            name: name.clone(),
            frame_timeout: config.transfer_timeout,
        });
        tokio::spawn(server::serve(listener, served, stopped));
        let transport = TcpTransport::new(TcpConfig {
            connect_timeout: config.connect_timeout,
            transfer_timeout: config.transfer_timeout,
            connections_per_owner: config.connections_per_peer.max(1),
            transfer_threads: config.transfer_threads.max(1),
            dedicated_runtime: false,
        });
        tracing::info!(session = %name, "transfer engine serving");
        let same_host = config
            .same_host
            .then(|| SameHost::new(config.transfer_timeout));
        Ok(TransferEngine {
            same_host_batches: Default::default(),
            tcp_batches: Default::default(),
            name,
            port,
            regions,
            transport,
            same_host,
            config,
            managed: Mutex::new(HashMap::new()),
            stop,
        })
    }

    /// `host:port`, the name peers address this engine by.
    pub fn session_name(&self) -> &str {
        &self.name
    }

    pub fn rpc_port(&self) -> u16 {
        self.port
    }

    /// Offers `addr..addr + len` to peers' transfers (and to this engine's own as a buffer).
    pub fn register(&self, addr: u64, len: u64) -> Result<(), EngineError> {
        self.regions.register(addr, len)
    }

    /// Withdraws the region starting at `addr`; returns once no transfer uses it.
    pub async fn unregister(&self, addr: u64) -> Result<(), EngineError> {
        self.regions
            .unregister(addr, self.config.transfer_timeout * 2)
            .await
    }

    /// This engine's regions, (address, length) each.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.regions.list()
    }

    /// A zeroed, registered buffer of `len` bytes, freed by `free_managed`.
    pub fn allocate_managed(&self, len: u64) -> Result<u64, EngineError> {
        let addr = memory::allocate(len)
            .ok_or_else(|| EngineError::Invalid(format!("cannot allocate {len} bytes")))?;
        if let Err(e) = self.regions.register(addr, len) {
            memory::free(addr, len);
            return Err(e);
        }
        self.managed.lock().insert(addr, len);
        Ok(addr)
    }

    /// Unregisters and frees a buffer `allocate_managed` returned.
    pub async fn free_managed(&self, addr: u64) -> Result<(), EngineError> {
        let Some(len) = self.managed.lock().get(&addr).copied() else {
            return Err(EngineError::NotRegistered { addr, len: 0 });
        };
        self.unregister(addr).await?;
        self.managed.lock().remove(&addr);
        memory::free(addr, len);
        Ok(())
    }

    /// Copies `data` into this process's registered memory at `addr`.
    pub fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), EngineError> {
        let usage = self.regions.lookup(addr, data.len() as u64)?;
        usage
            .bytes_mut(addr, data.len() as u64)
            .copy_from_slice(data);
        Ok(())
    }

    /// The `len` bytes of this process's registered memory at `addr`.
    pub fn read_local(&self, addr: u64, len: u64) -> Result<Vec<u8>, EngineError> {
        let usage = self.regions.lookup(addr, len)?;
        Ok(usage.bytes(addr, len).to_vec())
    }

    /// The regions `target` registered.
    pub async fn peer_regions(&self, target: &str) -> Result<Vec<(u64, u64)>, EngineError> {
        let (segment, key) = peer(target)?;
        self.transport
            .peer_regions(&segment, &key)
            .await
            .map_err(|source| EngineError::Transfer {
                target: target.to_string(),
                source,
            })
    }

    /// Moves every request of `batch` between this process and `target`; all or an error (the
    /// first failure). Local buffers must lie in regions this engine registered; the peer
    /// checks its own side. Ends within the transfer deadline.
    pub async fn transfer(
        &self,
        target: &str,
        op: TransferOp,
        batch: &[TransferRequest],
    ) -> Result<(), EngineError> {
        let (segment, key) = peer(target)?;
        // Hold every local range for the whole call: unregistering waits for it.
        let mut uses: Vec<Use> = batch
            .iter()
            .map(|r| self.regions.lookup(r.local, r.len))
            .collect::<Result<_, _>>()?;
        if let Some(r) = batch.iter().find(|r| r.len == 0) {
            return Err(EngineError::Invalid(format!(
                "a transfer of 0 bytes at {:#x}",
                r.local
            )));
        }
        let total: u64 = batch.iter().map(|r| r.len).sum();
        // Below SAME_HOST_MIN bytes the grant's round trip costs more than the socket copies.
        if let Some(local) = self.same_host.as_ref().filter(|_| total >= SAME_HOST_MIN) {
            let pairs = batch.iter().map(|r| (r.local, r.remote, r.len)).collect();
            match local
                .transfer(target, op == TransferOp::Read, pairs, uses)
                .await?
            {
                Outcome::Done => {
                    self.same_host_batches.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Outcome::NotLocal(back) => uses = back,
            }
        }
        let stamp = Stamp {
            put_id: 0,
            replica_num: 1,
            soft_pin: false,
            hard_pin: false,
        };
        let results = match op {
            TransferOp::Write => {
                let parts: Vec<[&[u8]; 1]> = batch
                    .iter()
                    .zip(&uses)
                    .map(|(r, u)| [u.bytes(r.local, r.len)])
                    .collect();
                let items: Vec<WriteItem<'_>> = batch
                    .iter()
                    .zip(&parts)
                    .map(|(r, p)| WriteItem {
                        key: &key,
                        offset: r.remote,
                        stamp,
                        parts: p,
                    })
                    .collect();
                self.transport.peer_write_batch(&segment, &items).await
            }
            TransferOp::Read => {
                let mut parts: Vec<[&mut [u8]; 1]> = batch
                    .iter()
                    .zip(&uses)
                    .map(|(r, u)| [u.bytes_mut(r.local, r.len)])
                    .collect();
                let mut items: Vec<ReadItem<'_, '_>> = batch
                    .iter()
                    .zip(parts.iter_mut())
                    .map(|(r, p)| ReadItem {
                        key: &key,
                        offset: r.remote,
                        put_id: 0,
                        parts: p,
                    })
                    .collect();
                self.transport.peer_read_batch(&segment, &mut items).await
            }
        };
        drop(uses);
        self.tcp_batches.fetch_add(1, Ordering::Relaxed);
        match results.into_iter().find_map(Result::err) {
            None => Ok(()),
            Some(source) => Err(EngineError::Transfer {
                target: target.to_string(),
                source,
            }),
        }
    }

    /// Batches moved so far, by path.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            same_host_batches: self.same_host_batches.load(Ordering::Relaxed),
            tcp_batches: self.tcp_batches.load(Ordering::Relaxed),
        }
    }

    /// Stops serving peers (also on drop). Transfers under way on the peers' side fail.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.stop();
        // Managed buffers go with the engine, unless a request being served still uses one
        // (the server stops between requests): that one is left allocated rather than freed
        // under it.
        for (addr, len) in self.managed.get_mut().drain() {
            if self.regions.remove_if_idle(addr) {
                memory::free(addr, len);
            } else {
                tracing::warn!(
                    addr = format_args!("{addr:#x}"),
                    len,
                    "a managed buffer was in use as its engine stopped; leaving it allocated"
                );
            }
        }
    }
}

/// The host of `host[:port]` (IPv6 in brackets keeps its colons).
fn host_part(s: &str) -> &str {
    if s.starts_with('[') {
        return s.split_once(']').map_or(s, |(h, _)| &h[1..]);
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.parse::<u16>().is_ok() => h,
        _ => s,
    }
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
