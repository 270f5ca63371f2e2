//! The owner's side of the master's work queue: long-polls the master for work, offloads
//! memory ranges to disk, drops records, promotes records back into memory, copies replicas
//! from other owners (replica tasks), and reports each outcome. The master is told before any
//! record is overwritten, and a record is only reported once its bytes are on disk. Registering
//! the records found on disk after a (re)mount is the link's
//! (`MasterLink::register_ssd_records`); the disk itself is `crate::ssd`'s.

use std::{sync::Arc, time::Duration};

use mooncake_common::{
    auth::{Access, Scope},
    Code, ObjectKey, Stamp,
};
use mooncake_proto::master as pb;
use tokio::{
    sync::{mpsc, watch, Semaphore},
    task::JoinSet,
};

use super::{
    peer_read::{self, PeerRead},
    MasterLink,
};
use crate::{
    catalog::Catalog,
    pool::MemoryPool,
    ssd::{Dropped, SsdError, SsdStore},
};

/// How long one poll may wait at the master for work.
const POLL_WAIT: Duration = Duration::from_secs(2);
/// Tasks taken per poll.
const POLL_MAX: u32 = 256;
/// Results sent in one report at most.
const REPORT_MAX: usize = 1024;
/// How long a promotion or a copy waits for its range to be free (a reader still on it, a
/// superseded write draining) before it fails.
const FILL_PATIENCE: Duration = Duration::from_secs(2);

/// What the loop needs to do its work.
pub struct Worker {
    pub link: MasterLink,
    /// The SSD tier; without one, only copies are done (SSD work fails).
    pub store: Option<Arc<SsdStore>>,
    pub pool: Arc<MemoryPool>,
    pub catalog: Arc<Catalog>,
    /// Tasks executed at once (disk queue depth for offloads and promotions).
    pub concurrency: usize,
    /// The longest a copy may take from the poll that brought it, its wait for a free task
    /// slot and its read from the other owner included: set within the master's task timeout
    /// (see `daemon`), so a copy that cannot finish is reported failed (its room given back at
    /// once) before the master gives it up.
    pub copy_timeout: Duration,
}

/// A finished task: its code and, for a failure, why.
type Done = (pb::OwnerTask, i32, String);

/// Why a task failed, as the master's code and a message for the log.
struct Failure(Code, String);

impl From<SsdError> for Failure {
    fn from(e: SsdError) -> Self {
        Failure(e.code(), e.to_string())
    }
}

impl Worker {
    /// Polls and works until `stop` turns true: up to `concurrency` tasks run at once, each
    /// reported as soon as it ends (finished tasks are batched into one report while the
    /// previous report is on its way), so the master frees memory as offloads land.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let (tx, rx) = mpsc::unbounded_channel::<Done>();
        // The reporter and the tasks under way: an abort of this run (a shutdown that stops
        // waiting for them) takes them down with it instead of leaving them running detached.
        let mut running = JoinSet::new();
        running.spawn(self.clone().report_loop(rx));
        let permits = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let mut backoff = Duration::from_millis(100);
        'run: loop {
            self.report_lost().await;
            let polled = tokio::select! {
                r = self.link.poll_tasks(POLL_MAX, POLL_WAIT) => r,
                _ = stop.changed() => break,
            };
            match polled {
                Ok(resp) if resp.remount => {
                    // The heartbeat loop mounts again and registers the disk records.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(resp) if resp.epoch != self.link.epoch() => {
                    // Work of another master than the one this owner is mounted at (a deposed
                    // leader's, or a new one's before the remount): refused; the heartbeat loop
                    // mounts at the current one.
                    if !resp.tasks.is_empty() {
                        tracing::warn!(
                            tasks = resp.tasks.len(),
                            epoch = resp.epoch,
                            mounted = self.link.epoch(),
                            "refusing ssd work of another master"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(resp) => {
                    backoff = Duration::from_millis(100);
                    while running.try_join_next().is_some() {}
                    // A copy's time counts from here, its wait for a free slot included.
                    let polled = tokio::time::Instant::now();
                    for t in resp.tasks {
                        let permit = tokio::select! {
                            p = permits.clone().acquire_owned() => p.expect("never closed"),
                            _ = stop.changed() => break 'run,
                        };
                        let (w, tx) = (self.clone(), tx.clone());
                        running.spawn(async move {
                            let (code, message) = w.execute(&t, polled).await;
                            drop(permit);
                            let _ = tx.send((t, code, message));
                        });
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "polling the master for ssd work failed");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => break,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        // Tasks under way finish (their I/O is bounded) and are reported; then the reporter ends.
        drop(tx);
        while running.join_next().await.is_some() {}
    }

    /// Records reads found missing or corrupt: the master stops pointing at them (the object is
    /// gone unless another replica holds it), then corrupt ones are dropped here, so the next
    /// get answers "not found" instead of failing again.
    async fn report_lost(&self) {
        let Some(store) = &self.store else { return };
        let lost = store.take_lost();
        if lost.is_empty() {
            return;
        }
        let records = lost.iter().map(|l| (&l.key, l.put_id));
        if let Err(e) = self.link.disk_dropped(records).await {
            tracing::warn!(error = %e, "cannot tell the master about lost records; gets keep failing on them");
            return;
        }
        for l in lost {
            if let Some(seq) = l.corrupt_seq {
                // A header left behind is logged; the master already dropped this copy.
                let _ = store.delete(&l.key, l.put_id, Some(seq)).await;
            }
        }
    }

    async fn execute(&self, t: &pb::OwnerTask, polled: tokio::time::Instant) -> (i32, String) {
        match self.one(t, polled).await {
            Ok(()) => (0, String::new()),
            Err(Failure(code, message)) => {
                tracing::warn!(key = %t.key, kind = ?t.kind(), %message, "owner task failed");
                (code.as_i32(), message)
            }
        }
    }

    async fn report_loop(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Done>) {
        while let Some(first) = rx.recv().await {
            let mut done = vec![first];
            while done.len() < REPORT_MAX {
                match rx.try_recv() {
                    Ok(x) => done.push(x),
                    Err(_) => break,
                }
            }
            self.report(done).await;
        }
    }

    async fn report(&self, done: Vec<Done>) {
        let results = done
            .iter()
            .map(|(t, code, message)| pb::TaskResult {
                kind: t.kind,
                key: t.key.clone(),
                put_id: t.put_id,
                code: *code,
                task_id: t.task_id,
                message: message.clone(),
                offset: t.offset,
            })
            .collect();
        let codes = match self.link.report_tasks(results).await {
            Ok(c) => c,
            Err(e) => {
                // The master gives the work up after its timeout: records written stay indexed
                // here and are dropped when the master asks or overwritten in time; copies and
                // promotions it gave up are forgotten as its freed-range notes say.
                tracing::warn!(error = %e, "reporting ssd work failed");
                return;
            }
        };
        // Records deleted below: the master is told, so that the tombstones it laid for them
        // (their objects removed while they were written) go.
        let mut deleted: Vec<(ObjectKey, u64)> = Vec::new();
        for ((t, code, _), answer) in done.iter().zip(codes) {
            if *code != 0 || answer == 0 {
                continue;
            }
            // The master no longer wants what was made (the object went meanwhile).
            let key = match ObjectKey::new(&t.key) {
                Ok(k) => k,
                Err(_) => continue,
            };
            match t.kind() {
                pb::TaskKind::Offload => {
                    if let Some(store) = &self.store {
                        if let Ok(Dropped::NotFound | Dropped::Gone) =
                            store.delete(&key, t.put_id, None).await
                        {
                            deleted.push((key, t.put_id));
                        }
                    }
                }
                pb::TaskKind::Promote | pb::TaskKind::Copy => {
                    // Only if the range still holds what the promotion wrote (checked and
                    // forgotten under one lock: a new put may record there at any moment).
                    self.catalog
                        .forget_if_holds(t.offset, t.size, &key, t.put_id, t.grant);
                }
                pb::TaskKind::Drop => {}
            }
        }
        if !deleted.is_empty() {
            if let Err(e) = self
                .link
                .disk_dropped(deleted.iter().map(|(k, p)| (k, *p)))
                .await
            {
                tracing::debug!(error = %e, "cannot tell the master about deleted records; its tombstones of them stay until those are overwritten");
            }
        }
    }

    async fn one(&self, t: &pb::OwnerTask, polled: tokio::time::Instant) -> Result<(), Failure> {
        let key =
            ObjectKey::new(&t.key).map_err(|e| Failure(Code::InvalidParams, e.to_string()))?;
        // A kind this build does not know (a newer master's) is refused, not taken for another
        // (prost reads an unknown value as the first, an offload).
        if pb::TaskKind::try_from(t.kind).is_err() {
            return Err(Failure(
                Code::InvalidParams,
                format!(
                    "unknown task kind {}: this owner is older than its master",
                    t.kind
                ),
            ));
        }
        if t.kind() == pb::TaskKind::Copy {
            return self.copy(&key, t, polled + self.copy_timeout).await;
        }
        let Some(store) = &self.store else {
            return Err(Failure(
                Code::InvalidParams,
                "this owner has no SSD tier".into(),
            ));
        };
        match t.kind() {
            pb::TaskKind::Offload => self.offload(store, &key, t).await,
            // Reported failed while the header may still be on disk: the master then keeps the
            // removal's tombstone, which refuses the record should a restart find it.
            pb::TaskKind::Drop => match store.delete(&key, t.put_id, None).await {
                Ok(Dropped::NotFound | Dropped::Gone) => Ok(()),
                Ok(Dropped::Overwriting) => Err(Failure(
                    Code::InternalError,
                    "the dropped record's header lies under a write in flight; until that lands \
                     a restart could find it"
                        .into(),
                )),
                Err(e) => Err(Failure(
                    Code::InternalError,
                    format!("cannot zero the dropped record's header: {e}"),
                )),
            },
            pb::TaskKind::Promote => {
                let value = store.read(&key, t.put_id, t.size).await?;
                self.fill(&key, t, &value).await
            }
            pb::TaskKind::Copy => unreachable!("handled above"),
        }
    }

    /// Copies a replica from another owner into the range the master reserved here, by
    /// `deadline` (see `TaskWorker::copy_timeout`).
    async fn copy(
        &self,
        key: &ObjectKey,
        t: &pb::OwnerTask,
        deadline: tokio::time::Instant,
    ) -> Result<(), Failure> {
        let source = mooncake_common::SegmentName::parse(&t.source)
            .map_err(|e| Failure(Code::InvalidParams, format!("copy source: {e}")))?;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(Failure(
                Code::TransferFail,
                format!(
                    "waited {:?} for a free task slot before reading {key} from {source}",
                    self.copy_timeout
                ),
            ));
        }
        let from_disk = t.source_tier == pb::ReplicaTier::Disk as i32;
        // A disk read names no offset (the record is found by key), as a client's does.
        let offset = if from_disk { 0 } else { t.source_offset };
        let seal = self.link.seal_read(
            &Scope {
                access: Access::Read,
                tenant: mooncake_common::tenant::tenant_of(key.as_str()),
                key: key.as_str(),
                segment: source.as_str(),
                offset,
                length: t.size,
                put_id: t.put_id,
            },
            left,
        );
        let read = PeerRead {
            segment: &source,
            key,
            put_id: t.put_id,
            offset,
            size: t.size,
            from_disk,
            credential: self.link.credential(),
            seal,
        };
        let value = peer_read::read(read, left)
            .await
            .map_err(|(code, message)| Failure(code, message))?;
        self.fill(key, t, &value).await
    }

    async fn offload(
        &self,
        store: &SsdStore,
        key: &ObjectKey,
        t: &pb::OwnerTask,
    ) -> Result<(), Failure> {
        let (registrations, _) = self.link.registrations();
        // Checked before the reservation evicts anything for it (checked again once reserved).
        if !self.catalog.holds(t.offset, t.size, key, t.put_id) {
            return Err(Failure(
                Code::ObjectNotFound,
                format!("memory at offset {} no longer holds {key}", t.offset),
            ));
        }
        let mut r = store.reserve(key, t.size)?;
        if !r.victims.is_empty() {
            let records = r.victims.iter().map(|v| (&v.key, v.put_id));
            if let Err(e) = self.link.disk_dropped(records).await {
                store.abandon(r).await;
                return Err(Failure(
                    Code::RpcFail,
                    format!("cannot tell the master about records to overwrite: {e}"),
                ));
            }
            store.evict_victims(&mut r);
            // A registration since the reservation may have brought them back at the master
            // (see `MasterLink::registrations`): told again, now that they are gone here.
            if self.link.registrations() != (registrations, false) {
                let records = r.victims.iter().map(|v| (&v.key, v.put_id));
                if let Err(e) = self.link.disk_dropped(records).await {
                    tracing::warn!(error = %e, "cannot tell the master again about records taken during a registration; it learns so at the first read of each");
                }
            }
        }
        let encoded = match self.pool.read_range(t.offset, t.size) {
            Ok(guard) if self.catalog.holds(t.offset, t.size, key, t.put_id) => {
                Ok(store.encode(&r, key, t.put_id, &guard))
            }
            Ok(_) => Err(Failure(
                Code::ObjectNotFound,
                format!("memory at offset {} no longer holds {key}", t.offset),
            )),
            Err(e) => Err(Failure(e.code(), e.to_string())),
        };
        match encoded {
            Ok(buf) => {
                store.write(r, buf, key, t.put_id, t.size).await?;
                Ok(())
            }
            Err(f) => {
                store.abandon(r).await;
                Err(f)
            }
        }
    }

    /// Writes a promotion's or a copy's `value` into the range the master reserved.
    async fn fill(&self, key: &ObjectKey, t: &pb::OwnerTask, value: &[u8]) -> Result<(), Failure> {
        if value.len() as u64 != t.size {
            return Err(Failure(
                Code::TransferFail,
                format!("read {} bytes of {key}, expected {}", value.len(), t.size),
            ));
        }
        self.catalog.saw_grant(t.grant);
        // The copy is written under the task's grant, so it is fenced like any write (a newer
        // grant's bytes in the range win), and keeps the object's put id as its version.
        let mut guard = self
            .pool
            .write_range_granted(t.offset, t.size, t.grant, FILL_PATIENCE)
            .await
            .map_err(|e| Failure(e.code(), e.to_string()))?;
        if let Some(newer) = self.catalog.claim(t.offset, t.size, t.grant) {
            return Err(Failure(
                Code::TransferFail,
                format!("the range to fill already holds newer put {newer}"),
            ));
        }
        guard.copy_from_slice(value);
        // Pins and the replica count are the master's: the copy's record gets the defaults.
        let stamp = Stamp {
            put_id: t.put_id,
            replica_num: 1,
            ..Stamp::default()
        };
        self.catalog
            .record(t.offset, t.size, key.clone(), stamp, t.grant);
        Ok(())
    }
}
