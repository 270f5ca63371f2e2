//! Memory the caller registered for zero-copy transfers. Every raw pointer coming from Python is
//! checked to lie inside one registered range before it becomes a slice; anything else is refused
//! and never dereferenced. An operation holds the registry's read lock while it uses the memory,
//! so `unregister_buffer` waits for transfers in flight instead of pulling memory from under them.

use std::{collections::BTreeMap, ops::Deref, sync::Arc};

use mooncake_client::device::DeviceMemory;
use parking_lot::{lock_api::ArcRwLockReadGuard, RawRwLock, RwLock, RwLockReadGuard};

/// Registered host memory (start -> length) and device memory (start -> length and device).
/// Device memory is never sliced: its bytes move through the device's own copies.
#[derive(Default)]
pub struct Ranges {
    host: BTreeMap<usize, usize>,
    device: BTreeMap<usize, (usize, Arc<dyn DeviceMemory>)>,
    /// Python objects that own registered memory (the store's own pool blocks): they live as
    /// long as the registry, so a call still in flight when the store is freed without
    /// `close()` never writes into memory unmapped under it.
    owners: Vec<pyo3::Py<pyo3::PyAny>>,
}

#[derive(Default)]
pub struct Registry {
    ranges: Arc<RwLock<Ranges>>,
}

#[derive(Debug)]
pub enum RegistryError {
    NullOrEmpty,
    Overflow,
    NotRegistered,
    PartlyDevice,
    NotHostMemory,
}

impl std::error::Error for RegistryError {}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RegistryError::NullOrEmpty => "buffer pointer is null or size is zero",
            RegistryError::Overflow => "buffer range overflows the address space",
            RegistryError::NotRegistered => "buffer is not registered",
            RegistryError::PartlyDevice => {
                "buffer is partly device memory: register each device allocation on its own"
            }
            RegistryError::NotHostMemory => {
                "buffer is not host memory this process can read and write (unmapped, \
                 read-only, or device memory this build does not recognise)"
            }
        })
    }
}

impl Registry {
    pub fn register(&self, ptr: usize, len: usize) -> Result<(), RegistryError> {
        if ptr == 0 || len == 0 {
            return Err(RegistryError::NullOrEmpty);
        }
        ptr.checked_add(len).ok_or(RegistryError::Overflow)?;
        // Host memory is read and written through slices of it: anything else would crash.
        if !mooncake_common::host_memory::readable_and_writable(ptr, len) {
            return Err(RegistryError::NotHostMemory);
        }
        let mut ranges = self.ranges.write();
        let entry = ranges.host.entry(ptr).or_insert(len);
        *entry = (*entry).max(len);
        Ok(())
    }

    /// Registers `[ptr, ptr + len)` as memory of `device`.
    pub fn register_device(
        &self,
        ptr: usize,
        len: usize,
        device: Arc<dyn DeviceMemory>,
    ) -> Result<(), RegistryError> {
        if ptr == 0 || len == 0 {
            return Err(RegistryError::NullOrEmpty);
        }
        ptr.checked_add(len).ok_or(RegistryError::Overflow)?;
        self.ranges.write().device.insert(ptr, (len, device));
        Ok(())
    }

    pub fn unregister(&self, ptr: usize) -> Result<(), RegistryError> {
        let mut ranges = self.ranges.write();
        let host = ranges.host.remove(&ptr).is_some();
        let device = ranges.device.remove(&ptr).is_some();
        if host || device {
            Ok(())
        } else {
            Err(RegistryError::NotRegistered)
        }
    }

    /// Keeps `owner` (the object whose memory was registered) alive as long as the registry,
    /// which outlives every call still pinning it.
    pub fn keep_alive(&self, owner: pyo3::Py<pyo3::PyAny>) {
        self.ranges.write().owners.push(owner);
    }

    /// Holds registrations stable while memory is in use.
    pub fn pin(&self) -> Pinned<RwLockReadGuard<'_, Ranges>> {
        Pinned {
            ranges: self.ranges.read(),
        }
    }

    /// `pin`, unless that would wait (a writer holds or waits for the registry).
    pub fn try_pin(&self) -> Option<Pinned<RwLockReadGuard<'_, Ranges>>> {
        Some(Pinned {
            ranges: self.ranges.try_read()?,
        })
    }

    /// The registry pinned until the pin is dropped, on any thread (an async call's task),
    /// unless that would wait.
    fn try_pin_owned(&self) -> Option<OwnedPin> {
        Some(Pinned {
            ranges: self.ranges.try_read_arc()?,
        })
    }

    /// The registry pinned now when that does not wait, else a way to wait for the pin on
    /// another thread (see `PinLater`).
    pub fn pin_later(&self) -> PinLater {
        match self.try_pin_owned() {
            Some(pin) => PinLater::Now(pin),
            None => PinLater::Wait(self.ranges.clone()),
        }
    }
}

/// A pin for an async call: taken at once, or (a register or unregister waits for the
/// transfers in flight, and new pins queue behind it) waited for in the call's task, never on
/// the caller's event loop. The wait polls rather than parking a blocking thread per waiting
/// call: transfers in flight may need those threads to finish and let the writer through.
pub enum PinLater {
    Now(OwnedPin),
    Wait(Arc<RwLock<Ranges>>),
}

impl PinLater {
    /// The pin.
    pub async fn get(self) -> OwnedPin {
        match self {
            PinLater::Now(pin) => pin,
            PinLater::Wait(ranges) => {
                let mut pause = std::time::Duration::from_millis(1);
                loop {
                    if let Some(ranges) = ranges.try_read_arc() {
                        return Pinned { ranges };
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_millis(8));
                }
            }
        }
    }
}

/// The registry read-locked: ranges checked against it stay registered while it is held.
pub struct Pinned<G> {
    ranges: G,
}

pub type OwnedPin = Pinned<ArcRwLockReadGuard<RawRwLock, Ranges>>;

impl<G: Deref<Target = Ranges>> Pinned<G> {
    fn registered(&self, ptr: usize, len: usize) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        ptr != 0
            && self
                .ranges
                .host
                .range(..=ptr)
                .rev() // nearest start first: a hit is usually the first range looked at
                .any(|(start, l)| *start <= ptr && end <= start + l)
    }

    /// The device whose registered memory holds `[ptr, ptr + len)`, if any.
    pub fn device_of(&self, ptr: usize, len: usize) -> Option<&Arc<dyn DeviceMemory>> {
        let end = ptr.checked_add(len)?;
        self.ranges
            .device
            .range(..=ptr)
            .rev()
            .find(|(start, (l, _))| **start <= ptr && end <= **start + l)
            .map(|(_, (_, d))| d)
    }

    /// `len` bytes at `ptr` if they lie inside one registration.
    pub fn slice(&self, ptr: usize, len: usize) -> Option<&[u8]> {
        if len == 0 {
            return Some(&[]);
        }
        if !self.registered(ptr, len) {
            return None;
        }
        // SAFETY: the caller registered [ptr, ptr+len) as memory valid for transfers until it
        // unregisters it, and unregistering waits for this guard. Concurrent writes by the
        // caller's own code during the call are the caller's contract (as in Mooncake).
        Some(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
    }

    /// Mutable slices for `ranges`, each `None` when it is not registered or overlaps an earlier
    /// range of the same request (two destinations must never alias).
    // The memory is the caller's, not the registry's: `&self` only proves the registration is
    // pinned, and aliasing is ruled out by the overlap check below.
    #[allow(clippy::mut_from_ref)]
    pub fn slices_mut(&self, ranges: &[(usize, usize)]) -> Vec<Option<&mut [u8]>> {
        // Start -> end of every range handed out so far; they never overlap, so a new range
        // overlaps one of them exactly when the last one starting before its end reaches past
        // its start (one lookup, not a scan: batches may have thousands of buffers).
        let mut taken: std::collections::BTreeMap<usize, usize> = Default::default();
        ranges
            .iter()
            .map(|&(ptr, len)| {
                if len == 0 {
                    return Some(&mut [][..]);
                }
                if !self.registered(ptr, len) {
                    return None;
                }
                let end = ptr + len;
                if taken
                    .range(..end)
                    .next_back()
                    .is_some_and(|(_, &e)| e > ptr)
                {
                    return None;
                }
                taken.insert(ptr, end);
                // SAFETY: registered as above; no other slice of this request overlaps it, and
                // the registry's read guard keeps the registration alive while the slice lives.
                Some(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) })
            })
            .collect()
    }
}
