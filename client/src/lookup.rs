//! A batch lookup's answer (and a batch put start's) in the client's own form: per key a code, a size and a run of replica
//! locations, the segment names parsed once per distinct segment (a batch mostly names one or two
//! owners) and shared. Built from the framed RPC's bytes without a `String` per replica, or from
//! gRPC's message.

use std::ops::Range;

use mooncake_common::{pbreplicas, SegmentName};
use mooncake_proto::master as pb;

#[derive(Debug, Default)]
pub struct Lookup {
    pub results: Vec<pbreplicas::Found>,
    pub locations: Vec<Location>,
    pub lease_ttl_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Location {
    /// None when the master sent a name that does not parse (the replica is skipped).
    pub segment: Option<SegmentName>,
    pub offset: u64,
    pub disk: bool,
    pub put_id: u64,
}

impl Lookup {
    pub fn replicas(&self, found: &pbreplicas::Found) -> &[Location] {
        self.locations.get(found.replicas.clone()).unwrap_or(&[])
    }

    pub fn from_decoded(d: pbreplicas::Decoded<'_>) -> Lookup {
        let mut names = Interner::default();
        Lookup {
            locations: d.replicas.iter().map(|r| location(r, &mut names)).collect(),
            results: d.results,
            lease_ttl_ms: d.lease_ttl_ms,
        }
    }

    pub fn from_pb(resp: pb::BatchGetReplicasResponse) -> Lookup {
        let mut names = Interner::default();
        let mut locations = Vec::new();
        let results = resp
            .results
            .iter()
            .map(|r| {
                let start = locations.len();
                locations.extend(r.replicas.iter().map(|l| pb_location(l, &mut names)));
                pbreplicas::Found {
                    code: r.code,
                    size: r.size,
                    replicas: Range {
                        start,
                        end: locations.len(),
                    },
                }
            })
            .collect();
        Lookup {
            results,
            locations,
            lease_ttl_ms: resp.lease_ttl_ms,
        }
    }
}

/// A batch put start's answer: per key a code (and message), the put's id and a run of the
/// replica locations to write.
#[derive(Debug, Default)]
pub struct Starts {
    pub starts: Vec<Start>,
    pub locations: Vec<Location>,
}

#[derive(Debug)]
pub struct Start {
    pub code: i32,
    pub message: String,
    pub put_id: u64,
    replicas: Range<usize>,
}

fn location(r: &pbreplicas::ReplicaRef<'_>, names: &mut Interner) -> Location {
    Location {
        segment: names.get(r.segment),
        offset: r.offset,
        disk: r.tier == pb::ReplicaTier::Disk as i32,
        put_id: r.put_id,
    }
}

fn pb_location(l: &pb::ReplicaLocation, names: &mut Interner) -> Location {
    location(
        &pbreplicas::ReplicaRef {
            segment: &l.segment,
            offset: l.offset,
            size: l.size,
            tier: l.tier,
            put_id: l.put_id,
        },
        names,
    )
}

impl Starts {
    pub fn replicas(&self, s: &Start) -> &[Location] {
        self.locations.get(s.replicas.clone()).unwrap_or(&[])
    }

    pub fn from_decoded(
        starts: Vec<pbreplicas::Started<'_>>,
        replicas: Vec<pbreplicas::ReplicaRef<'_>>,
    ) -> Starts {
        let mut names = Interner::default();
        Starts {
            locations: replicas.iter().map(|r| location(r, &mut names)).collect(),
            starts: starts
                .into_iter()
                .map(|s| Start {
                    code: s.code,
                    message: s.message.to_string(),
                    put_id: s.put_id,
                    replicas: s.replicas,
                })
                .collect(),
        }
    }

    pub fn from_pb(resp: pb::BatchPutStartResponse) -> Starts {
        let mut names = Interner::default();
        let mut locations = Vec::new();
        let starts = resp
            .results
            .into_iter()
            .map(|r| {
                let start = locations.len();
                locations.extend(r.replicas.iter().map(|l| pb_location(l, &mut names)));
                Start {
                    code: r.code,
                    message: r.message,
                    put_id: r.put_id,
                    replicas: start..locations.len(),
                }
            })
            .collect();
        Starts { starts, locations }
    }
}

/// Segment names parsed so far in one answer.
#[derive(Default)]
struct Interner {
    seen: Vec<(String, Option<SegmentName>)>,
}

impl Interner {
    fn get(&mut self, name: &str) -> Option<SegmentName> {
        if let Some((_, s)) = self.seen.iter().find(|(n, _)| n == name) {
            return s.clone();
        }
        let parsed = SegmentName::parse(name).ok();
        if self.seen.len() < 64 {
            self.seen.push((name.to_string(), parsed.clone()));
        }
        parsed
    }
}
