//! Replica descriptors as `batch_get_replica_desc` returns them, shaped like Mooncake's: a
//! descriptor says whether it is a memory or a disk replica and where it lives.

use pyo3::prelude::*;

#[pyclass(module = "mooncake_rs._native", get_all, frozen)]
#[derive(Clone, Debug)]
pub struct BufferDescriptor {
    /// Offset of the replica inside its segment (this design never exposes raw addresses).
    pub buffer_address: u64,
    pub size: u64,
    /// The owner's data endpoint, "host:port" (also the segment name).
    pub transport_endpoint: String,
}

#[pymethods]
impl BufferDescriptor {
    fn __repr__(&self) -> String {
        format!(
            "<Descriptor size={} buffer_address={} transport_endpoint={}>",
            self.size, self.buffer_address, self.transport_endpoint
        )
    }
}

#[pyclass(module = "mooncake_rs._native", get_all, frozen)]
#[derive(Clone, Debug)]
pub struct MemoryDescriptor {
    pub buffer_descriptor: BufferDescriptor,
}

/// A replica on an owner's SSD tier. There is no file per object here: `file_path` names the
/// owner (its segment) whose SSD tier holds the copy.
#[pyclass(module = "mooncake_rs._native", get_all, frozen)]
#[derive(Clone, Debug)]
pub struct DiskDescriptor {
    pub file_path: String,
    pub object_size: u64,
}

#[pymethods]
impl DiskDescriptor {
    fn __repr__(&self) -> String {
        format!(
            "<DiskDescriptor file_path={:?} object_size={}>",
            self.file_path, self.object_size
        )
    }
}

/// `ReplicaStatus.COMPLETE`: the only replicas a lookup returns are readable ones.
const COMPLETE: u8 = 3;

#[pyclass(module = "mooncake_rs._native", get_all, frozen)]
#[derive(Clone, Debug)]
pub struct ReplicaDescriptor {
    pub segment: String,
    /// "memory" or "disk".
    pub tier: String,
    /// A `ReplicaStatus` value.
    pub status: u8,
    pub size: u64,
    offset: u64,
}

impl ReplicaDescriptor {
    pub fn new(segment: String, memory: bool, size: u64, offset: u64) -> Self {
        ReplicaDescriptor {
            segment,
            tier: if memory { "memory" } else { "disk" }.into(),
            status: COMPLETE,
            size,
            offset,
        }
    }
}

#[pymethods]
impl ReplicaDescriptor {
    fn is_memory_replica(&self) -> bool {
        self.tier == "memory"
    }

    fn is_disk_replica(&self) -> bool {
        self.tier == "disk"
    }

    fn get_memory_descriptor(&self) -> Option<MemoryDescriptor> {
        self.is_memory_replica().then(|| MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                buffer_address: self.offset,
                size: self.size,
                transport_endpoint: self.segment.clone(),
            },
        })
    }

    fn get_disk_descriptor(&self) -> Option<DiskDescriptor> {
        self.is_disk_replica().then(|| DiskDescriptor {
            file_path: self.segment.clone(),
            object_size: self.size,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "<ReplicaDescriptor status={} {} size={} on {}>",
            self.status, self.tier, self.size, self.segment
        )
    }
}
