//! The engine: its regions, the server peers reach it on, and the calls that move bytes between
//! this process's registered buffers and a peer's.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    sync::Arc,
    time::Duration,
};

use mooncake_client::device::DeviceMemory;
use parking_lot::Mutex;
use tokio::{net::TcpListener, sync::watch};

use crate::{
    directory::Directory,
    local, memory,
    peers::{self, Peers},
    regions::Regions,
    requester::{Counters, MetPeer, Requester, Shared},
    server::{self, Served},
    EngineError,
};

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
    /// How peers find each other.
    pub metadata: Metadata,
    /// Devices (GPUs) whose memory `register` recognises: such a region's bytes move through
    /// host staging with the device's own copies, never read as host memory.
    pub devices: Devices,
}

/// The devices an engine recognises memory of.
#[derive(Clone, Default)]
pub struct Devices(pub Vec<Arc<dyn DeviceMemory>>);

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|d| d.name()))
            .finish()
    }
}

/// How peers find each other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Metadata {
    /// A peer's name is its session name, `host:port` (Mooncake's `P2PHANDSHAKE`).
    #[default]
    P2pHandshake,
    /// Engines publish their session name in etcd under the name they were started with
    /// (`local_hostname`), and peers are named by those names.
    Etcd(Vec<String>),
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
            metadata: Metadata::P2pHandshake,
            devices: Devices::default(),
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

pub use crate::requester::EngineStats;

pub struct TransferEngine {
    name: String,
    port: u16,
    /// Drawn at start; peers' requests must carry it (see `peers`).
    incarnation: u64,
    regions: Arc<Regions>,
    requester: Requester,
    counters: Arc<Counters>,
    peers: Arc<Peers>,
    mappings: Arc<Mutex<local::Mappings>>,
    directory: Option<Arc<Directory>>,
    config: EngineConfig,
    /// Buffers `allocate_managed` handed out, by address.
    managed: Mutex<HashMap<u64, memory::Managed>>,
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
        let incarnation = peers::draw_incarnation();
        let served = Arc::new(Served {
            regions: regions.clone(),
            identity: local::host_identity(),
            name: name.clone(),
            frame_timeout: config.transfer_timeout,
            incarnation,
            // Twice the time an unregister waits for it.
            grant_patience: config.transfer_timeout * 4,
        });
        tokio::spawn(server::serve(listener, served, stopped));
        let directory = match &config.metadata {
            Metadata::P2pHandshake => None,
            Metadata::Etcd(endpoints) => Some(Arc::new(
                Directory::publish(
                    endpoints.clone(),
                    &config.local_hostname,
                    &name,
                    config.connect_timeout.max(Duration::from_secs(2)),
                )
                .await?,
            )),
        };
        let counters = Arc::new(Counters::default());
        let peers = Arc::new(Peers::default());
        let mappings = Arc::default();
        let requester = Requester::new(
            regions.clone(),
            &config,
            Shared {
                counters: counters.clone(),
                peers: peers.clone(),
                mappings: Arc::clone(&mappings),
            },
            false,
            directory.clone(),
        );
        Ok(TransferEngine {
            name,
            port,
            incarnation,
            regions,
            requester,
            counters,
            peers,
            mappings,
            directory,
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

    /// The random number this engine drew at start; every read, write and grant a peer sends it
    /// must carry it, so that a peer that knew an earlier process under the same name is
    /// refused instead of served at stale addresses.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Offers `addr..addr + len` to peers' transfers (and to this engine's own as a buffer).
    /// Memory of one of `config.devices` is recognised as such.
    pub fn register(&self, addr: u64, len: u64) -> Result<(), EngineError> {
        let (start, n) = (addr as usize, len as usize);
        let device = (self.config.devices.0.iter())
            .find(|d| d.owns(start, n))
            .cloned();
        // A range a device claims only part of would be taken for host memory and read as such:
        // refused instead.
        if device.is_none() && (self.config.devices.0.iter()).any(|d| d.owns_an_end(start, n)) {
            return Err(EngineError::Invalid(format!(
                "region {addr:#x} of {len} bytes is partly device memory: register each device \
                 allocation on its own"
            )));
        }
        // Host memory is read and written as such: anything else would crash the process.
        if device.is_none()
            && len > 0
            && !mooncake_common::host_memory::readable_and_writable(start, n)
        {
            return Err(EngineError::Invalid(format!(
                "region {addr:#x} of {len} bytes is not host memory this process can read and \
                 write (unmapped, read-only, or device memory this build does not recognise)"
            )));
        }
        self.regions.register(addr, len, device)
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

    /// A zeroed, registered buffer of `len` bytes, freed by `free_managed`. It lies in a memory
    /// file where the OS has them, so that same-host peers copy into and out of it with
    /// `memcpy` through a mapping of their own (see `local`).
    pub fn allocate_managed(&self, len: u64) -> Result<u64, EngineError> {
        let m = memory::Managed::allocate(len)
            .ok_or_else(|| EngineError::Invalid(format!("cannot allocate {len} bytes")))?;
        let addr = m.addr;
        let registered = match &m.fd {
            Some(fd) => self.regions.register_file(addr, len, fd.as_raw_fd()),
            None => self.regions.register(addr, len, None),
        };
        if let Err(e) = registered {
            drop(m);
            return Err(e);
        }
        self.managed.lock().insert(addr, m);
        Ok(addr)
    }

    /// Unregisters and frees a buffer `allocate_managed` returned (also one unregistered
    /// already with `unregister`). Refused (`InUse`) while another region registered inside
    /// it remains (after `unregister` of the buffer, a part of it registered again): freeing
    /// would leave peers reading and writing unmapped memory through that region.
    pub async fn free_managed(&self, addr: u64) -> Result<(), EngineError> {
        let Some(len) = self.managed.lock().get(&addr).map(|m| m.len) else {
            return Err(EngineError::NotRegistered { addr, len: 0 });
        };
        match self.unregister(addr).await {
            Ok(()) | Err(EngineError::NotRegistered { .. }) => {}
            Err(e) => return Err(e),
        }
        if let Some(region) = self.regions.overlapping(addr, len) {
            return Err(EngineError::InUse { addr, len, region });
        }
        let freed = self.managed.lock().remove(&addr);
        drop(freed);
        Ok(())
    }

    /// Copies `data` into this process's registered memory at `addr`.
    pub fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), EngineError> {
        let usage = self.regions.lookup(addr, data.len() as u64)?;
        match usage.device() {
            Some(d) => d
                .copy_from_host(data, addr as usize)
                .map_err(|e| EngineError::Invalid(e.to_string())),
            None => {
                usage
                    .bytes_mut(addr, data.len() as u64)
                    .copy_from_slice(data);
                Ok(())
            }
        }
    }

    /// The `len` bytes of this process's registered memory at `addr`.
    pub fn read_local(&self, addr: u64, len: u64) -> Result<Vec<u8>, EngineError> {
        let usage = self.regions.lookup(addr, len)?;
        match usage.device() {
            Some(d) => {
                let mut out = vec![0u8; len as usize];
                d.copy_to_host(addr as usize, &mut out)
                    .map_err(|e| EngineError::Invalid(e.to_string()))?;
                Ok(out)
            }
            None => Ok(usage.bytes(addr, len).to_vec()),
        }
    }

    /// The regions `target` registered; meets it afresh (see `Requester::peer_regions`).
    pub async fn peer_regions(&self, target: &str) -> Result<Vec<(u64, u64)>, EngineError> {
        self.requester.peer_regions(target).await
    }

    /// Moves every request of `batch` between this process and `target`; all or an error (the
    /// first failure). See `Requester::transfer`.
    pub async fn transfer(
        &self,
        target: &str,
        op: TransferOp,
        batch: &[TransferRequest],
    ) -> Result<(), EngineError> {
        self.requester.transfer(target, op, batch).await
    }

    /// `target` as this engine knows it now: a call made now and run later names it
    /// (`transfer_as`).
    pub fn met(&self, target: &str) -> Option<MetPeer> {
        self.requester.met(target)
    }

    /// `transfer` of a call made when `target` was known as `met`. See `Requester::transfer_as`.
    pub async fn transfer_as(
        &self,
        target: &str,
        op: TransferOp,
        batch: &[TransferRequest],
        met: Option<MetPeer>,
    ) -> Result<(), EngineError> {
        self.requester.transfer_as(target, op, batch, met).await
    }

    /// Another requester of this engine's (its regions, its counters), with connections of its
    /// own: for callers on another runtime (a connection belongs to the runtime it was made on).
    /// `dedicated_runtime`: that runtime is a current-thread one that runs nothing but these
    /// calls, so a large batch may block it while its threads move the bytes.
    pub fn requester(&self, dedicated_runtime: bool) -> Requester {
        Requester::new(
            self.regions.clone(),
            &self.config,
            Shared {
                counters: self.counters.clone(),
                peers: self.peers.clone(),
                mappings: self.mappings.clone(),
            },
            dedicated_runtime,
            self.directory.clone(),
        )
    }

    /// Batches moved so far, by path.
    pub fn stats(&self) -> EngineStats {
        self.counters.stats()
    }

    /// Removes this engine's etcd entry now (with etcd metadata), so peers stop finding it.
    pub async fn withdraw(&self) {
        if let Some(d) = &self.directory {
            d.withdraw().await;
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
        // (the server stops between requests) or another region registered inside it remains
        // (see `free_managed`): that one is left allocated rather than freed under it.
        for (addr, m) in self.managed.get_mut().drain() {
            if self.regions.remove_if_idle(addr) && self.regions.overlapping(addr, m.len).is_none()
            {
                drop(m);
            } else {
                tracing::warn!(
                    addr = format_args!("{addr:#x}"),
                    len = m.len,
                    "a managed buffer was in use as its engine stopped (by a transfer, or a \
                     region registered inside it); leaving it allocated"
                );
                // Its memory and its file stay: a peer may still be granted them.
                std::mem::forget(m);
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
