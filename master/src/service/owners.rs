//! The owners' side of the service: mounting segments, heartbeats, and the SSD tier's work
//! queue (a long poll for tasks, reports of their outcome, disk records about to disappear, and
//! records found on disk after a restart). The poll waits on a notification, never while
//! holding the lock.

use std::time::Duration;

use mooncake_common::{ClientId, DiskStats, ObjectKey, SegmentName};

use super::MasterService;
use crate::{
    core::{
        Freed, HeartbeatReply, MountReport, Mounted, OwnerTask, ReportOutcome, Reported, TaskKind,
    },
    error::MasterError,
    metrics::Op,
};

/// The longest an owner's poll is held open.
const MAX_POLL_WAIT: Duration = Duration::from_secs(5);
/// The most tasks one poll hands out.
const MAX_POLL_TASKS: usize = 1024;

/// What a poll found: tasks, or that the owner must mount again.
#[derive(Debug, Default)]
pub struct Polled {
    pub tasks: Vec<OwnerTask>,
    /// The master does not know the segment (it restarted, or the owner expired).
    pub remount: bool,
}

/// One task's outcome as an owner reports it.
#[derive(Debug, Clone, Copy)]
pub struct TaskReport<'a> {
    pub kind: TaskKind,
    pub key: &'a str,
    pub put_id: u64,
    pub done: bool,
    /// Copy: its replica task, and why it failed.
    pub task_id: u64,
    pub message: &'a str,
    /// The task's offset (Promote: the memory range it wrote).
    pub offset: u64,
}

impl MasterService {
    pub fn mount_segment(
        &self,
        owner: ClientId,
        segment: SegmentName,
        size: u64,
        disk_capacity: u64,
        report: MountReport,
    ) -> Result<Mounted, MasterError> {
        let now = self.shared.clock.now();
        let res = self.shared.state.lock().mount_segment(
            owner,
            segment,
            size,
            disk_capacity,
            report,
            now,
        );
        self.shared
            .metrics
            .record(Op::MountSegment, 1, res.is_err() as usize);
        res
    }

    pub fn unmount_segment(
        &self,
        owner: ClientId,
        segment: &SegmentName,
    ) -> Result<(), MasterError> {
        let res = self.shared.state.lock().unmount_segment(owner, segment);
        self.shared
            .metrics
            .record(Op::UnmountSegment, 1, res.is_err() as usize);
        res
    }

    /// Records that `owner` is alive (and its SSD tier's state, if it has one); returns the
    /// ranges it should forget, whose objects are gone, past the notes it says it applied:
    /// `applied` is (epoch, largest note), and counts only if the epoch is this master's. The
    /// flag: more notes wait than these (it should heartbeat again at once).
    pub fn heartbeat(
        &self,
        owner: ClientId,
        disk: Option<DiskStats>,
        applied: (u64, u64),
    ) -> (HeartbeatReply, Vec<Freed>, bool) {
        let now = self.shared.clock.now();
        let reply = {
            let mut state = self.shared.state.lock();
            let reply = state.heartbeat(owner, now);
            if let Some(d) = disk {
                state.set_disk_stats(owner, d);
            }
            let applied = if applied.0 == state.epoch() {
                applied.1
            } else {
                0
            };
            let notes = state.freed_notes(owner, applied);
            let more = state.freed_waiting(owner) > notes.len();
            (reply, notes, more)
        };
        self.shared.metrics.record(Op::Heartbeat, 1, 0);
        reply
    }

    /// Waits up to `wait` (at most 5 s) for SSD-tier work for the segment and takes up to `max`
    /// tasks (at most 1024). None for an owner mounted under another epoch (`mounted`; 0: not
    /// mounted yet): it would refuse them, and they would wait out their timeouts here.
    pub async fn poll_tasks(
        &self,
        owner: ClientId,
        segment: &SegmentName,
        mounted: u64,
        max: usize,
        wait: Duration,
    ) -> Polled {
        let max = max.clamp(1, MAX_POLL_TASKS);
        let deadline = tokio::time::Instant::now() + wait.min(MAX_POLL_WAIT);
        loop {
            let work = self.shared.owner_work.notified();
            tokio::pin!(work);
            work.as_mut().enable();
            let nothing = |remount| Polled {
                tasks: Vec::new(),
                remount,
            };
            let tasks = {
                let mut state = self.shared.state.lock();
                let Ok(id) = state.owned_segment(owner, segment) else {
                    return nothing(true);
                };
                let now = self.shared.clock.now();
                state.touch(owner, now);
                // A long poll may outlive the term it began in: a deposed leader hands out
                // nothing, and neither does a stopping server.
                let stopping = self
                    .shared
                    .stopping
                    .load(std::sync::atomic::Ordering::SeqCst);
                if !self.leading() || stopping || mounted != state.epoch() {
                    return nothing(false);
                }
                state.take_tasks(id, max, now)
            };
            if !tasks.is_empty() || tokio::time::timeout_at(deadline, work).await.is_err() {
                return Polled {
                    tasks,
                    remount: false,
                };
            }
        }
    }

    /// Takes the outcomes of tasks; per report, whether the master still wants what was done
    /// (an error: the owner drops what it wrote). The outer error: the segment is not the
    /// owner's.
    pub fn report_tasks(
        &self,
        owner: ClientId,
        segment: &SegmentName,
        reports: &[TaskReport<'_>],
    ) -> Result<Vec<Result<(), MasterError>>, MasterError> {
        let now = self.shared.clock.now();
        let results = {
            // The segment is looked up under the same lock as the reports land: an unmount in
            // between would leave them naming a segment that is gone.
            let mut state = self.shared.state.lock();
            let id = state.owned_segment(owner, segment)?;
            let results: Vec<Result<(), MasterError>> = reports
                .iter()
                .map(|t| {
                    ObjectKey::new(t.key)
                        .map_err(MasterError::from)
                        .and_then(|k| match t.kind {
                            TaskKind::Copy => {
                                let failure = (!t.done).then_some(t.message);
                                state.report_copy(
                                    id, t.task_id, &k, t.put_id, t.offset, failure, now,
                                )
                            }
                            TaskKind::Promote => {
                                state.report_promotion(id, &k, t.put_id, t.offset, t.done)
                            }
                            kind => state.report_task(id, kind, &k, t.put_id, t.done, now),
                        })
                })
                .collect();
            self.shared.wake_owners(&mut state);
            results
        };
        let failed = reports
            .iter()
            .zip(&results)
            .filter(|(t, r)| !t.done || r.is_err())
            .count();
        self.shared
            .metrics
            .record(Op::ReportTasks, results.len(), failed);
        self.shared.offload_progress.notify_waiters();
        Ok(results)
    }

    /// Disk records of (key, version) the owner is about to lose.
    pub fn disk_dropped(
        &self,
        owner: ClientId,
        segment: &SegmentName,
        records: &[(&str, u64)],
    ) -> Result<(), MasterError> {
        let now = self.shared.clock.now();
        let mut state = self.shared.state.lock();
        let id = state.disk_segment(owner, segment)?;
        for &(key, put_id) in records {
            if let Ok(k) = ObjectKey::new(key) {
                state.disk_dropped(id, &k, put_id, now);
            }
        }
        self.shared.wake_owners(&mut state);
        self.shared
            .metrics
            .record(Op::DiskDropped, records.len(), 0);
        Ok(())
    }

    /// Records of (key, size, version) found on disk after a restart; per record its version as
    /// registered, or why not (OBJECT_ALREADY_EXISTS: the owner drops its stale record).
    pub fn register_disk(
        &self,
        owner: ClientId,
        segment: &SegmentName,
        records: &[(&str, u64, u64)],
        done: bool,
    ) -> Result<Vec<Result<u64, MasterError>>, MasterError> {
        let now = self.shared.clock.now();
        let mut state = self.shared.state.lock();
        let id = state.disk_segment(owner, segment)?;
        state.touch(owner, now);
        let registered: Vec<_> = records
            .iter()
            .map(|&(key, size, put_id)| {
                ObjectKey::new(key)
                    .map_err(MasterError::from)
                    .and_then(|k| state.register_disk(id, &k, size, put_id, now))
            })
            .collect();
        let refused = registered.iter().filter(|r| r.is_err()).count();
        self.shared
            .metrics
            .record(Op::RegisterDisk, registered.len(), refused);
        if done {
            state.disk_registered(id);
        }
        // An older version replaced may have left work for its owners (drops).
        self.shared.wake_owners(&mut state);
        Ok(registered)
    }

    /// A chunk of the catalog an owner reports after mounting; the last (`done`) merges it.
    pub fn report_catalog(
        &self,
        owner: ClientId,
        segment: &SegmentName,
        items: Vec<Reported>,
        done: bool,
    ) -> Result<Option<ReportOutcome>, MasterError> {
        let now = self.shared.clock.now();
        let n = items.len();
        let res = self
            .shared
            .state
            .lock()
            .catalog_reported(owner, segment, items, done, now);
        self.shared.metrics.record(
            Op::ReportCatalog,
            n.max(1),
            if res.is_err() { n.max(1) } else { 0 },
        );
        res
    }

    /// This master's epoch (see `MasterState::epoch`).
    pub fn epoch(&self) -> u64 {
        self.shared.state.lock().epoch()
    }
}
