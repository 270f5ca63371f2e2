//! Batch get: validate locally, one lookup for the batch (which leases the hits), then the
//! preferred replica of every key read at once (one transport batch per owner and tier); keys
//! whose first replica failed try the others one by one. A read that outlives its lease is not
//! trusted.

use std::{sync::atomic::Ordering, time::Instant};

use futures::future::join_all;
use mooncake_common::{
    master_api::Lookup,
    transport::{ReadItem, TransferError},
    Code, ObjectKey, ReplicaLocation, SegmentName, Tier,
};

use crate::{
    client::Client,
    error::ClientError,
    group::Groups,
    leases::{found, Granted},
    put::fill,
};

type GetResult = Result<usize, ClientError>;

/// A key's replicas in the order to try them (the usual single replica without allocating).
enum Order<'l> {
    One([&'l ReplicaLocation; 1]),
    Many(Vec<&'l ReplicaLocation>),
}

impl<'l> std::ops::Deref for Order<'l> {
    type Target = [&'l ReplicaLocation];

    fn deref(&self) -> &[&'l ReplicaLocation] {
        match self {
            Order::One(l) => l,
            Order::Many(v) => v,
        }
    }
}

/// One key of a batch get: where to try, where the bytes go, and how it went.
struct ReadJob<'k, 'b, 'l> {
    i: usize,
    key: &'k ObjectKey,
    replicas: Order<'l>,
    dst: Vec<&'b mut [u8]>,
    done: Option<Result<(), ClientError>>,
    /// The tier of the attempt that counts.
    served_by: Option<Tier>,
    /// When the read that counts ended: checked against the lease, key by key (a slow owner's
    /// keys do not make another owner's early reads late).
    ended: Option<Instant>,
}

impl Client {
    pub async fn get(&self, key: &str, buf: &mut [u8]) -> GetResult {
        self.batch_get(&[key], &mut [buf])
            .await
            .pop()
            .expect("one result per key")
    }

    /// Reads each key into its buffer; returns the bytes read per key, in order. A buffer smaller
    /// than its object gives INVALID_PARAMS (-600); a read that outlived its lease, LEASE_EXPIRED.
    pub async fn batch_get(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<GetResult> {
        let mut parts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut **b]).collect();
        self.batch_get_parts(keys, &mut parts).await
    }

    /// Like `batch_get`, with each object scattered over several buffers in order; the buffers of
    /// one key together must hold the object.
    pub async fn batch_get_parts(
        &self,
        keys: &[&str],
        bufs: &mut [Vec<&mut [u8]>],
    ) -> Vec<GetResult> {
        if keys.len() != bufs.len() {
            let msg = format!("{} keys but {} buffer lists", keys.len(), bufs.len());
            return keys
                .iter()
                .map(|_| Err(ClientError::Invalid(msg.clone())))
                .collect();
        }
        let mut results: Vec<Option<GetResult>> = (0..keys.len()).map(|_| None).collect();
        let mut valid: Vec<(usize, ObjectKey)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.object_key(key) {
                Ok(k) => valid.push((i, k)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        if !valid.is_empty() {
            self.get_valid(&valid, bufs, &mut results).await;
        }
        results
            .into_iter()
            .map(|r| r.expect("every key answered"))
            .collect()
    }

    async fn get_valid(
        &self,
        valid: &[(usize, ObjectKey)],
        bufs: &mut [Vec<&mut [u8]>],
        results: &mut [Option<GetResult>],
    ) {
        let asked_at = Instant::now();
        let names: Vec<&str> = valid.iter().map(|(_, k)| k.as_str()).collect();
        self.tiers
            .get_keys
            .fetch_add(names.len() as u64, Ordering::Relaxed);
        let lookup = match self.lookup(&names).await {
            Ok(l) => l,
            Err(e) => {
                self.leases.call_ended();
                return fill(results, valid, &e.into());
            }
        };
        let granted = Granted::by_lookup(asked_at, &lookup);
        // The lease started no earlier than our request did, so this deadline is conservative.
        let lease_deadline = granted.deadline();
        let reading = self.leases.reading(found(&names, &lookup), granted);

        let mut jobs = self.read_jobs(valid, &lookup, bufs, results);
        self.read_first_replicas(&mut jobs).await;
        // Keys whose first replica failed try the others, one by one.
        let retries = jobs
            .iter_mut()
            .filter(|j| matches!(j.done, Some(Err(_))))
            .map(|job| async move {
                for loc in job.replicas[1..].iter() {
                    match self.read_at(loc, job.key, &mut job.dst[..]).await {
                        Ok(()) => {
                            job.done = Some(Ok(()));
                            job.served_by = Some(loc.tier);
                            job.ended = Some(Instant::now());
                            break;
                        }
                        Err(e) => {
                            tracing::debug!(key = %job.key, segment = %loc.segment, tier = ?loc.tier, error = %e, "replica read failed");
                            job.done = Some(Err(e.into()));
                        }
                    }
                }
            });
        join_all(retries).await;
        // The reads are over: the holds the lookup took go back, and those kept for this call.
        drop(reading);
        self.count_served(&jobs);
        for job in jobs {
            let n: usize = job.dst.iter().map(|d| d.len()).sum();
            let ended = job.ended.unwrap_or_else(Instant::now);
            results[job.i] = Some(job.done.expect("attempted").and_then(|()| {
                if ended >= lease_deadline {
                    Err(ClientError::LeaseExpired(job.key.to_string()))
                } else {
                    Ok(n)
                }
            }));
        }
    }

    /// A read job per key the lookup found and whose buffers hold it; every other key's result
    /// is filled in here.
    fn read_jobs<'k, 'b, 'l>(
        &self,
        valid: &'k [(usize, ObjectKey)],
        lookup: &'l Lookup,
        bufs: &mut [Vec<&'b mut [u8]>],
        results: &mut [Option<GetResult>],
    ) -> Vec<ReadJob<'k, 'b, 'l>> {
        let mut jobs = Vec::with_capacity(valid.len());
        for ((i, key), found) in valid.iter().zip(lookup.results()) {
            let i = *i;
            let found = match found {
                Ok(f) => f,
                Err(code) => {
                    results[i] = Some(Err(ClientError::master(*code, format!("get {key}"))));
                    continue;
                }
            };
            let buf = &mut bufs[i];
            let have: usize = buf.iter().map(|b| b.len()).sum();
            if (have as u64) < found.size {
                results[i] = Some(Err(ClientError::BufferTooSmall {
                    need: found.size,
                    have,
                }));
                continue;
            }
            let replicas = self.replica_order(lookup.replicas(found));
            if replicas.is_empty() {
                results[i] = Some(Err(ClientError::master(
                    Code::ObjectNotFound,
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
                ended: None,
            });
        }
        jobs
    }

    /// The first replica of every job, one batch per (owner, tier), all at once: memory reads
    /// and disk reads take different paths.
    async fn read_first_replicas(&self, jobs: &mut [ReadJob<'_, '_, '_>]) {
        let mut groups: Groups<(&SegmentName, Tier), ReadItem<'_, '_>> = Groups::new();
        for (j, job) in jobs.iter_mut().enumerate() {
            let loc = job.replicas[0];
            groups.push(
                (&loc.segment, loc.tier),
                j,
                ReadItem {
                    key: job.key,
                    offset: loc.offset,
                    put_id: loc.put_id,
                    seal: loc.seal,
                    parts: &mut job.dst[..],
                },
            );
        }
        let batches = groups.iter_mut().map(|g| async move {
            let (segment, tier) = g.to;
            let res = match tier {
                Tier::Disk => self.transport.read_disk_batch(segment, &mut g.items).await,
                Tier::Memory => self.transport.read_batch(segment, &mut g.items).await,
            };
            (std::mem::take(&mut g.slots), res, Instant::now())
        });
        let outcomes = join_all(batches).await;
        drop(groups);
        for (slots, res, ended) in outcomes {
            for (j, r) in slots.into_iter().zip(res) {
                let job = &mut jobs[j];
                job.done = Some(r.map_err(ClientError::from));
                job.served_by = Some(job.replicas[0].tier);
                job.ended = Some(ended);
            }
        }
    }

    /// Counts the keys and bytes served, by tier.
    fn count_served(&self, jobs: &[ReadJob<'_, '_, '_>]) {
        let mut per_tier = [(0u64, 0u64); 2];
        for job in jobs {
            if let (Some(Ok(())), Some(tier)) = (&job.done, job.served_by) {
                let t = &mut per_tier[usize::from(tier == Tier::Disk)];
                t.0 += 1;
                t.1 += job.dst.iter().map(|d| d.len() as u64).sum::<u64>();
            }
        }
        self.tiers.add(Tier::Memory, per_tier[0].0, per_tier[0].1);
        self.tiers.add(Tier::Disk, per_tier[1].0, per_tier[1].1);
        tracing::debug!(
            keys = jobs.len(),
            memory_keys = per_tier[0].0,
            memory_bytes = per_tier[0].1,
            disk_keys = per_tier[1].0,
            disk_bytes = per_tier[1].1,
            "batch get served"
        );
    }

    /// Reads each key into a freshly allocated buffer of the object's size (one master round
    /// trip, like `batch_get`), for callers that cannot know sizes in advance.
    pub async fn batch_get_owned(&self, keys: &[&str]) -> Vec<Result<Vec<u8>, ClientError>> {
        self.batch_get_alloc(keys, |sizes| {
            sizes.iter().map(|&size| Ok(vec![0u8; size])).collect()
        })
        .await
    }

    /// Like `batch_get_owned`, with the buffers made by `alloc` from the found objects' sizes
    /// (one call for the whole batch, with the sizes of the hits in key order, before any read
    /// starts, so that an allocator behind a lock, Python's GIL, takes it once); an error from
    /// `alloc` is that key's result, and so is a buffer shorter than the size asked
    /// (BufferTooSmall) or one `alloc` did not return. A longer buffer gets the value in its
    /// first `size` bytes.
    pub async fn batch_get_alloc<B: AsMut<[u8]> + Send>(
        &self,
        keys: &[&str],
        alloc: impl FnOnce(&[usize]) -> Vec<Result<B, ClientError>>,
    ) -> Vec<Result<B, ClientError>> {
        let valid: Vec<Result<ObjectKey, ClientError>> =
            keys.iter().map(|k| self.object_key(k)).collect();
        let names: Vec<&str> = valid.iter().flatten().map(|k| k.as_str()).collect();
        if names.is_empty() {
            // Every key is invalid (or there is none): their errors.
            return valid.into_iter().filter_map(Result::err).map(Err).collect();
        }
        let asked_at = Instant::now();
        self.tiers
            .get_keys
            .fetch_add(names.len() as u64, Ordering::Relaxed);
        let lookup = match self.lookup(&names).await {
            Ok(l) => l,
            Err(e) => {
                self.leases.call_ended();
                // An invalid key keeps its own error.
                let e = ClientError::from(e);
                return valid
                    .into_iter()
                    .map(|k| Err(k.err().unwrap_or_else(|| e.for_each_key())))
                    .collect();
            }
        };
        let granted = Granted::by_lookup(asked_at, &lookup);
        let lease_deadline = granted.deadline();
        let reading = self.leases.reading(found(&names, &lookup), granted);
        let mut found = lookup.results().iter();
        let lookup = &lookup;
        let hits: Vec<Result<_, ClientError>> = valid
            .into_iter()
            .map(|k| {
                let hit = k.as_ref().ok().and_then(|_| found.next());
                let key = k?;
                let hit = hit.expect("one lookup result per valid key");
                let hit = hit
                    .as_ref()
                    .map_err(|code| ClientError::master(*code, format!("get {key}")))?;
                Ok((key, hit))
            })
            .collect();
        // Buffers first, in key order, so `alloc` needs no synchronisation with the reads.
        let sizes: Vec<usize> = hits
            .iter()
            .flatten()
            .map(|(_, h)| h.size as usize)
            .collect();
        let mut bufs = alloc(&sizes).into_iter();
        let jobs: Vec<Result<_, ClientError>> = hits
            .into_iter()
            .map(|h| {
                let (key, hit) = h?;
                let mut buf = bufs.next().unwrap_or_else(|| {
                    Err(ClientError::Invalid(format!(
                        "the allocator returned fewer buffers than the {} values found",
                        sizes.len()
                    )))
                })?;
                let have = buf.as_mut().len();
                if (have as u64) < hit.size {
                    // An allocator's short buffer (a `Vec::with_capacity`, say) must not pass
                    // for the whole value.
                    return Err(ClientError::BufferTooSmall {
                        need: hit.size,
                        have,
                    });
                }
                Ok((key, hit, buf))
            })
            .collect();
        let reads = jobs.into_iter().map(|job| async move {
            let (key, hit, mut buf) = job?;
            // The value's bytes only: an allocator may round a buffer up.
            let dst = &mut buf.as_mut()[..hit.size as usize];
            self.read_one(&key, lookup.replicas(hit), &mut [dst])
                .await?;
            if Instant::now() >= lease_deadline {
                return Err(ClientError::LeaseExpired(key.to_string()));
            }
            Ok(buf)
        });
        let got = join_all(reads).await;
        drop(reading);
        got
    }

    /// Replicas in the order to try them: memory before disk, the preferred segment first
    /// within each.
    fn replica_order<'l>(&self, replicas: &'l [ReplicaLocation]) -> Order<'l> {
        if let [only] = replicas {
            return Order::One([only]);
        }
        let mut order: Vec<&ReplicaLocation> = replicas.iter().collect();
        let preferred = self.preferred.as_ref();
        order.sort_by_key(|l| (l.is_disk(), Some(&l.segment) != preferred));
        Order::Many(order)
    }

    /// Reads one object from one replica, in memory or on disk.
    async fn read_at(
        &self,
        loc: &ReplicaLocation,
        key: &ObjectKey,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        let mut items = [ReadItem {
            key,
            offset: loc.offset,
            put_id: loc.put_id,
            seal: loc.seal,
            parts: dst,
        }];
        if loc.tier == Tier::Memory {
            return self.transport.read(&loc.segment, &mut items[0]).await;
        }
        self.transport
            .read_disk_batch(&loc.segment, &mut items)
            .await
            .pop()
            .expect("one result")
    }

    /// Reads from the preferred replica first, then the others; the last error if all fail.
    async fn read_one(
        &self,
        key: &ObjectKey,
        replicas: &[ReplicaLocation],
        dst: &mut [&mut [u8]],
    ) -> GetResult {
        let len = dst.iter().map(|d| d.len()).sum();
        let mut last = ClientError::master(Code::ObjectNotFound, format!("{key} has no replica"));
        for loc in self.replica_order(replicas).iter() {
            match self.read_at(loc, key, dst).await {
                Ok(()) => {
                    self.tiers.add(loc.tier, 1, len as u64);
                    return Ok(len);
                }
                Err(e) => {
                    tracing::debug!(%key, segment = %loc.segment, tier = ?loc.tier, error = %e, "replica read failed");
                    last = e.into();
                }
            }
        }
        Err(last)
    }
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
