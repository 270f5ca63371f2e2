//! `TransferEngine`: Mooncake's point-to-point engine (`mooncake.engine.TransferEngine`) over
//! this project's `mooncake-engine` crate, with its method names, arguments and return codes:
//! 0 or a negative code, addresses as ints, batch ids for async batches. Each engine runs its
//! own small runtime, which also serves peers' requests in the background.

use std::{collections::HashMap, sync::Arc, time::Duration};

use mooncake_client::device::DeviceMemory;
use mooncake_common::leader::{parse_endpoints, ETCD_SCHEME};
use mooncake_engine::{
    Devices, EngineConfig, EngineError, Metadata, Requester, TransferEngine, TransferOp,
    TransferRequest,
};
use parking_lot::Mutex;
use pyo3::{exceptions::PyValueError, prelude::*, types::PyBytes};
use tokio::{runtime::Runtime, task::JoinHandle};

/// A batch of one transfer.
fn single(buffer: u64, peer_buffer_address: u64, length: u64) -> Vec<TransferRequest> {
    vec![TransferRequest {
        local: buffer,
        remote: peer_buffer_address,
        len: length,
    }]
}

/// Mooncake's `TransferOpcode` (Read = 0, Write = 1), when supported: not with a notify
/// (logged otherwise).
fn opcode(op: i64, notify: bool) -> Option<TransferOp> {
    match (op, notify) {
        (0, false) => Some(TransferOp::Read),
        (1, false) => Some(TransferOp::Write),
        _ => {
            tracing::warn!("transfer engine: opcode {op} (or a notify) is not supported");
            None
        }
    }
}

struct Running {
    /// The process that initialized it: a fork's copy is not usable (its runtimes' threads did
    /// not survive the fork, its sockets are the parent's); the child initializes its own.
    pid: u32,
    /// Serves peers and runs background batches, and the synchronous calls of threads that
    /// find the sync lane taken.
    rt: Runtime,
    engine: Arc<TransferEngine>,
    /// Synchronous calls, one thread at a time: a current-thread runtime that the calling
    /// thread drives itself, so an answer wakes it directly instead of through another thread
    /// (a 4 KiB write's latency). Its calls may block that thread (a small transfer on a
    /// blocking socket), so a second thread must not wait on the same runtime: it goes through
    /// `rt`.
    sync_lane: Mutex<SyncLane>,
    /// The synchronous calls' requester on `rt`.
    shared: Requester,
}

struct SyncLane {
    rt: Runtime,
    requester: Requester,
}

/// Runs a synchronous call (`$call`, with `$q` a requester) to completion on the calling
/// thread of `$r` (a `Running`): on the sync lane when it is free, else on the shared runtime.
macro_rules! block_on {
    ($r:expr, |$q:ident| $call:expr) => {
        match $r.sync_lane.try_lock() {
            Some(lane) => {
                let $q = &lane.requester;
                lane.rt.block_on($call)
            }
            None => {
                let $q = &$r.shared;
                $r.rt.block_on($call)
            }
        }
    };
}

#[pyclass(name = "TransferEngine", module = "mooncake_rs._native", subclass)]
pub struct NativeEngine {
    running: Option<Running>,
    /// Devices attached for tests (`_attach_host_backed_device`), besides the machine's GPUs.
    extra_devices: Vec<Arc<dyn DeviceMemory>>,
    batches: Mutex<HashMap<u64, JoinHandle<Result<(), EngineError>>>>,
    next_batch: Mutex<u64>,
}

/// The transfer deadline: `MC_TRANSFER_TIMEOUT` seconds (at least 5, 30 by default), as
/// Mooncake reads it.
fn transfer_timeout() -> Duration {
    let secs = std::env::var("MC_TRANSFER_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(30, |s| s.max(5));
    Duration::from_secs(secs)
}

fn log_failure(what: &str, e: &EngineError) -> i64 {
    tracing::warn!("transfer engine: {what} failed: {e}");
    e.code() as i64
}

impl NativeEngine {
    fn running(&self) -> Result<&Running, EngineError> {
        match &self.running {
            Some(r) if r.pid == std::process::id() => Ok(r),
            Some(_) => Err(EngineError::Invalid(
                "this process is a fork of the one that called initialize(): the engine stays \
                 with that process; call initialize() in this one"
                    .into(),
            )),
            None => Err(EngineError::Invalid("initialize() was not called".into())),
        }
    }

    fn batch(
        buffers: &[u64],
        peer_buffer_addresses: &[u64],
        lengths: &[u64],
    ) -> Result<Vec<TransferRequest>, EngineError> {
        if buffers.len() != peer_buffer_addresses.len() || buffers.len() != lengths.len() {
            return Err(EngineError::Invalid(format!(
                "{} buffers, {} peer addresses and {} lengths",
                buffers.len(),
                peer_buffer_addresses.len(),
                lengths.len()
            )));
        }
        Ok(buffers
            .iter()
            .zip(peer_buffer_addresses)
            .zip(lengths)
            .map(|((&local, &remote), &len)| TransferRequest { local, remote, len })
            .collect())
    }

    /// A synchronous batch (or why its lists are not one): 0, or -1 (the failure is logged).
    fn sync(
        &self,
        py: Python<'_>,
        target: &str,
        op: TransferOp,
        batch: Result<Vec<TransferRequest>, EngineError>,
    ) -> i64 {
        let run = || -> Result<(), EngineError> {
            let (r, batch) = (self.running()?, batch?);
            py.detach(|| block_on!(r, |q| q.transfer(target, op, &batch)))
        };
        match run() {
            Ok(()) => 0,
            Err(e) => {
                log_failure(&format!("{op:?} with {target}"), &e);
                -1
            }
        }
    }

    /// Starts a batch in the background; its id, or 0 when it cannot start (logged).
    fn submit(
        &self,
        target: &str,
        op: TransferOp,
        batch: Result<Vec<TransferRequest>, EngineError>,
    ) -> u64 {
        let (r, batch) = match self.running().and_then(|r| Ok((r, batch?))) {
            Ok(v) => v,
            Err(e) => {
                log_failure(&format!("starting a {op:?} with {target}"), &e);
                return 0;
            }
        };
        let engine = r.engine.clone();
        let target = target.to_string();
        // The call names the peer as known now, when it is made, not when its task runs.
        let met = engine.met(&target);
        let handle =
            r.rt.spawn(async move { engine.transfer_as(&target, op, &batch, met).await });
        let mut next = self.next_batch.lock();
        *next += 1;
        self.batches.lock().insert(*next, handle);
        *next
    }
}

#[pymethods]
impl NativeEngine {
    #[new]
    fn new() -> Self {
        NativeEngine {
            running: None,
            extra_devices: Vec::new(),
            batches: Mutex::new(HashMap::new()),
            next_batch: Mutex::new(0),
        }
    }

    /// Starts serving at `local_hostname` (a port given with it is ignored: a free one is
    /// picked, see `get_rpc_port`). With `metadata_server` "P2PHANDSHAKE" peers name each other
    /// by session name (`host:port`); with "etcd://HOST:PORT;HOST:PORT" (or a bare HOST:PORT)
    /// by the `local_hostname` each was started with, which etcd maps to its session name.
    /// Transfers go over TCP whatever `protocol` says (as Mooncake's engine falls back to TCP
    /// without RDMA devices). 0, or -1 with the reason logged.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name))]
    fn initialize(
        &mut self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i64 {
        let _ = device_name;
        if self.running().is_ok() {
            tracing::warn!("transfer engine: initialize() called twice");
            return -1;
        }
        if let Some(inherited) = self.running.take() {
            // Across fork(): the parent's to stop; never touched here (see `Running::pid`).
            std::mem::forget(inherited);
        }
        let metadata = match metadata_server.trim() {
            "P2PHANDSHAKE" => Metadata::P2pHandshake,
            m if m.starts_with("http://")
                || m.starts_with("https://")
                || m.starts_with("redis://") =>
            {
                tracing::warn!(
                    "transfer engine: metadata server {m:?} is not supported; use \"P2PHANDSHAKE\" \
                     or etcd://HOST:PORT"
                );
                return -1;
            }
            // Mooncake reads a bare HOST:PORT as etcd too.
            m => match parse_endpoints(m.strip_prefix(ETCD_SCHEME).unwrap_or(m)) {
                Ok(endpoints) => Metadata::Etcd(endpoints),
                Err(e) => {
                    tracing::warn!("transfer engine: metadata server {m:?}: {e}");
                    return -1;
                }
            },
        };
        if !matches!(protocol, "tcp" | "rdma" | "") {
            tracing::warn!("transfer engine: protocol {protocol:?} is not supported; use tcp");
            return -1;
        }
        let rt = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("mooncake-engine")
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!("transfer engine: cannot start its runtime: {e}");
                return -1;
            }
        };
        let config = EngineConfig {
            local_hostname: local_hostname.to_string(),
            transfer_timeout: transfer_timeout(),
            // Peers on this host are copied with directly unless MOONCAKE_SHM=0.
            same_host: match std::env::var("MOONCAKE_SHM") {
                Err(_) => true,
                Ok(v) => match mooncake_client::config::switch("MOONCAKE_SHM", &v) {
                    Ok(on) => on,
                    Err(e) => {
                        tracing::warn!("transfer engine: {e}");
                        return -1;
                    }
                },
            },
            metadata,
            // GPU memory registered is recognised and staged through host memory.
            devices: Devices(
                crate::gpu::detect()
                    .into_iter()
                    .chain(self.extra_devices.iter().cloned())
                    .collect(),
            ),
            ..Default::default()
        };
        let sync_rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!("transfer engine: cannot start its runtime: {e}");
                return -1;
            }
        };
        match py.detach(|| rt.block_on(TransferEngine::start(config))) {
            Ok(engine) => {
                let requester = engine.requester(true);
                let shared = engine.requester(false);
                self.running = Some(Running {
                    pid: std::process::id(),
                    rt,
                    engine: Arc::new(engine),
                    sync_lane: Mutex::new(SyncLane {
                        rt: sync_rt,
                        requester,
                    }),
                    shared,
                });
                0
            }
            Err(e) => {
                log_failure("initialize", &e);
                -1
            }
        }
    }

    /// `initialize` with Mooncake's extra `metadata_type` (ignored with P2PHANDSHAKE).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &mut self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i64 {
        let _ = metadata_type;
        self.initialize(py, local_hostname, metadata_server, protocol, device_name)
    }

    fn get_rpc_port(&self) -> i64 {
        self.running().map_or(-1, |r| r.engine.rpc_port() as i64)
    }

    /// `host:rpc_port`, the name peers pass as `target_hostname`.
    fn get_session_id(&self) -> String {
        self.running()
            .map_or_else(|_| String::new(), |r| r.engine.session_name().to_string())
    }

    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(&self, buffer_addr: u64, capacity: u64, location: &str) -> i64 {
        let _ = location;
        match self
            .running()
            .and_then(|r| r.engine.register(buffer_addr, capacity))
        {
            Ok(()) => 0,
            Err(e) => log_failure("register_memory", &e),
        }
    }

    /// Waits for transfers that use the region; -3 when nothing is registered there.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i64 {
        let run = || {
            let r = self.running()?;
            py.detach(|| r.rt.block_on(r.engine.unregister(buffer_addr)))
        };
        match run() {
            Ok(()) => 0,
            Err(e) => log_failure("unregister_memory", &e),
        }
    }

    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        buffer_addresses: Vec<u64>,
        capacities: Vec<u64>,
        location: &str,
    ) -> i64 {
        if buffer_addresses.len() != capacities.len() {
            return -1;
        }
        for (a, c) in buffer_addresses.into_iter().zip(capacities) {
            let rc = self.register_memory(a, c, location);
            if rc != 0 {
                return rc;
            }
        }
        0
    }

    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<u64>) -> i64 {
        let mut rc = 0;
        for a in buffer_addresses {
            let r = self.unregister_memory(py, a);
            if rc == 0 {
                rc = r;
            }
        }
        rc
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let one = Ok(single(buffer, peer_buffer_address, length));
        self.sync(py, target_hostname, TransferOp::Write, one)
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let one = Ok(single(buffer, peer_buffer_address, length));
        self.sync(py, target_hostname, TransferOp::Read, one)
    }

    /// `opcode`: 0 read, 1 write (Mooncake's `TransferOpcode`). `notify` is not supported.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: i64,
        notify: Option<Py<PyAny>>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(op) = self::opcode(opcode, notify.is_some()) else {
            return -1;
        };
        let one = Ok(single(buffer, peer_buffer_address, length));
        self.sync(py, target_hostname, op, one)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.sync(py, target_hostname, TransferOp::Write, batch)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.sync(py, target_hostname, TransferOp::Read, batch)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: i64,
        notify: Option<Py<PyAny>>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(op) = self::opcode(opcode, notify.is_some()) else {
            return -1;
        };
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.sync(py, target_hostname, op, batch)
    }

    /// Starts the batch and returns its id for `get_batch_transfer_status`; 0 when it cannot
    /// start. The buffers must stay valid until the status is taken.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.submit(target_hostname, TransferOp::Write, batch)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.submit(target_hostname, TransferOp::Read, batch)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    fn batch_transfer_async(
        &self,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: i64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let Some(op) = self::opcode(opcode, false) else {
            return 0;
        };
        let batch = Self::batch(&buffers, &peer_buffer_addresses, &lengths);
        self.submit(target_hostname, op, batch)
    }

    /// Waits for the batches `batch_ids` (each ends within the transfer deadline): 0 when all
    /// succeeded, -1 when any failed or is unknown. Their ids are spent either way.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i64 {
        let Ok(r) = self.running() else {
            return -1;
        };
        let handles: Vec<Option<JoinHandle<_>>> = {
            let mut b = self.batches.lock();
            batch_ids.iter().map(|id| b.remove(id)).collect()
        };
        let mut rc = 0;
        for (id, h) in batch_ids.iter().zip(handles) {
            let outcome = match h {
                None => Err(EngineError::Invalid(format!("no batch {id}"))),
                Some(h) => match py.detach(|| r.rt.block_on(h)) {
                    Ok(res) => res,
                    Err(e) => Err(EngineError::Invalid(format!("batch {id} panicked: {e}"))),
                },
            };
            if let Err(e) = outcome {
                log_failure(&format!("batch {id}"), &e);
                rc = -1;
            }
        }
        rc
    }

    /// Mooncake's single asynchronous write: a batch id (0 when it cannot start).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let one = Ok(single(buffer, peer_buffer_address, length));
        self.submit(target_hostname, TransferOp::Write, one)
    }

    /// Without waiting: 1 done (the id is spent), 0 still running, -1 failed or unknown.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i64 {
        let done = match self.batches.lock().get(&batch_id) {
            None => return -1,
            Some(h) => h.is_finished(),
        };
        if !done {
            return 0;
        }
        match self.get_batch_transfer_status(py, vec![batch_id]) {
            0 => 1,
            _ => -1,
        }
    }

    /// A zeroed, registered, page-aligned buffer; its address, or 0.
    fn allocate_managed_buffer(&self, length: u64) -> u64 {
        match self
            .running()
            .and_then(|r| r.engine.allocate_managed(length))
        {
            Ok(a) => a,
            Err(e) => {
                log_failure("allocate_managed_buffer", &e);
                0
            }
        }
    }

    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: u64) -> i64 {
        let _ = length;
        let run = || {
            let r = self.running()?;
            py.detach(|| r.rt.block_on(r.engine.free_managed(buffer_addr)))
        };
        match run() {
            Ok(()) => 0,
            Err(e) => log_failure("free_managed_buffer", &e),
        }
    }

    /// The first region `segment_name` (a peer's session name) registered; 0 if none or
    /// unreachable. Looking a peer's buffers up is what lets calls reach it again after it
    /// restarted (they fail until then: the addresses known were the old process's).
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        let run = || {
            let r = self.running()?;
            py.detach(|| block_on!(r, |q| q.peer_regions(segment_name)))
        };
        match run() {
            Ok(list) => list.first().map_or(0, |(a, _)| *a),
            Err(e) => {
                log_failure("get_first_buffer_address", &e);
                0
            }
        }
    }

    /// 0 when `peer_server_name` answers. Learns no addresses: a restarted peer's calls
    /// still fail until its buffers are looked up again (`get_first_buffer_address`).
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i64 {
        let run = || {
            let r = self.running()?;
            py.detach(|| block_on!(r, |q| q.probe(peer_server_name)))
        };
        match run() {
            Ok(_) => 0,
            Err(e) => log_failure("send_probe", &e),
        }
    }

    /// Copies `length` bytes of `data` into registered memory at `buffer_addr`: 0, or -3 when
    /// the range is not inside a registered region (Mooncake copies anywhere), -1 when `data`
    /// is shorter than `length`.
    fn write_bytes_to_buffer(&self, buffer_addr: u64, data: &[u8], length: u64) -> i64 {
        if length as usize > data.len() {
            return -1;
        }
        match self
            .running()
            .and_then(|r| r.engine.write_local(buffer_addr, &data[..length as usize]))
        {
            Ok(()) => 0,
            Err(e) => log_failure("write_bytes_to_buffer", &e),
        }
    }

    /// The `length` bytes of registered memory at `buffer_addr`; ValueError outside registered
    /// regions (Mooncake reads anywhere).
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        buffer_addr: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        match self
            .running()
            .and_then(|r| r.engine.read_local(buffer_addr, length))
        {
            Ok(v) => Ok(PyBytes::new(py, &v)),
            Err(e) => Err(PyValueError::new_err(e.to_string())),
        }
    }

    /// Batches moved so far by path: {"same_host": n, "same_host_mapped": n, "tcp": n}
    /// (the mapped ones, through a peer's managed buffer, are among the same-host ones).
    fn get_stats(&self) -> HashMap<&'static str, u64> {
        let s = self
            .running
            .as_ref()
            .map(|r| r.engine.stats())
            .unwrap_or_default();
        HashMap::from([
            ("same_host", s.same_host_batches),
            ("same_host_mapped", s.mapped_batches),
            ("tcp", s.tcp_batches),
        ])
    }

    /// Attaches device-like memory on the host (tests of the GPU path where no GPU exists; its
    /// addresses fault if read directly). Before `initialize`.
    fn _attach_host_backed_device(&mut self) -> PyResult<crate::gpu::HostBackedDevice> {
        if self.running.is_some() {
            return Err(PyValueError::new_err("attach devices before initialize()"));
        }
        let device = Arc::new(mooncake_client::device::host_backed::HostBackedDevice::new());
        self.extra_devices.push(device.clone());
        Ok(crate::gpu::HostBackedDevice { device })
    }

    /// Notifications are not supported: always empty.
    fn get_notifies(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// An engine dropped stops on a thread of its own (see `stopping`): its etcd entry withdrawn,
/// peers no longer served, its runtimes shut down.
impl Drop for NativeEngine {
    fn drop(&mut self) {
        let Some(r) = self.running.take() else {
            return;
        };
        if r.pid != std::process::id() {
            // Inherited across fork(): the parent's to stop (see `Running::pid`).
            std::mem::forget(r);
            return;
        }
        crate::stopping::stop_off_thread(
            "mooncake-engine-stop",
            "a dropped transfer engine",
            move || stop(r),
        );
    }
}

fn stop(r: Running) {
    r.rt.block_on(r.engine.withdraw());
    r.engine.stop();
    let lane = r.sync_lane.into_inner();
    drop(lane.requester);
    lane.rt.shutdown_timeout(Duration::from_secs(1));
    drop(r.shared);
    // Background batches end within their deadline; the engine goes after them.
    drop(r.engine);
    r.rt.shutdown_timeout(Duration::from_secs(1));
}
