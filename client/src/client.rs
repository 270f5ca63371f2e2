//! The requester-only client: batch put and get between caller memory and owners, with the
//! master deciding placement, leases and commit. One master round trip per phase per batch;
//! transfers of a batch run concurrently.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures::future::join_all;
use mooncake_common::{
    transport::{parts_len, DataTransport, ReadItem, TransferStats, WriteItem},
    Code, ObjectKey, SegmentName,
};
use mooncake_proto::master as pb;

use crate::{
    config::{resolve_preferred, ClientConfig, PREFERRED_SEGMENT_ENV},
    error::ClientError,
    lookup::Location,
    master::MasterRpc,
    transport::{tcp::TcpConfig, HybridConfig, HybridTransport},
};

/// Per-put replication settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicateConfig {
    /// Replicas on distinct segments; 0 is read as 1. Fewer are made when fewer segments have room.
    pub replica_num: usize,
    /// Segments tried first, in order. Empty: the client's preferred segment, if any.
    pub preferred_segments: Vec<String>,
    /// Evicted only after everything unpinned (for the master's soft-pin TTL).
    pub soft_pin: bool,
    /// Never evicted.
    pub hard_pin: bool,
}

/// A successful put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    /// The key was already there (or being written by another put): objects are write-once.
    AlreadyExists,
}

/// Where an object's replicas are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectDesc {
    pub size: u64,
    pub replicas: Vec<ReplicaDesc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaDesc {
    pub segment: SegmentName,
    pub offset: u64,
    pub tier: Tier,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Memory,
    Disk,
}

/// Mooncake's convention for a put result: 0 for stored or already there, else the code.
pub fn put_code(r: &Result<PutOutcome, ClientError>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.code().as_i32(),
    }
}

/// Mooncake's convention for a get result: bytes read, else the code.
pub fn get_code(r: &Result<usize, ClientError>) -> i64 {
    match r {
        Ok(n) => *n as i64,
        Err(e) => e.code().as_i32() as i64,
    }
}

pub struct Client {
    master: MasterRpc,
    transport: Arc<dyn DataTransport>,
    preferred: Option<SegmentName>,
    tiers: TierCounters,
}

/// Keys and bytes of successful gets, by the tier that served them.
#[derive(Default)]
struct TierCounters {
    memory_keys: AtomicU64,
    memory_bytes: AtomicU64,
    disk_keys: AtomicU64,
    disk_bytes: AtomicU64,
}

impl TierCounters {
    fn add(&self, disk: bool, keys: u64, bytes: u64) {
        let (k, b) = if disk {
            (&self.disk_keys, &self.disk_bytes)
        } else {
            (&self.memory_keys, &self.memory_bytes)
        };
        k.fetch_add(keys, Ordering::Relaxed);
        b.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// One replica to read from: an owner's memory at `offset`, or its SSD tier (`offset` is then
/// the object's version, which the record on disk must carry).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Loc {
    seg: SegmentName,
    offset: u64,
    disk: bool,
}

/// A key's replicas in the order to try them.
enum Order {
    One([Loc; 1]),
    Many(Vec<Loc>),
}

impl std::ops::Deref for Order {
    type Target = [Loc];

    fn deref(&self) -> &[Loc] {
        match self {
            Order::One(l) => l,
            Order::Many(v) => v,
        }
    }
}

impl Client {
    /// Connects to the master (checking it answers within the RPC deadline). The client
    /// contributes no memory.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        let env = std::env::var(PREFERRED_SEGMENT_ENV).ok();
        let preferred = resolve_preferred(config.preferred_segment.as_deref(), env.as_deref())?;
        let transport = Self::default_transport(&config);
        Self::connect_with(config, preferred, transport).await
    }

    /// The transport `connect` uses: the same-host path where available (unless turned off in
    /// the config or by `MOONCAKE_SHM=0`), TCP elsewhere.
    pub fn default_transport(config: &ClientConfig) -> Arc<dyn DataTransport> {
        Arc::new(HybridTransport::new(HybridConfig {
            tcp: TcpConfig {
                connect_timeout: config.connect_timeout,
                transfer_timeout: config.transfer_timeout,
                connections_per_owner: config.connections_per_owner,
                transfer_threads: config.transfer_threads,
                dedicated_runtime: config.dedicated_runtime,
            },
            shared_memory: config.shared_memory && mooncake_common::local::shm_enabled(),
            socket_dir: config
                .socket_dir
                .clone()
                .unwrap_or_else(mooncake_common::local::socket_dir),
        }))
    }

    /// Like `connect`, with an explicit preferred segment and transport.
    pub async fn connect_with(
        config: ClientConfig,
        preferred: Option<SegmentName>,
        transport: Arc<dyn DataTransport>,
    ) -> Result<Client, ClientError> {
        config.validate()?;
        let master = MasterRpc::new(
            &config.master,
            config.rpc_timeout,
            config.connect_timeout,
            config.master_protocol,
            config.master_spin,
        )?;
        master.list_segments().await?;
        Ok(Client {
            tiers: TierCounters::default(),
            master,
            transport,
            preferred,
        })
    }

    pub fn preferred_segment(&self) -> Option<&SegmentName> {
        self.preferred.as_ref()
    }

    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        config: &ReplicateConfig,
    ) -> Result<PutOutcome, ClientError> {
        self.batch_put(&[(key, value)], config)
            .await
            .pop()
            .expect("one result per item")
    }

    /// Puts every (key, value); one result per item, in order.
    pub async fn batch_put(
        &self,
        items: &[(&str, &[u8])],
        config: &ReplicateConfig,
    ) -> Vec<Result<PutOutcome, ClientError>> {
        let parts: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<(&str, &[&[u8]])> = items
            .iter()
            .zip(&parts)
            .map(|((k, _), p)| (*k, &p[..]))
            .collect();
        self.batch_put_parts(&items, config).await
    }

    /// Puts objects each given as the concatenation of several buffers (e.g. K and V), sent
    /// without first being copied together; one result per item, in order.
    pub async fn batch_put_parts(
        &self,
        items: &[(&str, &[&[u8]])],
        config: &ReplicateConfig,
    ) -> Vec<Result<PutOutcome, ClientError>> {
        let mut results: Vec<Option<Result<PutOutcome, ClientError>>> =
            (0..items.len()).map(|_| None).collect();
        // Validate locally; only valid items go to the master.
        let mut valid: Vec<(usize, ObjectKey)> = Vec::with_capacity(items.len());
        for (i, (key, parts)) in items.iter().enumerate() {
            match ObjectKey::new(key) {
                Err(e) => results[i] = Some(Err(ClientError::Invalid(e.to_string()))),
                Ok(_) if parts.iter().all(|p| p.is_empty()) => {
                    results[i] = Some(Err(ClientError::Invalid(format!(
                        "value of {key} is empty"
                    ))))
                }
                Ok(k) => valid.push((i, k)),
            }
        }
        if !valid.is_empty() {
            self.put_valid(items, &valid, config, &mut results).await;
        }
        results
            .into_iter()
            .map(|r| r.expect("every item answered"))
            .collect()
    }

    async fn put_valid(
        &self,
        items: &[(&str, &[&[u8]])],
        valid: &[(usize, ObjectKey)],
        config: &ReplicateConfig,
        results: &mut [Option<Result<PutOutcome, ClientError>>],
    ) {
        let mut preferred = config.preferred_segments.clone();
        if preferred.is_empty() {
            preferred.extend(self.preferred.iter().map(|s| s.to_string()));
        }
        let starts: Vec<(&str, u64)> = valid
            .iter()
            .map(|(i, k)| (k.as_str(), parts_len(items[*i].1)))
            .collect();
        let pb_config = pb::ReplicateConfig {
            replica_num: config.replica_num as u32,
            preferred_segments: preferred,
            soft_pin: config.soft_pin,
            hard_pin: config.hard_pin,
        };
        let started = match self.master.put_start(&starts, pb_config).await {
            Ok(r) if r.starts.len() == valid.len() => r,
            Ok(r) => {
                let msg = format!(
                    "master answered {} results for {} keys",
                    r.starts.len(),
                    valid.len()
                );
                return fill(results, valid, || ClientError::Rpc(msg.clone()));
            }
            Err(e) => return fill(results, valid, || clone_err(&e)),
        };

        // Write every replica of every granted put, all at once.
        // Every replica write, one batch per owner, all owners at once.
        let mut write_errors: Vec<Option<ClientError>> = (0..valid.len()).map(|_| None).collect();
        let mut groups: Vec<(SegmentName, Vec<usize>, Vec<WriteItem<'_>>)> = Vec::new();
        let grants = &started.starts;
        for (slot, ((i, key), grant)) in valid.iter().zip(grants).enumerate() {
            if grant.code != 0 {
                continue;
            }
            for rep in started.replicas(grant) {
                let Some(seg) = rep.segment.clone() else {
                    write_errors[slot]
                        .get_or_insert(ClientError::Rpc("master sent a bad segment name".into()));
                    continue;
                };
                let g = match groups.iter().position(|(s, ..)| *s == seg) {
                    Some(g) => g,
                    None => {
                        groups.push((seg, Vec::new(), Vec::new()));
                        groups.len() - 1
                    }
                };
                groups[g].1.push(slot);
                groups[g].2.push(WriteItem {
                    key,
                    offset: rep.offset,
                    parts: items[*i].1,
                });
            }
        }
        let batches = groups.iter().map(|(seg, slots, witems)| async move {
            (slots, self.transport.write_batch(seg, witems).await)
        });
        for (slots, res) in join_all(batches).await {
            for (slot, r) in slots.iter().zip(res) {
                if let Err(e) = r {
                    tracing::debug!(key = %valid[*slot].1, error = %e, "replica write failed; revoking the put");
                    write_errors[*slot].get_or_insert(e.into());
                }
            }
        }

        let (mut end, mut revoke) = (Vec::new(), Vec::new());
        for (slot, ((i, key), grant)) in valid.iter().zip(grants).enumerate() {
            let put_ref = (key.as_str(), grant.put_id);
            if grant.code == Code::ObjectAlreadyExists.as_i32() {
                results[*i] = Some(Ok(PutOutcome::AlreadyExists));
            } else if grant.code != 0 {
                results[*i] = Some(Err(ClientError::master(grant.code, grant.message.clone())));
            } else if let Some(e) = write_errors[slot].take() {
                results[*i] = Some(Err(e));
                revoke.push(put_ref);
            } else {
                end.push((*i, put_ref));
            }
        }
        if !revoke.is_empty() {
            if let Err(e) = self.master.put_revoke(&revoke).await {
                tracing::warn!(error = %e, "revoking failed puts failed; the master reclaims them after its release timeout");
            }
        }
        if end.is_empty() {
            return;
        }
        let (idx, refs): (Vec<usize>, Vec<(&str, u64)>) = end.into_iter().unzip();
        match self.master.put_end(&refs).await {
            Ok(codes) if codes.len() == idx.len() => {
                for (i, code) in idx.into_iter().zip(codes) {
                    results[i] = Some(if code == 0 {
                        Ok(PutOutcome::Stored)
                    } else {
                        Err(ClientError::master(code, "put end refused"))
                    });
                }
            }
            Ok(_) => {
                for i in idx {
                    results[i] = Some(Err(ClientError::Rpc(
                        "master answered a wrong number of put-end results".into(),
                    )));
                }
            }
            Err(e) => {
                for i in idx {
                    results[i] = Some(Err(clone_err(&e)));
                }
            }
        }
    }

    pub async fn get(&self, key: &str, buf: &mut [u8]) -> Result<usize, ClientError> {
        self.batch_get(&[key], &mut [buf])
            .await
            .pop()
            .expect("one result per key")
    }

    /// Reads each key into its buffer; returns the bytes read per key, in order. A buffer smaller
    /// than its object gives INVALID_PARAMS (-600); a read that outlived its lease, LEASE_EXPIRED.
    pub async fn batch_get(
        &self,
        keys: &[&str],
        bufs: &mut [&mut [u8]],
    ) -> Vec<Result<usize, ClientError>> {
        let mut parts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut **b]).collect();
        self.batch_get_parts(keys, &mut parts).await
    }

    /// Like `batch_get`, with each object scattered over several buffers in order; the buffers of
    /// one key together must hold the object.
    pub async fn batch_get_parts(
        &self,
        keys: &[&str],
        bufs: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<usize, ClientError>> {
        if keys.len() != bufs.len() {
            let msg = format!("{} keys but {} buffer lists", keys.len(), bufs.len());
            return keys
                .iter()
                .map(|_| Err(ClientError::Invalid(msg.clone())))
                .collect();
        }
        let mut results: Vec<Option<Result<usize, ClientError>>> =
            (0..keys.len()).map(|_| None).collect();
        let mut valid: Vec<(usize, ObjectKey)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match ObjectKey::new(key) {
                Ok(k) => valid.push((i, k)),
                Err(e) => results[i] = Some(Err(ClientError::Invalid(e.to_string()))),
            }
        }
        if valid.is_empty() {
            return results.into_iter().map(|r| r.expect("answered")).collect();
        }
        let asked_at = Instant::now();
        let names: Vec<&str> = valid.iter().map(|(_, k)| k.as_str()).collect();
        let resp = match self.master.get_replicas(&names).await {
            Ok(r) if r.results.len() == valid.len() => r,
            Ok(_) => {
                fill(&mut results, &valid, || {
                    ClientError::Rpc("master answered a wrong number of results".into())
                });
                return results.into_iter().map(|r| r.expect("answered")).collect();
            }
            Err(e) => {
                fill(&mut results, &valid, || clone_err(&e));
                return results.into_iter().map(|r| r.expect("answered")).collect();
            }
        };
        // The lease started no earlier than our request did, so this deadline is conservative.
        let lease_deadline = asked_at + Duration::from_millis(resp.lease_ttl_ms);

        let mut slot_of = vec![usize::MAX; keys.len()];
        for (slot, (i, _)) in valid.iter().enumerate() {
            slot_of[*i] = slot;
        }
        // First attempt: the preferred replica of every key, one batch per owner, all at once.
        let mut jobs: Vec<ReadJob<'_, '_>> = Vec::new();
        for (i, buf) in bufs.iter_mut().enumerate() {
            let slot = slot_of[i];
            if slot == usize::MAX {
                continue;
            }
            let found = &resp.results[slot];
            let key = &valid[slot].1;
            if found.code != 0 {
                results[i] = Some(Err(ClientError::master(found.code, format!("get {key}"))));
                continue;
            }
            let have: usize = buf.iter().map(|b| b.len()).sum();
            if (have as u64) < found.size {
                results[i] = Some(Err(ClientError::BufferTooSmall {
                    need: found.size,
                    have,
                }));
                continue;
            }
            let replicas = self.replica_order(resp.replicas(found));
            if replicas.is_empty() {
                results[i] = Some(Err(ClientError::master(
                    Code::ObjectNotFound.as_i32(),
                    format!("{key} has no replica"),
                )));
                continue;
            }
            jobs.push(ReadJob {
                i,
                key,
                replicas,
                dst: clip(std::mem::take(buf), found.size as usize),
                done: None,
                served_by: None,
            });
        }
        {
            // One batch per (owner, tier): memory reads and disk reads take different paths.
            let mut groups: Vec<(Loc, Vec<usize>, Vec<ReadItem<'_, '_>>)> = Vec::new();
            for (j, job) in jobs.iter_mut().enumerate() {
                let loc = job.replicas[0].clone();
                let offset = loc.offset;
                let g = match groups
                    .iter()
                    .position(|(l, ..)| l.seg == loc.seg && l.disk == loc.disk)
                {
                    Some(g) => g,
                    None => {
                        groups.push((loc, Vec::new(), Vec::new()));
                        groups.len() - 1
                    }
                };
                job.served_by = Some(groups[g].0.disk);
                groups[g].1.push(j);
                groups[g].2.push(ReadItem {
                    key: job.key,
                    offset,
                    parts: &mut job.dst[..],
                });
            }
            let batches = groups.iter_mut().map(|(loc, js, ritems)| async move {
                let res = if loc.disk {
                    self.transport.read_disk_batch(&loc.seg, ritems).await
                } else {
                    self.transport.read_batch(&loc.seg, ritems).await
                };
                (std::mem::take(js), res)
            });
            let outcomes = join_all(batches).await;
            drop(groups);
            for (js, res) in outcomes {
                for (j, r) in js.into_iter().zip(res) {
                    jobs[j].done = Some(r.map_err(ClientError::from));
                }
            }
        }
        // Keys whose first replica failed try the others, one by one.
        let retries = jobs.iter_mut().filter(|j| matches!(j.done, Some(Err(_)))).map(|job| async move {
            for loc in job.replicas[1..].iter() {
                match self.read_at(loc, job.key, &mut job.dst[..]).await {
                    Ok(()) => {
                        job.done = Some(Ok(()));
                        job.served_by = Some(loc.disk);
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(key = %job.key, segment = %loc.seg, disk = loc.disk, error = %e, "replica read failed");
                        job.done = Some(Err(e.into()));
                    }
                }
            }
        });
        join_all(retries).await;
        let mut per_tier = [(0u64, 0u64); 2];
        for job in &jobs {
            if let (Some(Ok(())), Some(disk)) = (&job.done, job.served_by) {
                let t = &mut per_tier[disk as usize];
                t.0 += 1;
                t.1 += job.dst.iter().map(|d| d.len() as u64).sum::<u64>();
            }
        }
        self.tiers.add(false, per_tier[0].0, per_tier[0].1);
        self.tiers.add(true, per_tier[1].0, per_tier[1].1);
        tracing::debug!(
            keys = keys.len(),
            memory_keys = per_tier[0].0,
            memory_bytes = per_tier[0].1,
            disk_keys = per_tier[1].0,
            disk_bytes = per_tier[1].1,
            "batch get served"
        );
        for job in jobs {
            let n: usize = job.dst.iter().map(|d| d.len()).sum();
            results[job.i] = Some(job.done.expect("attempted").and_then(|()| {
                if Instant::now() >= lease_deadline {
                    Err(ClientError::LeaseExpired(keys[job.i].to_string()))
                } else {
                    Ok(n)
                }
            }));
        }
        results.into_iter().map(|r| r.expect("answered")).collect()
    }

    /// Reads each key into a freshly allocated buffer of the object's size (one master round
    /// trip, like `batch_get`), for callers that cannot know sizes in advance.
    pub async fn batch_get_owned(&self, keys: &[&str]) -> Vec<Result<Vec<u8>, ClientError>> {
        let valid: Vec<Result<ObjectKey, ClientError>> = keys
            .iter()
            .map(|k| ObjectKey::new(k).map_err(|e| ClientError::Invalid(e.to_string())))
            .collect();
        let names: Vec<&str> = valid.iter().flatten().map(|k| k.as_str()).collect();
        if names.is_empty() {
            return valid.into_iter().map(|k| k.map(|_| Vec::new())).collect();
        }
        let asked_at = Instant::now();
        let resp = match self.master.get_replicas(&names).await {
            Ok(r) => r,
            Err(e) => return keys.iter().map(|_| Err(clone_err(&e))).collect(),
        };
        let lease_deadline = asked_at + Duration::from_millis(resp.lease_ttl_ms);
        let mut found = resp.results.iter();
        let resp = &resp;
        let reads = valid.into_iter().map(|k| {
            let hit = k.as_ref().ok().and_then(|_| found.next());
            async move {
                let key = k?;
                let hit =
                    hit.ok_or_else(|| ClientError::Rpc("master answered too few results".into()))?;
                if hit.code != 0 {
                    return Err(ClientError::master(hit.code, format!("get {key}")));
                }
                let mut buf = vec![0u8; hit.size as usize];
                self.read_one(&key, resp.replicas(hit), &mut [&mut buf[..]])
                    .await?;
                if Instant::now() >= lease_deadline {
                    return Err(ClientError::LeaseExpired(key.to_string()));
                }
                Ok(buf)
            }
        });
        join_all(reads).await
    }

    /// Replicas in the order to try them: memory before disk, the preferred segment first
    /// within each; unparsable names dropped.
    fn replica_order(&self, replicas: &[Location]) -> Order {
        let mut locs = replicas.iter().filter_map(|r| {
            r.segment.clone().map(|seg| Loc {
                seg,
                offset: if r.disk { r.put_id } else { r.offset },
                disk: r.disk,
            })
        });
        if replicas.len() == 1 {
            // The usual case, with no allocation.
            return match locs.next() {
                Some(l) => Order::One([l]),
                None => Order::Many(Vec::new()),
            };
        }
        let mut order: Vec<Loc> = locs.collect();
        let preferred = self.preferred.as_ref();
        order.sort_by_key(|l| (l.disk, Some(&l.seg) != preferred));
        Order::Many(order)
    }

    /// Reads one object from one replica, in memory or on disk.
    async fn read_at(
        &self,
        loc: &Loc,
        key: &ObjectKey,
        dst: &mut [&mut [u8]],
    ) -> Result<(), mooncake_common::transport::TransferError> {
        if !loc.disk {
            return self.transport.read(&loc.seg, key, loc.offset, dst).await;
        }
        let mut items = [ReadItem {
            key,
            offset: loc.offset,
            parts: dst,
        }];
        self.transport
            .read_disk_batch(&loc.seg, &mut items)
            .await
            .pop()
            .expect("one result")
    }

    /// Reads from the preferred replica first, then the others; the last error if all fail.
    async fn read_one(
        &self,
        key: &ObjectKey,
        replicas: &[Location],
        dst: &mut [&mut [u8]],
    ) -> Result<usize, ClientError> {
        let len = dst.iter().map(|d| d.len()).sum();
        let mut last = ClientError::master(
            Code::ObjectNotFound.as_i32(),
            format!("{key} has no replica"),
        );
        for loc in self.replica_order(replicas).iter() {
            match self.read_at(loc, key, dst).await {
                Ok(()) => {
                    self.tiers.add(loc.disk, 1, len as u64);
                    return Ok(len);
                }
                Err(e) => {
                    tracing::debug!(%key, segment = %loc.seg, disk = loc.disk, error = %e, "replica read failed");
                    last = e.into();
                }
            }
        }
        Err(last)
    }

    /// Bytes moved so far through the same-host path and over TCP, and keys and bytes of gets
    /// served from memory and from disk.
    pub fn transfer_stats(&self) -> TransferStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferStats {
            memory_keys: load(&self.tiers.memory_keys),
            memory_bytes: load(&self.tiers.memory_bytes),
            disk_keys: load(&self.tiers.disk_keys),
            disk_bytes: load(&self.tiers.disk_bytes),
            ..self.transport.stats()
        }
    }

    pub async fn exists(&self, key: &str) -> Result<bool, ClientError> {
        self.batch_exists(&[key])
            .await?
            .pop()
            .expect("one result per key")
    }

    /// Existence of each key; hits are leased. The outer error is a failed master call.
    pub async fn batch_exists(
        &self,
        keys: &[&str],
    ) -> Result<Vec<Result<bool, ClientError>>, ClientError> {
        let resp = self.master.exists_strs(keys).await?;
        Self::exists_results(keys.len(), resp)
    }

    fn exists_results(
        n: usize,
        resp: pb::BatchExistsResponse,
    ) -> Result<Vec<Result<bool, ClientError>>, ClientError> {
        if resp.codes.len() != n {
            return Err(ClientError::Rpc(
                "master answered a wrong number of results".into(),
            ));
        }
        Ok(resp
            .codes
            .into_iter()
            .map(|c| match c {
                1 => Ok(true),
                0 => Ok(false),
                c => Err(ClientError::master(c, "exists")),
            })
            .collect())
    }

    pub async fn remove(&self, key: &str, force: bool) -> Result<(), ClientError> {
        self.batch_remove(&[key], force)
            .await?
            .pop()
            .expect("one result per key")
    }

    pub async fn batch_remove(
        &self,
        keys: &[&str],
        force: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let codes = self
            .master
            .remove(keys.iter().map(|k| k.to_string()).collect(), force)
            .await?;
        if codes.len() != keys.len() {
            return Err(ClientError::Rpc(
                "master answered a wrong number of results".into(),
            ));
        }
        Ok(codes
            .into_iter()
            .zip(keys)
            .map(|(c, k)| {
                if c == 0 {
                    Ok(())
                } else {
                    Err(ClientError::master(c, format!("remove {k}")))
                }
            })
            .collect())
    }

    /// Removes every object (leased ones only with `force`); returns how many.
    pub async fn remove_all(&self, force: bool) -> Result<u64, ClientError> {
        self.master.remove_all(force).await
    }

    /// Where each key's replicas are (leases the hits, like a get).
    pub async fn batch_get_replica_desc(
        &self,
        keys: &[&str],
    ) -> Result<Vec<Result<ObjectDesc, ClientError>>, ClientError> {
        let resp = self.master.get_replicas(keys).await?;
        if resp.results.len() != keys.len() {
            return Err(ClientError::Rpc(
                "master answered a wrong number of results".into(),
            ));
        }
        Ok(resp
            .results
            .iter()
            .map(|r| {
                if r.code != 0 {
                    return Err(ClientError::master(r.code, "get replica list"));
                }
                let replicas = resp
                    .replicas(r)
                    .iter()
                    .map(|l| {
                        Ok(ReplicaDesc {
                            segment: l.segment.clone().ok_or_else(|| {
                                ClientError::Rpc("master sent a bad segment name".into())
                            })?,
                            offset: l.offset,
                            tier: if l.disk { Tier::Disk } else { Tier::Memory },
                        })
                    })
                    .collect::<Result<Vec<_>, ClientError>>()?;
                Ok(ObjectDesc {
                    size: r.size,
                    replicas,
                })
            })
            .collect())
    }

    /// Mounted segments with (capacity, allocated) bytes.
    pub async fn list_segments(&self) -> Result<Vec<(SegmentName, u64, u64)>, ClientError> {
        self.master
            .list_segments()
            .await?
            .into_iter()
            .map(|s| {
                SegmentName::parse(&s.name)
                    .map(|n| (n, s.capacity, s.allocated))
                    .map_err(|e| ClientError::Rpc(format!("master sent a bad segment name: {e}")))
            })
            .collect()
    }
}

/// One key of a batch get: where to try, where the bytes go, and how it went.
struct ReadJob<'k, 'b> {
    i: usize,
    key: &'k ObjectKey,
    replicas: Order,
    dst: Vec<&'b mut [u8]>,
    done: Option<Result<(), ClientError>>,
    /// Whether the attempt that counts read from disk.
    served_by: Option<bool>,
}

/// The leading `n` bytes of `parts`, as parts (in place: no allocation).
fn clip(mut parts: Vec<&mut [u8]>, mut n: usize) -> Vec<&mut [u8]> {
    let mut keep = 0;
    for p in parts.iter_mut() {
        if n == 0 {
            break;
        }
        let take = p.len().min(n);
        let whole = std::mem::take(p);
        *p = &mut whole[..take];
        n -= take;
        keep += 1;
    }
    parts.truncate(keep);
    parts
}

fn fill<T>(
    results: &mut [Option<Result<T, ClientError>>],
    valid: &[(usize, ObjectKey)],
    err: impl Fn() -> ClientError,
) {
    for (i, _) in valid {
        results[*i] = Some(Err(err()));
    }
}

/// ClientError holds io errors and is not Clone; batch-wide failures are copied by code and text.
fn clone_err(e: &ClientError) -> ClientError {
    match e {
        ClientError::RpcTimeout(d) => ClientError::RpcTimeout(*d),
        ClientError::Rpc(m) => ClientError::Rpc(m.clone()),
        other => ClientError::Master {
            code: other.code(),
            message: other.to_string(),
        },
    }
}
