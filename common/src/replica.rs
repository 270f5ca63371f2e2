//! Where an object's bytes are, and how a put wants them placed: the one vocabulary the master,
//! the client and their wire adapters share. The wire forms (`mooncake_proto`'s generated
//! `ReplicaLocation` and the codecs' borrowed `ReplicaRef`) are translated to these at the edges.

use crate::{auth::Seal, SegmentName};

/// Which tier a replica lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Memory,
    Disk,
}

/// One replica of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLocation {
    /// The owner's segment, which is also its data-plane endpoint "host:port".
    pub segment: SegmentName,
    /// Offset in the segment's memory; 0 for a disk replica.
    pub offset: u64,
    pub size: u64,
    pub tier: Tier,
    /// The object's version; an owner serving a disk replica checks its record against it.
    pub put_id: u64,
    /// The master's seal on the access this answer grants (a put's write, a get's read), which
    /// the owner checks; none in a cluster without a secret.
    pub seal: Seal,
}

impl ReplicaLocation {
    pub fn is_disk(&self) -> bool {
        self.tier == Tier::Disk
    }
}

/// How a put wants its object replicated and kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicateConfig {
    /// Replicas on distinct segments (at least 1, at most `MAX_REPLICAS`). Fewer are made when
    /// fewer segments have room.
    pub replica_num: usize,
    /// Segments tried first, in order; absent or full ones are skipped. Empty: the client's
    /// preferred segment, if it has one.
    pub preferred_segments: Vec<SegmentName>,
    /// Evicted only after everything unpinned (for the master's soft-pin TTL).
    pub soft_pin: bool,
    /// Never evicted.
    pub hard_pin: bool,
    /// Replace an object the key already names (Mooncake's upsert) instead of answering
    /// OBJECT_ALREADY_EXISTS. Until the new value's put ends the key reads as not ready; the old
    /// value's memory is reused when no reader holds it and it is large enough. A put of the
    /// key still in flight is not replaced: the upsert is refused with OBJECT_ALREADY_EXISTS,
    /// which the client reports as a failure (it stored nothing).
    pub upsert: bool,
}

/// The most replicas one put may ask for.
pub const MAX_REPLICAS: usize = 64;

/// The most preferred segments one put may name (each is looked at for every object of the
/// batch, under the master's lock).
pub const MAX_PREFERRED: usize = 256;

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            preferred_segments: Vec::new(),
            soft_pin: false,
            hard_pin: false,
            upsert: false,
        }
    }
}

impl ReplicateConfig {
    /// A replica count as asked on the wire or in Python: 0 is read as 1, above the limit is
    /// refused with the reason.
    pub fn replica_count(asked: u64) -> Result<usize, String> {
        match asked {
            0 => Ok(1),
            n if n <= MAX_REPLICAS as u64 => Ok(n as usize),
            n => Err(format!(
                "replica_num {n} is above the limit of {MAX_REPLICAS}"
            )),
        }
    }
}

/// Segment names parsed once per distinct name while reading one answer (a batch mostly names
/// one or two owners), shared after that (`SegmentName` clones are reference counts).
#[derive(Default)]
pub struct SegmentNames {
    seen: Vec<(Box<str>, SegmentName)>,
}

impl SegmentNames {
    /// The parsed name; an error text for one that does not parse.
    pub fn get(&mut self, name: &str) -> Result<SegmentName, String> {
        if let Some((_, s)) = self.seen.iter().find(|(n, _)| &**n == name) {
            return Ok(s.clone());
        }
        let parsed = SegmentName::parse(name).map_err(|e| e.to_string())?;
        if self.seen.len() < 64 {
            self.seen.push((name.into(), parsed.clone()));
        }
        Ok(parsed)
    }
}
