//! `NativeStore`: Mooncake's `MooncakeDistributedStore` methods with its return conventions.
//! Writes return 0 or a negative code; reads return bytes read or a negative code; existence is
//! 1 / 0 / negative; `get` returns b"" on a miss; a store that was never set up answers -600
//! (never a crash). The GIL is released around every network and copy step.

use std::sync::Arc;

use mooncake_client::{
    device::{DeviceMemory, DeviceParts, DeviceRange},
    ClientError, ReplicateConfig as ClientConfig, Tier,
};
use mooncake_common::Code;
use parking_lot::{RwLock, RwLockReadGuard};
use pyo3::{
    prelude::*,
    pybacked::PyBackedStr,
    types::{PyByteArray, PyBytes, PyDict, PyTuple, PyType},
};

use crate::{
    buffer::{FreshByteArray, PyBytesView},
    config::{ReplicateConfig, SetupArgs},
    registry::{Pinned, Registry, RegistryError},
    replica::ReplicaDescriptor,
    session::Session,
};

pub(crate) const INVALID: i32 = Code::InvalidParams as i32;

#[pyclass(subclass, module = "mooncake_rs._native")]
pub struct NativeStore {
    pub(crate) session: RwLock<Option<Arc<Session>>>,
    pub(crate) registry: Registry,
    /// I/O threads for the next setup() when MOONCAKE_IO_THREADS is not set (0: the calling
    /// thread drives the calls; the async store asks for some).
    io_threads: std::sync::atomic::AtomicUsize,
    /// Devices whose memory `register_buffer` recognises (the GPUs found at the first setup).
    pub(crate) devices: RwLock<Vec<Arc<dyn DeviceMemory>>>,
    /// Whether the GPUs were looked for: once per store, not again at each setup after a close
    /// (each look holds every GPU's context and a staging pool for the store's life).
    gpus_found: std::sync::atomic::AtomicBool,
}

/// `replicate`, for an upsert when `upsert`.
pub(crate) fn config_of(
    config: Option<PyRef<'_, ReplicateConfig>>,
    upsert: bool,
) -> Option<ClientConfig> {
    replicate(config).map(|c| ClientConfig { upsert, ..c })
}

/// The client's form of a put's config; None (logged) when it names a segment that does not
/// parse, which the put answers with INVALID_PARAMS.
pub(crate) fn replicate(config: Option<PyRef<'_, ReplicateConfig>>) -> Option<ClientConfig> {
    match config.map(|c| c.to_client()) {
        None => Some(ClientConfig::default()),
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => {
            tracing::error!(error = %e, "invalid ReplicateConfig");
            None
        }
    }
}

/// Mooncake's convention for a put result: 0 for stored or already there, else the code.
pub(crate) fn put_code(r: &Result<mooncake_client::PutOutcome, ClientError>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.code().as_i32(),
    }
}

/// Mooncake's convention for a get result: bytes read, else the code.
pub(crate) fn get_code(r: &Result<usize, ClientError>) -> i64 {
    match r {
        Ok(n) => *n as i64,
        Err(e) => e.code().as_i32() as i64,
    }
}

pub(crate) fn log_unregistered(what: &str, ptr: usize, size: usize) {
    tracing::error!(
        ptr = format_args!("{ptr:#x}"),
        size,
        "{what}: buffer is not inside a registered range; call register_buffer first"
    );
}

impl NativeStore {
    /// The session this process set up. One inherited across `fork()` is none: its I/O threads
    /// did not survive the fork (a call would wait for ever) and its sockets are the parent's
    /// (a call would read the parent's answers, or the parent this one's), so it is dropped
    /// from this process unused, never closed (that would unmount the parent's segments and
    /// talk over its sockets), and this process may call setup() for a session of its own.
    pub(crate) fn session(&self) -> Option<Arc<Session>> {
        let s = self.session.read().clone()?;
        if s.pid == std::process::id() {
            return Some(s);
        }
        drop(s);
        self.forget_inherited();
        None
    }

    /// Leaks a session inherited across `fork()` (see `session`).
    fn forget_inherited(&self) {
        let inherited = self
            .session
            .write()
            .take_if(|s| s.pid != std::process::id());
        if let Some(s) = inherited {
            tracing::error!(
                parent = s.pid,
                "this process is a fork of the one that called setup(): the store's session stays \
                 with that process; call setup() again in this one"
            );
            std::mem::forget(s);
        }
    }

    /// Runs `f` on the session with the GIL released; `missing` when setup has not succeeded.
    fn with_session<T: Send>(
        &self,
        py: Python<'_>,
        missing: T,
        f: impl FnOnce(&Session) -> T + Send,
    ) -> T {
        let Some(session) = self.session() else {
            tracing::error!("the store is not set up: call setup() first");
            return missing;
        };
        py.detach(|| f(&session))
    }

    /// The registry pinned: at once when nobody is changing it (the usual case, no GIL
    /// hand-off), otherwise waited for with the GIL released: an unregister may be waiting for
    /// a transfer that must take the GIL back before it unpins, and new pins queue behind that
    /// unregister.
    fn pin(&self, py: Python<'_>) -> Pinned<RwLockReadGuard<'_, crate::registry::Ranges>> {
        (self.registry.try_pin()).unwrap_or_else(|| py.detach(|| self.registry.pin()))
    }

    /// Ends the session once the calls in flight (which hold it) are over, waiting for them
    /// with the GIL released, as long as their deadlines allow; past that, the session ends
    /// with the last of them.
    fn close_session(&self, py: Python<'_>) {
        self.forget_inherited();
        let Some(mut session) = self.session.write().take() else {
            return;
        };
        let until = std::time::Instant::now() + session.calls_end_within();
        py.detach(|| loop {
            match Arc::try_unwrap(session) {
                Ok(s) => return s.close(),
                Err(s) if std::time::Instant::now() < until => {
                    session = s;
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(_) => {
                    return tracing::warn!(
                        "close(): calls still in flight past their deadlines; the session ends when they finish"
                    )
                }
            }
        })
    }
}

#[pymethods]
impl NativeStore {
    #[new]
    fn new() -> Self {
        NativeStore {
            session: RwLock::new(None),
            registry: Registry::default(),
            io_threads: Default::default(),
            devices: RwLock::new(Vec::new()),
            gpus_found: Default::default(),
        }
    }

    /// `setup(local_hostname, metadata_server, global_segment_size=16 MiB, local_buffer_size=16 MiB,
    /// protocol="tcp", rdma_devices="", master_server_addr="127.0.0.1:50051")` (Mooncake's
    /// defaults) or `setup(config: dict)`; returns 0 or a negative code.
    #[pyo3(signature = (*args, **kwargs))]
    fn setup(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<i32> {
        let parsed = SetupArgs::parse(args, kwargs)?;
        if self.session().is_some() {
            tracing::error!("setup() called twice; call close() first");
            return Ok(INVALID);
        }
        let threads = self.io_threads.load(std::sync::atomic::Ordering::Relaxed);
        let session = match py.detach(|| Session::start(&parsed, threads)) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(code = e.code.as_i32(), "setup failed: {}", e.message);
                return Ok(e.code.as_i32());
            }
        };
        // The devices are known before the session is: a GPU buffer registered as soon as
        // setup() answers (or while it runs, from another thread) is not taken for host memory.
        if !self
            .gpus_found
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let gpus = py.detach(crate::gpu::detect);
            self.devices.write().extend(gpus);
        }
        let mut slot = self.session.write();
        if slot.is_some() {
            // Another thread's setup() won meanwhile: this one's session goes.
            drop(slot);
            tracing::error!("setup() called twice (from two threads at once); call close() first");
            py.detach(|| session.close());
            return Ok(INVALID);
        }
        *slot = Some(Arc::new(session));
        Ok(0)
    }

    /// I/O threads the next `setup()` starts unless MOONCAKE_IO_THREADS says otherwise.
    fn _set_io_threads(&self, threads: usize) {
        self.io_threads
            .store(threads, std::sync::atomic::Ordering::Relaxed);
    }

    fn close(&self, py: Python<'_>) -> i32 {
        self.close_session(py);
        0
    }

    /// What this client moved so far: bytes by path (`local_bytes` same-host, `tcp_bytes`) and
    /// keys and bytes of gets served from owners' memory and from their SSD tiers. Not part of
    /// Mooncake's API; empty before setup.
    fn transfer_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(s) = self.session() {
            let t = s.transfer_stats();
            for (k, v) in [
                ("local_bytes", t.local_bytes),
                ("tcp_bytes", t.tcp_bytes),
                ("memory_keys", t.memory_keys),
                ("memory_bytes", t.memory_bytes),
                ("disk_keys", t.disk_keys),
                ("disk_bytes", t.disk_bytes),
                ("get_keys", t.get_keys),
                ("put_keys", t.put_keys),
                ("put_bytes", t.put_bytes),
            ] {
                d.set_item(k, v)?;
            }
        }
        Ok(d)
    }

    /// This process's segment ("host:port") when it contributes memory, else its local hostname.
    fn get_hostname(&self) -> String {
        self.session()
            .map(|s| s.hostname.clone())
            .unwrap_or_default()
    }

    /// 0 healthy, 1 not set up, 2 master unreachable.
    fn health_check(&self, py: Python<'_>) -> i32 {
        self.with_session(py, 1, |s| {
            if s.block_on(async |c| c.list_segments().await).is_ok() {
                0
            } else {
                2
            }
        })
    }

    fn register_buffer(&self, py: Python<'_>, buffer_ptr: usize, size: usize) -> i32 {
        if self.session().is_none() {
            // The devices are found by setup(): a GPU buffer registered before would be taken
            // for host memory.
            tracing::error!("register_buffer before setup(): call setup() first");
            return INVALID;
        }
        let devices = self.devices.read().clone();
        let registered = py.detach(|| {
            // GPU memory is recognised and never read as host memory: it moves through staging.
            match devices.iter().find(|d| d.owns(buffer_ptr, size)) {
                Some(d) => self.registry.register_device(buffer_ptr, size, d.clone()),
                None if devices.iter().any(|d| d.owns_an_end(buffer_ptr, size)) => {
                    Err(RegistryError::PartlyDevice)
                }
                None => self.registry.register(buffer_ptr, size),
            }
        });
        match registered {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(
                    ptr = format_args!("{buffer_ptr:#x}"),
                    size,
                    "register_buffer: {e}"
                );
                INVALID
            }
        }
    }

    /// Adds `size` bytes of this process's memory to the store as a new segment (an owner inside
    /// this process, serving other clients too): `{"ret": 0, "segment_ids": [name],
    /// "allocated_size": size}`, or `ret` < 0 and no segment. `protocol` must be "tcp";
    /// `location` (a NUMA or device hint) is not used.
    #[pyo3(signature = (size, protocol="tcp".to_string(), location=String::new()))]
    fn allocate_and_mount_segment<'py>(
        &self,
        py: Python<'py>,
        size: u64,
        protocol: String,
        location: String,
    ) -> PyResult<Bound<'py, PyDict>> {
        let _ = location;
        let mounted = if protocol.eq_ignore_ascii_case("tcp") {
            self.with_session(py, Err(INVALID), |s| {
                s.mount_memory(size).map_err(|e| {
                    tracing::error!(size, "allocate_and_mount_segment: {}", e.message);
                    e.code.as_i32()
                })
            })
        } else {
            tracing::error!(
                protocol,
                "allocate_and_mount_segment: only protocol \"tcp\" exists"
            );
            Err(INVALID)
        };
        let d = PyDict::new(py);
        match mounted {
            Ok(name) => {
                d.set_item("ret", 0)?;
                d.set_item("segment_ids", vec![name])?;
                d.set_item("allocated_size", size)?;
            }
            Err(code) => {
                d.set_item("ret", code)?;
                d.set_item("segment_ids", Vec::<String>::new())?;
                d.set_item("allocated_size", 0)?;
            }
        }
        Ok(d)
    }

    /// Unmounts and frees segments `allocate_and_mount_segment` made (their objects go with
    /// them); 0, or -600 when a name is not one of them (the others are still freed).
    fn unmount_and_free_segment(&self, py: Python<'_>, segment_ids: Vec<String>) -> i32 {
        self.with_session(py, INVALID, |s| {
            let unknown: Vec<&String> = segment_ids
                .iter()
                .filter(|id| !s.unmount_memory(id))
                .collect();
            if unknown.is_empty() {
                0
            } else {
                tracing::error!(
                    ?unknown,
                    "unmount_and_free_segment: not segments this store mounted"
                );
                INVALID
            }
        })
    }

    /// Keeps `owner` (a pool block the store allocated and registered) alive until no call can
    /// use its memory any more, even when the store is freed without `close()`.
    fn _keep_alive(&self, py: Python<'_>, owner: Py<PyAny>) {
        // Waited for without the GIL (see `NativeStore::pin`).
        py.detach(|| self.registry.keep_alive(owner));
    }

    /// Whether `[ptr, ptr + size)` lies inside registered host memory (for the Python layer's
    /// own copies into caller buffers).
    fn _is_registered(&self, py: Python<'_>, ptr: usize, size: usize) -> bool {
        self.pin(py).slice(ptr, size).is_some()
    }

    /// Copies `n` bytes of `src` (bytes-like) from `offset` into registered host memory at
    /// `dst`, with the registry pinned throughout, so that an unregister (and `close()`, which
    /// frees the store's pool blocks after unregistering them) waits for the copy; the GIL is
    /// released for it. 0, or INVALID (logged) when `dst` is not registered or `src` is short.
    fn _copy_into(
        &self,
        py: Python<'_>,
        dst: usize,
        src: &Bound<'_, PyAny>,
        offset: usize,
        n: usize,
    ) -> PyResult<i32> {
        let view = PyBytesView::readable(src)?;
        let bytes = view.as_slice();
        let Some(from) = offset.checked_add(n).and_then(|end| bytes.get(offset..end)) else {
            tracing::error!(
                offset,
                n,
                have = bytes.len(),
                "copy: the source is shorter than the range asked"
            );
            return Ok(INVALID);
        };
        let pin = self.pin(py);
        let Some(Some(to)) = pin.slices_mut(&[(dst, n)]).pop() else {
            log_unregistered("copy", dst, n);
            return Ok(INVALID);
        };
        py.detach(|| to.copy_from_slice(from));
        Ok(0)
    }

    /// For tests of the GPU path without a GPU: device-like host memory this store recognises
    /// in `register_buffer` from now on (see `HostBackedDevice`).
    fn _attach_host_backed_device(&self) -> crate::gpu::HostBackedDevice {
        let device = Arc::new(mooncake_client::device::host_backed::HostBackedDevice::new());
        self.devices.write().push(device.clone());
        crate::gpu::HostBackedDevice { device }
    }

    /// Waits for transfers using the buffer to finish, then forgets it.
    fn unregister_buffer(&self, py: Python<'_>, buffer_ptr: usize) -> i32 {
        match py.detach(|| self.registry.unregister(buffer_ptr)) {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(
                    ptr = format_args!("{buffer_ptr:#x}"),
                    "unregister_buffer: {e}"
                );
                INVALID
            }
        }
    }

    #[pyo3(signature = (key, value, config=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.put_one(
            py,
            key,
            std::slice::from_ref(value),
            config_of(config, false),
        )
    }

    /// `put`, replacing the value if the key exists (see `ReplicateConfig.upsert` of the
    /// client: until it ends the key reads as not ready).
    #[pyo3(signature = (key, value, config=None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.put_one(
            py,
            key,
            std::slice::from_ref(value),
            config_of(config, true),
        )
    }

    /// Stores the concatenation of `parts` (bytes-like objects) under `key`, without joining
    /// them first.
    #[pyo3(signature = (key, *parts, config=None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        let parts: Vec<Bound<'_, PyAny>> = parts.iter().collect();
        self.put_one(py, key, &parts, config_of(config, false))
    }

    #[pyo3(signature = (key, *parts, config=None))]
    fn upsert_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        let parts: Vec<Bound<'_, PyAny>> = parts.iter().collect();
        self.put_one(py, key, &parts, config_of(config, true))
    }

    /// Puts each (key, value); returns 0, or the first failure's code.
    #[pyo3(signature = (keys, values, config=None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.put_values(py, &keys, values, config_of(config, false))
    }

    #[pyo3(signature = (keys, values, config=None))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.put_values(py, &keys, values, config_of(config, true))
    }

    /// The object's bytes, or b"" on a miss or an error.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let got = self.with_session(py, None, |s| {
            s.block_on(async |c| c.batch_get_owned(&[key]).await).pop()
        });
        match got {
            Some(Ok(v)) => PyBytes::new(py, &v),
            Some(Err(e)) => {
                log_miss("get", key, &e);
                PyBytes::new(py, b"")
            }
            None => PyBytes::new(py, b""),
        }
    }

    /// Like `get` for several keys; b"" for each miss.
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> Vec<Bound<'py, PyBytes>> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        let got = self.with_session(py, Vec::new(), |s| {
            s.block_on(async |c| c.batch_get_owned(&refs).await)
        });
        if got.is_empty() {
            return keys.iter().map(|_| PyBytes::new(py, b"")).collect();
        }
        got.into_iter()
            .map(|r| PyBytes::new(py, r.as_deref().unwrap_or(b"")))
            .collect()
    }

    /// Each object's bytes in a new `cls(size)` (a bytearray subclass: `BufferHandle`), read
    /// straight into it with the GIL released; None for a miss or an error (logged).
    fn _get_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        cls: Bound<'_, PyType>,
    ) -> Vec<Option<Py<PyByteArray>>> {
        let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
        let cls = cls.unbind();
        let got = self.with_session(py, Vec::new(), |s| {
            s.block_on(async |c| c.batch_get_alloc(&refs, FreshByteArray::maker(&cls)).await)
        });
        buffer_results(got, &refs)
    }

    /// `_get_buffers` with why each miss missed: (buffer, 0) or (None, a negative code).
    fn _get_buffers_coded(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        cls: Bound<'_, PyType>,
    ) -> Vec<(Option<Py<PyByteArray>>, i32)> {
        let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
        let cls = cls.unbind();
        let got = self.with_session(py, Vec::new(), |s| {
            s.block_on(async |c| c.batch_get_alloc(&refs, FreshByteArray::maker(&cls)).await)
        });
        coded_buffer_results(got, &refs)
    }

    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: PyBackedStr,
        buffer_ptr: usize,
        size: usize,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i32 {
        let key = std::slice::from_ref(&key);
        let cfg = config_of(config, false);
        self.put_from_ranges(py, key, &[(buffer_ptr, size)], &[1], cfg)[0]
    }

    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: PyBackedStr,
        buffer_ptr: usize,
        size: usize,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i32 {
        let key = std::slice::from_ref(&key);
        let cfg = config_of(config, true);
        self.put_from_ranges(py, key, &[(buffer_ptr, size)], &[1], cfg)[0]
    }

    fn get_into(&self, py: Python<'_>, key: PyBackedStr, buffer_ptr: usize, size: usize) -> i64 {
        let key = std::slice::from_ref(&key);
        self.get_into_ranges(py, key, &[(buffer_ptr, size)], &[1])[0]
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let cfg = config_of(config, false);
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some((ranges, counts)) => self.put_from_ranges(py, &keys, &ranges, &counts, cfg),
            None => vec![INVALID; keys.len()],
        }
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let cfg = config_of(config, true);
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some((ranges, counts)) => self.put_from_ranges(py, &keys, &ranges, &counts, cfg),
            None => vec![INVALID; keys.len()],
        }
    }

    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> Vec<i64> {
        match single_ranges(keys.len(), &buffer_ptrs, &sizes) {
            Some((ranges, counts)) => self.get_into_ranges(py, &keys, &ranges, &counts),
            None => vec![INVALID as i64; keys.len()],
        }
    }

    /// Each key's value is the concatenation of its buffers, all inside registered memory.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config=None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let cfg = config_of(config, false);
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some((ranges, counts)) => self.put_from_ranges(py, &keys, &ranges, &counts, cfg),
            None => vec![INVALID; keys.len()],
        }
    }

    /// Each object is scattered over its buffers in order; they must hold it together (-600 if not).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<PyBackedStr>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        prefer_alloc_in_same_node: bool,
    ) -> Vec<i64> {
        let _ = prefer_alloc_in_same_node; // placement is the master's; reads prefer the local replica already
        match multi_ranges(keys.len(), &all_buffer_ptrs, &all_sizes) {
            Some((ranges, counts)) => self.get_into_ranges(py, &keys, &ranges, &counts),
            None => vec![INVALID as i64; keys.len()],
        }
    }

    /// 1 if the key exists, 0 if not, a negative code on error. A hit is leased.
    fn is_exist(&self, py: Python<'_>, key: &str) -> i32 {
        self.exists_of(py, &[key])[0]
    }

    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<PyBackedStr>) -> Vec<i32> {
        // Borrowed from the Python strings (their UTF-8 form): no copy per key.
        let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
        self.exists_of(py, &refs)
    }

    /// The object's size in bytes, or a negative code (-704 on a miss).
    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        self.with_session(py, INVALID as i64, |s| {
            match s.block_on(async |c| c.batch_get_replica_desc(&[key]).await) {
                Ok(mut r) => match r.pop().expect("one result") {
                    Ok(d) => d.size as i64,
                    Err(e) => e.code().as_i32() as i64,
                },
                Err(e) => e.code().as_i32() as i64,
            }
        })
    }

    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> i32 {
        self.batch_remove(py, vec![key.to_string()], force)[0]
    }

    #[pyo3(signature = (keys, force=false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i32> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        let n = keys.len();
        self.with_session(py, vec![INVALID; n], |s| {
            remove_codes(s.block_on(async |c| c.batch_remove(&refs, force).await), n)
        })
    }

    /// How many objects were removed, or a negative code.
    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        self.with_session(py, INVALID as i64, |s| {
            match s.block_on(async |c| c.remove_all(force).await) {
                Ok(n) => n as i64,
                Err(e) => e.code().as_i32() as i64,
            }
        })
    }

    /// Removes the objects whose keys `regex_pattern` matches anywhere (ECMAScript-style syntax,
    /// look-around and back-references included, as Mooncake's std::regex search); how many, or
    /// a negative code (-600 for a pattern
    /// that does not compile).
    #[pyo3(signature = (regex_pattern, force=false))]
    fn remove_by_regex(&self, py: Python<'_>, regex_pattern: &str, force: bool) -> i64 {
        self.with_session(py, INVALID as i64, |s| {
            match s.block_on(async |c| c.remove_by_regex(regex_pattern, force).await) {
                Ok(n) => n as i64,
                Err(e) => {
                    tracing::error!(pattern = regex_pattern, "remove_by_regex: {e}");
                    e.code().as_i32() as i64
                }
            }
        })
    }

    /// Starts copying `key` to each of `targets` (segment names): ((0, task id), 0), or
    /// ((0, 0), negative code).
    fn create_copy_task(
        &self,
        py: Python<'_>,
        key: &str,
        targets: Vec<String>,
    ) -> ((u64, u64), i32) {
        let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
        self.with_session(py, ((0, 0), INVALID), |s| {
            task_created(
                key,
                s.block_on(async |c| c.create_copy_task(key, &targets).await),
            )
        })
    }

    /// Starts moving `key`'s replica on `source` to `target`; answers like `create_copy_task`.
    fn create_move_task(
        &self,
        py: Python<'_>,
        key: &str,
        source: &str,
        target: &str,
    ) -> ((u64, u64), i32) {
        self.with_session(py, ((0, 0), INVALID), |s| {
            let created = s.block_on(async |c| c.create_move_task(key, source, target).await);
            task_created(key, created)
        })
    }

    /// A task's state as (code, (type, status, created ms, updated ms, assigned segments,
    /// detail)); the Python layer makes the QueryTaskResponse.
    #[allow(clippy::type_complexity)]
    fn _query_task(
        &self,
        py: Python<'_>,
        task_id: u64,
    ) -> (i32, Option<(u8, u8, u64, u64, Vec<String>, String)>) {
        self.with_session(py, (INVALID, None), |s| {
            match s.block_on(async |c| c.query_task(task_id).await) {
                Ok(t) => (
                    0,
                    Some((
                        t.kind as u8,
                        t.status as u8,
                        t.created_at_ms,
                        t.updated_at_ms,
                        t.assigned,
                        t.detail,
                    )),
                ),
                Err(e) => (e.code().as_i32(), None),
            }
        })
    }

    /// Drops each key's memory replica on `segment_name` (the object goes when nothing else
    /// holds it), or whole objects when it is empty; answers the keys cleared. Leased objects
    /// are left (their lease must have run out).
    #[pyo3(signature = (keys, segment_name=""))]
    fn batch_replica_clear(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        segment_name: &str,
    ) -> Vec<String> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let segment = Some(segment_name).filter(|s| !s.is_empty());
        self.with_session(py, Vec::new(), |s| {
            match s.block_on(async |c| c.batch_replica_clear(&refs, segment).await) {
                Ok(codes) => keys
                    .iter()
                    .zip(codes)
                    .filter(|(_, c)| c.is_ok())
                    .map(|(k, _)| k.clone())
                    .collect(),
                Err(e) => {
                    tracing::error!("batch_replica_clear: {e}");
                    Vec::new()
                }
            }
        })
    }

    /// The replicas of `key` ([] on a miss).
    fn get_replica_desc(&self, py: Python<'_>, key: &str) -> Vec<ReplicaDescriptor> {
        self.replica_descs(py, &[key.to_string()])
            .pop()
            .flatten()
            .unwrap_or_default()
    }

    /// {key: [ReplicaDescriptor, ...]} for the keys that exist; misses are left out.
    fn batch_get_replica_desc<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let descs = self.replica_descs(py, &keys);
        let out = PyDict::new(py);
        for (k, d) in keys.iter().zip(descs) {
            if let Some(d) = d {
                out.set_item(k, d)?;
            }
        }
        Ok(out)
    }
}

impl NativeStore {
    fn replica_descs(
        &self,
        py: Python<'_>,
        keys: &[String],
    ) -> Vec<Option<Vec<ReplicaDescriptor>>> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        let n = keys.len();
        self.with_session(py, vec![None; n], |s| {
            match s.block_on(async |c| c.batch_get_replica_desc(&refs).await) {
                Ok(r) => r
                    .into_iter()
                    .map(|d| {
                        d.ok().map(|d| {
                            d.replicas
                                .into_iter()
                                .map(|r| {
                                    ReplicaDescriptor::new(
                                        r.segment.to_string(),
                                        r.tier == Tier::Memory,
                                        d.size,
                                        r.offset,
                                    )
                                })
                                .collect()
                        })
                    })
                    .collect(),
                Err(_) => vec![None; n],
            }
        })
    }
}

/// A task-creating call's answer in Mooncake's shape: ((0, id), 0), or ((0, 0), code).
fn task_created(key: &str, created: Result<u64, ClientError>) -> ((u64, u64), i32) {
    match created {
        Ok(id) => ((0, id), 0),
        Err(e) => {
            tracing::error!(key, "replica task refused: {e}");
            ((0, 0), e.code().as_i32())
        }
    }
}

/// A store dropped without `close()` is dropped by Python's deallocation: with the GIL held,
/// and maybe on one of the session's own I/O threads (the cyclic collector runs wherever Python
/// code allocates). Closing waits for the network (the embedded owners unmount) and for those
/// threads, so it runs on a thread of its own, waited for without the GIL, and not waited for
/// on a runtime thread (which it would wait for).
impl Drop for NativeStore {
    fn drop(&mut self) {
        let Some(session) = self.session.get_mut().take() else {
            return;
        };
        if session.pid != std::process::id() {
            // Inherited across fork(): the parent's to close (see `session`).
            std::mem::forget(session);
            return;
        }
        let Ok(session) = Arc::try_unwrap(session) else {
            return;
        };
        crate::stopping::stop_off_thread("mooncake-close", "a dropped store", move || {
            session.close()
        });
    }
}

/// The batch calls' buffers as one list of (pointer, size) ranges and how many belong to each key.
pub(crate) type Ranges = (Vec<(usize, usize)>, Vec<usize>);

/// One buffer per key; None (logged) when the lists' lengths differ.
pub(crate) fn single_ranges(keys: usize, ptrs: &[usize], sizes: &[usize]) -> Option<Ranges> {
    if keys != ptrs.len() || keys != sizes.len() {
        tracing::error!("keys, buffer pointers and sizes must have matching shapes");
        return None;
    }
    Some((
        ptrs.iter().copied().zip(sizes.iter().copied()).collect(),
        vec![1; keys],
    ))
}

/// Several buffers per key; None (logged) when the shapes differ.
pub(crate) fn multi_ranges(
    keys: usize,
    ptrs: &[Vec<usize>],
    sizes: &[Vec<usize>],
) -> Option<Ranges> {
    let ok = keys == ptrs.len()
        && keys == sizes.len()
        && ptrs.iter().zip(sizes).all(|(p, s)| p.len() == s.len());
    if !ok {
        tracing::error!("keys, buffer pointers and sizes must have matching shapes");
        return None;
    }
    Some((
        ptrs.iter()
            .zip(sizes)
            .flat_map(|(p, s)| p.iter().copied().zip(s.iter().copied()))
            .collect(),
        ptrs.iter().map(Vec::len).collect(),
    ))
}

impl NativeStore {
    /// Stores the concatenation of the bytes-like `parts` under `key`.
    fn put_one(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &[Bound<'_, PyAny>],
        cfg: Option<ClientConfig>,
    ) -> PyResult<i32> {
        let views = parts
            .iter()
            .map(PyBytesView::readable)
            .collect::<PyResult<Vec<_>>>()?;
        let slices: Vec<&[u8]> = views.iter().map(|v| v.as_slice()).collect();
        let Some(cfg) = cfg else {
            return Ok(INVALID);
        };
        Ok(self.with_session(py, INVALID, |s| {
            put_code(&s.block_on(async |c| c.batch_put_parts(&[(key, &slices)], &cfg).await)[0])
        }))
    }

    /// Puts each (key, value) of an iterable of bytes-like values; 0, or the first failure's
    /// code.
    fn put_values(
        &self,
        py: Python<'_>,
        keys: &[String],
        values: &Bound<'_, PyAny>,
        cfg: Option<ClientConfig>,
    ) -> PyResult<i32> {
        let values: Vec<Bound<'_, PyAny>> = values.try_iter()?.collect::<PyResult<_>>()?;
        if values.len() != keys.len() {
            tracing::error!("put_batch: {} keys but {} values", keys.len(), values.len());
            return Ok(INVALID);
        }
        let views = values
            .iter()
            .map(PyBytesView::readable)
            .collect::<PyResult<Vec<_>>>()?;
        let parts: Vec<[&[u8]; 1]> = views.iter().map(|v| [v.as_slice()]).collect();
        let items: Vec<(&str, &[&[u8]])> = keys
            .iter()
            .map(|k| k.as_str())
            .zip(parts.iter().map(|p| &p[..]))
            .collect();
        let Some(cfg) = cfg else {
            return Ok(INVALID);
        };
        Ok(self.with_session(py, INVALID, |s| {
            let res = s.block_on(async |c| c.batch_put_parts(&items, &cfg).await);
            res.iter().map(put_code).find(|c| *c != 0).unwrap_or(0)
        }))
    }

    /// Puts each key's value from its run of `ranges` (`counts[i]` ranges for key i), all inside
    /// registered memory.
    fn put_from_ranges(
        &self,
        py: Python<'_>,
        keys: &[PyBackedStr],
        ranges: &[(usize, usize)],
        counts: &[usize],
        cfg: Option<ClientConfig>,
    ) -> Vec<i32> {
        let Some(cfg) = cfg else {
            return vec![INVALID; keys.len()];
        };
        let pinned = self.pin(py);
        let mut out = vec![INVALID; keys.len()];
        let mut idx = Vec::with_capacity(keys.len());
        let mut parts: Vec<Vec<&[u8]>> = Vec::with_capacity(keys.len());
        let mut on_device = OnDevice::default();
        let mut at = 0;
        for (i, &n) in counts.iter().enumerate() {
            let mine = &ranges[at..at + n];
            at += n;
            if on_device.take(&pinned, i, mine) {
                continue;
            }
            let slices: Option<Vec<&[u8]>> =
                mine.iter().map(|&(p, len)| pinned.slice(p, len)).collect();
            match slices {
                Some(s) => {
                    idx.push(i);
                    parts.push(s);
                }
                None => log_unregistered(
                    "batch_put_from",
                    mine.first().map_or(0, |r| r.0),
                    mine.iter().map(|r| r.1).sum(),
                ),
            }
        }
        let items: Vec<(&str, &[&[u8]])> = idx
            .iter()
            .zip(&parts)
            .map(|(&i, p)| (&*keys[i], &p[..]))
            .collect();
        let codes = self.with_session(py, None, |s| {
            s.block_on(async |c| {
                let host = c.batch_put_parts(&items, &cfg);
                let device = on_device.put(c, keys, &cfg);
                let (host, device) = tokio::join!(host, device);
                Some((host.iter().map(put_code).collect::<Vec<_>>(), device))
            })
        });
        if let Some((codes, device)) = codes {
            for (i, c) in idx.into_iter().zip(codes).chain(device) {
                out[i] = c;
            }
        }
        out
    }

    /// Reads each key's value into its run of `ranges`, all inside registered memory and none
    /// overlapping another.
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        keys: &[PyBackedStr],
        ranges: &[(usize, usize)],
        counts: &[usize],
    ) -> Vec<i64> {
        let pinned = self.pin(py);
        // Destinations of the whole batch must not alias: check them all together.
        let mut slices = pinned.slices_mut(ranges).into_iter();
        let mut out = vec![INVALID as i64; keys.len()];
        let mut idx = Vec::with_capacity(keys.len());
        let mut bufs: Vec<Vec<&mut [u8]>> = Vec::with_capacity(keys.len());
        let mut on_device = OnDevice::writing();
        let mut at = 0;
        for (i, &n) in counts.iter().enumerate() {
            // Every one of this key's `n` slices is taken before any is checked: stopping at the
            // first refused one would hand the rest of them to the next key.
            let mine: Vec<Option<&mut [u8]>> = slices.by_ref().take(n).collect();
            let mine: Option<Vec<&mut [u8]>> = mine.into_iter().collect();
            if on_device.take(&pinned, i, &ranges[at..at + n]) {
                at += n;
                continue;
            }
            match mine {
                Some(b) => {
                    idx.push(i);
                    bufs.push(b);
                }
                None => log_unregistered(
                    "batch_get_into",
                    ranges.get(at).map_or(0, |r| r.0),
                    ranges[at..at + n].iter().map(|r| r.1).sum(),
                ),
            }
            at += n;
        }
        let key_refs: Vec<&str> = idx.iter().map(|&i| &*keys[i]).collect();
        let got = self.with_session(py, None, |s| {
            s.block_on(async |c| {
                let host = c.batch_get_parts(&key_refs, &mut bufs);
                let device = on_device.get(c, keys);
                let (res, device) = tokio::join!(host, device);
                let host = res
                    .iter()
                    .zip(&key_refs)
                    .map(|(r, k)| {
                        if let Err(e) = r {
                            log_miss("get", k, e);
                        }
                        get_code(r)
                    })
                    .collect::<Vec<_>>();
                Some((host, device))
            })
        });
        if let Some((got, device)) = got {
            for (i, c) in idx.into_iter().zip(got).chain(device) {
                out[i] = c;
            }
        }
        out
    }
}

/// The keys of a batch whose buffers are registered memory of one device: they go through the
/// device's staging path (`Client::batch_put_from_device` / `batch_get_into_device`), beside the
/// host keys' transfer.
#[derive(Default)]
pub(crate) struct OnDevice {
    /// (key index, device, the key's buffers), in key order.
    items: Vec<(usize, Arc<dyn DeviceMemory>, DeviceParts)>,
    /// For a batch that writes into the buffers (a get): the device ranges taken so far, start
    /// to end, so that no two overlap (as host destinations are refused when they do).
    apart: Option<std::collections::BTreeMap<usize, usize>>,
}

impl OnDevice {
    /// For a batch that writes into the buffers: a key whose device ranges overlap another
    /// key's (or each other) is not taken.
    pub(crate) fn writing() -> Self {
        OnDevice {
            apart: Some(Default::default()),
            ..Default::default()
        }
    }

    /// Takes key `i` when all its buffers are registered memory of one device; a key that mixes
    /// device and host buffers (or two devices) is not taken, and, not being all host memory,
    /// is refused with -600.
    pub(crate) fn take<G>(
        &mut self,
        pinned: &crate::registry::Pinned<G>,
        i: usize,
        ranges: &[(usize, usize)],
    ) -> bool
    where
        G: std::ops::Deref<Target = crate::registry::Ranges>,
    {
        let Some(&(ptr, len)) = ranges.first() else {
            return false;
        };
        let Some(d) = pinned.device_of(ptr, len) else {
            return false;
        };
        let same = |&(p, l): &(usize, usize)| {
            pinned
                .device_of(p, l)
                .is_some_and(|other| Arc::ptr_eq(other, d))
        };
        if !ranges.iter().all(same) {
            return false;
        }
        if let Some(taken) = &mut self.apart {
            let mut mine: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
            for &(p, l) in ranges.iter().filter(|r| r.1 > 0) {
                let end = p.saturating_add(l);
                let overlaps = |m: &std::collections::BTreeMap<usize, usize>| {
                    m.range(..end).next_back().is_some_and(|(_, &e)| e > p)
                };
                if overlaps(taken) || mine.iter().any(|&(q, e)| q < end && p < e) {
                    return false;
                }
                mine.push((p, end));
            }
            taken.extend(mine);
        }
        let parts = ranges
            .iter()
            .map(|&(ptr, len)| DeviceRange { ptr, len })
            .collect();
        self.items.push((i, d.clone(), parts));
        true
    }

    /// Runs of consecutive items on one device.
    fn runs(&self) -> impl Iterator<Item = &[(usize, Arc<dyn DeviceMemory>, DeviceParts)]> {
        self.items.chunk_by(|a, b| Arc::ptr_eq(&a.1, &b.1))
    }

    pub(crate) async fn put(
        &self,
        client: &mooncake_client::Client,
        keys: &[PyBackedStr],
        cfg: &ClientConfig,
    ) -> Vec<(usize, i32)> {
        let mut out = Vec::with_capacity(self.items.len());
        for run in self.runs() {
            let names: Vec<&str> = run.iter().map(|(i, _, _)| &*keys[*i]).collect();
            let values: Vec<DeviceParts> = run.iter().map(|(_, _, r)| r.clone()).collect();
            let res = client
                .batch_put_from_device(&names, &values, run[0].1.clone(), cfg)
                .await;
            out.extend(run.iter().zip(&res).map(|((i, _, _), r)| (*i, put_code(r))));
        }
        out
    }

    pub(crate) async fn get(
        &self,
        client: &mooncake_client::Client,
        keys: &[PyBackedStr],
    ) -> Vec<(usize, i64)> {
        let mut out = Vec::with_capacity(self.items.len());
        for run in self.runs() {
            let names: Vec<&str> = run.iter().map(|(i, _, _)| &*keys[*i]).collect();
            let values: Vec<DeviceParts> = run.iter().map(|(_, _, r)| r.clone()).collect();
            let res = client
                .batch_get_into_device(&names, &values, run[0].1.clone())
                .await;
            out.extend(run.iter().zip(&res).map(|((i, _, _), r)| (*i, get_code(r))));
        }
        out
    }
}

/// `get_buffer`'s answers: each read buffer, or None for a miss or an error (logged); all None
/// when the store is not set up (no results at all).
pub(crate) fn buffer_results(
    got: Vec<Result<FreshByteArray, ClientError>>,
    keys: &[&str],
) -> Vec<Option<Py<PyByteArray>>> {
    coded_buffer_results(got, keys)
        .into_iter()
        .map(|(b, _)| b)
        .collect()
}

/// Each read buffer with 0, or None with the negative code of its miss or error (logged);
/// INVALID for all when the store is not set up (no results at all).
pub(crate) fn coded_buffer_results(
    got: Vec<Result<FreshByteArray, ClientError>>,
    keys: &[&str],
) -> Vec<(Option<Py<PyByteArray>>, i32)> {
    if got.is_empty() {
        return keys.iter().map(|_| (None, INVALID)).collect();
    }
    got.into_iter()
        .zip(keys)
        .map(|(r, k)| match r {
            Ok(b) => (Some(b.into_object()), 0),
            Err(e) => {
                log_miss("get_buffer", k, &e);
                (None, e.code().as_i32())
            }
        })
        .collect()
}

/// Mooncake's convention for existence: 1, 0, or the code, per key (the call's code for all
/// `n` when the call failed).
pub(crate) fn exists_codes(
    r: Result<Vec<Result<bool, ClientError>>, ClientError>,
    n: usize,
) -> Vec<i32> {
    match r {
        Ok(r) => r
            .iter()
            .map(|x| match x {
                Ok(true) => 1,
                Ok(false) => 0,
                Err(e) => e.code().as_i32(),
            })
            .collect(),
        Err(e) => vec![e.code().as_i32(); n],
    }
}

/// 0 or the code per removed key (the call's code for all `n` when the call failed).
pub(crate) fn remove_codes(
    r: Result<Vec<Result<(), ClientError>>, ClientError>,
    n: usize,
) -> Vec<i32> {
    match r {
        Ok(r) => r
            .iter()
            .map(|x| x.as_ref().map_or_else(|e| e.code().as_i32(), |_| 0))
            .collect(),
        Err(e) => vec![e.code().as_i32(); n],
    }
}

/// Misses are routine for a cache; only other failures are worth a warning.
pub(crate) fn log_miss(op: &str, key: &str, e: &ClientError) {
    if e.code() == Code::ObjectNotFound {
        tracing::debug!(key, "{op}: miss");
    } else {
        tracing::warn!(key, code = e.code().as_i32(), "{op} failed: {e}");
    }
}

impl NativeStore {
    /// Exists over borrowed keys: 1, 0, or a negative code each.
    fn exists_of(&self, py: Python<'_>, refs: &[&str]) -> Vec<i32> {
        let n = refs.len();
        self.with_session(py, vec![INVALID; n], |s| {
            exists_codes(s.block_on(async |c| c.batch_exists(refs).await), n)
        })
    }
}
