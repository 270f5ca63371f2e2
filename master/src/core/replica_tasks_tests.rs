//! Replica tasks and replica clears on the master: a copy adds a replica only once its owner
//! reports it, a move drops the source after, a copy of a version that went meanwhile is thrown
//! away, silent owners and lost segments fail tasks without leaking room. Invariants are
//! checked after every step.

use std::time::Duration;

use mooncake_common::{
    ClientId, ObjectKey, ReplicaTaskStatus, ReplicaTaskType, ReplicateConfig, SegmentName, Tier,
};

use super::*;
use crate::{clock::Millis, error::MasterError};

const MIB: u64 = 1 << 20;

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

fn seg(i: u16) -> SegmentName {
    SegmentName::parse(&format!("127.0.0.1:{}", 3000 + i)).unwrap()
}

fn owner(i: u16) -> ClientId {
    ClientId::from_u128(i as u128 + 1)
}

/// Three owners of 8 MiB, no SSD tier.
fn three() -> MasterState {
    let policy = Policy {
        client_ttl: Duration::from_secs(3600),
        ..Policy::default()
    };
    let mut s = MasterState::with_seed(policy, 3);
    for i in 0..3 {
        s.mount_segment(
            owner(i),
            seg(i),
            8 * MIB,
            0,
            MountReport::default(),
            Millis(0),
        )
        .unwrap();
    }
    s
}

/// Puts `key` on segment `on`.
fn put_on(s: &mut MasterState, key: &str, size: u64, on: u16) -> u64 {
    let c = ReplicateConfig {
        preferred_segments: vec![seg(on)],
        ..Default::default()
    };
    let g = s.put_start(&k(key), size, &c, Millis(0)).unwrap();
    assert_eq!(g.replicas[0].segment, seg(on));
    s.put_end(key, g.put_id, Millis(0)).unwrap();
    g.put_id
}

fn holders(s: &mut MasterState, key: &str, now: u64) -> Vec<SegmentName> {
    let (_, reps) = s.get_replicas(&k(key), Millis(now)).unwrap();
    reps.iter()
        .filter(|r| r.tier == Tier::Memory)
        .map(|r| r.segment.clone())
        .collect()
}

/// The owner of segment `i` takes its work and reports each copy (`failure`: why it failed).
fn copies(
    s: &mut MasterState,
    i: u16,
    failure: Option<&str>,
    now: u64,
) -> Vec<Result<(), MasterError>> {
    let id = s.segment_id(&seg(i)).unwrap();
    let tasks = s.take_tasks(id, 100, Millis(now));
    let out = tasks
        .iter()
        .map(|t| {
            assert_eq!(t.kind, TaskKind::Copy);
            s.report_copy(
                id,
                t.task_id,
                &t.key,
                t.put_id,
                t.offset,
                failure,
                Millis(now),
            )
        })
        .collect();
    s.check_invariants().unwrap();
    out
}

fn status(s: &MasterState, id: u64) -> ReplicaTaskStatus {
    s.query_task(id).unwrap().status
}

#[test]
fn a_copy_adds_a_replica_once_the_owner_reports_it() {
    let mut s = three();
    let put_id = put_on(&mut s, "a", MIB, 0);
    let targets = [seg(1), seg(2)];
    let id = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &targets }, Millis(1))
        .unwrap();
    s.check_invariants().unwrap();
    assert_eq!(status(&s, id), ReplicaTaskStatus::Pending);
    // Room is reserved, but nobody reads the copy before it is reported.
    assert_eq!(s.allocated(), 3 * MIB);
    assert_eq!(holders(&mut s, "a", 1), vec![seg(0)]);
    // The owner of segment 1 is told where to read and where to write.
    let seg1 = s.segment_id(&seg(1)).unwrap();
    let tasks = s.take_tasks(seg1, 10, Millis(2));
    assert_eq!(tasks.len(), 1);
    let from = tasks[0].copy_from.clone().unwrap();
    assert_eq!((from.segment, from.tier), (seg(0), Tier::Memory));
    assert_eq!(tasks[0].put_id, put_id);
    assert!(
        tasks[0].grant > put_id,
        "the copy is fenced by a fresh grant"
    );
    assert_eq!(status(&s, id), ReplicaTaskStatus::Processing);
    let at = tasks[0].offset;
    s.report_copy(seg1, id, &k("a"), put_id, at, None, Millis(3))
        .unwrap();
    assert_eq!(holders(&mut s, "a", 3).len(), 2);
    assert_eq!(status(&s, id), ReplicaTaskStatus::Processing);
    copies(&mut s, 2, None, 4);
    let info = s.query_task(id).unwrap();
    assert_eq!(info.status, ReplicaTaskStatus::Success);
    assert_eq!(info.kind, ReplicaTaskType::Copy);
    assert_eq!(info.assigned, vec![seg(1), seg(2)]);
    assert_eq!(holders(&mut s, "a", 4).len(), 3);
    // A repeated report (a retry whose first answer was lost) changes nothing, and the owner
    // keeps the copy the master counts; one naming another range is refused.
    let allocated = s.allocated();
    s.report_copy(seg1, id, &k("a"), put_id, at, None, Millis(5))
        .unwrap();
    assert!(s
        .report_copy(seg1, id, &k("a"), put_id, at + MIB, None, Millis(5))
        .is_err());
    assert_eq!(holders(&mut s, "a", 5).len(), 3);
    assert_eq!(s.allocated(), allocated);
    s.check_invariants().unwrap();
}

#[test]
fn a_failed_copy_gives_the_room_back_and_fails_the_task() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let id = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))
        .unwrap();
    assert_eq!(copies(&mut s, 1, Some("source refused"), 1), vec![Ok(())]);
    let info = s.query_task(id).unwrap();
    assert_eq!(info.status, ReplicaTaskStatus::Failed);
    assert!(info.detail.contains("source refused"), "{}", info.detail);
    assert_eq!(s.allocated(), MIB);
    assert_eq!(holders(&mut s, "a", 1), vec![seg(0)]);
}

#[test]
fn a_copy_of_a_removed_version_is_thrown_away() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let id = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))
        .unwrap();
    s.remove(&k("a"), true, Millis(1)).unwrap();
    put_on(&mut s, "a", MIB, 2);
    // The owner copied the old version: the master refuses it, so the owner forgets it; a note
    // says so too, should the refusal be lost on its way.
    let seg1 = s.segment_id(&seg(1)).unwrap();
    let task = s.take_tasks(seg1, 10, Millis(2)).pop().unwrap();
    s.take_freed(owner(1));
    let answer = s.report_copy(seg1, id, &k("a"), task.put_id, task.offset, None, Millis(2));
    assert!(matches!(answer, Err(MasterError::StalePut { .. })));
    let notes: Vec<(u64, u64)> = s
        .take_freed(owner(1))
        .iter()
        .map(|f| (f.offset, f.put_id))
        .collect();
    assert_eq!(notes, vec![(task.offset, task.put_id)]);
    assert_eq!(status(&s, id), ReplicaTaskStatus::Failed);
    assert_eq!(holders(&mut s, "a", 3), vec![seg(2)]);
    assert_eq!(s.allocated(), MIB);
    s.check_invariants().unwrap();
}

#[test]
fn a_move_drops_the_source_after_the_copy_and_waits_for_its_readers() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let (source, target) = (seg(0), seg(2));
    let id = s
        .create_replica_task(
            &k("a"),
            TaskRequest::Move {
                source: &source,
                target: &target,
            },
            Millis(0),
        )
        .unwrap();
    // A reader leases the object while it moves.
    holders(&mut s, "a", 100);
    copies(&mut s, 2, None, 200);
    let info = s.query_task(id).unwrap();
    assert_eq!(
        (info.kind, info.status),
        (ReplicaTaskType::Move, ReplicaTaskStatus::Success)
    );
    assert_eq!(holders(&mut s, "a", 300), vec![seg(2)]);
    // The source's range waits out the reader's lease before it can be reused, and its owner
    // keeps serving it to those readers until then.
    assert_eq!(s.allocated(), 2 * MIB);
    // The lease the move saw was the one taken at 100.
    let lease_end = 100 + s.policy().lease_ttl.as_millis() as u64;
    s.tick(Millis(lease_end - 1));
    assert!(s.take_freed(owner(0)).is_empty());
    s.tick(Millis(lease_end + 1));
    s.check_invariants().unwrap();
    assert_eq!(s.allocated(), MIB);
    // Then it is told to forget the range (no stale entry for a rebuild to find).
    let notes = s.take_freed(owner(0));
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(
        notes[0].put_id,
        s.get_replicas(&k("a"), Millis(lease_end + 2)).unwrap().1[0].put_id
    );
}

#[test]
fn bad_tasks_are_refused_with_codes_and_reserve_nothing() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let code = |r: Result<u64, MasterError>| r.unwrap_err().code();
    let unknown = SegmentName::parse("127.0.0.1:1").unwrap();
    assert_eq!(
        code(s.create_replica_task(
            &k("nope"),
            TaskRequest::Copy { targets: &[seg(1)] },
            Millis(0)
        )),
        mooncake_common::Code::ObjectNotFound
    );
    assert_eq!(
        code(s.create_replica_task(
            &k("a"),
            TaskRequest::Copy {
                targets: &[unknown]
            },
            Millis(0)
        )),
        mooncake_common::Code::SegmentNotFound
    );
    assert_eq!(
        code(s.create_replica_task(&k("a"), TaskRequest::Copy { targets: &[] }, Millis(0))),
        mooncake_common::Code::InvalidParams
    );
    assert_eq!(
        code(s.create_replica_task(
            &k("a"),
            TaskRequest::Copy {
                targets: &[seg(1), seg(1)]
            },
            Millis(0)
        )),
        mooncake_common::Code::InvalidParams
    );
    // No replica on the move's source; a move onto itself.
    let (s1, s0) = (seg(1), seg(0));
    assert_eq!(
        code(s.create_replica_task(
            &k("a"),
            TaskRequest::Move {
                source: &s1,
                target: &s0
            },
            Millis(0)
        )),
        mooncake_common::Code::InvalidParams
    );
    assert_eq!(
        code(s.create_replica_task(
            &k("a"),
            TaskRequest::Move {
                source: &s0,
                target: &s0
            },
            Millis(0)
        )),
        mooncake_common::Code::InvalidParams
    );
    // No room: all or nothing.
    put_on(&mut s, "big", 7 * MIB + MIB / 2, 2);
    assert_eq!(
        code(s.create_replica_task(
            &k("big"),
            TaskRequest::Copy {
                targets: &[seg(1), seg(0)]
            },
            Millis(0)
        )),
        mooncake_common::Code::NoAvailableHandle
    );
    assert_eq!(s.allocated(), 8 * MIB + MIB / 2);
    // A second copy to the same target while one is under way.
    s.create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))
        .unwrap();
    assert_eq!(
        code(s.create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))),
        mooncake_common::Code::InvalidParams
    );
    s.check_invariants().unwrap();
    // A target that already holds a replica is done at once.
    let id = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(0)] }, Millis(0))
        .unwrap();
    assert_eq!(status(&s, id), ReplicaTaskStatus::Success);
    assert!(s.query_task(id + 1_000_000).is_none());
}

#[test]
fn silent_owners_and_lost_targets_fail_tasks_without_leaking_room() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let late = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))
        .unwrap();
    let lost = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(2)] }, Millis(0))
        .unwrap();
    let seg1 = s.segment_id(&seg(1)).unwrap();
    let task = s.take_tasks(seg1, 10, Millis(0));
    let (at, put_id) = (task[0].offset, task[0].put_id);
    s.unmount_segment(owner(2), &seg(2)).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(status(&s, lost), ReplicaTaskStatus::Failed);
    let timeout = s.policy().offload_timeout.as_millis() as u64;
    s.tick(Millis(timeout + 1));
    s.check_invariants().unwrap();
    assert_eq!(status(&s, late), ReplicaTaskStatus::Failed);
    assert!(s
        .query_task(late)
        .unwrap()
        .detail
        .contains("did not report"));
    // The owner is told at once to forget what the copy may have recorded (a report lost on
    // its way would otherwise leave it for a later master to adopt, after a removal too),
    // again once the copy has surely ended, and once more as its room is freed.
    let notes = |s: &mut MasterState| {
        s.take_freed(owner(1))
            .iter()
            .map(|f| (f.offset, f.put_id))
            .collect::<Vec<_>>()
    };
    assert_eq!(notes(&mut s), vec![(at, put_id)]);
    let discard = s.policy().put_discard_timeout.as_millis() as u64;
    s.tick(Millis(timeout + discard + 3_002));
    assert_eq!(notes(&mut s), vec![(at, put_id)]);
    // The late copy's room waits out the longest a writer may take, then comes back.
    assert_eq!(s.allocated(), 2 * MIB);
    let release = s.policy().put_release_timeout.as_millis() as u64;
    s.tick(Millis(timeout + release + 2));
    s.check_invariants().unwrap();
    assert_eq!(s.allocated(), MIB);
    assert_eq!(notes(&mut s), vec![(at, put_id)]);
    // The owner that wakes up late is told its copy is not wanted.
    assert!(s
        .report_copy(
            seg1,
            late,
            &k("a"),
            put_id,
            at,
            None,
            Millis(timeout + release + 3)
        )
        .is_err());
    s.check_invariants().unwrap();
}

/// A copy its target's owner never took (it stopped polling) fails at the timeout, leaves that
/// owner's queue and gives its room back at once: nothing can be writing it. Before, it held
/// the room for the release timeout, and an owner polling later did the copy for nothing.
#[test]
fn a_copy_never_taken_leaves_the_queue_and_frees_its_room_at_the_timeout() {
    let mut s = three();
    put_on(&mut s, "a", MIB, 0);
    let id = s
        .create_replica_task(&k("a"), TaskRequest::Copy { targets: &[seg(1)] }, Millis(0))
        .unwrap();
    assert_eq!(s.allocated(), 2 * MIB);
    let timeout = s.policy().offload_timeout.as_millis() as u64;
    s.tick(Millis(timeout + 1));
    s.check_invariants().unwrap();
    assert_eq!(status(&s, id), ReplicaTaskStatus::Failed);
    assert!(s.query_task(id).unwrap().detail.contains("did not take"));
    assert_eq!(s.allocated(), MIB, "the room came back at once");
    let seg1 = s.segment_id(&seg(1)).unwrap();
    assert!(s.take_tasks(seg1, 10, Millis(timeout + 2)).is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn replica_clear_drops_one_segment_or_whole_objects_but_not_leased_ones() {
    let mut s = three();
    let c = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let g = s.put_start(&k("two"), MIB, &c, Millis(0)).unwrap();
    s.put_end("two", g.put_id, Millis(0)).unwrap();
    put_on(&mut s, "one", MIB, 0);
    put_on(&mut s, "leased", MIB, 0);
    let first = g.replicas[0].segment.clone();
    let first_owner = (0..3).find(|&i| seg(i) == first).map(owner).unwrap();
    s.take_freed(first_owner);
    holders(&mut s, "leased", 1);
    let res = s.replica_clear(&[k("two"), k("leased"), k("nope")], Some(&first), Millis(2));
    assert_eq!(res[0], Ok(()));
    assert!(matches!(res[1], Err(MasterError::HasLease(_))));
    assert!(matches!(res[2], Err(MasterError::NotFound(_))));
    // Its owner is told to forget the cleared replica (or a later master would adopt it).
    let notes: Vec<(u64, u64)> = s
        .take_freed(first_owner)
        .iter()
        .map(|f| (f.offset, f.put_id))
        .collect();
    assert_eq!(notes, vec![(g.replicas[0].offset, g.put_id)]);
    s.check_invariants().unwrap();
    let after = holders(&mut s, "two", 3);
    assert_eq!(after.len(), 1);
    assert_ne!(after[0], first);
    // Clearing the last replica removes the object; without a segment the whole object goes.
    let later = 3 + s.policy().lease_ttl.as_millis() as u64 + 1;
    let res = s.replica_clear(&[k("one")], Some(&seg(0)), Millis(later));
    assert_eq!(res, vec![Ok(())]);
    let res = s.replica_clear(&[k("two")], None, Millis(later));
    assert_eq!(res, vec![Ok(())]);
    assert!(s.get_replicas(&k("one"), Millis(later)).is_err());
    assert!(s.get_replicas(&k("two"), Millis(later)).is_err());
    let unknown = SegmentName::parse("127.0.0.1:1").unwrap();
    assert!(matches!(
        s.replica_clear(&[k("leased")], Some(&unknown), Millis(4))[0],
        Err(MasterError::SegmentNotFound(_))
    ));
    s.check_invariants().unwrap();
}
