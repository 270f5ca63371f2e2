//! Replica tasks (Mooncake's copy and move tasks): a copy reserves room for the object on each
//! target segment and queues work for the target's owner, which reads the bytes from a current
//! replica and writes them under a fresh grant; the master adds the replica when the owner
//! reports it. A move is a copy to one target that then drops the source's memory replica.
//! The object stays readable throughout: its existing replicas are untouched until the copy is
//! in place. Every report is checked against the object's current version, so a copy of a
//! version that was removed or rewritten meanwhile is thrown away, never served.

use std::collections::{BTreeSet, HashMap, VecDeque};

use mooncake_common::{
    master_api::{ReplicaTaskStatus, ReplicaTaskType},
    ObjectKey, SegmentName, Tier,
};

use super::{
    allocator::Allocation,
    objects::Replica,
    tiers::{CopyFrom, OwnerTask, TaskKind},
    MasterState, SegmentId,
};
use crate::{clock::Millis, error::MasterError};

/// Finished tasks remembered for `query_task`, at most (the oldest are forgotten first).
const MAX_FINISHED: usize = 1 << 14;

/// A task as `query_task` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    pub id: u64,
    /// The object it copies or moves (stored form: its tenant's prefix included).
    pub key: ObjectKey,
    pub kind: ReplicaTaskType,
    pub status: ReplicaTaskStatus,
    pub created: Millis,
    pub updated: Millis,
    /// The segments whose owners do the copies.
    pub assigned: Vec<SegmentName>,
    /// Why it failed, or what is left.
    pub detail: String,
}

/// What a task is asked to do.
pub enum TaskRequest<'a> {
    Copy {
        targets: &'a [SegmentName],
    },
    Move {
        source: &'a SegmentName,
        target: &'a SegmentName,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Queued,
    Taken,
    Done,
    Failed,
}

struct Target {
    segment: SegmentId,
    name: SegmentName,
    /// The room reserved for the copy, until it becomes a replica or is given back.
    allocation: Option<Allocation>,
    step: Step,
}

struct ReplicaTask {
    kind: ReplicaTaskType,
    key: ObjectKey,
    put_id: u64,
    /// A move's source segment.
    source: Option<SegmentId>,
    targets: Vec<Target>,
    created: Millis,
    updated: Millis,
    failures: Vec<String>,
    finished: bool,
}

impl ReplicaTask {
    fn status(&self) -> ReplicaTaskStatus {
        if !self.finished {
            if self.targets.iter().any(|t| t.step != Step::Queued) {
                ReplicaTaskStatus::Processing
            } else {
                ReplicaTaskStatus::Pending
            }
        } else if self.failures.is_empty() {
            ReplicaTaskStatus::Success
        } else {
            ReplicaTaskStatus::Failed
        }
    }
}

/// The tasks under way and the recently finished ones.
#[derive(Default)]
pub(super) struct ReplicaTasks {
    tasks: HashMap<u64, ReplicaTask>,
    finished_order: VecDeque<u64>,
    /// The tasks not finished, by (creation, id): what expiry and a new task's checks look
    /// at, instead of every task remembered.
    open: BTreeSet<(Millis, u64)>,
    /// The open tasks' ids by key: a new task's check of copies under way looks at its key's
    /// alone (every open task per target made a batch of tasks quadratic).
    open_by_key: HashMap<ObjectKey, Vec<u64>>,
}

impl ReplicaTasks {
    /// The tasks not finished.
    fn open(&self) -> impl Iterator<Item = (u64, &ReplicaTask)> {
        self.open.iter().map(|&(_, id)| (id, &self.tasks[&id]))
    }

    /// The tasks of `key` not finished.
    fn open_of(&self, key: &ObjectKey) -> impl Iterator<Item = &ReplicaTask> {
        self.open_by_key
            .get(key)
            .into_iter()
            .flatten()
            .map(|id| &self.tasks[id])
    }

    fn opened(&mut self, id: u64, key: &ObjectKey, now: Millis) {
        self.open.insert((now, id));
        self.open_by_key.entry(key.clone()).or_default().push(id);
    }

    fn closed(&mut self, id: u64, key: &ObjectKey, created: Millis) {
        self.open.remove(&(created, id));
        if let Some(ids) = self.open_by_key.get_mut(key) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.open_by_key.remove(key);
            }
        }
    }

    /// Whether `open` lists exactly the tasks not finished, for the invariant check.
    pub fn check_open(&self) -> Result<(), String> {
        let unfinished: BTreeSet<(Millis, u64)> = (self.tasks.iter())
            .filter(|(_, t)| !t.finished)
            .map(|(id, t)| (t.created, *id))
            .collect();
        if unfinished != self.open {
            return Err(format!(
                "open replica tasks {:?}, unfinished ones {unfinished:?}",
                self.open
            ));
        }
        let by_key: usize = self.open_by_key.values().map(Vec::len).sum();
        let listed = self.open_by_key.iter().all(|(k, ids)| {
            ids.iter()
                .all(|id| self.tasks[id].key == *k && !self.tasks[id].finished)
        });
        if by_key != self.open.len() || !listed {
            return Err(format!(
                "open replica tasks by key ({by_key}) do not match the open ones ({})",
                self.open.len()
            ));
        }
        Ok(())
    }

    /// The reserved ranges of copies under way, for the invariant check.
    pub fn reserved(&self) -> impl Iterator<Item = (SegmentId, &Allocation)> {
        self.tasks.values().flat_map(|t| {
            t.targets
                .iter()
                .filter_map(|x| x.allocation.as_ref().map(|a| (x.segment, a)))
        })
    }

    /// A copy task was handed to the owner of `segment`.
    pub fn taken(&mut self, id: u64, segment: SegmentId, now: Millis) {
        if let Some(t) = self.tasks.get_mut(&id) {
            for x in t.targets.iter_mut().filter(|x| x.segment == segment) {
                if x.step == Step::Queued {
                    x.step = Step::Taken;
                    t.updated = now;
                }
            }
        }
    }
}

impl MasterState {
    /// Starts a copy or move of `key`'s current version; answers the task id.
    pub fn create_replica_task(
        &mut self,
        key: &ObjectKey,
        request: TaskRequest<'_>,
        now: Millis,
    ) -> Result<u64, MasterError> {
        let (kind, names, source_name): (_, &[SegmentName], _) = match request {
            TaskRequest::Copy { targets } => (ReplicaTaskType::Copy, targets, None),
            TaskRequest::Move { source, target } => (
                ReplicaTaskType::Move,
                std::slice::from_ref(target),
                Some(source),
            ),
        };
        if names.is_empty() {
            return Err(MasterError::Invalid(
                "a copy needs at least one target".into(),
            ));
        }
        let mut targets: Vec<SegmentId> = Vec::with_capacity(names.len());
        for name in names {
            let id = self
                .segment_id(name)
                .ok_or_else(|| MasterError::SegmentNotFound(name.clone()))?;
            if targets.contains(&id) {
                return Err(MasterError::Invalid(format!(
                    "target {name} is named twice"
                )));
            }
            targets.push(id);
        }
        let obj = self
            .objects
            .get(key)
            .filter(|o| o.phase.is_complete())
            .ok_or_else(|| MasterError::NotFound(key.clone()))?;
        let (size, put_id) = (obj.size, obj.put_id);
        let source = match source_name {
            Some(name) => {
                let id = self
                    .segment_id(name)
                    .ok_or_else(|| MasterError::SegmentNotFound(name.clone()))?;
                if targets[0] == id {
                    return Err(MasterError::Invalid(format!(
                        "a move from {name} onto itself"
                    )));
                }
                if !obj.replicas.iter().any(|r| r.segment == id) {
                    return Err(MasterError::Invalid(format!(
                        "{key} has no memory replica on {name} to move"
                    )));
                }
                Some(id)
            }
            None => None,
        };
        // Where the owners read from: a memory replica (the move's source when it is one), or
        // a disk copy.
        let from = match source {
            Some(id) => obj.replicas.iter().find(|r| r.segment == id),
            None => obj.replicas.first(),
        }
        .map(|r| CopyFrom {
            segment: self.segments[&r.segment].name.clone(),
            offset: r.allocation.offset(),
            tier: Tier::Memory,
        })
        .or_else(|| {
            obj.disk().first().map(|d| CopyFrom {
                segment: self.segments[d].name.clone(),
                offset: 0,
                tier: Tier::Disk,
            })
        })
        .ok_or_else(|| MasterError::NotFound(key.clone()))?;
        let held: Vec<SegmentId> = obj.replicas.iter().map(|r| r.segment).collect();
        for (&id, name) in targets.iter().zip(names) {
            let under_way = self.replica_tasks.open_of(key).any(|t| {
                t.targets
                    .iter()
                    .any(|x| x.segment == id && x.allocation.is_some())
            });
            if under_way {
                return Err(MasterError::Invalid(format!(
                    "a copy of {key} to {name} is under way"
                )));
            }
            if self.segments[&id].report.is_some() {
                return Err(MasterError::Busy(format!(
                    "segment {name} is reporting its catalog; retry shortly"
                )));
            }
        }
        let needed = targets.iter().filter(|id| !held.contains(id)).count() as u64;
        if self.grants.next.saturating_add(needed + 1) > self.grants.ceiling {
            return Err(MasterError::GrantsExhausted);
        }
        // Room on every target first, so a task is all or nothing.
        let mut reserved: Vec<Target> = Vec::with_capacity(targets.len());
        for (&id, name) in targets.iter().zip(names) {
            if held.contains(&id) {
                reserved.push(Target {
                    segment: id,
                    name: name.clone(),
                    allocation: None,
                    step: Step::Done,
                });
                continue;
            }
            let seg = self.segments.get_mut(&id).expect("resolved above");
            match seg.allocator.allocate(size) {
                Some(allocation) => reserved.push(Target {
                    segment: id,
                    name: name.clone(),
                    allocation: Some(allocation),
                    step: Step::Queued,
                }),
                None => {
                    for t in reserved {
                        if let Some(a) = t.allocation {
                            self.free_replicas([Replica {
                                segment: t.segment,
                                allocation: a,
                            }]);
                        }
                    }
                    tracing::info!(%key, segment = %name, size, "no room for a replica task's copy");
                    return Err(MasterError::NoSpace { size });
                }
            }
        }
        let id = self.grants.next().expect("reserved above");
        for t in &reserved {
            let Some(a) = &t.allocation else { continue };
            let grant = self.grants.next().expect("reserved above");
            self.queue_task(
                t.segment,
                OwnerTask {
                    kind: TaskKind::Copy,
                    key: key.clone(),
                    put_id,
                    offset: a.offset(),
                    size,
                    grant,
                    task_id: id,
                    copy_from: Some(from.clone()),
                },
            );
        }
        let task = ReplicaTask {
            kind,
            key: key.clone(),
            put_id,
            source,
            targets: reserved,
            created: now,
            updated: now,
            failures: Vec::new(),
            finished: false,
        };
        tracing::info!(task = id, %key, ?kind, targets = task.targets.len(), "replica task created");
        self.replica_tasks.tasks.insert(id, task);
        self.replica_tasks.opened(id, key, now);
        self.settle_task(id, now);
        Ok(id)
    }

    pub fn query_task(&self, id: u64) -> Option<TaskInfo> {
        let t = self.replica_tasks.tasks.get(&id)?;
        let detail = if !t.failures.is_empty() {
            t.failures.join("; ")
        } else if t.finished {
            String::new()
        } else {
            let left = t
                .targets
                .iter()
                .filter(|x| matches!(x.step, Step::Queued | Step::Taken))
                .count();
            format!("{left} of {} copies under way", t.targets.len())
        };
        Some(TaskInfo {
            id,
            key: t.key.clone(),
            kind: t.kind,
            status: t.status(),
            created: t.created,
            updated: t.updated,
            assigned: t.targets.iter().map(|x| x.name.clone()).collect(),
            detail,
        })
    }

    /// The owner of `segment` reports its copy for task `id` into the range at `offset`. An
    /// error answer means the master does not want the copy (the object went or changed): the
    /// owner forgets it.
    #[allow(clippy::too_many_arguments)]
    pub fn report_copy(
        &mut self,
        segment: SegmentId,
        id: u64,
        key: &ObjectKey,
        put_id: u64,
        offset: u64,
        failure: Option<&str>,
        now: Millis,
    ) -> Result<(), MasterError> {
        let stale = || MasterError::StalePut {
            key: key.clone(),
            put_id,
        };
        // A task this master does not know (one of an earlier master, reported late) whose
        // copy this master adopted from the owner's report when it mounted: the owner keeps it.
        let unknown = |s: &Self| {
            if failure.is_none() && s.lists_replica(key, put_id, segment, offset) {
                Ok(())
            } else {
                Err(stale())
            }
        };
        let Some(task) = self.replica_tasks.tasks.get_mut(&id) else {
            return unknown(self);
        };
        if &task.key != key || task.put_id != put_id {
            return unknown(self);
        }
        let Some(at) = task
            .targets
            .iter()
            .position(|x| x.segment == segment && matches!(x.step, Step::Queued | Step::Taken))
        else {
            return unknown(self);
        };
        let target = &mut task.targets[at];
        let allocation = target.allocation.take().expect("a copy under way has room");
        let name = target.name.clone();
        task.updated = now;
        let replica = Replica {
            segment,
            allocation,
        };
        let current = self.objects.get_mut(key).filter(|o| {
            o.put_id == put_id
                && o.phase.is_complete()
                && !o.replicas.iter().any(|r| r.segment == segment)
        });
        let (step, note, outcome) = match (failure, current) {
            (None, Some(obj)) => {
                obj.replicas.push(replica);
                self.objects.link(key);
                // A disk-only object in memory again is something eviction can take.
                self.evictable_changed();
                (Step::Done, None, Ok(()))
            }
            (None, None) => {
                // The owner is done with the range: it goes back at once, and the owner is told
                // to forget the copy also by a note (should this answer be lost).
                self.drop_replicas([replica], put_id);
                let why = format!("{key} was removed or rewritten while it was copied to {name}");
                (Step::Failed, Some(why), Err(stale()))
            }
            (Some(why), _) => {
                self.free_replicas([replica]);
                (
                    Step::Failed,
                    Some(format!("copy to {name} failed: {why}")),
                    Ok(()),
                )
            }
        };
        let task = self.replica_tasks.tasks.get_mut(&id).expect("found above");
        task.targets[at].step = step;
        task.failures.extend(note);
        self.settle_task(id, now);
        outcome
    }

    /// Copies not reported within the offload timeout fail. Those their owner took wait out
    /// the longest a writer may take before their room is free (the owner may still be
    /// writing); those it never took leave its queue, their room free at once.
    pub(super) fn expire_replica_tasks(&mut self, now: Millis) {
        let timeout = self.policy.offload_timeout;
        let late: Vec<u64> = self
            .replica_tasks
            .open
            .iter()
            .take_while(|(created, _)| created.plus(timeout) <= now)
            .map(|&(_, id)| id)
            .collect();
        for id in late {
            let task = self.replica_tasks.tasks.get_mut(&id).expect("listed above");
            let (mut abandoned, mut unsent) = (Vec::new(), Vec::new());
            for x in &mut task.targets {
                if let Some(a) = x.allocation.take() {
                    let replica = Replica {
                        segment: x.segment,
                        allocation: a,
                    };
                    let why = if x.step == Step::Queued {
                        unsent.push(replica);
                        "did not take its copy"
                    } else {
                        abandoned.push(replica);
                        "did not report its copy"
                    };
                    x.step = Step::Failed;
                    task.failures
                        .push(format!("the owner of {} {why} within {timeout:?}", x.name));
                }
            }
            task.updated = now;
            let put_id = task.put_id;
            for r in &unsent {
                if let Some(seg) = self.segments.get_mut(&r.segment) {
                    seg.tasks
                        .retain(|t| !(t.kind == TaskKind::Copy && t.task_id == id));
                }
            }
            self.free_replicas(unsent);
            let at = now.plus(self.policy.put_release_timeout);
            self.abandon_write(abandoned, put_id, now, at);
            self.settle_task(id, now);
        }
    }

    /// A segment went away: copies to it fail (their room went with it), and so do moves from
    /// it.
    pub(super) fn replica_tasks_lose_segment(&mut self, segment: SegmentId, now: Millis) {
        let ids: Vec<u64> = self.replica_tasks.open().map(|(id, _)| id).collect();
        for id in ids {
            let task = self.replica_tasks.tasks.get_mut(&id).expect("listed above");
            for x in &mut task.targets {
                if x.segment == segment && x.allocation.take().is_some() {
                    x.step = Step::Failed;
                    task.failures
                        .push(format!("target {} was unmounted or expired", x.name));
                    task.updated = now;
                }
            }
            if task.source == Some(segment) {
                task.source = None;
            }
            self.settle_task(id, now);
        }
    }

    /// Ends a task once no copy is under way: a successful move drops the source's replica
    /// (after the readers leased on it are done).
    fn settle_task(&mut self, id: u64, now: Millis) {
        let Some(task) = self.replica_tasks.tasks.get_mut(&id) else {
            return;
        };
        if task.finished
            || task
                .targets
                .iter()
                .any(|x| matches!(x.step, Step::Queued | Step::Taken))
        {
            return;
        }
        task.finished = true;
        task.updated = now;
        let moved_from = match (task.kind, task.failures.is_empty()) {
            (ReplicaTaskType::Move, true) => task.source,
            _ => None,
        };
        let (key, put_id, created) = (task.key.clone(), task.put_id, task.created);
        self.replica_tasks.closed(id, &key, created);
        if let Some(source) = moved_from {
            let released = self.objects.get_mut(&key).and_then(|obj| {
                if obj.put_id != put_id || obj.replicas.len() < 2 {
                    return None;
                }
                let at = obj.replicas.iter().position(|r| r.segment == source)?;
                Some((obj.replicas.remove(at), obj.lease.until()))
            });
            match released {
                Some((replica, lease_until)) if lease_until > now => {
                    // Readers leased on the source keep reading it: its owner keeps the range
                    // until the lease ends, and is told to forget it then.
                    self.defer_drop([replica], put_id, lease_until);
                }
                Some((replica, _)) => self.drop_replicas([replica], put_id),
                None => {
                    if let Some(t) = self.replica_tasks.tasks.get_mut(&id) {
                        t.failures.push(format!(
                            "copied, but {key} changed before its source replica could go"
                        ));
                    }
                }
            }
        }
        let order = &mut self.replica_tasks.finished_order;
        order.push_back(id);
        while order.len() > MAX_FINISHED {
            if let Some(old) = order.pop_front() {
                self.replica_tasks.tasks.remove(&old);
            }
        }
        let status = self.replica_tasks.tasks.get(&id).map(|t| t.status());
        tracing::info!(task = id, %key, ?status, "replica task finished");
    }

    /// Drops `keys`' memory replicas on `segment` (the object goes when nothing else holds
    /// it), or whole objects without a segment. Leased objects and puts under way are left.
    pub fn replica_clear(
        &mut self,
        keys: &[ObjectKey],
        segment: Option<&SegmentName>,
        now: Millis,
    ) -> Vec<Result<(), MasterError>> {
        let segment = match segment.map(|name| self.segment_id(name).ok_or(name)) {
            Some(Err(name)) => {
                let e = MasterError::SegmentNotFound(name.clone());
                return keys.iter().map(|_| Err(e.clone())).collect();
            }
            Some(Ok(id)) => Some(id),
            None => None,
        };
        if self.rebuilding(now) {
            // As a removal: an unknown key may yet be reported, and a cleared replica or
            // object may come back with a later report (asked again once owners reported).
            return keys
                .iter()
                .map(|k| Err(MasterError::Rebuilding(k.clone())))
                .collect();
        }
        keys.iter()
            .map(|key| {
                let obj = self
                    .objects
                    .get(key)
                    .ok_or_else(|| MasterError::NotFound(key.clone()))?;
                if !obj.phase.is_complete() {
                    return Err(MasterError::NotReady(key.clone()));
                }
                if obj.is_leased(now) {
                    return Err(MasterError::HasLease(key.clone()));
                }
                let Some(seg) = segment else {
                    return self.remove(key, false, now);
                };
                let obj = self.objects.get_mut(key).expect("checked above");
                let at = obj
                    .replicas
                    .iter()
                    .position(|r| r.segment == seg)
                    .ok_or_else(|| MasterError::NotFound(key.clone()))?;
                if obj.replicas.len() == 1 && obj.disk().is_empty() {
                    return self.remove(key, false, now);
                }
                let (replica, put_id) = (obj.replicas.remove(at), obj.put_id);
                self.drop_replicas([replica], put_id);
                Ok(())
            })
            .collect()
    }
}
