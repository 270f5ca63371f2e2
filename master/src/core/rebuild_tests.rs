//! The catalog rebuild, on an injected clock: when unknown keys are "not known yet", how a
//! report becomes objects and allocations, and what a report may not do.

use std::time::Duration;

use mooncake_common::{ClientId, ObjectKey, ReplicateConfig, SegmentName, Stamp};

use super::*;
use crate::{clock::Millis, error::MasterError};

const MIB: u64 = 1 << 20;

fn seg(i: u16) -> SegmentName {
    SegmentName::parse(&format!("127.0.0.1:{}", 2000 + i)).unwrap()
}

fn owner(i: u16) -> ClientId {
    ClientId::from_u128(i as u128 + 100)
}

fn item(key: &str, offset: u64, size: u64, put_id: u64, replicas: u8) -> Reported {
    Reported {
        key: ObjectKey::new(key).unwrap(),
        offset,
        size,
        stamp: Stamp {
            put_id,
            replica_num: replicas,
            hard_pin: key.starts_with("pinned"),
            ..Stamp::default()
        },
    }
}

fn fresh() -> MasterState {
    fresh_with_ttl(Duration::from_secs(3600))
}

/// `fresh`, with owners expiring after `client_ttl` without a heartbeat.
fn fresh_with_ttl(client_ttl: Duration) -> MasterState {
    let mut s = MasterState::with_seed(
        Policy {
            client_ttl,
            ..Policy::default()
        },
        7,
    );
    // As the server does: ids of this process start above the earlier one's (the wall clock).
    s.raise_grants(1000);
    s.started(Millis(0));
    s
}

fn returning(newest_grant: u64, objects: u64) -> MountReport {
    MountReport {
        newest_grant,
        objects,
        disk_records: 0,
    }
}

fn lookup(s: &mut MasterState, key: &str, now: u64) -> Result<usize, MasterError> {
    s.get_replicas(&ObjectKey::new(key).unwrap(), Millis(now))
        .map(|(_, r)| r.len())
}

#[test]
fn a_fresh_cluster_answers_not_found_as_soon_as_an_owner_says_it_is_fresh() {
    let mut s = fresh();
    assert!(matches!(
        lookup(&mut s, "k", 10),
        Err(MasterError::Rebuilding(_))
    ));
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(0, 0), Millis(20))
        .unwrap();
    assert!(matches!(
        lookup(&mut s, "k", 30),
        Err(MasterError::NotFound(_))
    ));
    // Without any owner, the grace alone bounds it.
    let s = fresh();
    assert!(s.rebuilding(Millis(1_999)) && !s.rebuilding(Millis(2_000)));
}

#[test]
fn a_restarted_master_adopts_what_owners_report_and_waits_for_the_reports() {
    let mut s = fresh();
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        returning(1900, 3),
        Millis(100),
    )
    .unwrap();
    s.mount_segment(
        owner(1),
        seg(1),
        4 * MIB,
        0,
        returning(1950, 1),
        Millis(100),
    )
    .unwrap();
    assert!(
        s.next_grant() > 1950,
        "ids continue above every grant the owners saw"
    );
    // Reporting segments take no allocation, and unknown keys are not known yet, also past the
    // grace, while a report is open: a put is told to retry shortly.
    assert!(matches!(
        s.put_start(
            &ObjectKey::new("new").unwrap(),
            1000,
            &ReplicateConfig::default(),
            Millis(150)
        ),
        Err(MasterError::Rebuilding(_))
    ));
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![
            item("a", 0, 1000, 700, 2),
            item("pinned/b", 1024, 10, 800, 1),
        ],
        false,
        Millis(200),
    )
    .unwrap();
    assert!(matches!(
        lookup(&mut s, "a", 2_500),
        Err(MasterError::Rebuilding(_))
    ));
    let done = s
        .catalog_reported(
            owner(0),
            &seg(0),
            vec![item("c", 4096, 64, 900, 1)],
            true,
            Millis(2_600),
        )
        .unwrap()
        .unwrap();
    assert_eq!((done.registered, done.refused), (3, 0));
    assert!(
        matches!(
            lookup(&mut s, "zzz", 2_700),
            Err(MasterError::Rebuilding(_))
        ),
        "segment 1 still reports"
    );
    // The second replica of "a", and a stale older version of "c" that loses to the current one.
    let done = s
        .catalog_reported(
            owner(1),
            &seg(1),
            vec![item("a", 64, 1000, 700, 2), item("c", 8192, 64, 850, 1)],
            true,
            Millis(2_800),
        )
        .unwrap()
        .unwrap();
    assert_eq!((done.registered, done.refused), (1, 1));
    let freed: Vec<(u64, u64)> = s
        .take_freed(owner(1))
        .iter()
        .map(|f| (f.offset, f.put_id))
        .collect();
    assert_eq!(
        freed,
        vec![(8192, 850)],
        "the refused older version's owner forgets it"
    );
    assert_eq!(lookup(&mut s, "a", 2_900), Ok(2));
    assert_eq!(lookup(&mut s, "c", 2_900), Ok(1));
    assert!(matches!(
        lookup(&mut s, "zzz", 2_900),
        Err(MasterError::NotFound(_))
    ));
    // The allocator holds exactly the adopted ranges: new puts land beside them.
    let stats = s.segment_stats();
    let seg0 = stats.iter().find(|x| x.name == seg(0)).unwrap();
    assert_eq!(seg0.allocated, 1024 + 64 + 64);
    let g = s
        .put_start(
            &ObjectKey::new("new").unwrap(),
            100,
            &ReplicateConfig::default(),
            Millis(3_000),
        )
        .unwrap();
    assert!(g.put_id > 1950);
    // A put started by the earlier master ends with a retryable answer, not "not found".
    assert!(matches!(
        s.put_end("lost", 500, Millis(3_000)),
        Err(MasterError::EarlierMaster { .. })
    ));
}

/// A key removed while owners still report would come back with the next report that holds it
/// (a second replica): the removal is refused as "not known yet" (the client asks again)
/// until the rebuild is over, and then holds.
#[test]
fn a_removal_waits_for_the_rebuild_so_a_later_report_cannot_bring_the_key_back() {
    let mut s = fresh();
    for i in 0..2 {
        s.mount_segment(
            owner(i),
            seg(i),
            4 * MIB,
            0,
            returning(1900, 1),
            Millis(100),
        )
        .unwrap();
    }
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![item("a", 0, 1000, 700, 2)],
        true,
        Millis(200),
    )
    .unwrap()
    .unwrap();
    let a = ObjectKey::new("a").unwrap();
    assert!(matches!(
        s.remove(&a, false, Millis(300)),
        Err(MasterError::Rebuilding(_))
    ));
    // A replica clear likewise, for a known key and one not known yet.
    let unknown = ObjectKey::new("not-yet").unwrap();
    for cleared in s.replica_clear(&[a.clone(), unknown], None, Millis(300)) {
        assert!(
            matches!(cleared, Err(MasterError::Rebuilding(_))),
            "{cleared:?}"
        );
    }
    s.catalog_reported(
        owner(1),
        &seg(1),
        vec![item("a", 64, 1000, 700, 2)],
        true,
        Millis(400),
    )
    .unwrap()
    .unwrap();
    let over = Millis(s.policy().rebuild_grace.as_millis() as u64 + 500);
    assert!(!s.rebuilding(over));
    s.remove(&a, false, over).unwrap();
    assert!(matches!(
        lookup(&mut s, "a", over.0 + 1),
        Err(MasterError::NotFound(_))
    ));
    let notes = |s: &mut MasterState, i| {
        s.take_freed(owner(i))
            .iter()
            .map(|f| (f.offset, f.put_id))
            .collect::<Vec<_>>()
    };
    assert_eq!(notes(&mut s, 0), vec![(0, 700)]);
    assert_eq!(notes(&mut s, 1), vec![(64, 700)]);
    s.check_invariants().unwrap();
}

/// Disk records registered while the master rebuilds: a newer version found after an older one
/// replaces it there too (before: the replacement went through the client's removal, which
/// waits for the rebuild, and the master panicked), and ids issued later are above every
/// registered version, as above the grants reported at mounts.
#[test]
fn disk_records_registered_during_a_rebuild_replace_older_ones_and_raise_the_ids() {
    let mut s = fresh();
    for i in 0..2 {
        s.mount_segment(
            owner(i),
            seg(i),
            4 * MIB,
            1 << 30,
            returning(1900, 0),
            Millis(100),
        )
        .unwrap();
    }
    assert!(s.rebuilding(Millis(200)));
    let (d0, d1) = (
        s.disk_segment(owner(0), &seg(0)).unwrap(),
        s.disk_segment(owner(1), &seg(1)).unwrap(),
    );
    let a = ObjectKey::new("a").unwrap();
    assert_eq!(s.register_disk(d0, &a, 1000, 1500, Millis(200)), Ok(1500));
    let newer = s.next_grant() + 1_000;
    assert_eq!(s.register_disk(d1, &a, 900, newer, Millis(300)), Ok(newer));
    assert!(s.next_grant() > newer);
    s.check_invariants().unwrap();
}

/// A copy or promotion the previous master asked for, whose report reaches the new master only
/// after the owner's mount report (which listed the range) was adopted: the owner is told to
/// keep it, not to forget a range the master counts as a replica. One naming a range the
/// master does not count is refused as before.
#[test]
fn a_late_report_of_work_for_an_earlier_master_keeps_what_was_adopted() {
    let mut s = fresh();
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        returning(1900, 1),
        Millis(100),
    )
    .unwrap();
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![item("a", 4096, 1000, 700, 1)],
        true,
        Millis(200),
    )
    .unwrap()
    .unwrap();
    let id = s.segment_id(&seg(0)).unwrap();
    let a = ObjectKey::new("a").unwrap();
    s.report_copy(id, 12345, &a, 700, 4096, None, Millis(300))
        .unwrap();
    s.report_promotion(id, &a, 700, 4096, true).unwrap();
    for wrong in [
        s.report_copy(id, 12345, &a, 700, 0, None, Millis(300)),
        s.report_copy(id, 12345, &a, 699, 4096, None, Millis(300)),
        s.report_copy(id, 12345, &a, 700, 4096, Some("failed"), Millis(300)),
        s.report_promotion(id, &a, 700, 8192, true),
        s.report_promotion(id, &a, 700, 4096, false),
    ] {
        assert!(
            matches!(wrong, Err(MasterError::StalePut { .. })),
            "{wrong:?}"
        );
    }
    assert_eq!(lookup(&mut s, "a", 400), Ok(1));
    s.check_invariants().unwrap();
}

/// An owner keeps an upsert's old range while readers are leased on it, so a rebuild may hear
/// of both versions of a key, the older first: the newer one wins, and the older one's owner is
/// told to forget it.
#[test]
fn a_newer_version_reported_after_an_older_one_replaces_it() {
    let mut s = fresh();
    for i in 0..2 {
        s.mount_segment(
            owner(i),
            seg(i),
            4 * MIB,
            0,
            returning(1900, 1),
            Millis(100),
        )
        .unwrap();
    }
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![item("a", 0, 1000, 700, 1)],
        true,
        Millis(200),
    )
    .unwrap();
    s.catalog_reported(
        owner(1),
        &seg(1),
        vec![item("a", 4096, 900, 750, 1)],
        true,
        Millis(300),
    )
    .unwrap();
    let (size, replicas) = s
        .get_replicas(&ObjectKey::new("a").unwrap(), Millis(2_500))
        .unwrap();
    assert_eq!(
        (size, replicas.len(), replicas[0].put_id),
        (900, 1, 750),
        "the newer version"
    );
    assert_eq!(replicas[0].segment, seg(1));
    let freed: Vec<(u64, u64)> = s
        .take_freed(owner(0))
        .iter()
        .map(|f| (f.offset, f.put_id))
        .collect();
    assert_eq!(freed, vec![(0, 700)], "the older one's owner forgets it");
    let used: u64 = s.segment_stats().iter().map(|x| x.allocated).sum();
    assert_eq!(
        used, 960,
        "only the newer version's range (900 bytes: 960 reserved) is in use"
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_report_may_not_lay_out_what_cannot_be() {
    let mut s = fresh();
    let mounted = s.mount_segment(owner(0), seg(0), MIB, 0, returning(10, 4), Millis(0));
    assert_eq!(mounted, Ok(Mounted::AwaitingReport));
    let retried = s.mount_segment(owner(0), seg(0), MIB, 0, returning(10, 4), Millis(1));
    assert_eq!(retried, Ok(Mounted::AwaitingReport), "nothing laid out yet");
    let done = s
        .catalog_reported(
            owner(0),
            &seg(0),
            vec![
                item("ok", 0, 100, 5, 1),
                item("overlaps", 64, 100, 6, 1),
                item("misaligned", 300, 10, 7, 1),
                item("outside", MIB - 64, 128, 8, 1),
            ],
            true,
            Millis(10),
        )
        .unwrap()
        .unwrap();
    assert_eq!((done.registered, done.refused), (1, 3));
    // Only the mounting owner may report, and only while a report is open.
    assert!(s
        .catalog_reported(owner(9), &seg(0), vec![], true, Millis(20))
        .is_err());
    assert!(s
        .catalog_reported(owner(0), &seg(0), vec![], true, Millis(20))
        .is_err());
    // A mount retried after the merge (its answer lost) has nothing to report.
    let retried = s.mount_segment(owner(0), seg(0), MIB, 0, returning(10, 4), Millis(30));
    assert_eq!(retried, Ok(Mounted::Ready));
}

#[test]
fn a_new_leader_waits_for_the_segments_the_previous_one_had_within_the_window() {
    let mut s = fresh();
    s.expect_segments(vec![seg(0), seg(1)], Millis(0));
    s.mount_segment(owner(0), seg(0), MIB, 0, returning(5, 0), Millis(100))
        .unwrap();
    assert!(s.rebuilding(Millis(5_000)), "seg(1) has not come back");
    s.mount_segment(owner(1), seg(1), MIB, 0, returning(5, 0), Millis(5_100))
        .unwrap();
    assert!(!s.rebuilding(Millis(5_200)));
    // A segment that never comes back holds the rebuild only until the window closes.
    let mut s = fresh();
    s.expect_segments(vec![seg(3)], Millis(0));
    assert!(s.rebuilding(Millis(29_999)) && !s.rebuilding(Millis(30_000)));
}

/// An owner of an earlier master that has records on its SSD registers them after its mount:
/// until it says it registered the last, keys not known yet stay "not known yet" (past the
/// grace too). Before, a get of a key only on disk answered "not found" meanwhile, and a
/// removal missed it.
#[test]
fn a_rebuild_waits_for_the_records_an_owner_registers_from_disk() {
    let mut s = fresh();
    let report = MountReport {
        newest_grant: 10,
        objects: 0,
        disk_records: 2,
    };
    s.mount_segment(owner(0), seg(0), MIB, 1 << 30, report, Millis(100))
        .unwrap();
    assert!(
        s.rebuilding(Millis(5_000)),
        "past the grace, records to come"
    );
    let id = s.disk_segment(owner(0), &seg(0)).unwrap();
    s.register_disk(
        id,
        &ObjectKey::new("on-disk").unwrap(),
        100,
        7,
        Millis(5_000),
    )
    .unwrap();
    assert!(matches!(
        lookup(&mut s, "other", 5_001),
        Err(MasterError::Rebuilding(_))
    ));
    s.disk_registered(id);
    assert!(!s.rebuilding(Millis(5_002)));
    assert_eq!(lookup(&mut s, "on-disk", 5_003), Ok(1));
    assert!(matches!(
        lookup(&mut s, "other", 5_003),
        Err(MasterError::NotFound(_))
    ));
    s.check_invariants().unwrap();
}

/// Copies of one version reported by several owners (a replica task's copy carries no pin)
/// keep the strongest pin any of them reports, whichever reports first. Before, the first
/// report's pin stood: a hard-pinned object whose unpinned copy was reported first became
/// evictable after a failover.
#[test]
fn copies_of_one_version_keep_the_strongest_pin_reported() {
    let mut s = fresh();
    for i in 0..2 {
        s.mount_segment(
            owner(i),
            seg(i),
            4 * MIB,
            0,
            returning(1900, 1),
            Millis(100),
        )
        .unwrap();
    }
    let copy = item("k", 0, 1000, 1500, 2);
    let mut pinned = item("k", 0, 1000, 1500, 2);
    pinned.stamp.hard_pin = true;
    s.catalog_reported(owner(1), &seg(1), vec![copy], true, Millis(110))
        .unwrap()
        .unwrap();
    s.catalog_reported(owner(0), &seg(0), vec![pinned], true, Millis(120))
        .unwrap()
        .unwrap();
    // Past the rebuild window and any lease, at a high enough ratio to take everything else.
    let later = 3_600_000;
    s.tick(Millis(later));
    s.evict(Millis(later), 64 * MIB);
    assert_eq!(
        lookup(&mut s, "k", later + 1),
        Ok(2),
        "a hard-pinned object was evicted"
    );
    s.check_invariants().unwrap();
}

/// An owner restarted on its SSD directory (its memory pool empty, its disk records found) is an
/// owner of an earlier master, not a fresh one: the rebuild waits for its records. Before, its
/// mount (no put id seen in memory) ended the rebuild at once, so a get of a key on its disk
/// answered "not found", and a removal of it missed it, until its record was registered.
#[test]
fn an_owner_back_with_only_disk_records_is_waited_for() {
    let mut s = fresh();
    let report = MountReport {
        newest_grant: 0,
        objects: 0,
        disk_records: 2,
    };
    s.mount_segment(owner(0), seg(0), MIB, 1 << 30, report, Millis(100))
        .unwrap();
    assert!(s.rebuilding(Millis(5_000)), "records to come");
    assert!(matches!(
        lookup(&mut s, "on-disk", 5_001),
        Err(MasterError::Rebuilding(_))
    ));
    let id = s.disk_segment(owner(0), &seg(0)).unwrap();
    s.register_disk(
        id,
        &ObjectKey::new("on-disk").unwrap(),
        100,
        7,
        Millis(5_002),
    )
    .unwrap();
    s.disk_registered(id);
    assert!(!s.rebuilding(Millis(5_003)));
    assert_eq!(lookup(&mut s, "on-disk", 5_004), Ok(1));
    s.check_invariants().unwrap();
}

/// A mount retried after its answer was lost, from an owner whose pool holds nothing any more
/// (the objects it counted the first time were forgotten meanwhile), ends the report the first
/// mount opened: the segment takes puts. Before, the report stayed open with nothing to come,
/// and every put to the segment was told to retry until the rebuild window closed.
#[test]
fn a_retried_mount_with_nothing_to_report_ends_the_report() {
    let mut s = fresh();
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 2), Millis(10))
        .unwrap();
    let again = s
        .mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 0), Millis(20))
        .unwrap();
    assert!(matches!(again, Mounted::Ready));
    // Past the grace: no report holds the rebuild open, and the segment takes allocations.
    s.put_start(
        &ObjectKey::new("x").unwrap(),
        1000,
        &ReplicateConfig::default(),
        Millis(2_030),
    )
    .unwrap();
    s.check_invariants().unwrap();
}

/// A fresh master whose one owner (of an earlier master) reported `reported` at 10-20 ms.
fn reported_by_one_owner(reported: Reported) -> MasterState {
    let mut s = fresh();
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 1), Millis(10))
        .unwrap();
    s.catalog_reported(owner(0), &seg(0), vec![reported], true, Millis(20))
        .unwrap();
    s
}

/// A mount retried after its report was merged and everything it adopted went (removed or
/// evicted), from an owner that still lists those objects (it missed the mount's answer, so it
/// has not applied the freed-range notes): the master answers ready and keeps its notes. Before,
/// the empty allocator looked like a report not laid out yet: the report started over and the
/// removed key came back, on a range the owner then forgot.
#[test]
fn a_mount_retried_after_its_report_was_merged_does_not_bring_removed_keys_back() {
    let mut s = reported_by_one_owner(item("k", 0, 1000, 800, 1));
    s.tick(Millis(2_100));
    assert!(!s.rebuilding(Millis(2_100)));
    assert_eq!(lookup(&mut s, "k", 2_101), Ok(1));
    s.release_leases(&["k"], Millis(2_102));
    s.remove(&ObjectKey::new("k").unwrap(), false, Millis(2_103))
        .unwrap();
    let again = s
        .mount_segment(
            owner(0),
            seg(0),
            4 * MIB,
            0,
            returning(1900, 1),
            Millis(2_200),
        )
        .unwrap();
    assert!(
        matches!(again, Mounted::Ready),
        "the report is not asked again"
    );
    assert!(matches!(
        lookup(&mut s, "k", 2_300),
        Err(MasterError::NotFound(_))
    ));
    s.check_invariants().unwrap();
}

/// An owner reporting its catalog (or registering disk records, or polling) sends no heartbeat
/// meanwhile: each of those calls shows it alive, so a report longer than the client TTL does
/// not get it expired half-way (it would start over at its remount, and again, for good).
#[test]
fn an_owner_reporting_for_longer_than_the_ttl_is_not_expired() {
    let mut s = fresh_with_ttl(Duration::from_secs(1));
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(900, 3), Millis(100))
        .unwrap();
    let mut now = 100;
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        // A chunk every 0.8 s; upkeep runs in between, as it does every fraction of a second.
        for _ in 0..4 {
            now += 200;
            s.tick(Millis(now));
        }
        let done = i == 2;
        let item = item(key, i as u64 * 4096, 1000, 800 + i as u64, 1);
        s.catalog_reported(owner(0), &seg(0), vec![item], done, Millis(now))
            .unwrap();
    }
    assert!(now > 100 + 2_000, "the report outlasted the TTL twice");
    s.tick(Millis(now + 100));
    assert_eq!(
        lookup(&mut s, "c", now + 200),
        Ok(1),
        "every object adopted"
    );
    s.check_invariants().unwrap();
}

/// An owner the master dropped (it missed heartbeats for the client TTL) comes back to the same
/// master and reports its pool: what was removed meanwhile does not come back with it, whether
/// the removal came before the drop (its note never reached the owner) or after (the object was
/// already gone with the segment, or kept another replica); what it still held does.
#[test]
fn an_owner_back_after_being_dropped_does_not_bring_back_removed_objects() {
    let mut s = fresh_with_ttl(Duration::from_secs(1));
    for i in 0..2 {
        s.mount_segment(
            owner(i),
            seg(i),
            4 * MIB,
            0,
            MountReport::default(),
            Millis(0),
        )
        .unwrap();
    }
    let on_first = ReplicateConfig {
        preferred_segments: vec![seg(0)],
        ..ReplicateConfig::default()
    };
    let on_both = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    let mut report = Vec::new();
    for (key, config) in [
        ("a", &on_first),
        ("b", &on_first),
        ("c", &on_first),
        ("d", &on_both),
    ] {
        let g = s
            .put_start(&ObjectKey::new(key).unwrap(), 1000, config, Millis(10))
            .unwrap();
        s.put_end(key, g.put_id, Millis(11)).unwrap();
        let mine = g.replicas.iter().find(|r| r.segment == seg(0)).unwrap();
        report.push(item(
            key,
            mine.offset,
            1000,
            g.put_id,
            config.replica_num as u8,
        ));
    }
    // Removed while its owner cannot hear of it; then the owner is dropped.
    s.remove(&ObjectKey::new("a").unwrap(), false, Millis(20))
        .unwrap();
    let mut now = 20;
    while now < 1_500 {
        now += 200;
        s.heartbeat(owner(1), Millis(now));
        s.tick(Millis(now));
    }
    assert_eq!(
        lookup(&mut s, "c", now),
        Err(MasterError::NotFound(ObjectKey::new("c").unwrap()))
    );
    // Removed after the drop: one gone with the segment, one that kept its other replica.
    assert!(s
        .remove(&ObjectKey::new("b").unwrap(), false, Millis(now))
        .is_err());
    s.remove(&ObjectKey::new("d").unwrap(), false, Millis(now))
        .unwrap();

    // The owner is back (the partition healed) and reports what its pool holds.
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        returning(1900, 4),
        Millis(now + 10),
    )
    .unwrap();
    let outcome = s
        .catalog_reported(owner(0), &seg(0), report, true, Millis(now + 20))
        .unwrap()
        .unwrap();
    assert_eq!((outcome.registered, outcome.refused), (1, 3));
    assert_eq!(lookup(&mut s, "c", now + 30), Ok(1), "still held: adopted");
    for gone in ["a", "b", "d"] {
        assert!(lookup(&mut s, gone, now + 30).is_err(), "{gone} came back");
    }
    s.check_invariants().unwrap();
}

/// An owner dropped twice, the second time before its report came in (the partition came back
/// mid-report): what it held at the first drop still comes back when it reports at last. Before,
/// the second drop, holding nothing yet, replaced what the first had remembered, so the report's
/// objects were refused and the owner told to forget them: committed data lost for good.
#[test]
fn an_owner_dropped_again_before_its_report_keeps_what_it_held() {
    let mut s = fresh_with_ttl(Duration::from_secs(1));
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    let g = s
        .put_start(
            &ObjectKey::new("k").unwrap(),
            1000,
            &ReplicateConfig::default(),
            Millis(10),
        )
        .unwrap();
    s.put_end("k", g.put_id, Millis(11)).unwrap();
    let report = vec![item("k", g.replicas[0].offset, 1000, g.put_id, 1)];
    let silent_until = |s: &mut MasterState, from: u64, to: u64| {
        let mut now = from;
        while now < to {
            now += 200;
            s.tick(Millis(now));
        }
    };
    silent_until(&mut s, 11, 1_500);
    assert!(
        lookup(&mut s, "k", 1_500).is_err(),
        "dropped with its owner"
    );
    // Back, its report opened, and silent again for the TTL: dropped a second time.
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        returning(g.put_id, 1),
        Millis(1_600),
    )
    .unwrap();
    silent_until(&mut s, 1_600, 3_000);
    // Back for good: the report comes in.
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        returning(g.put_id, 1),
        Millis(3_100),
    )
    .unwrap();
    let outcome = s
        .catalog_reported(owner(0), &seg(0), report, true, Millis(3_200))
        .unwrap()
        .unwrap();
    assert_eq!((outcome.registered, outcome.refused), (1, 0));
    assert_eq!(
        lookup(&mut s, "k", 3_300),
        Ok(1),
        "k came back with its owner"
    );
    assert!(
        s.take_freed(owner(0)).is_empty(),
        "the owner was told to forget k"
    );
    s.check_invariants().unwrap();
}

/// While the only segment that could hold a put reports its catalog (a master restart, a
/// leader change), a put is told to retry shortly, not that the store is full, and nothing the
/// report brought is evicted for it.
#[test]
fn a_put_while_its_segment_reports_is_told_to_retry() {
    let mut s = fresh();
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 1), Millis(10))
        .unwrap();
    let e = s
        .put_start(
            &ObjectKey::new("x").unwrap(),
            1000,
            &ReplicateConfig::default(),
            Millis(20),
        )
        .unwrap_err();
    assert!(matches!(e, MasterError::Rebuilding(_)), "{e:?}");
    assert_eq!(e.code(), mooncake_common::Code::UnavailableInCurrentStatus);
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![item("a", 0, 1000, 1500, 1)],
        true,
        Millis(30),
    )
    .unwrap()
    .unwrap();
    assert_eq!(lookup(&mut s, "a", 40), Ok(1));
    // A key nobody reported waits for the grace (another owner may hold it).
    s.put_start(
        &ObjectKey::new("x").unwrap(),
        1000,
        &ReplicateConfig::default(),
        Millis(2_100),
    )
    .unwrap();
    s.check_invariants().unwrap();
}

/// While the master rebuilds, a put of a key it does not know yet is "not known yet" (retry),
/// as a lookup is: an owner yet to report may hold the key. Before, the put was granted; the
/// late report's older version was then refused, so a key written once got another value (and
/// lost both, had the put then failed). A key reported already answers as usual.
#[test]
fn a_put_of_a_key_not_known_yet_waits_for_the_rebuild() {
    let mut s = fresh();
    s.expect_segments(vec![seg(0), seg(1)], Millis(0));
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 1), Millis(10))
        .unwrap();
    s.catalog_reported(
        owner(0),
        &seg(0),
        vec![item("a", 0, 1000, 1500, 1)],
        true,
        Millis(20),
    )
    .unwrap()
    .unwrap();
    let put = |s: &mut MasterState, key: &str, now: u64| {
        s.put_start(
            &ObjectKey::new(key).unwrap(),
            1000,
            &ReplicateConfig::default(),
            Millis(now),
        )
    };
    let e = put(&mut s, "b", 3_000).unwrap_err();
    assert!(matches!(e, MasterError::Rebuilding(_)), "{e:?}");
    assert_eq!(e.code(), mooncake_common::Code::UnavailableInCurrentStatus);
    assert!(matches!(
        put(&mut s, "a", 3_000),
        Err(MasterError::Exists(_))
    ));
    // seg(1) reports "b": the value written once stays.
    s.mount_segment(
        owner(1),
        seg(1),
        4 * MIB,
        0,
        returning(1900, 1),
        Millis(3_100),
    )
    .unwrap();
    s.catalog_reported(
        owner(1),
        &seg(1),
        vec![item("b", 0, 1000, 1600, 1)],
        true,
        Millis(3_200),
    )
    .unwrap()
    .unwrap();
    assert!(!s.rebuilding(Millis(3_300)));
    assert!(matches!(
        put(&mut s, "b", 3_300),
        Err(MasterError::Exists(_))
    ));
    assert_eq!(lookup(&mut s, "b", 3_300), Ok(1));
    put(&mut s, "c", 3_300).unwrap();
    s.check_invariants().unwrap();
}

/// Put ids no master of the cluster issues (a corrupt catalog) neither use up the ids nor
/// overflow them: a mount naming one is refused, a reported object with one is not adopted.
#[test]
fn put_ids_beyond_any_issued_are_refused() {
    let mut s = fresh();
    for newest in [u64::MAX, u64::MAX - 1] {
        let e = s
            .mount_segment(
                owner(0),
                seg(0),
                4 * MIB,
                0,
                returning(newest, 1),
                Millis(10),
            )
            .unwrap_err();
        assert!(matches!(e, MasterError::Invalid(_)), "{e:?}");
    }
    s.mount_segment(owner(0), seg(0), 4 * MIB, 0, returning(1900, 2), Millis(20))
        .unwrap();
    let report = vec![
        item("a", 0, 1000, 1500, 1),
        item("b", MIB, 1000, u64::MAX, 1),
    ];
    let outcome = s
        .catalog_reported(owner(0), &seg(0), report, true, Millis(30))
        .unwrap()
        .unwrap();
    assert_eq!(outcome.registered, 1);
    assert_eq!(lookup(&mut s, "a", 40), Ok(1));
    assert!(lookup(&mut s, "b", 40).is_err());
    let g = s
        .put_start(
            &ObjectKey::new("c").unwrap(),
            1000,
            &ReplicateConfig::default(),
            Millis(2_050),
        )
        .unwrap();
    assert!(g.put_id > 1900 && g.put_id < 1 << 62);
    s.check_invariants().unwrap();
}

/// An owner of an earlier master that mounts after the rebuild is over reports its catalog
/// while clients already remove keys: a key removed meanwhile (known from another owner, or
/// not known at all) is not brought back by that report. Before, the report adopted it again,
/// and the removed key was readable.
#[test]
fn a_late_report_does_not_bring_back_keys_removed_while_it_was_open() {
    let mut s = reported_by_one_owner(item("k", 0, 1000, 800, 2));
    // Past the rebuild window: a second owner of the earlier master mounts late.
    s.tick(Millis(40_000));
    assert!(!s.rebuilding(Millis(40_000)));
    s.mount_segment(
        owner(1),
        seg(1),
        4 * MIB,
        0,
        returning(1900, 2),
        Millis(40_010),
    )
    .unwrap();
    assert!(!s.rebuilding(Millis(40_020)));
    // Removed while its report is open: "k" known from the first owner, "j" known nowhere.
    s.remove(&ObjectKey::new("k").unwrap(), false, Millis(40_020))
        .unwrap();
    assert!(matches!(
        s.remove(&ObjectKey::new("j").unwrap(), false, Millis(40_021)),
        Err(MasterError::NotFound(_))
    ));
    // The late owner holds a newer version of "k" than the one adopted: refused all the same
    // (everything it lists was there before the removal).
    let items = vec![item("k", 0, 1000, 820, 2), item("j", 4096, 1000, 850, 1)];
    let outcome = s
        .catalog_reported(owner(1), &seg(1), items, true, Millis(40_030))
        .unwrap()
        .unwrap();
    assert_eq!((outcome.registered, outcome.refused), (0, 2));
    for key in ["k", "j"] {
        assert!(
            matches!(lookup(&mut s, key, 40_040), Err(MasterError::NotFound(_))),
            "{key} came back"
        );
    }
    // Once no report is open, nothing is remembered.
    assert!(s.removed_while_reporting.is_empty());
    s.check_invariants().unwrap();
}
