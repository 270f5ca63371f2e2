//! The eviction order through the state machine: what CAR keeps that LRU loses, its memory per
//! object, stale entries, and the same protections under both policies. Invariants (every
//! object with memory in the order exactly once) are checked after each scenario.

use std::time::Duration;

use mooncake_common::{ClientId, ObjectKey, ReplicateConfig, SegmentName};

use super::*;
use crate::clock::Millis;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

fn one_segment(bytes: u64, eviction_policy: EvictionPolicy) -> MasterState {
    let policy = Policy {
        client_ttl: Duration::from_secs(3600),
        eviction_policy,
        ..Policy::default()
    };
    let mut s = MasterState::with_seed(policy, 11);
    s.mount_segment(
        ClientId::from_u128(1),
        SegmentName::parse("127.0.0.1:3000").unwrap(),
        bytes,
        0,
        MountReport::default(),
        Millis(0),
    )
    .unwrap();
    s
}

/// A put that makes room as the service does (eviction on a full segment), then ends.
fn put(s: &mut MasterState, key: &str, size: u64) {
    let cfg = ReplicateConfig::default();
    let g = s.put_start(&k(key), size, &cfg, Millis(0)).unwrap();
    s.put_end(key, g.put_id, Millis(0)).unwrap();
}

/// A reader's lookup and its release: the object was read, nothing holds it after.
fn read(s: &mut MasterState, key: &str) -> bool {
    let found = s.get_replicas(&k(key), Millis(0)).is_ok();
    if found {
        s.release_leases(&[key], Millis(0));
    }
    found
}

/// Blocks read twice long ago, then a scan of new blocks twice the cache: LRU evicts the old
/// blocks (least recently used), CAR keeps them in its frequent list while the recent list
/// takes the scan.
fn old_frequent_blocks_after_a_long_scan(policy: EvictionPolicy) -> usize {
    let mut s = one_segment(200 * 64 * KIB, policy);
    for i in 0..50 {
        put(&mut s, &format!("hot{i}"), 64 * KIB);
    }
    for i in 0..50 {
        assert!(read(&mut s, &format!("hot{i}")));
    }
    // The scan: eviction runs as puts find the segment full.
    for j in 0..400 {
        put(&mut s, &format!("scan{j}"), 64 * KIB);
    }
    s.check_invariants().unwrap();
    (0..50)
        .filter(|i| s.exists(&k(&format!("hot{i}")), Millis(0)))
        .count()
}

#[test]
fn car_keeps_what_was_read_again_where_lru_lets_a_scan_flush_it() {
    assert_eq!(
        old_frequent_blocks_after_a_long_scan(EvictionPolicy::Car),
        50
    );
    assert_eq!(
        old_frequent_blocks_after_a_long_scan(EvictionPolicy::Lru),
        0
    );
}

/// In a cache of 1000 objects of 4 KiB: half of it read again (the frequent list), then a scan
/// as large as the cache.
fn hot_then_scan(s: &mut MasterState) {
    for i in 0..500 {
        put(s, &format!("hot{i}"), 4 * KIB);
        assert!(read(s, &format!("hot{i}")));
    }
    for j in 0..1000 {
        put(s, &format!("scan{j}"), 4 * KIB);
    }
}

#[test]
fn a_key_put_again_soon_after_eviction_joins_the_frequent_list() {
    let mut s = one_segment(1000 * 4 * KIB, EvictionPolicy::Car);
    hot_then_scan(&mut s);
    // The scan key evicted last is remembered; putting it again is a ghost hit.
    let gone = (0..1000)
        .rev()
        .find(|j| s.objects.get(format!("scan{j}").as_str()).is_none())
        .expect("the scan evicted");
    let before = s.eviction_stats();
    put(&mut s, &format!("scan{gone}"), 4 * KIB);
    let after = s.eviction_stats();
    assert_eq!(after.recent_ghost_hits, before.recent_ghost_hits + 1);
    assert_eq!(
        after.frequent,
        before.frequent + 1,
        "it joined the frequent list"
    );
    assert!(
        after.recent_target > before.recent_target,
        "the recent list's target grew"
    );
    // A key never seen is not a ghost.
    put(&mut s, "fresh", 4 * KIB);
    assert_eq!(
        s.eviction_stats().recent_ghost_hits,
        after.recent_ghost_hits
    );
    s.check_invariants().unwrap();
}

#[test]
fn both_policies_spare_what_is_being_read_written_or_pinned() {
    for policy in [EvictionPolicy::Car, EvictionPolicy::Lru] {
        let mut s = one_segment(8 * MIB, policy);
        let hard = ReplicateConfig {
            hard_pin: true,
            ..Default::default()
        };
        let g = s.put_start(&k("hard"), MIB, &hard, Millis(0)).unwrap();
        s.put_end("hard", g.put_id, Millis(0)).unwrap();
        let writing = s
            .put_start(&k("writing"), MIB, &Default::default(), Millis(0))
            .unwrap();
        put(&mut s, "read", MIB);
        s.get_replicas(&k("read"), Millis(0)).unwrap(); // held: no release
        for i in 0..5 {
            put(&mut s, &format!("o{i}"), MIB);
        }
        // Full: the next puts evict, twice over, but never the three above.
        for i in 0..10 {
            put(&mut s, &format!("n{i}"), MIB);
        }
        for kept in ["hard", "read"] {
            assert!(s.exists(&k(kept), Millis(0)), "{policy:?}: {kept} evicted");
        }
        s.put_end("writing", writing.put_id, Millis(0)).unwrap();
        assert!(s.exists(&k("writing"), Millis(0)), "{policy:?}");
        s.check_invariants().unwrap();
    }
}

#[test]
fn the_order_costs_at_most_sixteen_bytes_an_object() {
    // 200 000 objects of 1 KiB, every other one read again, in a segment that holds 50 000:
    // most were evicted, and as many as the cache holds are remembered as ghosts (CAR's bound).
    let mut s = one_segment(50_000 * KIB, EvictionPolicy::Car);
    for j in 0..200_000 {
        let key = format!("key-{j}");
        put(&mut s, &key, KIB);
        if j % 2 == 0 {
            read(&mut s, &key);
        }
    }
    let stats = s.eviction_stats();
    assert!(stats.frequent > 1000 && stats.recent > 1000, "{stats:?}");
    let objects = s.key_count();
    assert!(objects > 40_000, "{objects} objects");
    let per_object = s.eviction_order_bytes() as f64 / objects as f64;
    println!("eviction order: {per_object:.2} bytes per object ({objects} objects)");
    assert!(per_object <= 16.0, "{per_object:.1} bytes per object");
    s.check_invariants().unwrap();
}

#[test]
fn removed_objects_leave_no_entries_behind_for_long() {
    let mut s = one_segment(1 << 30, EvictionPolicy::Car);
    for j in 0..20_000 {
        put(&mut s, &format!("key-{j}"), KIB);
    }
    let full = s.eviction_order_bytes();
    for j in 0..19_000 {
        s.remove(&k(&format!("key-{j}")), true, Millis(0)).unwrap();
    }
    assert!(
        s.eviction_order_bytes() < full / 4,
        "stale entries were swept: {} of {full} bytes left",
        s.eviction_order_bytes()
    );
    s.check_invariants().unwrap();
    // What is left still evicts in order.
    assert_eq!(s.eviction_stats().recent, 1000);
}

/// A store full of objects being read: the first failing put walks the order once; the rest of
/// the batch (same instant) does not walk it again (before: two walks per put, 40 s under the
/// lock for 64 puts over a million objects). A hold going back, a put ending, or the earliest
/// lease ending makes the next put walk again and find room.
#[test]
fn a_barren_eviction_round_is_not_repeated_until_something_changes() {
    let mut s = one_segment(8 * 64 * KIB, EvictionPolicy::default());
    for i in 0..8 {
        put(&mut s, &format!("o{i}"), 64 * KIB);
        s.get_replicas(&k(&format!("o{i}")), Millis(1)).unwrap();
    }
    let cfg = ReplicateConfig::default();
    let rounds = s.counters().eviction_rounds;
    for i in 0..16 {
        assert!(s
            .put_start(&k(&format!("n{i}")), 64 * KIB, &cfg, Millis(2))
            .is_err());
    }
    assert_eq!(s.make_room(Millis(2), 64 * KIB), 0);
    assert_eq!(
        s.counters().eviction_rounds,
        rounds + 1,
        "one walk for the batch"
    );

    // A hold goes back: that object may go at once.
    s.release_leases(&["o3"], Millis(3));
    let g = s.put_start(&k("n0"), 64 * KIB, &cfg, Millis(3)).unwrap();
    assert!(
        s.get_replicas(&k("o3"), Millis(3)).is_err(),
        "o3 made the room"
    );
    assert!(s.put_start(&k("n1"), 64 * KIB, &cfg, Millis(3)).is_err());
    // A put ends: the new object may go (nothing else can).
    s.put_end("n0", g.put_id, Millis(3)).unwrap();
    s.put_start(&k("n1"), 64 * KIB, &cfg, Millis(3)).unwrap();
    assert!(
        s.get_replicas(&k("n0"), Millis(3)).is_err(),
        "n0 made the room"
    );
    // The leases end by themselves: the walk comes back then.
    assert!(s.put_start(&k("n2"), 64 * KIB, &cfg, Millis(4)).is_err());
    let ttl = Policy::default().lease_ttl.as_millis() as u64;
    assert!(s.put_start(&k("n2"), 64 * KIB, &cfg, Millis(ttl)).is_err());
    s.put_start(&k("n2"), 64 * KIB, &cfg, Millis(1 + ttl))
        .unwrap();
    s.check_invariants().unwrap();
}

/// An object given its second chance during a round (it was read since) is still looked at in
/// that round: a list is done only once each of its objects was passed over. Before, an object
/// that cannot go (hard-pinned) was passed twice while the read one moved behind it, the list
/// counted as done, and the put was told NoSpace (and the round barren for up to 5 s) although
/// the read object could go.
#[test]
fn an_object_given_its_second_chance_is_still_considered_in_the_round() {
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Car] {
        let mut s = one_segment(2 * MIB, policy);
        let hard = ReplicateConfig {
            hard_pin: true,
            ..ReplicateConfig::default()
        };
        let g = s.put_start(&k("pin"), MIB, &hard, Millis(0)).unwrap();
        s.put_end("pin", g.put_id, Millis(0)).unwrap();
        put(&mut s, "r", MIB);
        assert!(read(&mut s, "r"));
        s.put_start(&k("n"), MIB, &ReplicateConfig::default(), Millis(1))
            .unwrap_or_else(|e| panic!("{policy:?}: {e:?}"));
        assert!(
            s.get_replicas(&k("r"), Millis(1)).is_err(),
            "{policy:?}: r made the room"
        );
        s.check_invariants().unwrap();
    }
}

/// CAR taking from its frequent list, whose objects are all being read, while the recent
/// list's objects were read again (each moves to the frequent list's back on its second
/// chance): the round walks the frequent list once, the recent one, then the frequent one
/// again for what joined it, and frees what it was asked to. Before, every object that joined
/// sent the round through the whole frequent list again, and the round's budget ran out after a
/// handful of evictions (a put then found no room while evictable objects were plenty).
#[test]
fn a_round_walks_a_list_again_once_for_what_joined_it() {
    let mut s = one_segment(1000 * 4 * KIB, EvictionPolicy::Car);
    hot_then_scan(&mut s);
    // 300 evicted scan keys come back: ghost hits, so they join the frequent list and the
    // recent list's target grows past what it holds: CAR takes from the frequent list first.
    let gone: Vec<String> = (0..1000)
        .rev()
        .map(|j| format!("scan{j}"))
        .filter(|key| s.objects.get(key.as_str()).is_none())
        .take(300)
        .collect();
    for key in &gone {
        put(&mut s, key, 4 * KIB);
    }
    let stats = s.eviction_stats();
    assert!(stats.recent < stats.recent_target, "{stats:?}");
    // Every frequent object is being read; every recent one was read again and is done.
    let now = Millis(0);
    let (mut frequent, mut recent) = (Vec::new(), Vec::new());
    for o in s.objects.iter() {
        let key = o.key().to_string();
        if o.place().is_frequent() {
            frequent.push(key);
        } else {
            recent.push(key);
        }
    }
    for key in &frequent {
        s.get_replicas(&k(key), now).unwrap();
    }
    for key in &recent {
        assert!(read(&mut s, key));
    }
    let want = 100 * 4 * KIB;
    let freed = s.evict(now, want);
    assert!(freed >= want, "freed {freed} of {want}");
    for key in &frequent {
        assert!(s.exists(&k(key), now), "{key} was being read");
    }
    s.check_invariants().unwrap();
}

/// A barren round's answer (nothing could go) stands while nothing changes: a hold handed back
/// that leaves its lease held by other readers changes nothing, and does not send the next
/// round through the whole order again; the lease's last hold does.
#[test]
fn a_release_that_ends_no_lease_keeps_a_barren_rounds_answer() {
    let mut s = one_segment(10 * 64 * KIB, EvictionPolicy::Car);
    for i in 0..10 {
        put(&mut s, &format!("o{i}"), 64 * KIB);
    }
    // Two readers of each.
    for _ in 0..2 {
        for i in 0..10 {
            s.get_replicas(&k(&format!("o{i}")), Millis(0)).unwrap();
        }
    }
    assert_eq!(s.evict(Millis(0), 64 * KIB), 0, "all being read");
    let rounds = s.counters.eviction_rounds;
    s.release_leases(&["o3"], Millis(1));
    assert_eq!(s.evict(Millis(1), 64 * KIB), 0);
    assert_eq!(
        s.counters.eviction_rounds, rounds,
        "the barren answer stood"
    );
    s.release_leases(&["o3"], Millis(2));
    assert_eq!(
        s.evict(Millis(2), 64 * KIB),
        64 * KIB,
        "o3's last reader is done"
    );
    assert_eq!(s.counters.eviction_rounds, rounds + 1);
    s.check_invariants().unwrap();
}
