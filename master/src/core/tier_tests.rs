//! The SSD tier on the master: offload on eviction, disk-only reads, promotion, what happens when
//! the SSD is behind, owner reports that come late or for a rewritten object, and registration
//! after an owner restart. Invariants are checked after every step.

use std::time::Duration;

use mooncake_common::{ClientId, ObjectKey, ReplicateConfig, SegmentName, Tier};

use super::*;
use crate::{clock::Millis, error::MasterError};

const MIB: u64 = 1 << 20;

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

fn seg(i: u16) -> SegmentName {
    SegmentName::parse(&format!("127.0.0.1:{}", 2000 + i)).unwrap()
}

fn owner(i: u16) -> ClientId {
    ClientId::from_u128(i as u128 + 1)
}

/// One owner with `mem` bytes of memory and an SSD tier of 1 GiB.
fn tiered(mem: u64, policy: Policy) -> (MasterState, SegmentId) {
    let policy = Policy {
        client_ttl: Duration::from_secs(3600),
        ..policy
    };
    let mut s = MasterState::with_seed(policy, 7);
    s.mount_segment(
        owner(0),
        seg(0),
        mem,
        1 << 30,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let id = s.disk_segment(owner(0), &seg(0)).unwrap();
    (s, id)
}

/// One tiered owner of 4 MiB holding "a" (1 MiB) on disk only: offloaded eagerly, then evicted
/// (it has a disk copy, so its memory went at once). Promoted after `hits` disk reads.
fn disk_only_a(hits: u32) -> (MasterState, SegmentId) {
    let policy = Policy {
        eager_offload: true,
        promote_after_hits: hits,
        ..Policy::default()
    };
    let (mut s, id) = tiered(4 * MIB, policy);
    put(&mut s, "a", MIB, 0).unwrap();
    owner_works(&mut s, id, true, 1);
    s.evict(Millis(2), MIB);
    (s, id)
}

/// Eager offloads, at most `queue_limit` per SSD tier at a time.
fn eager(queue_limit: usize) -> Policy {
    Policy {
        eager_offload: true,
        offload_queue_limit: queue_limit,
        ..Policy::default()
    }
}

/// Mounts `seg(i)` for `owner(i)` with `mem` bytes of memory and `disk` of SSD tier (0: none).
fn mount(s: &mut MasterState, i: u16, mem: u64, disk: u64) -> SegmentId {
    s.mount_segment(
        owner(i),
        seg(i),
        mem,
        disk,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    s.owned_segment(owner(i), &seg(i)).unwrap()
}

/// A put config preferring `seg(i)`.
fn on(i: u16) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segments: vec![seg(i)],
        ..ReplicateConfig::default()
    }
}

fn put(s: &mut MasterState, key: &str, size: u64, now: u64) -> Result<u64, MasterError> {
    let g = s.put_start(&k(key), size, &ReplicateConfig::default(), Millis(now))?;
    s.put_end(key, g.put_id, Millis(now))?;
    s.check_invariants().unwrap();
    Ok(g.put_id)
}

/// The owner does every queued task and reports it (`ok`).
fn owner_works(s: &mut MasterState, id: SegmentId, ok: bool, now: u64) -> Vec<OwnerTask> {
    let tasks = s.take_tasks(id, 1000, Millis(0));
    for t in &tasks {
        let _ = match t.kind {
            TaskKind::Promote => s.report_promotion(id, &t.key, t.put_id, t.offset, ok),
            kind => s.report_task(id, kind, &t.key, t.put_id, ok, Millis(now)),
        };
    }
    s.check_invariants().unwrap();
    tasks
}

fn tiers(s: &mut MasterState, key: &str, now: u64) -> Vec<Tier> {
    let (_, reps) = s.get_replicas(&k(key), Millis(now)).unwrap();
    reps.iter().map(|r| r.tier).collect()
}

#[test]
fn eviction_offloads_first_and_frees_memory_when_the_copy_lands() {
    let (mut s, id) = tiered(4 * MIB, Policy::default());
    for i in 0..4 {
        put(&mut s, &format!("k{i}"), MIB, i).unwrap();
    }
    // Memory is full: the next put waits for offloads instead of dropping anything.
    assert!(matches!(
        put(&mut s, "k4", MIB, 10),
        Err(MasterError::NoSpace { .. })
    ));
    assert!(s.offloads_outstanding());
    assert!(s.take_wakeup());
    let tasks = owner_works(&mut s, id, true, 11);
    assert!(!tasks.is_empty());
    assert!(tasks.iter().all(|t| t.kind == TaskKind::Offload));
    assert_eq!(tasks[0].key, k("k0"), "least recently used goes first");
    assert!(!s.offloads_outstanding());
    put(&mut s, "k4", MIB, 12).unwrap();
    // k0 is now disk-only and still readable.
    assert_eq!(tiers(&mut s, "k0", 13), vec![Tier::Disk]);
    assert_eq!(s.key_count(), 5);
    assert_eq!(s.counters().offloads_done, tasks.len() as u64);
}

#[test]
fn an_object_with_a_disk_copy_leaves_memory_at_once() {
    let policy = Policy {
        eager_offload: true,
        ..Policy::default()
    };
    let (mut s, id) = tiered(4 * MIB, policy);
    put(&mut s, "a", MIB, 0).unwrap();
    put(&mut s, "b", MIB, 1).unwrap();
    assert_eq!(owner_works(&mut s, id, true, 2).len(), 2);
    // Both are in memory and on disk.
    assert_eq!(tiers(&mut s, "a", 3), vec![Tier::Memory, Tier::Disk]);
    s.tick(Millis(20_000)); // leases of the gets above run out
    put(&mut s, "c", MIB, 20_001).unwrap();
    // Past the high watermark: the least recently used object with a disk copy leaves memory
    // at once, no owner round trip needed.
    put(&mut s, "d", MIB, 20_002).unwrap();
    assert_eq!(s.allocated(), 3 * MIB);
    assert_eq!(
        tiers(&mut s, "b", 20_003),
        vec![Tier::Disk],
        "b was read least recently"
    );
    assert_eq!(s.key_count(), 4);
}

#[test]
fn disk_only_objects_are_promoted_after_enough_hits() {
    let (mut s, id) = disk_only_a(2);
    assert_eq!(s.allocated(), 0);
    assert_eq!(tiers(&mut s, "a", 3), vec![Tier::Disk]);
    assert!(
        s.take_tasks(id, 10, Millis(0)).is_empty(),
        "one hit is not enough"
    );
    assert_eq!(tiers(&mut s, "a", 4), vec![Tier::Disk]);
    let tasks = s.take_tasks(id, 10, Millis(0));
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].kind, TaskKind::Promote);
    assert_eq!(s.allocated(), MIB, "memory is reserved for the promotion");
    s.check_invariants().unwrap();
    s.report_promotion(id, &k("a"), tasks[0].put_id, tasks[0].offset, true)
        .unwrap();
    assert_eq!(tiers(&mut s, "a", 6), vec![Tier::Memory, Tier::Disk]);
    assert_eq!(s.counters().promotions, 1);
    // A failed promotion gives the memory back.
    s.tick(Millis(20_000));
    s.evict(Millis(20_000), MIB);
    tiers(&mut s, "a", 20_001);
    tiers(&mut s, "a", 20_002);
    let tasks = s.take_tasks(id, 10, Millis(0));
    s.report_promotion(id, &k("a"), tasks[0].put_id, tasks[0].offset, false)
        .unwrap();
    assert_eq!(s.allocated(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn when_the_disk_is_behind_eviction_keeps_or_drops_by_policy() {
    for (when, kept) in [(WhenDiskBehind::Keep, true), (WhenDiskBehind::Drop, false)] {
        let policy = Policy {
            offload_queue_limit: 1,
            when_disk_behind: when,
            eviction_ratio: 0.5,
            ..Policy::default()
        };
        let (mut s, _id) = tiered(4 * MIB, policy);
        for i in 0..4 {
            put(&mut s, &format!("k{i}"), MIB, i).unwrap();
        }
        // Needs two objects' worth; the queue takes one offload, the second is behind.
        let kept_before = s.counters().kept_disk_behind;
        s.evict(Millis(10), 2 * MIB);
        s.check_invariants().unwrap();
        assert_eq!(s.key_count() == 4, kept, "{when:?}");
        let c = s.counters();
        assert_eq!(c.kept_disk_behind > 0, kept);
        assert_eq!(c.dropped_disk_behind > 0, !kept);
        if kept {
            // The three left behind are each passed over once, where they stand: not moved
            // to the frequent list (before: the round met each twice, relinking it there).
            assert_eq!(c.kept_disk_behind - kept_before, 3);
            assert_eq!(s.eviction_stats().recent, 3);
        }
    }
}

#[test]
fn freeing_at_once_passes_over_objects_that_need_an_offload_and_ignores_room_on_its_way() {
    let (mut s, _id) = tiered(4 * MIB, Policy::default());
    mount(&mut s, 1, 4 * MIB, 0);
    for i in 0..4 {
        let g = s
            .put_start(&k(&format!("a{i}")), MIB, &on(0), Millis(i))
            .unwrap();
        s.put_end(&format!("a{i}"), g.put_id, Millis(i)).unwrap();
    }
    for i in 0..4 {
        let g = s
            .put_start(&k(&format!("b{i}")), MIB, &on(1), Millis(10 + i))
            .unwrap();
        s.put_end(&format!("b{i}"), g.put_id, Millis(10 + i))
            .unwrap();
    }
    // The tiered owner's objects come first in the order: their offloads start and count as
    // room coming, so an ordinary round frees nothing more.
    assert_eq!(s.evict(Millis(20), 2 * MIB), 0);
    assert!(s.offloads_outstanding());
    assert_eq!(s.evict(Millis(21), 2 * MIB), 0);
    assert_eq!(s.key_count(), 8);
    let offloads = s.counters().offloads_started;
    // At once: the plain owner's oldest go; no offload starts, nothing of the tier is dropped.
    assert_eq!(s.free_at_once(Millis(22), 2 * MIB), 2 * MIB);
    s.check_invariants().unwrap();
    assert_eq!(s.counters().offloads_started, offloads);
    for i in 0..4 {
        assert!(
            s.get_replicas(&k(&format!("a{i}")), Millis(23)).is_ok(),
            "a{i}"
        );
    }
    assert!(s.get_replicas(&k("b0"), Millis(23)).is_err());
    assert!(s.get_replicas(&k("b1"), Millis(23)).is_err());
    assert!(s.get_replicas(&k("b2"), Millis(23)).is_ok());
}

#[test]
fn late_or_stale_reports_change_nothing_and_tell_the_owner_to_drop() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    let v1 = put(&mut s, "a", MIB, 0).unwrap();
    put(&mut s, "b", MIB, 1).unwrap();
    s.evict(Millis(5), MIB);
    let tasks = s.take_tasks(id, 10, Millis(0));
    assert_eq!(tasks.len(), 1);
    // The object is removed and put again while the offload is in flight.
    s.remove(&k("a"), true, Millis(6)).unwrap();
    let v2 = put(&mut s, "a", MIB, 7).unwrap();
    assert_ne!(v1, v2);
    assert!(s
        .report_task(id, TaskKind::Offload, &k("a"), v1, true, Millis(8))
        .is_err());
    s.check_invariants().unwrap();
    assert_eq!(tiers(&mut s, "a", 9), vec![Tier::Memory]);
    // Removing an object with a disk copy tells its owner to drop the record.
    s.start_offload(&k("b"), false, Millis(10));
    owner_works(&mut s, id, true, 11);
    s.remove(&k("b"), true, Millis(12)).unwrap();
    let drops = s.take_tasks(id, 10, Millis(0));
    assert_eq!(drops.len(), 1);
    assert_eq!((drops[0].kind, &drops[0].key), (TaskKind::Drop, &k("b")));
}

#[test]
fn a_failed_offload_leaves_the_object_in_memory_and_evictable() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    put(&mut s, "a", MIB, 0).unwrap();
    s.evict(Millis(5), MIB);
    owner_works(&mut s, id, false, 6);
    assert_eq!(s.counters().offloads_failed, 1);
    assert_eq!(tiers(&mut s, "a", 7), vec![Tier::Memory]);
    s.tick(Millis(20_000));
    // Failed once: now it is dropped like an object without an SSD tier.
    s.evict(Millis(20_001), MIB);
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn unreported_offloads_time_out() {
    let policy = Policy {
        offload_timeout: Duration::from_secs(5),
        ..Policy::default()
    };
    let (mut s, id) = tiered(4 * MIB, policy);
    put(&mut s, "a", MIB, 0).unwrap();
    put(&mut s, "b", MIB, 0).unwrap();
    s.evict(Millis(1), MIB);
    assert_eq!(s.take_tasks(id, 10, Millis(0)).len(), 1);
    // A second offload, started later, times out later: upkeep looks again for it.
    s.start_offload(&k("b"), true, Millis(4_000));
    s.tick(Millis(3_000));
    assert!(s.offloads_outstanding());
    s.tick(Millis(6_000));
    assert_eq!(s.counters().offloads_failed, 1, "a's timed out");
    assert!(s.offloads_outstanding(), "b's has not");
    s.tick(Millis(8_999));
    assert!(s.offloads_outstanding());
    s.tick(Millis(9_000));
    assert!(!s.offloads_outstanding());
    assert_eq!(s.counters().offloads_failed, 2);
    s.check_invariants().unwrap();
}

#[test]
fn the_owner_dropping_a_record_removes_a_disk_only_object() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    let v = put(&mut s, "a", MIB, 0).unwrap();
    s.evict(Millis(1), MIB);
    owner_works(&mut s, id, true, 2);
    assert_eq!(tiers(&mut s, "a", 3), vec![Tier::Disk]);
    s.disk_dropped(id, &k("a"), v + 1, Millis(3)); // another version: ignored
    assert_eq!(s.key_count(), 1);
    s.disk_dropped(id, &k("a"), v, Millis(4));
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn records_found_after_a_restart_are_registered_unless_the_key_is_taken() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    let v = s.register_disk(id, &k("a"), 1000, 77, Millis(0)).unwrap();
    assert_eq!(tiers(&mut s, "a", 1), vec![Tier::Disk]);
    // The same version again (a remount) is fine; another one is not.
    assert_eq!(s.register_disk(id, &k("a"), 1000, v, Millis(0)), Ok(v));
    // A version older than the catalog's (as any record is, that this master's puts followed).
    s.raise_grants(1000);
    put(&mut s, "b", 100, 3).unwrap();
    assert!(matches!(
        s.register_disk(id, &k("b"), 100, 5, Millis(4)),
        Err(MasterError::Exists(_))
    ));
    // A segment without an SSD tier cannot take disk work.
    s.mount_segment(owner(1), seg(1), MIB, 0, MountReport::default(), Millis(5))
        .unwrap();
    assert!(s.disk_segment(owner(1), &seg(1)).is_err());
    assert!(s.disk_segment(owner(0), &seg(1)).is_err());
    s.check_invariants().unwrap();
}

/// Two owners restarted on their SSD directories hold two versions of a key, and the older one
/// registers first: the newer one still wins, and the older one's owner is told to drop it.
/// Before, the newer one was refused, its owner deleted it, and gets served the older bytes.
#[test]
fn a_newer_version_found_on_disk_replaces_an_older_one_registered_first() {
    let (mut s, old_seg) = tiered(2 * MIB, Policy::default());
    s.mount_segment(
        owner(1),
        seg(1),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let new_seg = s.disk_segment(owner(1), &seg(1)).unwrap();
    assert_eq!(
        s.register_disk(old_seg, &k("a"), 1000, 77, Millis(1)),
        Ok(77)
    );
    assert_eq!(
        s.register_disk(new_seg, &k("a"), 900, 80, Millis(2)),
        Ok(80)
    );
    let (size, views) = s.get_replicas(&k("a"), Millis(3)).unwrap();
    assert_eq!((size, views.len(), views[0].put_id), (900, 1, 80));
    assert_eq!(views[0].segment, seg(1));
    // The older version's record goes from its disk; registered again (a remount before the
    // drop), it is refused.
    let drops = s.take_tasks(old_seg, 10, Millis(4));
    assert!(
        drops
            .iter()
            .any(|t| t.kind == TaskKind::Drop && t.put_id == 77),
        "{drops:?}"
    );
    assert!(s
        .register_disk(old_seg, &k("a"), 1000, 77, Millis(5))
        .is_err());
    // An older one than the catalog's is refused, as before.
    assert!(matches!(
        s.register_disk(old_seg, &k("a"), 1000, 79, Millis(6)),
        Err(MasterError::Exists(_))
    ));
    s.check_invariants().unwrap();
}

/// A key with a disk copy on an owner the master dropped (restarted, or expired) and a memory
/// replica elsewhere, removed before that owner is back: the owner's record is refused when it
/// registers it. Before, nothing remembered the copy, and the removed key came back.
#[test]
fn a_key_removed_while_its_disk_copys_owner_was_away_stays_removed() {
    let (mut s, tiered_seg) = tiered(2 * MIB, Policy::default());
    s.mount_segment(
        owner(1),
        seg(1),
        2 * MIB,
        0,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let on_memory = ReplicateConfig {
        preferred_segments: vec![seg(1)],
        ..ReplicateConfig::default()
    };
    let g = s.put_start(&k("a"), 1000, &on_memory, Millis(1)).unwrap();
    s.put_end("a", g.put_id, Millis(1)).unwrap();
    assert_eq!(g.replicas[0].segment, seg(1));
    // Its disk copy on the tiered owner (as after an offload of a second replica).
    assert_eq!(
        s.register_disk(tiered_seg, &k("a"), 1000, g.put_id, Millis(2)),
        Ok(g.put_id)
    );
    // That owner restarts (a new incarnation mounts its segment): the copy is forgotten.
    s.mount_segment(
        owner(7),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(3),
    )
    .unwrap();
    assert_eq!(tiers(&mut s, "a", 4), vec![Tier::Memory]);
    s.remove(&k("a"), true, Millis(5)).unwrap();
    let id = s.disk_segment(owner(7), &seg(0)).unwrap();
    assert!(
        s.register_disk(id, &k("a"), 1000, g.put_id, Millis(6))
            .is_err(),
        "the removed key came back"
    );
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();

    // Registered back before any removal, the copy is tracked again (no tombstone later).
    let g = s.put_start(&k("b"), 1000, &on_memory, Millis(7)).unwrap();
    s.put_end("b", g.put_id, Millis(7)).unwrap();
    s.register_disk(id, &k("b"), 1000, g.put_id, Millis(8))
        .unwrap();
    s.mount_segment(
        owner(8),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(9),
    )
    .unwrap();
    let id = s.disk_segment(owner(8), &seg(0)).unwrap();
    assert_eq!(
        s.register_disk(id, &k("b"), 1000, g.put_id, Millis(10)),
        Ok(g.put_id)
    );
    assert_eq!(tiers(&mut s, "b", 11), vec![Tier::Memory, Tier::Disk]);
    s.check_invariants().unwrap();
}

/// A promotion given up after its timeout, whose report comes once another promotion took its
/// place: the late report is refused, and the newer promotion's range (not written yet) is not
/// made a replica. Before, any report for the segment took over the reservation there.
#[test]
fn a_late_report_of_an_expired_promotion_does_not_take_over_the_next_one() {
    let (mut s, id) = disk_only_a(2);
    tiers(&mut s, "a", 3);
    tiers(&mut s, "a", 4);
    let first = s.take_tasks(id, 10, Millis(5));
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].kind, TaskKind::Promote);
    // Not reported within the offload timeout: given up; the next read starts another.
    let later = 5 + s.policy().offload_timeout.as_millis() as u64 + 1_000;
    s.tick(Millis(later));
    tiers(&mut s, "a", later + 1);
    let second = s.take_tasks(id, 10, Millis(later + 2));
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second[0].offset, first[0].offset);
    assert!(s
        .report_promotion(id, &k("a"), first[0].put_id, first[0].offset, true)
        .is_err());
    assert_eq!(tiers(&mut s, "a", later + 3), vec![Tier::Disk]);
    s.report_promotion(id, &k("a"), second[0].put_id, second[0].offset, true)
        .unwrap();
    let (_, views) = s.get_replicas(&k("a"), Millis(later + 4)).unwrap();
    assert_eq!(views[0].tier, Tier::Memory);
    assert_eq!(views[0].offset, second[0].offset);
    s.check_invariants().unwrap();
}

#[test]
fn an_owner_restart_drops_its_disk_replicas_until_it_registers_them() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    put(&mut s, "a", MIB, 0).unwrap();
    s.evict(Millis(1), MIB);
    owner_works(&mut s, id, true, 2);
    s.mount_segment(
        owner(5),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(3),
    )
    .unwrap();
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn eager_offloads_beyond_the_queue_limit_wait_in_a_backlog_and_all_land() {
    let (mut s, id) = tiered(16 * MIB, eager(2));
    for i in 0..5 {
        put(&mut s, &format!("k{i}"), MIB, i).unwrap();
    }
    let mut rounds = 0;
    while s.offloads_outstanding() {
        let done = owner_works(&mut s, id, true, 10 + rounds);
        assert!(done.len() <= 2, "the queue limit holds");
        rounds += 1;
        assert!(rounds < 10, "the backlog drains");
    }
    for i in 0..5 {
        assert_eq!(
            tiers(&mut s, &format!("k{i}"), 100),
            vec![Tier::Memory, Tier::Disk]
        );
    }
}

#[test]
fn a_removed_version_is_not_registered_again_by_an_owner_that_never_dropped_it() {
    let (mut s, id) = tiered(2 * MIB, Policy::default());
    let v = put(&mut s, "a", MIB, 0).unwrap();
    s.evict(Millis(1), MIB);
    owner_works(&mut s, id, true, 2);
    s.remove(&k("a"), true, Millis(3)).unwrap();
    // The owner dies before it drops the record, and comes back on the same directory.
    s.mount_segment(
        owner(7),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(4),
    )
    .unwrap();
    let id = s.disk_segment(owner(7), &seg(0)).unwrap();
    assert!(s.register_disk(id, &k("a"), MIB, v, Millis(10)).is_err());
    assert_eq!(s.key_count(), 0);
    // Refused again while the owner has not said the record is gone (the answer was lost, or
    // its drop failed there); once it has, the tombstone goes.
    assert!(s.register_disk(id, &k("a"), MIB, v, Millis(11)).is_err());
    assert_eq!(s.key_count(), 0);
    s.disk_dropped(id, &k("a"), v, Millis(12));
    assert!(!s.tombstones.contains(&(seg(0), k("a")), v));
    s.check_invariants().unwrap();
}

#[test]
fn a_promotion_abandoned_by_a_remove_keeps_its_memory_until_the_writer_is_surely_done() {
    let policy = Policy {
        eager_offload: true,
        promote_after_hits: 1,
        ..Policy::default()
    };
    let (mut s, id) = tiered(4 * MIB, policy.clone());
    put(&mut s, "a", MIB, 0).unwrap();
    owner_works(&mut s, id, true, 1);
    s.evict(Millis(2), MIB);
    assert_eq!(tiers(&mut s, "a", 3), vec![Tier::Disk]); // promotion starts
    assert_eq!(s.allocated(), MIB);
    s.remove(&k("a"), true, Millis(4)).unwrap();
    // The owner may still be copying into the range: it is not handed out yet.
    assert_eq!(s.allocated(), MIB);
    s.check_invariants().unwrap();
    s.tick(Millis(4).plus(policy.put_release_timeout));
    assert_eq!(s.allocated(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn an_object_whose_offload_failed_is_offloaded_again_after_the_timeout() {
    let policy = Policy {
        when_disk_behind: WhenDiskBehind::Keep,
        offload_timeout: Duration::from_secs(5),
        ..Policy::default()
    };
    let (mut s, id) = tiered(2 * MIB, policy);
    put(&mut s, "a", MIB, 0).unwrap();
    s.evict(Millis(1), MIB);
    owner_works(&mut s, id, false, 2);
    // Within the timeout: kept in memory (the policy says keep), no new offload.
    s.evict(Millis(3), MIB);
    assert!(s.take_tasks(id, 10, Millis(0)).is_empty());
    assert_eq!(s.key_count(), 1);
    // After it: tried again.
    s.evict(Millis(6_000), MIB);
    assert_eq!(s.take_tasks(id, 10, Millis(0)).len(), 1);
    s.check_invariants().unwrap();
}

/// A soft-pinned object met twice in one eviction round (the order cycles once something is
/// evicted) starts its offload once and is never dropped while that offload is on its way.
#[test]
fn a_soft_pinned_object_met_twice_in_a_round_is_offloaded_not_dropped() {
    let (mut s, id) = tiered(4 * MIB, Policy::default());
    let soft = ReplicateConfig {
        soft_pin: true,
        ..ReplicateConfig::default()
    };
    let g = s.put_start(&k("s"), MIB, &soft, Millis(0)).unwrap();
    s.put_end("s", g.put_id, Millis(0)).unwrap();
    put(&mut s, "a", MIB, 0).unwrap();
    s.make_room(Millis(1), 4 * MIB);
    s.check_invariants().unwrap();
    assert!(
        s.objects.get(&k("s")).is_some(),
        "the soft-pinned object was dropped"
    );
    assert_eq!(s.counters().dropped_disk_behind, 0);
    // Both offloads land and both objects stay readable from disk.
    owner_works(&mut s, id, true, 2);
    assert_eq!(tiers(&mut s, "s", 3), vec![Tier::Disk]);
    assert_eq!(tiers(&mut s, "a", 3), vec![Tier::Disk]);
}

/// A report naming a segment that is gone (unmounted between the owner's lookup and its report),
/// or one without an SSD tier, records no disk copy: later reads and removals find the object
/// whole instead of a disk replica on a segment that does not exist.
#[test]
fn an_offload_report_for_a_segment_that_is_gone_or_has_no_tier_is_refused() {
    let (mut s, id) = tiered(4 * MIB, Policy::default());
    let plain = mount(&mut s, 1, 4 * MIB, 0);
    let g = s.put_start(&k("k"), MIB, &on(1), Millis(0)).unwrap();
    s.put_end("k", g.put_id, Millis(0)).unwrap();
    // No SSD tier on seg1: nothing to record.
    assert!(s
        .report_task(plain, TaskKind::Offload, &k("k"), g.put_id, true, Millis(1))
        .is_err());
    s.check_invariants().unwrap();
    // seg0 unmounted, then a late report names it.
    s.unmount_segment(owner(0), &seg(0)).unwrap();
    assert!(s
        .report_task(id, TaskKind::Offload, &k("k"), g.put_id, true, Millis(2))
        .is_err());
    assert!(s
        .report_task(id, TaskKind::Drop, &k("k"), g.put_id, true, Millis(2))
        .is_err());
    s.check_invariants().unwrap();
    assert_eq!(tiers(&mut s, "k", 3), vec![Tier::Memory]);
    s.remove(&k("k"), true, Millis(4)).unwrap();
    s.check_invariants().unwrap();
}

/// Eager offloads wait per SSD tier: keys for an idle tier start at once while another tier's
/// queue is full, and the full tier's keys start as its offloads land, oldest first.
#[test]
fn eager_backlogs_are_per_tier() {
    let (mut s, busy) = tiered(16 * MIB, eager(1));
    let idle = mount(&mut s, 1, 16 * MIB, 1 << 30);
    for i in 0..4 {
        let key = format!("busy{i}");
        let g = s.put_start(&k(&key), MIB, &on(0), Millis(1)).unwrap();
        s.put_end(&key, g.put_id, Millis(1)).unwrap();
    }
    let g = s.put_start(&k("idle"), MIB, &on(1), Millis(1)).unwrap();
    s.put_end("idle", g.put_id, Millis(1)).unwrap();
    let started: Vec<String> = owner_works(&mut s, idle, true, 2)
        .iter()
        .map(|t| t.key.to_string())
        .collect();
    assert_eq!(started, vec!["idle"]);
    for i in 0..4 {
        let tasks = owner_works(&mut s, busy, true, 3 + i);
        assert_eq!(tasks.len(), 1, "the queue limit holds");
        assert_eq!(tasks[0].key.as_str(), format!("busy{i}"), "oldest first");
    }
    assert!(!s.offloads_outstanding());
    s.check_invariants().unwrap();
}

/// A promotion and a copy that land on the same segment leave one replica there: the second to
/// land gives its range back (and its owner forgets it).
#[test]
fn a_promotion_and_a_copy_to_one_segment_leave_one_replica_there() {
    let (mut s, id) = disk_only_a(2);
    tiers(&mut s, "a", 3);
    tiers(&mut s, "a", 4);
    let promote = s.take_tasks(id, 10, Millis(0));
    assert_eq!(promote[0].kind, TaskKind::Promote);
    let task = s
        .create_replica_task(
            &k("a"),
            replica_tasks::TaskRequest::Copy { targets: &[seg(0)] },
            Millis(5),
        )
        .unwrap();
    let copy = s.take_tasks(id, 10, Millis(5));
    assert_eq!(copy.len(), 1);
    s.report_copy(
        id,
        task,
        &k("a"),
        copy[0].put_id,
        copy[0].offset,
        None,
        Millis(6),
    )
    .unwrap();
    s.report_promotion(id, &k("a"), promote[0].put_id, promote[0].offset, true)
        .unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.allocated(), MIB, "the second range went back");
}

/// A disk-only object goes with its owner's segment (the owner restarted, or missed its
/// heartbeats). Removing its key meanwhile, before or after the owner mounts again, keeps its
/// record from coming back when the owner registers it; left alone, the record comes back.
/// Before, the removal found nothing to remove and laid no tombstone: the removed key came back.
#[test]
fn a_removed_key_does_not_come_back_from_a_dropped_segments_disk() {
    for remove_before_the_mount in [true, false] {
        let (mut s, _) = disk_only_a(2);
        let left = put(&mut s, "left", MIB, 3).unwrap();
        let id = s.disk_segment(owner(0), &seg(0)).unwrap();
        owner_works(&mut s, id, true, 4);
        s.evict(Millis(5), MIB);
        assert_eq!(tiers(&mut s, "a", 6), vec![Tier::Disk]);
        assert_eq!(tiers(&mut s, "left", 6), vec![Tier::Disk]);
        let a = s.objects.get("a").unwrap().put_id;
        // Its owner is silent past the client TTL: the segment goes, with both objects.
        let ttl = s.policy.client_ttl.as_millis() as u64;
        s.tick(Millis(7 + ttl + 1));
        assert_eq!(s.key_count(), 0);
        let now = 8 + ttl + 1;
        if remove_before_the_mount {
            assert!(s.remove(&k("a"), false, Millis(now)).is_err());
        }
        s.mount_segment(
            owner(9),
            seg(0),
            4 * MIB,
            1 << 30,
            MountReport::default(),
            Millis(now + 1),
        )
        .unwrap();
        if !remove_before_the_mount {
            assert!(s.remove(&k("a"), false, Millis(now + 2)).is_err());
        }
        let id = s.disk_segment(owner(9), &seg(0)).unwrap();
        assert!(
            s.register_disk(id, &k("a"), MIB, a, Millis(now + 3))
                .is_err(),
            "the removed key came back from disk"
        );
        assert_eq!(
            s.register_disk(id, &k("left"), MIB, left, Millis(now + 3)),
            Ok(left),
            "a record of a key nobody removed comes back"
        );
        assert_eq!(tiers(&mut s, "left", now + 4), vec![Tier::Disk]);
        assert_eq!(s.key_count(), 1);
        s.check_invariants().unwrap();
    }
}

/// A disk copy on a segment dropped while its object lived on elsewhere, the object then gone
/// with that other segment: removing the key still keeps the first segment's record from
/// coming back. Before, the first segment's remembered records (none, then) were forgotten at
/// the next upkeep, and the record came back.
#[test]
fn a_record_whose_object_went_later_with_another_segment_stays_removed() {
    let policy = Policy {
        client_ttl: Duration::from_secs(10),
        ..Policy::default()
    };
    let mut s = MasterState::with_seed(policy, 7);
    s.mount_segment(
        owner(0),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let tiered_seg = s.disk_segment(owner(0), &seg(0)).unwrap();
    s.mount_segment(
        owner(1),
        seg(1),
        2 * MIB,
        0,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let g = s.put_start(&k("a"), 1000, &on(1), Millis(1)).unwrap();
    s.put_end("a", g.put_id, Millis(1)).unwrap();
    s.register_disk(tiered_seg, &k("a"), 1000, g.put_id, Millis(2))
        .unwrap();
    // Owner 0 goes silent: its segment goes, "a" stays (its memory replica is on seg(1)).
    let mut now = 0;
    while now < 15_000 {
        now += 1_000;
        s.heartbeat(owner(1), Millis(now));
        s.tick(Millis(now));
    }
    assert_eq!(tiers(&mut s, "a", now), vec![Tier::Memory]);
    // Then owner 1: "a" goes with seg(1).
    while now < 30_000 {
        now += 1_000;
        s.tick(Millis(now));
    }
    assert_eq!(s.key_count(), 0);
    assert!(s.remove(&k("a"), false, Millis(now)).is_err());
    s.mount_segment(
        owner(7),
        seg(0),
        2 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(now),
    )
    .unwrap();
    let id = s.disk_segment(owner(7), &seg(0)).unwrap();
    assert!(
        s.register_disk(id, &k("a"), 1000, g.put_id, Millis(now + 1))
            .is_err(),
        "the removed key came back from disk"
    );
    s.check_invariants().unwrap();
}

/// The owner of `seg(0)` restarted (a new incarnation, 4 MiB and an SSD tier) at `now`: its
/// disk segment.
fn restarted_on_its_ssd(s: &mut MasterState, now: u64) -> SegmentId {
    s.mount_segment(
        owner(9),
        seg(0),
        4 * MIB,
        1 << 30,
        MountReport::default(),
        Millis(now),
    )
    .unwrap();
    s.disk_segment(owner(9), &seg(0)).unwrap()
}

/// A key removed while its offload is under way, whose owner writes the record and then goes
/// before its report lands (a crash, a lost RPC): the record is refused when the owner,
/// restarted on its SSD, registers it. The same when the owner's segment was dropped with the
/// offload pending and the key removed afterwards (a second replica kept it alive). Before, a
/// pending offload counted as no disk copy: no tombstone, and the removed key came back.
#[test]
fn a_key_removed_during_its_offload_does_not_come_back_from_the_record() {
    // Removed while the offload is pending.
    let (mut s, id) = tiered(4 * MIB, eager(8));
    let v = put(&mut s, "a", MIB, 1).unwrap();
    let tasks = s.take_tasks(id, 10, Millis(2));
    assert_eq!(tasks[0].kind, TaskKind::Offload);
    s.remove(&k("a"), true, Millis(3)).unwrap();
    assert!(s.tombstones.contains(&(seg(0), k("a")), v));
    let again = restarted_on_its_ssd(&mut s, 4);
    assert!(
        s.register_disk(again, &k("a"), MIB, v, Millis(5)).is_err(),
        "the removed key came back"
    );
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();

    // An offload that failed left no record: its tombstone goes with its report (kept, they
    // added up with every removal during an offload).
    let (mut s, id) = tiered(4 * MIB, eager(8));
    let v = put(&mut s, "c", MIB, 1).unwrap();
    assert_eq!(s.take_tasks(id, 10, Millis(2))[0].kind, TaskKind::Offload);
    s.remove(&k("c"), true, Millis(3)).unwrap();
    assert!(s.tombstones.contains(&(seg(0), k("c")), v));
    let _ = s.report_task(id, TaskKind::Offload, &k("c"), v, false, Millis(4));
    assert!(!s.tombstones.contains(&(seg(0), k("c")), v));

    // The segment dropped with the offload pending, the key kept by a replica elsewhere and
    // removed afterwards.
    let (mut s, id) = tiered(4 * MIB, eager(8));
    mount(&mut s, 1, 4 * MIB, 0);
    let two = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    let g = s.put_start(&k("b"), MIB, &two, Millis(1)).unwrap();
    s.put_end("b", g.put_id, Millis(1)).unwrap();
    let tasks = s.take_tasks(id, 10, Millis(2));
    assert_eq!(tasks[0].kind, TaskKind::Offload);
    let again = restarted_on_its_ssd(&mut s, 3);
    assert_eq!(tiers(&mut s, "b", 4), vec![Tier::Memory]);
    s.release_leases(&["b"], Millis(4));
    s.remove(&k("b"), false, Millis(5)).unwrap();
    assert!(
        s.register_disk(again, &k("b"), MIB, g.put_id, Millis(6))
            .is_err(),
        "the removed key came back"
    );
    s.check_invariants().unwrap();
}
