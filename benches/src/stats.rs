//! Throughput and batch-latency percentiles of one bench phase.

use std::time::Duration;

use mooncake_common::transport::TransferStats;

use crate::Row;

/// Which path moved the bytes between two snapshots of the client's transfer counters.
pub fn path(before: TransferStats, after: TransferStats) -> &'static str {
    let local = after.local_bytes - before.local_bytes;
    let tcp = after.tcp_bytes - before.tcp_bytes;
    match (local > 0, tcp > 0) {
        (true, false) => "shm",
        (false, true) => "tcp",
        (true, true) => "mixed",
        (false, false) => "none",
    }
}

/// Which tier served the gets between two snapshots: "mem", "disk" or "mixed" ("-" for puts).
pub fn tier(before: TransferStats, after: TransferStats) -> &'static str {
    let mem = after.memory_keys - before.memory_keys;
    let disk = after.disk_keys - before.disk_keys;
    match (mem > 0, disk > 0) {
        (true, false) => "mem",
        (false, true) => "disk",
        (true, true) => "mixed",
        (false, false) => "-",
    }
}

#[derive(Default)]
pub struct Phase {
    latencies: Vec<Duration>,
    bytes: usize,
    pub errors: usize,
    pub verified: usize,
}

impl Phase {
    pub fn record(&mut self, took: Duration, bytes: usize) {
        self.latencies.push(took);
        self.bytes += bytes;
    }

    pub fn row(
        mut self,
        op: &'static str,
        size: usize,
        keys: usize,
        batch: usize,
        path: &'static str,
        tier: &'static str,
    ) -> Row {
        self.latencies.sort();
        let total: Duration = self.latencies.iter().sum();
        let pct = |p: f64| {
            if self.latencies.is_empty() {
                return 0.0;
            }
            let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
            self.latencies[i].as_secs_f64() * 1e6
        };
        Row {
            op,
            value_size: size as u64,
            keys,
            batch,
            gib_s: if total.is_zero() {
                0.0
            } else {
                self.bytes as f64 / total.as_secs_f64() / (1u64 << 30) as f64
            },
            p50_us: pct(0.5),
            p99_us: pct(0.99),
            errors: self.errors,
            verified: self.verified,
            seconds: total.as_secs_f64(),
            path,
            tier,
            disk_keys: 0,
        }
    }
}
