//! The owner's link to the master: mount at start-up (retrying until a deadline), heartbeat, mount
//! again when the master has forgotten this owner (reporting the pool's catalog, so a restarted
//! master loses nothing the pool holds), unmount at shutdown, the SSD tier's RPCs, and
//! registering the records found on disk after a (re)mount. Every call has a deadline.
//! The loop that long-polls the master for work (SSD tier, copies) and carries it out is
//! `tasks`; this module and that one talk to the master, the `ssd` module below them never does.

mod peer_read;
mod target;
pub mod tasks;

use std::time::{Duration, Instant};

use std::sync::Arc;

use mooncake_common::{
    auth::{wall_clock_us, Credential, Scope, Seal, SealKey, ServerAuth},
    ClientId, Code, ObjectKey, SegmentName,
};
use mooncake_proto::master::{self as pb, master_client::MasterClient};
use tokio::sync::watch;
use tonic::transport::Channel;

use target::Target;

use crate::{
    catalog::Catalog,
    ssd::{Dropped, SsdStore},
};

/// Catalog entries per report message.
const REPORT_CHUNK: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("invalid master address {0:?}: expected HOST:PORT or etcd://HOST:PORT;HOST:PORT")]
    BadAddress(String),
    #[error("master {master} did not answer: {message}")]
    Unreachable { master: String, message: String },
    #[error("master {master} refused to mount segment {segment}: {code}: {message}")]
    Refused {
        master: String,
        segment: SegmentName,
        code: Code,
        message: String,
    },
    /// The master answered the call with an error status that a retry does not change (this
    /// owner's credentials, a request it cannot take).
    #[error("master {master} refused the call: {code}: {message}")]
    Status {
        master: String,
        code: Code,
        message: String,
    },
}

impl LinkError {
    /// The Mooncake code a caller branches on (and decides to retry by).
    pub fn code(&self) -> Code {
        match self {
            LinkError::BadAddress(_) => Code::InvalidParams,
            LinkError::Unreachable { .. } => Code::RpcFail,
            LinkError::Refused { code, .. } | LinkError::Status { code, .. } => *code,
        }
    }
}

/// What a heartbeat's answer asks of the owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// The master does not know this owner's mount (it restarted, the leader changed, or the
    /// owner was dropped): mount again.
    pub remount: bool,
    /// More freed-range notes wait than the answer carried: heartbeat again at once.
    pub more_freed: bool,
}

#[derive(Clone)]
pub struct MasterLink {
    target: Arc<Target>,
    owner: ClientId,
    segment: SegmentName,
    size: u64,
    rpc_timeout: Duration,
    ssd: Option<Arc<SsdStore>>,
    catalog: Arc<Catalog>,
    /// The epoch of the master this owner is mounted at (0: none yet): work of any other is
    /// refused, and a heartbeat answered by another one means mounting again.
    epoch: Arc<std::sync::atomic::AtomicU64>,
    /// The largest freed-range note of that master applied here (0: none): the next
    /// heartbeat says so, and the master sends only later ones.
    freed_applied: Arc<std::sync::atomic::AtomicU64>,
    /// The records on disk are not all registered at that master yet (a call failed).
    disk_unregistered: Arc<std::sync::atomic::AtomicBool>,
    /// Registrations of the records begun so far (see `registrations`).
    registrations: Arc<std::sync::atomic::AtomicU64>,
    /// Set when this owner unmounts to stop: no remount after that (a heartbeat answered
    /// after the unmount landed asks for one).
    unmounting: Arc<std::sync::atomic::AtomicBool>,
    /// Proved to the master and to other owners (copies read from them).
    credential: Option<Credential>,
    /// Seals this owner's own reads from other owners (it holds the cluster's secret).
    seals: Option<SealKey>,
}

impl MasterLink {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        master: &str,
        cluster_id: &str,
        owner: ClientId,
        segment: SegmentName,
        size: u64,
        rpc_timeout: Duration,
        ssd: Option<Arc<SsdStore>>,
        catalog: Arc<Catalog>,
        auth: Option<&ServerAuth>,
        tls: Option<mooncake_common::tls::TlsClient>,
    ) -> Result<Self, LinkError> {
        let credential = auth.map(ServerAuth::credential);
        Ok(MasterLink {
            target: Arc::new(Target::new(
                master,
                cluster_id,
                rpc_timeout,
                credential.clone(),
                tls,
            )?),
            owner,
            segment,
            size,
            rpc_timeout,
            ssd,
            catalog,
            epoch: Arc::default(),
            freed_applied: Arc::default(),
            disk_unregistered: Arc::default(),
            registrations: Arc::default(),
            unmounting: Arc::default(),
            credential,
            seals: auth.map(|a| a.seals.clone()),
        })
    }

    /// What this owner proves to its peers.
    pub fn credential(&self) -> Option<&Credential> {
        self.credential.as_ref()
    }

    /// This owner's seal on its own read of a replica held by another owner, good for `life`
    /// (none in a cluster without a secret).
    pub fn seal_read(&self, scope: &Scope<'_>, life: std::time::Duration) -> Seal {
        self.seals.as_ref().map_or_else(Seal::default, |k| {
            k.seal(
                scope,
                wall_clock_us().saturating_add(life.as_micros() as u64),
            )
        })
    }

    /// A call to the master at `addr` got no answer: with etcd, the leader is looked up again.
    fn unreachable(&self, addr: &str, message: impl ToString) -> LinkError {
        self.target.forget(addr);
        LinkError::Unreachable {
            master: addr.to_string(),
            message: message.to_string(),
        }
    }

    /// Runs one call on the current master under the RPC deadline (plus `extra`, for long polls).
    async fn call<T, F, Fut>(&self, extra: Duration, f: F) -> Result<T, LinkError>
    where
        F: FnOnce(MasterClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_within(self.rpc_timeout + extra, f).await
    }

    /// Runs one call on the current master, giving up after `after`.
    async fn call_within<T, F, Fut>(&self, after: Duration, f: F) -> Result<T, LinkError>
    where
        F: FnOnce(MasterClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let (addr, client) = self.target.client().await?;
        tokio::time::timeout(after, f(client))
            .await
            .map_err(|_| self.unreachable(&addr, format!("no answer within {after:?}")))?
            .map(|r| r.into_inner())
            .map_err(|s| self.status_error(&addr, &s))
    }

    /// What an error status from the master at `addr` means: a refusal a retry does not change
    /// (bad credentials, a bad request), or a master gone, deposed or too slow, which the link
    /// forgets so that the next call looks for the leader again.
    fn status_error(&self, addr: &str, s: &tonic::Status) -> LinkError {
        let refusal = |code| LinkError::Status {
            master: addr.to_string(),
            code,
            message: s.message().to_string(),
        };
        match s.code() {
            tonic::Code::PermissionDenied => refusal(Code::PermissionDenied),
            tonic::Code::Unauthenticated => refusal(Code::Unauthenticated),
            tonic::Code::InvalidArgument => refusal(Code::InvalidParams),
            // The master's word on this segment (not mounted, another owner's, no SSD tier): a
            // leader that answered, not one to look for again.
            tonic::Code::FailedPrecondition => refusal(Code::SegmentNotFound),
            _ if mooncake_common::auth::refused_proof(s) => refusal(Code::Unauthenticated),
            _ => self.unreachable(addr, format!("{}: {}", s.code(), s.message())),
        }
    }

    /// Mounts the segment and reports what the pool holds (a remount after the master lost
    /// its catalog); the segment takes allocations once the report is in.
    pub async fn mount(&self) -> Result<(), LinkError> {
        if self.unmounting.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(LinkError::Refused {
                master: self.target.given().to_string(),
                segment: self.segment.clone(),
                code: Code::InvalidParams,
                message: "this owner is stopping: it unmounted".into(),
            });
        }
        // Mounted nowhere until the whole mount (and its report) is in: should any step fail
        // after the master took the mount, the next heartbeat finds another epoch than this
        // one and mounts again, instead of leaving the segment half-reported for good.
        self.epoch.store(0, std::sync::atomic::Ordering::SeqCst);
        // Taken before the mount, so every entry is older than what the master grants after it.
        let entries = self.catalog.snapshot();
        let req = pb::MountSegmentRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            size: self.size,
            disk_capacity: self.ssd.as_ref().map_or(0, |s| s.stats().capacity),
            newest_grant: self.catalog.newest_grant(),
            catalog_objects: entries.len() as u64,
            disk_records: self.ssd.as_ref().map_or(0, |s| s.stats().records),
        };
        let resp = self
            .call(
                Duration::ZERO,
                |mut c| async move { c.mount_segment(req).await },
            )
            .await?;
        if resp.code != 0 {
            return Err(LinkError::Refused {
                master: self.target.given().to_string(),
                segment: self.segment.clone(),
                code: Code::from_i32(resp.code),
                message: resp.message,
            });
        }
        if resp.report_catalog {
            self.report_catalog(&entries).await?;
        }
        // Notes are numbered per master: none of this one's was applied yet.
        self.freed_applied
            .store(0, std::sync::atomic::Ordering::SeqCst);
        self.epoch
            .store(resp.epoch, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Streams the pool's catalog to the master in chunks; the last one closes the report.
    async fn report_catalog(
        &self,
        entries: &[(u64, crate::catalog::Entry)],
    ) -> Result<(), LinkError> {
        let started = Instant::now();
        let chunks: Vec<_> = entries.chunks(REPORT_CHUNK).collect();
        let mut outcome = pb::ReportCatalogResponse::default();
        for (i, chunk) in chunks.iter().enumerate() {
            let req = pb::ReportCatalogRequest {
                client_id: self.owner.to_string(),
                segment: self.segment.to_string(),
                items: chunk
                    .iter()
                    .map(|(offset, e)| pb::CatalogObject {
                        key: e.key.to_string(),
                        offset: *offset,
                        size: e.len,
                        put_id: e.stamp.put_id,
                        flags: e.stamp.flags() as u32,
                    })
                    .collect(),
                done: i + 1 == chunks.len(),
            };
            outcome = self
                .call(Duration::ZERO, |mut c| async move {
                    c.report_catalog(req).await
                })
                .await?;
            if outcome.code != 0 {
                return Err(LinkError::Refused {
                    master: self.target.given().to_string(),
                    segment: self.segment.clone(),
                    code: Code::from_i32(outcome.code),
                    message: outcome.message,
                });
            }
        }
        tracing::info!(segment = %self.segment, objects = entries.len(), registered = outcome.registered,
            refused = outcome.refused, took = ?started.elapsed(), "catalog reported to the master");
        Ok(())
    }

    /// Mounts, retrying errors that may pass (an unreachable master) until `deadline`; a
    /// definite refusal is final.
    pub async fn mount_until(&self, deadline: Duration) -> Result<(), LinkError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.mount().await {
                Ok(()) => return Ok(()),
                Err(e) if e.code().is_retryable() && start.elapsed() + backoff < deadline => {
                    tracing::warn!(error = %e, "mount failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A heartbeat; says whether the master asked for a remount, or has more freed-range notes
    /// waiting. A heartbeat gives up after `patience` (shorter than other calls): a master that
    /// cannot answer one soon is treated as gone, so the link looks for the leader again
    /// instead of waiting on a paused one.
    pub async fn heartbeat(&self, patience: Duration) -> Result<Beat, LinkError> {
        let req = pb::HeartbeatRequest {
            client_id: self.owner.to_string(),
            disk: self.ssd.as_ref().map(|s| s.stats().into()),
            freed_applied: self.freed_applied.load(std::sync::atomic::Ordering::SeqCst),
            freed_epoch: self.epoch(),
        };
        let resp = self
            .call_within(patience.min(self.rpc_timeout), |mut c| async move {
                c.heartbeat(req).await
            })
            .await?;
        // Another master answered than the one this owner mounted at (it restarted or the
        // leader changed): mount there. Otherwise forget what that master says is gone.
        let other = resp.remount || resp.epoch != self.epoch();
        if !other {
            for f in &resp.freed {
                // 0: a master that does not send the bound; any grant of that version goes.
                let before = Some(f.granted_before)
                    .filter(|b| *b != 0)
                    .unwrap_or(u64::MAX);
                self.catalog.forget_version(f.offset, f.put_id, before);
            }
            // Applied: the next heartbeat says so (until it does, the master keeps them).
            if let Some(last) = resp.freed.iter().map(|f| f.seq).max() {
                self.freed_applied
                    .fetch_max(last, std::sync::atomic::Ordering::SeqCst);
            }
        }
        Ok(Beat {
            remount: other,
            more_freed: !other && resp.more_freed,
        })
    }

    /// No mount starts from now on (see `unmount`): a shutdown says so before it waits for
    /// the work under way, so that no remount lands after its unmount.
    pub fn stop_mounting(&self) {
        self.unmounting
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub async fn unmount(&self) -> Result<(), LinkError> {
        self.stop_mounting();
        let req = pb::UnmountSegmentRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
        };
        self.call(Duration::ZERO, |mut c| async move {
            c.unmount_segment(req).await
        })
        .await?;
        Ok(())
    }

    /// Waits up to `wait` for SSD-tier work.
    pub async fn poll_tasks(
        &self,
        max_tasks: u32,
        wait: Duration,
    ) -> Result<pb::PollTasksResponse, LinkError> {
        let req = pb::PollTasksRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            max_tasks,
            wait_ms: wait.as_millis() as u64,
            epoch: self.epoch(),
        };
        self.call(wait, |mut c| async move { c.poll_tasks(req).await })
            .await
    }

    /// Reports finished tasks; returns the master's code for each.
    pub async fn report_tasks(&self, results: Vec<pb::TaskResult>) -> Result<Vec<i32>, LinkError> {
        let req = pb::ReportTasksRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            results,
        };
        Ok(self
            .call(
                Duration::ZERO,
                |mut c| async move { c.report_tasks(req).await },
            )
            .await?
            .codes)
    }

    /// Tells the master these disk records are about to be overwritten.
    pub async fn disk_dropped<'k>(
        &self,
        records: impl IntoIterator<Item = (&'k ObjectKey, u64)>,
    ) -> Result<(), LinkError> {
        let items = records
            .into_iter()
            .map(|(key, put_id)| pb::PutRef {
                key: key.to_string(),
                put_id,
            })
            .collect();
        let req = pb::DiskDroppedRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            items,
        };
        self.call(
            Duration::ZERO,
            |mut c| async move { c.disk_dropped(req).await },
        )
        .await
        .map(|_| ())
    }

    /// Registers records found on disk (`done`: the last of them); the master answers a code
    /// and a version for each.
    pub async fn register_disk(
        &self,
        items: Vec<pb::DiskObject>,
        done: bool,
    ) -> Result<pb::RegisterDiskResponse, LinkError> {
        let req = pb::RegisterDiskRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            items,
            done,
        };
        self.call(
            Duration::ZERO,
            |mut c| async move { c.register_disk(req).await },
        )
        .await
    }

    /// Registers every record on disk at the master (after a mount); records the master refuses
    /// (the key exists with other bytes) are dropped, the others take the version it assigns.
    /// The last call says it is the last (a call with no records when there are none), so a
    /// rebuilding master stops waiting for them. A failure leaves the registration to the next
    /// heartbeat (`heartbeat_loop`): the records would stay unreadable until then.
    pub async fn register_ssd_records(&self, store: &SsdStore) {
        self.registrations
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.disk_unregistered
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let records = store.records();
        let mut registered = 0usize;
        let mut refused = 0usize;
        let mut gone = Vec::new();
        let chunks: Vec<_> = records.chunks(1024).collect();
        let last = chunks.len().saturating_sub(1);
        for i in 0..=last {
            let chunk = chunks.get(i).copied().unwrap_or_default();
            let items = chunk
                .iter()
                .map(|r| pb::DiskObject {
                    key: r.key.to_string(),
                    size: r.value_len,
                    put_id: r.put_id,
                })
                .collect();
            let resp = match self.register_disk(items, i == last).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "registering ssd records failed; trying again at the next heartbeat");
                    return;
                }
            };
            // Records an offload took since the snapshot: its word to the master may have come
            // before this registration (and changed nothing), so the master hears it again.
            // (One it is about to take is told again by the offload, see `registrations`.)
            let mut taken = Vec::new();
            for ((r, code), put_id) in chunk.iter().zip(resp.codes).zip(resp.put_ids) {
                if code == 0 {
                    if put_id != r.put_id {
                        tracing::warn!(key = %r.key, "master registered a record under another version");
                    }
                    if !store.keeps(&r.key, r.put_id) {
                        taken.push((&r.key, r.put_id));
                    }
                    registered += 1;
                } else {
                    // The key exists with other bytes, or this version was removed: drop it.
                    // Once its header is gone, the master hears so (and forgets the removal it
                    // kept refusing it for); a header left behind is refused again next time.
                    if let Ok(Dropped::Gone | Dropped::NotFound) =
                        store.delete(&r.key, r.put_id, None).await
                    {
                        gone.push((r.key.clone(), r.put_id));
                    }
                    refused += 1;
                }
            }
            if !taken.is_empty() {
                if let Err(e) = self.disk_dropped(taken.iter().copied()).await {
                    tracing::warn!(error = %e, records = taken.len(), "cannot tell the master which registered records an offload took meanwhile; it learns so at the first read of each (reported lost)");
                }
            }
        }
        if !gone.is_empty() {
            if let Err(e) = self.disk_dropped(gone.iter().map(|(k, p)| (k, *p))).await {
                tracing::debug!(error = %e, records = gone.len(), "cannot tell the master which refused records are gone; it refuses them again if they come back");
            }
        }
        self.disk_unregistered
            .store(false, std::sync::atomic::Ordering::SeqCst);
        if !records.is_empty() {
            tracing::info!(registered, refused, "ssd records registered at the master");
        }
    }

    /// How many registrations of the records have begun, and whether one is under way: an
    /// offload that told the master about records it takes tells it again after taking them
    /// if a registration began since, or is under way (it may have registered them after the
    /// first word, which then changed nothing).
    pub fn registrations(&self) -> (u64, bool) {
        (
            self.registrations.load(std::sync::atomic::Ordering::SeqCst),
            self.disk_unregistered
                .load(std::sync::atomic::Ordering::SeqCst),
        )
    }

    /// The epoch of the master this owner is mounted at (0: none yet).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Heartbeats every `interval` until `stop`, and again at once while the master has more
    /// freed-range notes than one answer carries; remounts when the master asks for it.
    pub async fn heartbeat_loop(self, interval: Duration, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut again = false;
        // Heartbeats that only fetch more notes come a tenth of the interval apart (50 ms at
        // least): a backlog drains in round trips, and a steady flood of frees costs the master
        // and this owner a bounded share of their time instead of back-to-back answers.
        let pause = (interval / 10).max(Duration::from_millis(50));
        loop {
            if !again {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.changed() => return,
                }
            } else {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.changed() => return,
                }
            }
            again = false;
            // Two intervals, at least half a second.
            let patience = (interval * 2).max(Duration::from_millis(500));
            match self.heartbeat(patience).await {
                Ok(Beat {
                    remount: false,
                    more_freed,
                }) => {
                    again = more_freed;
                    let unregistered = self
                        .disk_unregistered
                        .load(std::sync::atomic::Ordering::SeqCst);
                    if let (true, Some(ssd)) = (unregistered, &self.ssd) {
                        self.register_ssd_records(ssd).await;
                    }
                }
                Ok(_) if self.unmounting.load(std::sync::atomic::Ordering::SeqCst) => {}
                Ok(_) => {
                    tracing::warn!(segment = %self.segment, "master does not know this owner; mounting again");
                    match self.mount().await {
                        Ok(()) => {
                            if let Some(ssd) = &self.ssd {
                                self.register_ssd_records(ssd).await;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "remount failed; will retry"),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refusal_about_the_segment_is_the_masters_word_not_an_unreachable_master() {
        let link = MasterLink::new(
            "127.0.0.1:9",
            "c",
            ClientId::from_u128(1),
            SegmentName::parse("127.0.0.1:10").unwrap(),
            1 << 20,
            Duration::from_secs(1),
            None,
            Arc::default(),
            None,
            None,
        )
        .unwrap();
        let refused = link.status_error(
            "127.0.0.1:9",
            &tonic::Status::failed_precondition("segment 127.0.0.1:10 is not mounted"),
        );
        assert!(matches!(refused, LinkError::Status { .. }), "{refused}");
        assert_eq!(refused.code(), Code::SegmentNotFound);
        let gone = link.status_error("127.0.0.1:9", &tonic::Status::unavailable("down"));
        assert!(matches!(gone, LinkError::Unreachable { .. }), "{gone}");
    }
}
