//! Prefix-cache trace replay. A trace (Mooncake's FAST'25 format: one JSON object per line whose
//! `hash_ids` are the request's prefix blocks in order; equal ids are the same KV block) is
//! replayed at speed the way a serving engine's connector drives the store: per request, a
//! `batch_exists` over its blocks, a `batch_get` of the longest cached prefix (every byte
//! verified), then a `batch_put` of the blocks that were missing. Exact LRU and Belady's MIN are
//! simulated over the same requests at the same capacity, as the yardsticks for the hit ratio.

use std::{
    collections::{BTreeSet, HashMap},
    io::BufRead,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Context;
use mooncake_client::{Client, ReplicateConfig};
use serde::Serialize;

use crate::pattern;

/// The requests of a trace, each its block ids in prefix order.
pub struct Trace {
    pub requests: Vec<Vec<u64>>,
}

impl Trace {
    pub fn load(path: &Path) -> anyhow::Result<Trace> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open trace {}", path.display()))?;
        let mut requests = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&line)
                .with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
            let ids = v["hash_ids"]
                .as_array()
                .with_context(|| format!("{} line {}: no hash_ids array", path.display(), i + 1))?
                .iter()
                .map(|x| x.as_u64())
                .collect::<Option<Vec<u64>>>()
                .with_context(|| {
                    format!(
                        "{} line {}: hash_ids must be integers",
                        path.display(),
                        i + 1
                    )
                })?;
            requests.push(ids);
        }
        anyhow::ensure!(
            !requests.is_empty(),
            "trace {} has no requests",
            path.display()
        );
        Ok(Trace { requests })
    }

    pub fn blocks(&self) -> usize {
        self.requests.iter().map(Vec::len).sum()
    }

    pub fn unique_blocks(&self) -> usize {
        let mut all: Vec<u64> = self.requests.iter().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }
}

/// Block hit ratio of an exact LRU cache of `capacity` blocks: each request hits its longest
/// cached prefix, then every one of its blocks is used (the missing ones inserted).
pub fn lru_hit_ratio(trace: &Trace, capacity: usize) -> f64 {
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let mut by_age: BTreeSet<(u64, u64)> = BTreeSet::new();
    let (mut clock, mut hits) = (0u64, 0usize);
    for req in &trace.requests {
        hits += req.iter().take_while(|b| last_use.contains_key(b)).count();
        for &b in req {
            clock += 1;
            if let Some(old) = last_use.insert(b, clock) {
                by_age.remove(&(old, b));
            } else if last_use.len() > capacity {
                let (_, victim) = by_age.pop_first().expect("over capacity");
                last_use.remove(&victim);
            }
            by_age.insert((clock, b));
        }
    }
    hits as f64 / trace.blocks().max(1) as f64
}

/// Block hit ratio under Belady's MIN at `capacity` blocks: on a miss with the cache full, the
/// block used again furthest in the future (or never) goes.
pub fn min_hit_ratio(trace: &Trace, capacity: usize) -> f64 {
    let accesses: Vec<u64> = trace.requests.iter().flatten().copied().collect();
    let mut next = vec![u64::MAX; accesses.len()];
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, b) in accesses.iter().enumerate().rev() {
        if let Some(&j) = seen.get(b) {
            next[i] = j as u64;
        }
        seen.insert(*b, i);
    }
    let mut cached: HashMap<u64, u64> = HashMap::new();
    let mut by_next: BTreeSet<(u64, u64)> = BTreeSet::new();
    let (mut at, mut hits) = (0usize, 0usize);
    for req in &trace.requests {
        hits += req.iter().take_while(|b| cached.contains_key(b)).count();
        for &b in req {
            let n = next[at];
            at += 1;
            if let Some(old) = cached.insert(b, n) {
                by_next.remove(&(old, b));
            }
            by_next.insert((n, b));
            if cached.len() > capacity {
                // Possibly the new block itself, when it is needed last (it bypasses).
                let (_, victim) = by_next.pop_last().expect("over capacity");
                cached.remove(&victim);
            }
        }
    }
    hits as f64 / trace.blocks().max(1) as f64
}

/// What a replay measured.
#[derive(Serialize)]
pub struct Replay {
    pub requests: usize,
    pub blocks: usize,
    pub unique_blocks: usize,
    pub block_size: u64,
    pub capacity_blocks: usize,
    pub seconds: f64,
    pub requests_per_s: f64,
    /// Requests per second of the store's own time: the timed calls alone (lookup, get, put),
    /// without the harness's work between them (making and checking every block's bytes),
    /// which costs every store the same and narrows the ratios of `requests_per_s`.
    pub store_requests_per_s: f64,
    pub hit_ratio: f64,
    pub lru_hit_ratio: f64,
    pub min_hit_ratio: f64,
    pub lookup_get_p50_us: f64,
    pub lookup_get_p99_us: f64,
    pub put_p50_us: f64,
    pub put_p99_us: f64,
    /// Blocks read back and checked byte for byte.
    pub verified: usize,
    /// Reads that came back wrong (never expected), and calls that failed.
    pub wrong_bytes: usize,
    pub failed_gets: usize,
    pub failed_puts: usize,
    /// Lookups that failed, per block.
    pub lookup_errors: usize,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6
}

/// Replays `trace` against the store through `client`, blocks of `block_size` bytes under
/// `prefix`; `capacity_blocks` sizes the LRU and MIN simulations.
pub async fn replay(
    client: &Client,
    trace: &Trace,
    block_size: usize,
    prefix: &str,
    capacity_blocks: usize,
) -> Replay {
    let cfg = ReplicateConfig::default();
    let longest = trace.requests.iter().map(Vec::len).max().unwrap_or(0);
    let mut bufs: Vec<Vec<u8>> = (0..longest).map(|_| vec![0u8; block_size]).collect();
    let (mut lookups, mut puts) = (Vec::new(), Vec::new());
    let (mut hits, mut verified, mut wrong, mut failed_gets, mut failed_puts) = (0, 0, 0, 0, 0);
    let mut lookup_errors = 0;
    let started = Instant::now();
    for req in &trace.requests {
        let keys: Vec<String> = req.iter().map(|b| format!("{prefix}/{b}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let t = Instant::now();
        let exists = client.batch_exists(&refs).await;
        let mut took = t.elapsed();
        // A lookup that failed (whole, or for a key) is counted, and its blocks taken as
        // missing: they are computed and put again, as an engine would.
        let found: Vec<bool> = match &exists {
            Ok(e) => {
                lookup_errors += e.iter().filter(|r| r.is_err()).count();
                e.iter().map(|r| matches!(r, Ok(true))).collect()
            }
            Err(e) => {
                tracing::warn!(error = %e, "batch_exists failed");
                lookup_errors += req.len();
                vec![false; req.len()]
            }
        };
        let cached = found.iter().take_while(|f| **f).count();
        let mut usable = cached;
        if cached > 0 {
            // Poisoned first (untimed): a get that reports success without writing every byte
            // cannot pass on what an earlier request left in the buffer.
            for b in &mut bufs[..cached] {
                b.fill(0xA5);
            }
            let mut dst: Vec<&mut [u8]> = bufs[..cached].iter_mut().map(|b| &mut b[..]).collect();
            let t = Instant::now();
            let got = client.batch_get(&refs[..cached], &mut dst).await;
            took += t.elapsed();
            // A block evicted between the lookup and the read ends the usable prefix there.
            // Checked outside the timed span: the harness's work is not the store's.
            usable = got
                .iter()
                .take_while(|r| matches!(r, Ok(n) if *n == block_size))
                .count();
            for (i, r) in got.iter().enumerate() {
                match r {
                    Ok(n) if *n == block_size && pattern::verify(&keys[i], &bufs[i]) => {
                        verified += 1
                    }
                    Ok(n) => {
                        wrong += 1;
                        tracing::error!(key = %keys[i], bytes = n, "WRONG BYTES");
                    }
                    Err(_) => failed_gets += 1,
                }
            }
        }
        lookups.push(took);
        hits += usable;
        // The blocks the engine computed: those it did not have, stored for the next request.
        let missing: Vec<usize> = (usable..req.len())
            .filter(|&i| i < cached || !found[i])
            .collect();
        if missing.is_empty() {
            continue;
        }
        for (slot, &i) in missing.iter().enumerate() {
            pattern::fill(&keys[i], &mut bufs[slot]);
        }
        let items: Vec<(&str, &[u8])> = missing
            .iter()
            .enumerate()
            .map(|(slot, &i)| (refs[i], &bufs[slot][..]))
            .collect();
        let t = Instant::now();
        let res = client.batch_put(&items, &cfg).await;
        puts.push(t.elapsed());
        failed_puts += res
            .iter()
            .filter(
                |r| matches!(r, Err(e) if e.code() != mooncake_client::Code::ObjectAlreadyExists),
            )
            .count();
    }
    let seconds = started.elapsed().as_secs_f64();
    let store_seconds: f64 = lookups.iter().chain(&puts).map(Duration::as_secs_f64).sum();
    lookups.sort();
    puts.sort();
    Replay {
        requests: trace.requests.len(),
        blocks: trace.blocks(),
        unique_blocks: trace.unique_blocks(),
        block_size: block_size as u64,
        capacity_blocks,
        seconds,
        requests_per_s: trace.requests.len() as f64 / seconds,
        store_requests_per_s: trace.requests.len() as f64 / store_seconds.max(1e-9),
        hit_ratio: hits as f64 / trace.blocks().max(1) as f64,
        lru_hit_ratio: lru_hit_ratio(trace, capacity_blocks),
        min_hit_ratio: min_hit_ratio(trace, capacity_blocks),
        lookup_get_p50_us: pct(&lookups, 0.5),
        lookup_get_p99_us: pct(&lookups, 0.99),
        put_p50_us: pct(&puts, 0.5),
        put_p99_us: pct(&puts, 0.99),
        verified,
        wrong_bytes: wrong,
        failed_gets,
        failed_puts,
        lookup_errors,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(reqs: &[&[u64]]) -> Trace {
        Trace {
            requests: reqs.iter().map(|r| r.to_vec()).collect(),
        }
    }

    #[test]
    fn lru_and_min_count_prefix_hits() {
        // Capacity 2: [1,2] then [1,2] hits both; [3] evicts; [1,2] again.
        let t = trace(&[&[1, 2], &[1, 2], &[3], &[1, 2]]);
        // LRU: 0 + 2 + 0 + (1 evicted by 3, so the prefix breaks at once) 0 = 2 of 7.
        assert!((lru_hit_ratio(&t, 2) - 2.0 / 7.0).abs() < 1e-9);
        // MIN keeps 1 and 2 (3 is never used again: it goes first): 0 + 2 + 0 + 2 = 4 of 7.
        assert!((min_hit_ratio(&t, 2) - 4.0 / 7.0).abs() < 1e-9);
        // Large enough for everything: every repeat hits.
        assert!((lru_hit_ratio(&t, 10) - 4.0 / 7.0).abs() < 1e-9);
        assert!((min_hit_ratio(&t, 10) - 4.0 / 7.0).abs() < 1e-9);
    }

    #[test]
    fn a_prefix_stops_at_the_first_missing_block() {
        let t = trace(&[&[1, 2, 3], &[1, 9, 3]]);
        // The second request hits 1 only: 9 is missing, 3 after it does not count.
        assert!((lru_hit_ratio(&t, 10) - 1.0 / 6.0).abs() < 1e-9);
    }

    #[test]
    fn traces_load_from_json_lines_and_refuse_bad_ones() {
        let dir = std::env::temp_dir().join(format!("trace-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        std::fs::write(
            &good,
            "{\"timestamp\": 0, \"hash_ids\": [1, 2, 3]}\n\n{\"hash_ids\": [1]}\n",
        )
        .unwrap();
        let t = Trace::load(&good).unwrap();
        assert_eq!(t.requests, vec![vec![1, 2, 3], vec![1]]);
        assert_eq!((t.blocks(), t.unique_blocks()), (4, 3));
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"hash_ids\": [\"x\"]}\n").unwrap();
        assert!(Trace::load(&bad).is_err());
        std::fs::write(&bad, "").unwrap();
        assert!(Trace::load(&bad).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
