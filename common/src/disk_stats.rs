//! The state of an owner's SSD tier as the owner counts it and the master shows it in
//! `/metrics`: one type for both roles, and its one mapping to and from the heartbeat message.

use mooncake_proto::master as pb;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub capacity: u64,
    pub used: u64,
    pub records: u64,
    pub written_bytes: u64,
    pub read_bytes: u64,
    pub corrupt_reads: u64,
    pub evicted_records: u64,
}

impl From<&pb::DiskStats> for DiskStats {
    fn from(d: &pb::DiskStats) -> Self {
        DiskStats {
            capacity: d.capacity,
            used: d.used,
            records: d.records,
            written_bytes: d.written_bytes,
            read_bytes: d.read_bytes,
            corrupt_reads: d.corrupt_reads,
            evicted_records: d.evicted_records,
        }
    }
}

impl From<DiskStats> for pb::DiskStats {
    fn from(d: DiskStats) -> Self {
        pb::DiskStats {
            capacity: d.capacity,
            used: d.used,
            records: d.records,
            written_bytes: d.written_bytes,
            read_bytes: d.read_bytes,
            corrupt_reads: d.corrupt_reads,
            evicted_records: d.evicted_records,
        }
    }
}
