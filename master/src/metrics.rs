//! Prometheus text exposition of the master: per-operation counters kept here, gauges read from
//! the state at scrape time. Names follow Mooncake's so existing dashboards keep working.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{
    clock::Millis,
    core::{Counters, MasterState, SegmentStat},
};

/// Operations counted per item (a batch of 32 keys counts 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    MountSegment,
    UnmountSegment,
    Heartbeat,
    PutStart,
    PutEnd,
    PutRevoke,
    GetReplicaList,
    ExistKey,
    Remove,
    RemoveAll,
    ListSegments,
    /// Objects an owner reported after mounting (catalog rebuild).
    ReportCatalog,
    CreateReplicaTask,
    QueryTask,
    ReplicaClear,
    ReleaseLeases,
    /// Put starts whose caller never got the answer (counted per revoked put; the call itself
    /// when it revoked none).
    AbandonPutStart,
    /// Owners' reports of SSD work and copies, per result (a failure: the work failed, or the
    /// master no longer wanted it).
    ReportTasks,
    /// Disk records owners registered after a restart, per record (a failure: refused).
    RegisterDisk,
    /// Disk records owners said they lost or are about to lose, per record.
    DiskDropped,
}

impl Op {
    const ALL: [Op; 20] = [
        Op::MountSegment,
        Op::UnmountSegment,
        Op::Heartbeat,
        Op::PutStart,
        Op::PutEnd,
        Op::PutRevoke,
        Op::GetReplicaList,
        Op::ExistKey,
        Op::Remove,
        Op::RemoveAll,
        Op::ListSegments,
        Op::ReportCatalog,
        Op::CreateReplicaTask,
        Op::QueryTask,
        Op::ReplicaClear,
        Op::ReleaseLeases,
        Op::AbandonPutStart,
        Op::ReportTasks,
        Op::RegisterDisk,
        Op::DiskDropped,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::MountSegment => "mount_segment",
            Op::UnmountSegment => "unmount_segment",
            Op::Heartbeat => "ping",
            Op::PutStart => "put_start",
            Op::PutEnd => "put_end",
            Op::PutRevoke => "put_revoke",
            Op::GetReplicaList => "get_replica_list",
            Op::ExistKey => "exist_key",
            Op::Remove => "remove",
            Op::RemoveAll => "remove_all",
            Op::ListSegments => "get_all_segments",
            Op::ReportCatalog => "report_catalog",
            Op::CreateReplicaTask => "create_replica_task",
            Op::QueryTask => "query_task",
            Op::ReplicaClear => "batch_replica_clear",
            Op::ReleaseLeases => "release_leases",
            Op::AbandonPutStart => "abandon_put_start",
            Op::ReportTasks => "report_tasks",
            Op::RegisterDisk => "register_disk",
            Op::DiskDropped => "disk_dropped",
        }
    }
}

#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; Op::ALL.len()],
    failures: [AtomicU64; Op::ALL.len()],
}

impl Metrics {
    pub fn record(&self, op: Op, items: usize, failed: usize) {
        self.requests[op as usize].fetch_add(items as u64, Ordering::Relaxed);
        if failed > 0 {
            self.failures[op as usize].fetch_add(failed as u64, Ordering::Relaxed);
        }
    }

    /// The metrics at `now`, of a master that `leading` says leads (or serves alone).
    pub fn render(&self, state: &MasterState, now: Millis, leading: bool) -> String {
        let mut out = String::with_capacity(4096);
        render_state(&mut out, state, now, leading);
        let segs = state.segment_stats();
        render_segments(&mut out, &segs);
        if segs.iter().any(|s| s.disk.is_some()) {
            render_ssd(&mut out, &segs);
        }
        render_counters(&mut out, &state.counters());
        self.render_ops(&mut out);
        out
    }

    /// Requests and failures of every operation, counted per item.
    fn render_ops(&self, out: &mut String) {
        for op in Op::ALL {
            let n = op.name();
            for (kind, arr) in [("requests", &self.requests), ("failures", &self.failures)] {
                let v = arr[op as usize].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "# HELP master_{n}_{kind}_total {kind} of {n}, counted per item.\n# TYPE master_{n}_{kind}_total counter\nmaster_{n}_{kind}_total {v}"
                );
            }
        }
    }
}

/// The master's own gauges, at `now`, of a master that `leading` says serves.
fn render_state(out: &mut String, state: &MasterState, now: Millis, leading: bool) {
    let mut gauge = |name: &str, help: &str, v: u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge(
        "master_leading",
        "1 while this master serves (it leads, or runs without HA), else 0.",
        u64::from(leading),
    );
    gauge(
        "master_rebuilding",
        "1 while owners still report what they hold (unknown keys answer \"not known yet\", removals wait), else 0.",
        u64::from(state.rebuilding(now)),
    );
    gauge(
        "master_puts_in_flight",
        "Puts started and not yet ended, revoked or discarded.",
        state.puts_in_flight() as u64,
    );
    gauge(
        "master_key_count",
        "Objects known to the master.",
        state.key_count() as u64,
    );
    gauge(
        "master_allocated_bytes",
        "Bytes allocated in all segments.",
        state.allocated(),
    );
    gauge(
        "master_total_capacity_bytes",
        "Bytes of all mounted segments.",
        state.capacity(),
    );
    gauge(
        "master_active_clients",
        "Owners with a live heartbeat.",
        state.active_owners() as u64,
    );
    let e = state.eviction_stats();
    gauge(
        "master_eviction_recent_keys",
        "Objects with memory in the eviction order's recent list (seen once lately).",
        e.recent,
    );
    gauge(
        "master_eviction_frequent_keys",
        "Objects with memory in the eviction order's frequent list (read again).",
        e.frequent,
    );
    gauge(
        "master_eviction_recent_target_keys",
        "CAR's adaptive target for the recent list.",
        e.recent_target,
    );
    gauge(
        "master_eviction_order_bytes",
        "Memory of the eviction order beyond the objects (queues and remembered keys).",
        state.eviction_order_bytes() as u64,
    );
    render_tenants(out, state);
    for (name, help, v) in [
        (
            "master_eviction_recent_ghost_hits_total",
            "Keys put again soon after eviction took them from the recent list.",
            e.recent_ghost_hits,
        ),
        (
            "master_eviction_frequent_ghost_hits_total",
            "Keys put again soon after eviction took them from the frequent list.",
            e.frequent_ghost_hits,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    }
}

/// A gauge's value per tenant name ("" for the default tenant).
type PerTenant<'a> = Vec<(&'a str, u64)>;

/// Keys, bytes and quota per tenant (the default tenant as "default").
fn render_tenants(out: &mut String, state: &MasterState) {
    let usage = state.tenant_usage();
    let mut quotas: Vec<_> = state
        .policy()
        .quotas
        .iter()
        .map(|(t, q)| (t.as_str(), *q))
        .collect();
    quotas.sort();
    let keys = usage.iter().map(|(t, u)| (t.as_str(), u.keys)).collect();
    let bytes = usage.iter().map(|(t, u)| (t.as_str(), u.bytes)).collect();
    let series: [(&str, &str, PerTenant); 3] = [
        ("master_tenant_keys", "Objects a tenant stores.", keys),
        (
            "master_tenant_bytes",
            "Bytes of the values a tenant stores (each object once).",
            bytes,
        ),
        (
            "master_tenant_quota_bytes",
            "The most bytes a tenant may store.",
            quotas,
        ),
    ];
    for (name, help, values) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (t, v) in values {
            let label = if t.is_empty() { "default" } else { t };
            let _ = writeln!(out, "{name}{{tenant=\"{label}\"}} {v}");
        }
    }
}

/// Allocation and capacity per segment.
fn render_segments(out: &mut String, segs: &[SegmentStat]) {
    for (name, help, pick) in [
        (
            "segment_allocated_bytes",
            "Bytes allocated in one segment.",
            true,
        ),
        (
            "segment_total_capacity_bytes",
            "Capacity of one segment.",
            false,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for s in segs {
            let v = if pick { s.allocated } else { s.capacity };
            let _ = writeln!(out, "{name}{{segment=\"{}\"}} {v}", label(s.name.as_str()));
        }
    }
}

/// Each SSD tier's state as its owner last reported it, and the objects with a disk replica.
fn render_ssd(out: &mut String, segs: &[SegmentStat]) {
    type Pick = fn(&crate::core::DiskStats) -> u64;
    let ssd: [(&str, &str, Pick); 7] = [
        (
            "segment_ssd_capacity_bytes",
            "Capacity of one owner's SSD tier.",
            |d| d.capacity,
        ),
        (
            "segment_ssd_used_bytes",
            "Bytes of live records on one owner's SSD tier.",
            |d| d.used,
        ),
        (
            "segment_ssd_records",
            "Live records on one owner's SSD tier.",
            |d| d.records,
        ),
        (
            "segment_ssd_written_bytes_total",
            "Bytes written to one owner's SSD tier.",
            |d| d.written_bytes,
        ),
        (
            "segment_ssd_read_bytes_total",
            "Bytes read from one owner's SSD tier.",
            |d| d.read_bytes,
        ),
        (
            "segment_ssd_corrupt_reads_total",
            "Reads refused because a record did not check out.",
            |d| d.corrupt_reads,
        ),
        (
            "segment_ssd_evicted_records_total",
            "Records overwritten by the SSD ring (oldest first).",
            |d| d.evicted_records,
        ),
    ];
    for (name, help, pick) in ssd {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for s in segs {
            if let Some(d) = &s.disk {
                let _ = writeln!(
                    out,
                    "{name}{{segment=\"{}\"}} {}",
                    label(s.name.as_str()),
                    pick(d)
                );
            }
        }
    }
    let name = "segment_disk_objects";
    let _ = writeln!(
        out,
        "# HELP {name} Objects with a disk replica on one segment.\n# TYPE {name} gauge"
    );
    for s in segs.iter().filter(|s| s.disk.is_some()) {
        let _ = writeln!(
            out,
            "{name}{{segment=\"{}\"}} {}",
            label(s.name.as_str()),
            s.disk_objects
        );
    }
}

/// The state machine's counters.
fn render_counters(out: &mut String, c: &Counters) {
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    };
    counter(
        "master_eviction_rounds_total",
        "Eviction rounds run.",
        c.eviction_rounds,
    );
    counter(
        "master_evicted_keys_total",
        "Objects evicted.",
        c.evicted_objects,
    );
    counter(
        "master_evicted_bytes_total",
        "Bytes freed by eviction.",
        c.evicted_bytes,
    );
    counter(
        "master_expired_puts_total",
        "Abandoned puts whose space was reclaimed.",
        c.expired_puts,
    );
    counter(
        "master_freed_notes_dropped_total",
        "Freed-range notes dropped because an owner stopped applying them (their objects may come back after a master restart).",
        c.freed_notes_dropped,
    );
    counter(
        "master_expired_clients_total",
        "Owners dropped after missing heartbeats.",
        c.expired_owners,
    );
    for (name, help, v) in [
        (
            "master_offloads_started_total",
            "Objects queued for an SSD tier.",
            c.offloads_started,
        ),
        (
            "master_offloads_done_total",
            "Objects whose disk copy an owner reported.",
            c.offloads_done,
        ),
        (
            "master_offloads_failed_total",
            "Offloads that failed or were not reported in time.",
            c.offloads_failed,
        ),
        (
            "master_evictions_dropped_disk_behind_total",
            "Objects evicted without a disk copy because the SSD was behind.",
            c.dropped_disk_behind,
        ),
        (
            "master_evictions_kept_disk_behind_total",
            "Evictions skipped (object kept in memory) because the SSD was behind.",
            c.kept_disk_behind,
        ),
        (
            "master_disk_hits_total",
            "Reads of objects held only on disk.",
            c.disk_hits,
        ),
        (
            "master_promotions_total",
            "Objects copied back from disk to memory.",
            c.promotions,
        ),
        (
            "master_disk_replicas_dropped_total",
            "Disk replicas an owner's SSD ring overwrote.",
            c.disk_dropped,
        ),
        (
            "master_disk_objects_registered_total",
            "Objects re-registered from an owner's SSD after a restart.",
            c.disk_registered,
        ),
    ] {
        counter(name, help, v);
    }
}

/// A label value as the Prometheus text format wants it: backslash, quote and newline escaped
/// (a segment name is the owner's to choose, and one stray quote would spoil the whole scrape).
fn label(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return value.into();
    }
    let mut out = String::with_capacity(value.len() + 2);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.into()
}

#[cfg(test)]
mod label_tests {
    #[test]
    fn label_values_are_escaped() {
        assert_eq!(super::label("10.0.0.1:7000"), "10.0.0.1:7000");
        assert_eq!(super::label("a\"b\\c\nd:1"), "a\\\"b\\\\c\\nd:1");
    }
}
