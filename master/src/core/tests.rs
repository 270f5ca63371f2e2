//! State-machine tests: every scenario runs on an injected clock, and the invariants are checked
//! after each step.

use std::time::Duration;

use mooncake_common::{ClientId, Code, ObjectKey, ReplicateConfig, SegmentName};
use proptest::prelude::*;

use super::*;
use crate::{clock::Millis, error::MasterError};

const MIB: u64 = 1 << 20;

fn k(s: &str) -> ObjectKey {
    ObjectKey::new(s).unwrap()
}

fn seg(i: u16) -> SegmentName {
    SegmentName::parse(&format!("127.0.0.1:{}", 1000 + i)).unwrap()
}

fn owner(i: u16) -> ClientId {
    ClientId::from_u128(i as u128 + 1)
}

fn cfg(n: usize) -> ReplicateConfig {
    ReplicateConfig {
        replica_num: n,
        ..Default::default()
    }
}

/// Owners in these tests live for an hour without heartbeats unless a test says otherwise.
fn state_with(segments: &[u64]) -> MasterState {
    let policy = Policy {
        client_ttl: Duration::from_secs(3600),
        ..Policy::default()
    };
    state_with_policy(segments, policy)
}

fn state_with_policy(segments: &[u64], policy: Policy) -> MasterState {
    let mut s = MasterState::with_seed(policy, 42);
    for (i, size) in segments.iter().enumerate() {
        s.mount_segment(
            owner(i as u16),
            seg(i as u16),
            *size,
            0,
            MountReport::default(),
            Millis(0),
        )
        .unwrap();
    }
    s
}

fn put(
    s: &mut MasterState,
    key: &str,
    size: u64,
    c: &ReplicateConfig,
    now: u64,
) -> Result<PutGrant, MasterError> {
    let g = s.put_start(&k(key), size, c, Millis(now))?;
    s.put_end(key, g.put_id, Millis(0))?;
    s.check_invariants().unwrap();
    Ok(g)
}

/// The (offset, put id) of the ranges owner `i` is told to forget.
fn freed(s: &mut MasterState, i: u16) -> Vec<(u64, u64)> {
    s.take_freed(owner(i))
        .iter()
        .map(|f| (f.offset, f.put_id))
        .collect()
}

fn upsert() -> ReplicateConfig {
    ReplicateConfig {
        upsert: true,
        ..cfg(1)
    }
}

#[test]
fn an_upsert_reuses_memory_nobody_reads_and_otherwise_waits_for_the_readers() {
    let mut s = state_with(&[64 * MIB]);
    let first = put(&mut s, "a", 1000, &cfg(1), 0).unwrap();
    assert_eq!(
        s.put_start(&k("a"), 10, &cfg(1), Millis(1)),
        Err(MasterError::Exists(k("a"))),
        "a plain put still refuses"
    );
    // Nobody holds it and it fits: the same range under a new put id; not readable meanwhile.
    let second = s.put_start(&k("a"), 900, &upsert(), Millis(2)).unwrap();
    assert!(second.put_id > first.put_id);
    assert_eq!(second.replicas[0].offset, first.replicas[0].offset);
    assert_eq!(
        s.get_replicas(&k("a"), Millis(3)),
        Err(MasterError::NotReady(k("a")))
    );
    s.put_end("a", second.put_id, Millis(4)).unwrap();
    let (size, locs) = s.get_replicas(&k("a"), Millis(5)).unwrap();
    assert_eq!((size, locs[0].put_id), (900, second.put_id));
    s.check_invariants().unwrap();

    // Leased now (the get above): the new value goes elsewhere, the old range waits for the
    // lease to end (its owner keeps serving it to the readers), and its owner is told to forget
    // it then.
    let _ = s.take_freed(owner(0));
    let allocated = s.allocated();
    let third = s.put_start(&k("a"), 900, &upsert(), Millis(6)).unwrap();
    assert_ne!(third.replicas[0].offset, first.replicas[0].offset);
    assert_eq!(
        s.allocated(),
        allocated + 960,
        "both ranges held while the reader may read"
    );
    assert_eq!(freed(&mut s, 0), vec![], "readers still read the old range");
    s.put_end("a", third.put_id, Millis(7)).unwrap();
    let lease_end = 5 + Policy::default().lease_ttl.as_millis() as u64;
    s.tick(Millis(lease_end - 1));
    assert_eq!(freed(&mut s, 0), vec![], "readers still read the old range");
    s.tick(Millis(lease_end + 1));
    assert_eq!(
        s.allocated(),
        allocated + 960 - 1024,
        "the old range (1000 bytes: 1024 reserved) came back after the lease"
    );
    assert_eq!(
        freed(&mut s, 0),
        vec![(first.replicas[0].offset, second.put_id)],
        "its owner forgets it with the lease over"
    );
    s.check_invariants().unwrap();

    // Too large for its range: new space; an absent key: a plain put.
    let big = s
        .put_start(&k("a"), 5000, &upsert(), Millis(lease_end + 20_000))
        .unwrap();
    assert_ne!(big.replicas[0].offset, third.replicas[0].offset);
    s.put_end("a", big.put_id, Millis(lease_end + 20_001))
        .unwrap();
    let fresh = s
        .put_start(&k("b"), 10, &upsert(), Millis(lease_end + 20_002))
        .unwrap();
    s.put_end("b", fresh.put_id, Millis(lease_end + 20_003))
        .unwrap();
    // A put in flight is not taken over by an upsert.
    let inflight = s
        .put_start(&k("c"), 10, &cfg(1), Millis(lease_end + 20_004))
        .unwrap();
    assert_eq!(
        s.put_start(&k("c"), 10, &upsert(), Millis(lease_end + 20_005)),
        Err(MasterError::PutInFlight(k("c")))
    );
    s.put_revoke("c", inflight.put_id, Millis(0)).unwrap();
    s.check_invariants().unwrap();
}

/// An upsert that needs new space and finds none leaves the stored value readable: before, the
/// old object was taken out first, and a failed allocation left the key absent.
#[test]
fn an_upsert_that_finds_no_space_leaves_the_stored_value() {
    let mut s = state_with(&[4 * MIB]);
    let a = put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    let pinned = ReplicateConfig {
        hard_pin: true,
        ..cfg(1)
    };
    for i in 0..3 {
        put(&mut s, &format!("p{i}"), MIB, &pinned, 1).unwrap();
    }
    // Read (leased): not rewritten in place, and not evicted to make room.
    s.get_replicas(&k("a"), Millis(2)).unwrap();
    assert_eq!(
        s.put_start(&k("a"), 2 * MIB, &upsert(), Millis(3)),
        Err(MasterError::NoSpace { size: 2 * MIB })
    );
    s.check_invariants().unwrap();
    let (size, locs) = s.get_replicas(&k("a"), Millis(4)).unwrap();
    assert_eq!((size, locs[0].put_id), (MIB, a.put_id));
    assert_eq!(s.allocated(), 4 * MIB);
}

/// An upsert that needs new space while the master's put ids are used up (with HA, until its
/// next reservation reaches etcd) fails before the stored value is retired or anything evicted.
#[test]
fn an_upsert_that_finds_no_put_id_leaves_the_stored_value() {
    let mut s = state_with(&[8 * MIB]);
    let a = put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    put(&mut s, "b", MIB, &cfg(1), 0).unwrap();
    s.reserve_grants(s.next_grant());
    assert_eq!(
        s.put_start(&k("a"), 2 * MIB, &upsert(), Millis(3)),
        Err(MasterError::GrantsExhausted)
    );
    assert_eq!(
        s.put_start(&k("c"), 7 * MIB, &cfg(1), Millis(3)),
        Err(MasterError::GrantsExhausted)
    );
    s.check_invariants().unwrap();
    let (size, locs) = s.get_replicas(&k("a"), Millis(4)).unwrap();
    assert_eq!((size, locs[0].put_id), (MIB, a.put_id));
    assert_eq!(
        s.key_count(),
        2,
        "nothing evicted for a put that could not start"
    );
}

/// A put that went unfinished (revoked, or removed by force) is noted freed at once and again
/// once its seal has surely lapsed (a put discard timeout and 3 s later): a write of it on its way when the first note was applied lands
/// after it, and only the second note keeps a later master from adopting it. A completed object
/// removed is noted once.
#[test]
fn an_unfinished_puts_range_is_noted_freed_again_later() {
    let mut s = state_with(&[64 * MIB]);
    let later = s.policy.put_discard_timeout.as_millis() as u64 + 3000;
    let revoked = s.put_start(&k("r"), 1000, &cfg(1), Millis(0)).unwrap();
    s.put_revoke("r", revoked.put_id, Millis(0)).unwrap();
    let forced = s.put_start(&k("f"), 1000, &cfg(1), Millis(0)).unwrap();
    s.remove(&k("f"), true, Millis(0)).unwrap();
    put(&mut s, "done", 1000, &cfg(1), 0).unwrap();
    s.remove(&k("done"), false, Millis(0)).unwrap();
    let versions = |notes: Vec<Freed>| {
        let mut v: Vec<u64> = notes.iter().map(|n| n.put_id).collect();
        v.sort();
        v
    };
    assert_eq!(s.take_freed(owner(0)).len(), 3);
    // A put granted meanwhile (its range may be one of those, or hold a copy written since):
    // the second notes spare what was written under its grant and later ones.
    let meanwhile = put(&mut s, "meanwhile", 1000, &cfg(1), 10).unwrap();
    s.tick(Millis(later - 1));
    assert!(s.take_freed(owner(0)).is_empty());
    s.tick(Millis(later));
    let again = s.take_freed(owner(0));
    assert!(
        again.iter().all(|n| n.granted_before <= meanwhile.put_id),
        "{again:?}"
    );
    assert_eq!(versions(again), vec![revoked.put_id, forced.put_id]);
    assert_eq!(
        s.take_freed(owner(0)).len(),
        0,
        "once each, not at every tick"
    );
    s.tick(Millis(later + 1));
    assert!(s.take_freed(owner(0)).is_empty());
}

/// A heartbeat's notes stay until a later heartbeat says they were applied: an answer lost on
/// its way loses none (before, they were handed out once, and a removed object could come back
/// at the next rebuild).
#[test]
fn freed_range_notes_are_sent_again_until_applied() {
    let mut s = state_with(&[64 * MIB]);
    let a = put(&mut s, "a", 1000, &cfg(1), 0).unwrap();
    let b = put(&mut s, "b", 1000, &cfg(1), 0).unwrap();
    s.remove(&k("a"), false, Millis(1)).unwrap();
    let first = s.freed_notes(owner(0), 0);
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].offset, first[0].put_id),
        (a.replicas[0].offset, a.put_id)
    );
    assert_eq!(
        s.freed_notes(owner(0), 0),
        first,
        "the answer was lost: again"
    );
    s.remove(&k("b"), false, Millis(2)).unwrap();
    let both = s.freed_notes(owner(0), 0);
    assert_eq!(both.len(), 2);
    assert!(both[1].seq > both[0].seq);
    // The first applied: only the second is sent; then that one too.
    let rest = s.freed_notes(owner(0), first[0].seq);
    assert_eq!(rest.len(), 1);
    assert_eq!(
        (rest[0].offset, rest[0].put_id),
        (b.replicas[0].offset, b.put_id)
    );
    assert!(s.freed_notes(owner(0), rest[0].seq).is_empty());
}

#[test]
fn owners_are_told_which_ranges_to_forget_when_objects_go() {
    let mut s = state_with(&[64 * MIB]);
    let a = put(&mut s, "a", 1000, &cfg(1), 0).unwrap();
    let b = put(&mut s, "b", 1000, &cfg(1), 0).unwrap();
    let c = s.put_start(&k("c"), 1000, &cfg(1), Millis(0)).unwrap();
    // Nothing went yet; a heartbeat hands out nothing.
    assert_eq!(freed(&mut s, 0), vec![]);
    s.remove(&k("a"), false, Millis(1)).unwrap();
    s.put_revoke("c", c.put_id, Millis(0)).unwrap();
    let note = |g: &PutGrant| (g.replicas[0].offset, g.put_id);
    let notes = s.take_freed(owner(0));
    assert!(notes.iter().all(|f| f.granted_before == s.next_grant()));
    let notes: Vec<_> = notes.iter().map(|f| (f.offset, f.put_id)).collect();
    assert_eq!(notes, vec![note(&a), note(&c)]);
    assert_eq!(freed(&mut s, 0), vec![], "handed out once");
    // Eviction too (everything unleased goes at a high enough ratio).
    s.evict(Millis(2), 64 * MIB);
    assert_eq!(freed(&mut s, 0), vec![note(&b)]);
    assert_eq!(freed(&mut s, 9), vec![], "an unknown owner");
    s.check_invariants().unwrap();
}

#[test]
fn two_phase_put_then_get() {
    let mut s = state_with(&[64 * MIB]);
    let g = s.put_start(&k("a"), 1000, &cfg(1), Millis(0)).unwrap();
    assert_eq!(g.replicas.len(), 1);
    assert_eq!(g.replicas[0].size, 1000);
    // Not readable before put end; a second writer is told the put is in flight.
    assert_eq!(
        s.get_replicas(&k("a"), Millis(1)),
        Err(MasterError::NotReady(k("a")))
    );
    assert!(!s.exists(&k("a"), Millis(1)));
    assert_eq!(
        s.put_start(&k("a"), 1000, &cfg(1), Millis(1)),
        Err(MasterError::PutInFlight(k("a")))
    );
    s.put_end("a", g.put_id, Millis(0)).unwrap();
    let (size, reps) = s.get_replicas(&k("a"), Millis(2)).unwrap();
    assert_eq!((size, reps), (1000, g.replicas.clone()));
    assert_eq!(
        s.put_start(&k("a"), 1000, &cfg(1), Millis(3)),
        Err(MasterError::Exists(k("a")))
    );
    assert_eq!(MasterError::Exists(k("a")).code().as_i32(), -705);
    s.check_invariants().unwrap();
}

#[test]
fn bad_sizes() {
    let mut s = state_with(&[MIB]);
    assert!(matches!(
        s.put_start(&k("z"), 0, &cfg(1), Millis(0)),
        Err(MasterError::Invalid(_))
    ));
    let e = s
        .put_start(&k("big"), 2 * MIB, &cfg(1), Millis(0))
        .unwrap_err();
    assert_eq!(
        e,
        MasterError::TooLarge {
            size: 2 * MIB,
            largest: MIB
        }
    );
    assert_eq!(e.code().as_i32(), -600);
    // With no segment at all the answer says so, and is worth a retry once an owner mounts.
    let mut empty = state_with(&[]);
    let e = empty.put_start(&k("x"), 1, &cfg(1), Millis(0)).unwrap_err();
    assert_eq!(e, MasterError::NoSegments);
    assert_eq!(e.code(), Code::NoAvailableHandle);
    assert!(e.to_string().contains("no segment is mounted"), "{e}");
}

#[test]
fn replicas_on_distinct_segments_and_fewer_when_short() {
    let mut s = state_with(&[8 * MIB, 8 * MIB]);
    let g = put(&mut s, "r2", MIB, &cfg(2), 0).unwrap();
    assert_eq!(g.replicas.len(), 2);
    assert_ne!(g.replicas[0].segment, g.replicas[1].segment);
    let g = put(&mut s, "r3", MIB, &cfg(3), 0).unwrap();
    assert_eq!(g.replicas.len(), 2, "silently fewer replicas than asked");
}

#[test]
fn preferred_segment_first_then_fallback() {
    let mut s = state_with(&[4 * MIB, 4 * MIB, 4 * MIB]);
    let pref = |name: SegmentName| ReplicateConfig {
        replica_num: 1,
        preferred_segments: vec![name],
        ..Default::default()
    };
    for i in 0..3 {
        let g = put(&mut s, &format!("p{i}"), MIB, &pref(seg(1)), 0).unwrap();
        assert_eq!(g.replicas[0].segment, seg(1));
    }
    // Hard-pin a filler so segment 1 is full and nothing on it can be evicted.
    let filler = ReplicateConfig {
        hard_pin: true,
        ..pref(seg(1))
    };
    put(&mut s, "fill", MIB, &filler, 0).unwrap();
    let g = put(&mut s, "spill", MIB, &pref(seg(1)), 0).unwrap();
    assert_ne!(
        g.replicas[0].segment,
        seg(1),
        "full preferred segment falls back"
    );
    let unknown = SegmentName::parse("10.9.9.9:1").unwrap();
    let g = put(&mut s, "unk", MIB, &pref(unknown), 0).unwrap();
    assert_eq!(g.replicas.len(), 1);
}

#[test]
fn a_lease_ends_when_its_last_reader_is_done_or_at_its_ttl() {
    let mut s = state_with(&[8 * MIB]);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    let ttl = Policy::default().lease_ttl.as_millis() as u64;
    // Two readers: the lookup of one and the existence check of another.
    s.get_replicas(&k("a"), Millis(100)).unwrap();
    assert!(s.exists(&k("a"), Millis(110)));
    s.release_leases(&["a"], Millis(120));
    assert!(
        s.remove(&k("a"), false, Millis(130)).is_err(),
        "one reader is still at it"
    );
    s.release_leases(&["a", "unknown"], Millis(140));
    s.remove(&k("a"), false, Millis(150)).unwrap();
    // A reader that never says it is done holds until the TTL; a late release changes nothing
    // for a later reader's lease.
    put(&mut s, "b", MIB, &cfg(1), 0).unwrap();
    s.get_replicas(&k("b"), Millis(1000)).unwrap();
    assert!(s.remove(&k("b"), false, Millis(1000 + ttl - 1)).is_err());
    s.get_replicas(&k("b"), Millis(1000 + ttl + 5)).unwrap();
    s.release_leases(&["b"], Millis(1000 + ttl + 6));
    assert!(
        s.remove(&k("b"), false, Millis(1000 + ttl + 7)).is_ok(),
        "the one hold there was went with the release"
    );
    // More releases than holds never underflow into a lease.
    put(&mut s, "c", MIB, &cfg(1), 0).unwrap();
    s.release_leases(&["c", "c"], Millis(5000));
    s.get_replicas(&k("c"), Millis(5001)).unwrap();
    assert!(s.remove(&k("c"), false, Millis(5002)).is_err());
    s.check_invariants().unwrap();
}

/// A reader of a version that was replaced (an upsert, a forced removal and a new put) hands
/// its hold back by key: it must not end the hold of a reader of the new version, which
/// eviction would then take while it is read.
#[test]
fn an_old_versions_release_does_not_end_a_new_readers_hold() {
    let mut s = state_with(&[8 * MIB]);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    s.get_replicas(&k("a"), Millis(100)).unwrap(); // reader 1, of the first version
    let g = s.put_start(&k("a"), MIB, &upsert(), Millis(110)).unwrap();
    s.put_end("a", g.put_id, Millis(120)).unwrap();
    s.get_replicas(&k("a"), Millis(130)).unwrap(); // reader 2, of the second
    s.release_leases(&["a"], Millis(140)); // reader 1 is done
    assert_eq!(
        s.remove(&k("a"), false, Millis(150))
            .unwrap_err()
            .code()
            .as_i32(),
        -706,
        "reader 2 still reads the upserted value"
    );
    s.release_leases(&["a"], Millis(160)); // reader 2 is done
    s.remove(&k("a"), false, Millis(170)).unwrap();

    // The same through a forced removal and a plain put of the key.
    put(&mut s, "b", MIB, &cfg(1), 200).unwrap();
    s.get_replicas(&k("b"), Millis(210)).unwrap();
    assert!(s.exists(&k("b"), Millis(215)));
    s.remove(&k("b"), true, Millis(220)).unwrap();
    put(&mut s, "b", MIB, &cfg(1), 230).unwrap();
    s.get_replicas(&k("b"), Millis(240)).unwrap();
    s.release_leases(&["b", "b"], Millis(250)); // both old holds come back
    assert!(
        s.remove(&k("b"), false, Millis(260)).is_err(),
        "the new reader still holds it"
    );
    s.release_leases(&["b"], Millis(270));
    s.remove(&k("b"), false, Millis(280)).unwrap();

    // An old hold never handed back only keeps the new version leased until the old lease
    // would have ended; upkeep then forgets it.
    put(&mut s, "c", MIB, &cfg(1), 300).unwrap();
    s.get_replicas(&k("c"), Millis(310)).unwrap();
    s.remove(&k("c"), true, Millis(320)).unwrap();
    put(&mut s, "c", MIB, &cfg(1), 330).unwrap();
    s.get_replicas(&k("c"), Millis(340)).unwrap();
    s.release_leases(&["c"], Millis(350));
    assert!(s.remove(&k("c"), false, Millis(360)).is_err());
    let ttl = Policy::default().lease_ttl.as_millis() as u64;
    s.tick(Millis(310 + ttl + 1));
    assert_eq!(s.lingering.len(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn with_ttl_leases_a_release_changes_nothing() {
    let policy = Policy {
        lease_mode: LeaseMode::Ttl,
        client_ttl: Duration::from_secs(3600),
        ..Policy::default()
    };
    let mut s = state_with_policy(&[8 * MIB], policy);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    s.get_replicas(&k("a"), Millis(100)).unwrap();
    s.release_leases(&["a"], Millis(120));
    assert_eq!(
        s.remove(&k("a"), false, Millis(130))
            .unwrap_err()
            .code()
            .as_i32(),
        -706
    );
}

#[test]
fn lease_blocks_plain_remove_and_force_frees_at_once() {
    let mut s = state_with(&[8 * MIB]);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    s.get_replicas(&k("a"), Millis(100)).unwrap();
    let lease_end = 100 + Policy::default().lease_ttl.as_millis() as u64;
    let e = s.remove(&k("a"), false, Millis(200)).unwrap_err();
    assert_eq!(e.code().as_i32(), -706);
    s.remove(&k("a"), true, Millis(200)).unwrap();
    assert_eq!(s.key_count(), 0);
    assert_eq!(
        s.allocated(),
        0,
        "force frees at once; owners protect readers still in flight"
    );
    s.check_invariants().unwrap();
    // Once the lease ran out a plain remove works; a miss is -704.
    put(&mut s, "b", MIB, &cfg(1), 0).unwrap();
    assert!(s.exists(&k("b"), Millis(lease_end)));
    assert!(s.remove(&k("b"), false, Millis(lease_end + 1)).is_err());
    s.remove(&k("b"), false, Millis(2 * lease_end + 1)).unwrap();
    assert_eq!(
        s.remove(&k("b"), false, Millis(0))
            .unwrap_err()
            .code()
            .as_i32(),
        -704
    );
}

#[test]
fn eviction_frees_space_oldest_lease_first_and_spares_leased_and_pinned() {
    let mut s = state_with(&[10 * MIB]);
    let hard = ReplicateConfig {
        hard_pin: true,
        ..cfg(1)
    };
    let soft = ReplicateConfig {
        soft_pin: true,
        ..cfg(1)
    };
    put(&mut s, "hard", MIB, &hard, 0).unwrap();
    put(&mut s, "soft", MIB, &soft, 0).unwrap();
    for i in 0..8 {
        put(&mut s, &format!("o{i}"), MIB, &cfg(1), 0).unwrap();
    }
    // Touch in order so o0 has the oldest lease and o7 the newest; o7 stays leased.
    let ttl = Policy::default().lease_ttl.as_millis() as u64;
    for i in 0..8u64 {
        s.get_replicas(&k(&format!("o{i}")), Millis(i * 1000))
            .unwrap();
    }
    let now = 7000 + ttl - 1; // only o7's lease is still live
    put(&mut s, "new", MIB, &cfg(1), now).unwrap();
    assert!(
        !s.exists(&k("o0"), Millis(now)),
        "oldest lease evicted first"
    );
    for kept in ["hard", "soft", "o7", "new"] {
        assert!(s.exists(&k(kept), Millis(now)), "{kept} evicted");
    }
    assert!(s.counters().evicted_objects >= 1);
    s.check_invariants().unwrap();
}

#[test]
fn no_space_when_everything_is_leased() {
    let mut s = state_with(&[2 * MIB]);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    put(&mut s, "b", MIB, &cfg(1), 0).unwrap();
    s.get_replicas(&k("a"), Millis(0)).unwrap();
    s.get_replicas(&k("b"), Millis(0)).unwrap();
    let e = s.put_start(&k("c"), MIB, &cfg(1), Millis(1)).unwrap_err();
    assert_eq!(e, MasterError::NoSpace { size: MIB });
    assert_eq!(e.code().as_i32(), -200);
}

#[test]
fn watermark_eviction_in_upkeep() {
    let mut s = state_with(&[10 * MIB]);
    for i in 0..10 {
        put(&mut s, &format!("o{i}"), MIB, &cfg(1), 0).unwrap();
    }
    assert_eq!(s.allocated(), 10 * MIB);
    s.tick(Millis(1));
    assert!(
        s.allocated() <= 9 * MIB,
        "above the 90% watermark after upkeep"
    );
    s.check_invariants().unwrap();
}

#[test]
fn abandoned_put_is_taken_over_then_released() {
    let p = Policy::default();
    let mut s = state_with(&[4 * MIB]);
    let old = s.put_start(&k("a"), MIB, &cfg(1), Millis(0)).unwrap();
    let discard = p.put_discard_timeout.as_millis() as u64;
    let release = p.put_release_timeout.as_millis() as u64;
    let _ = freed(&mut s, 0);
    let new = s.put_start(&k("a"), MIB, &cfg(1), Millis(discard)).unwrap();
    assert_eq!(
        s.allocated(),
        2 * MIB,
        "the old writer's range is quarantined"
    );
    // Its owner forgets the abandoned version at once (not after the release timeout): kept,
    // it would come back at a failover even once the key was removed.
    assert_eq!(freed(&mut s, 0), vec![(old.replicas[0].offset, old.put_id)]);
    assert!(matches!(
        s.put_end("a", old.put_id, Millis(0)),
        Err(MasterError::StalePut { .. })
    ));
    s.put_end("a", new.put_id, Millis(0)).unwrap();
    s.tick(Millis(release - 1));
    assert_eq!(s.allocated(), 2 * MIB);
    s.tick(Millis(release));
    assert_eq!(s.allocated(), MIB);
    s.check_invariants().unwrap();

    // A put nobody takes over is reclaimed after the release timeout.
    s.put_start(&k("lost"), MIB, &cfg(1), Millis(release))
        .unwrap();
    assert_eq!(s.allocated(), 2 * MIB);
    s.tick(Millis(2 * release));
    assert_eq!(s.allocated(), MIB);
    assert_eq!(s.counters().expired_puts, 1);
}

/// Upkeep expires abandoned puts from an index of the puts not ended, not by looking at every
/// object: ended and revoked puts leave it at once, and an abandoned in-place upsert expires
/// like any other put.
#[test]
fn upkeep_knows_only_the_puts_not_ended() {
    let release = Policy::default().put_release_timeout.as_millis() as u64;
    let mut s = state_with(&[64 * MIB]);
    for i in 0..100u64 {
        let key = format!("done{i}");
        let g = s.put_start(&k(&key), 4096, &cfg(1), Millis(i)).unwrap();
        s.put_end(&key, g.put_id, Millis(i)).unwrap();
    }
    assert!(s.unfinished.is_empty());
    let revoked = s
        .put_start(&k("revoked"), 4096, &cfg(1), Millis(200))
        .unwrap();
    s.put_revoke("revoked", revoked.put_id, Millis(0)).unwrap();
    s.put_start(&k("lost"), 4096, &cfg(1), Millis(300)).unwrap();
    s.put_start(&k("done0"), 4096, &upsert(), Millis(400))
        .unwrap();
    assert_eq!(s.unfinished.len(), 2);
    s.check_invariants().unwrap();
    s.tick(Millis(300 + release));
    assert!(s.objects.get(&k("lost")).is_none());
    assert!(s.objects.get(&k("done0")).is_some(), "not due yet");
    s.tick(Millis(400 + release));
    assert!(s.objects.get(&k("done0")).is_none());
    assert!(s.unfinished.is_empty());
    assert_eq!(s.counters().expired_puts, 2);
    assert_eq!(s.key_count(), 99);
    s.check_invariants().unwrap();
}

/// A put taken over after its writer went silent: when its range is released, its owner is told
/// to forget that version (a write of it that did land must not come back as the object after a
/// master restart).
#[test]
fn a_taken_over_puts_owner_forgets_its_version_when_the_range_is_released() {
    let p = Policy::default();
    let mut s = state_with(&[4 * MIB]);
    let old = s.put_start(&k("a"), MIB, &cfg(1), Millis(0)).unwrap();
    let discard = p.put_discard_timeout.as_millis() as u64;
    let release = p.put_release_timeout.as_millis() as u64;
    s.put_start(&k("a"), MIB, &cfg(1), Millis(discard)).unwrap();
    s.tick(Millis(release));
    let offset = old.replicas[0].offset;
    assert!(
        freed(&mut s, 0).contains(&(offset, old.put_id)),
        "the owner is told to forget the taken-over version"
    );
    s.check_invariants().unwrap();
}

#[test]
fn revoke_frees_and_only_the_current_put_can_end() {
    let mut s = state_with(&[4 * MIB]);
    let g = s.put_start(&k("a"), MIB, &cfg(1), Millis(0)).unwrap();
    assert!(s.put_revoke("a", g.put_id + 1, Millis(0)).is_err());
    s.put_revoke("a", g.put_id, Millis(0)).unwrap();
    assert_eq!(s.allocated(), 0);
    assert!(s.put_end("a", g.put_id, Millis(0)).is_err());
    s.check_invariants().unwrap();
}

#[test]
fn silent_owner_expires_with_its_replicas() {
    let mut s = state_with_policy(&[4 * MIB, 4 * MIB], Policy::default());
    let on0 = ReplicateConfig {
        preferred_segments: vec![seg(0)],
        ..cfg(1)
    };
    let both = cfg(2);
    put(&mut s, "only0", MIB, &on0, 0).unwrap();
    put(&mut s, "both", MIB, &both, 0).unwrap();
    let ttl = Policy::default().client_ttl.as_millis() as u64;
    assert_eq!(s.heartbeat(owner(1), Millis(ttl)), HeartbeatReply::Ok);
    s.tick(Millis(ttl + 1));
    assert!(!s.exists(&k("only0"), Millis(ttl + 1)));
    let (_, reps) = s.get_replicas(&k("both"), Millis(ttl + 1)).unwrap();
    assert_eq!(reps.len(), 1);
    assert_eq!(reps[0].segment, seg(1));
    assert_eq!(
        s.heartbeat(owner(0), Millis(ttl + 2)),
        HeartbeatReply::Remount
    );
    assert_eq!(s.active_owners(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn remount_by_new_incarnation_drops_old_replicas() {
    let mut s = state_with(&[4 * MIB]);
    put(&mut s, "a", MIB, &cfg(1), 0).unwrap();
    s.mount_segment(
        owner(0),
        seg(0),
        4 * MIB,
        0,
        MountReport::default(),
        Millis(1),
    )
    .unwrap();
    assert!(
        s.exists(&k("a"), Millis(1)),
        "same owner remount is idempotent"
    );
    s.mount_segment(
        owner(9),
        seg(0),
        4 * MIB,
        0,
        MountReport::default(),
        Millis(2),
    )
    .unwrap();
    assert!(!s.exists(&k("a"), Millis(2)));
    assert_eq!(s.allocated(), 0);
    assert!(matches!(
        s.unmount_segment(owner(0), &seg(0)),
        Err(MasterError::NotSegmentOwner { .. })
    ));
    s.unmount_segment(owner(9), &seg(0)).unwrap();
    assert_eq!(s.capacity(), 0);
}

/// Sizes no machine has are refused at the mount: summed over segments they would overflow
/// the cluster's totals (the watermark's arithmetic).
#[test]
fn mounts_of_impossible_sizes_are_refused() {
    let mut s = state_with(&[4 * MIB]);
    for (size, disk) in [(u64::MAX / 2, 0), (4 * MIB, u64::MAX / 2)] {
        assert!(matches!(
            s.mount_segment(
                owner(1),
                seg(1),
                size,
                disk,
                MountReport::default(),
                Millis(0)
            ),
            Err(MasterError::Invalid(_))
        ));
    }
    s.tick(Millis(1));
    assert_eq!(s.capacity(), 4 * MIB);
    s.check_invariants().unwrap();
}

/// A put removed by force before it ended is no longer in flight (the metric said so until its
/// release timeout), nor one gone with its segment.
#[test]
fn puts_in_flight_count_only_puts_still_open() {
    let mut s = state_with(&[8 * MIB, 8 * MIB]);
    s.put_start(&k("a"), MIB, &cfg(1), Millis(0)).unwrap();
    let on_1 = ReplicateConfig {
        preferred_segments: vec![seg(1)],
        ..cfg(1)
    };
    s.put_start(&k("b"), MIB, &on_1, Millis(0)).unwrap();
    assert_eq!(s.puts_in_flight(), 2);
    s.remove(&k("a"), true, Millis(1)).unwrap();
    assert_eq!(s.puts_in_flight(), 1);
    s.unmount_segment(owner(1), &seg(1)).unwrap();
    assert_eq!(s.puts_in_flight(), 0);
    s.check_invariants().unwrap();
}

/// Space freed later (the old versions of objects rewritten while leased) comes back as each
/// release is due, whatever order the releases were made in.
#[test]
fn deferred_releases_come_due_in_time_order() {
    let mut s = state_with(&[8 * MIB]);
    let ttl = s.policy().lease_ttl.as_millis() as u64;
    for (key, leased_at) in [("a", 0), ("b", 100), ("c", 50)] {
        put(&mut s, key, MIB, &cfg(1), 0).unwrap();
        s.get_replicas(&k(key), Millis(leased_at)).unwrap();
    }
    for key in ["b", "a", "c"] {
        put(&mut s, key, MIB, &upsert(), 200).unwrap();
    }
    assert_eq!(s.allocated(), 6 * MIB, "the old versions are still leased");
    for (at, left) in [(ttl + 1, 5), (ttl + 51, 4), (ttl + 101, 3)] {
        s.tick(Millis(at));
        assert_eq!(s.allocated(), left * MIB, "at {at}");
        s.check_invariants().unwrap();
    }
}

#[test]
fn remove_all_skips_leased_unless_forced() {
    let mut s = state_with(&[8 * MIB]);
    for i in 0..4 {
        put(&mut s, &format!("o{i}"), MIB, &cfg(1), 0).unwrap();
    }
    s.exists(&k("o0"), Millis(0));
    assert_eq!(s.remove_all(false, Millis(1)), 3);
    assert_eq!(s.remove_all(true, Millis(1)), 1);
    assert_eq!(s.key_count(), 0);
    s.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Step {
    Put(u8, u32, u8),
    End(u8),
    Revoke(u8),
    Get(u8),
    Remove(u8, bool),
    Tick(u16),
    Heartbeat(u8),
    Remount(u8),
    /// The owner of segment .0 takes its tasks and reports them done (.1) or failed.
    OwnerWork(u8, bool),
    /// The owner of segment .1 drops its disk record of key .0.
    DiskDrop(u8, u8),
    /// A copy of key .0 to segment .1.
    Copy(u8, u8),
    /// A move of key .0 from segment .1 to segment .2.
    Move(u8, u8, u8),
    /// A replica clear of key .0 on segment .1 (3: whole object).
    Clear(u8, u8),
    /// A reader of key .0 is done.
    Release(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (any::<u8>(), 1u32..3_000_000, 1u8..4).prop_map(|(k, s, r)| Step::Put(k % 32, s, r)),
        any::<u8>().prop_map(|k| Step::End(k % 32)),
        any::<u8>().prop_map(|k| Step::Revoke(k % 32)),
        any::<u8>().prop_map(|k| Step::Get(k % 32)),
        (any::<u8>(), any::<bool>()).prop_map(|(k, f)| Step::Remove(k % 32, f)),
        (0u16..20_000).prop_map(Step::Tick),
        any::<u8>().prop_map(|o| Step::Heartbeat(o % 3)),
        any::<u8>().prop_map(|o| Step::Remount(o % 3)),
        (any::<u8>(), any::<bool>()).prop_map(|(o, ok)| Step::OwnerWork(o % 3, ok)),
        (any::<u8>(), any::<u8>()).prop_map(|(k, o)| Step::DiskDrop(k % 32, o % 3)),
        (any::<u8>(), any::<u8>()).prop_map(|(k, o)| Step::Copy(k % 32, o % 3)),
        (any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(k, a, b)| Step::Move(
            k % 32,
            a % 3,
            b % 3
        )),
        (any::<u8>(), any::<u8>()).prop_map(|(k, o)| Step::Clear(k % 32, o % 4)),
        any::<u8>().prop_map(|k| Step::Release(k % 32)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn invariants_hold_under_random_operations(steps in proptest::collection::vec(step(), 1..150)) {
        // Segments 0 and 1 have an SSD tier, 2 has none.
        let disk_of = |o: u16| if o < 2 { 1 << 30 } else { 0 };
        let mut s = MasterState::with_seed(Policy { client_ttl: Duration::from_secs(3600), offload_queue_limit: 4, ..Policy::default() }, 42);
        for (i, size) in [8 * MIB, 8 * MIB, 4 * MIB].iter().enumerate() {
            s.mount_segment(owner(i as u16), seg(i as u16), *size, disk_of(i as u16), MountReport::default(), Millis(0)).unwrap();
        }
        let mut now = 0u64;
        let mut puts: std::collections::HashMap<u8, u64> = Default::default();
        let mut incarnation = 100u16;
        for st in steps {
            match st {
                Step::Put(key, size, r) => {
                    if let Ok(g) = s.put_start(&k(&format!("k{key}")), size as u64, &cfg(r as usize), Millis(now)) {
                        puts.insert(key, g.put_id);
                    }
                }
                Step::End(key) => { if let Some(id) = puts.get(&key) { let _ = s.put_end(&format!("k{key}"), *id, Millis(now)); } }
                Step::Revoke(key) => { if let Some(id) = puts.get(&key) { let _ = s.put_revoke(&format!("k{key}"), *id, Millis(now)); } }
                Step::Get(key) => {
                    if let Ok((size, reps)) = s.get_replicas(&k(&format!("k{key}")), Millis(now)) {
                        prop_assert!(!reps.is_empty());
                        prop_assert!(reps.iter().all(|r| r.size == size));
                    }
                }
                Step::Remove(key, force) => { let _ = s.remove(&k(&format!("k{key}")), force, Millis(now)); }
                Step::Tick(dt) => { now += dt as u64; s.tick(Millis(now)); }
                Step::Heartbeat(o) => { s.heartbeat(owner(o as u16), Millis(now)); }
                Step::Remount(o) => {
                    incarnation += 1;
                    let size = if o == 2 { 4 * MIB } else { 8 * MIB };
                    s.mount_segment(owner(incarnation), seg(o as u16), size, disk_of(o as u16), MountReport::default(), Millis(now)).unwrap();
                }
                Step::OwnerWork(o, ok) => {
                    if let Some(id) = s.segment_id(&seg(o as u16)) {
                        for t in s.take_tasks(id, 16, Millis(now)) {
                            if t.kind == TaskKind::Copy {
                                let failure = (!ok).then_some("copy failed");
                                let _ = s.report_copy(id, t.task_id, &t.key, t.put_id, t.offset, failure, Millis(now));
                            } else {
                                let _ = match t.kind {
                                    TaskKind::Promote => s.report_promotion(id, &t.key, t.put_id, t.offset, ok),
                                    kind => s.report_task(id, kind, &t.key, t.put_id, ok, Millis(now)),
                                };
                            }
                        }
                    }
                }
                Step::Copy(key, o) => {
                    let targets = [seg(o as u16)];
                    let _ = s.create_replica_task(&k(&format!("k{key}")), TaskRequest::Copy { targets: &targets }, Millis(now));
                }
                Step::Move(key, a, b) => {
                    let (source, target) = (seg(a as u16), seg(b as u16));
                    let _ = s.create_replica_task(&k(&format!("k{key}")), TaskRequest::Move { source: &source, target: &target }, Millis(now));
                }
                Step::Release(key) => s.release_leases(&[format!("k{key}")], Millis(now)),
                Step::Clear(key, o) => {
                    let name = (o < 3).then(|| seg(o as u16));
                    let _ = s.replica_clear(&[k(&format!("k{key}"))], name.as_ref(), Millis(now));
                }
                Step::DiskDrop(key, o) => {
                    let key = k(&format!("k{key}"));
                    if let (Some(id), Some(put_id)) = (s.segment_id(&seg(o as u16)), s.objects.get(&key).map(|x| x.put_id)) {
                        s.disk_dropped(id, &key, put_id, Millis(now));
                    }
                }
            }
            if let Err(e) = s.check_invariants() { prop_assert!(false, "{}", e); }
            prop_assert!(s.allocated() <= s.capacity());
        }
    }
}

#[test]
fn policy_durations_are_what_the_reference_says() {
    let p = Policy::default();
    assert_eq!(p.lease_ttl, Duration::from_secs(10));
    assert_eq!(p.client_ttl, Duration::from_secs(10));
    assert_eq!(p.put_discard_timeout, Duration::from_secs(30));
    assert_eq!(p.put_release_timeout, Duration::from_secs(600));
}

#[test]
fn a_master_that_was_away_gives_every_owner_one_ttl_to_be_heard_from() {
    let policy = Policy::default();
    let ttl = policy.client_ttl.as_millis() as u64;
    let mut s = state_with_policy(&[4 * MIB, 4 * MIB], policy);
    put(&mut s, "a", MIB, &cfg(2), 0).unwrap();
    s.tick(Millis(100));
    // The master is stopped for three TTLs: no upkeep, no heartbeat heard.
    let back = 100 + 3 * ttl;
    s.tick(Millis(back));
    assert_eq!(s.active_owners(), 2, "nobody is dropped on resumption");
    assert!(s.exists(&k("a"), Millis(back)));
    // Owner 0 is heard from within a TTL of the resumption, owner 1 never.
    assert_eq!(
        s.heartbeat(owner(0), Millis(back + ttl / 3)),
        HeartbeatReply::Ok
    );
    for t in (back..=back + ttl).step_by(100) {
        s.tick(Millis(t));
    }
    assert_eq!(
        s.active_owners(),
        2,
        "one TTL after the resumption, not sooner"
    );
    s.tick(Millis(back + ttl + 1));
    assert_eq!(s.active_owners(), 1, "the silent owner goes after one TTL");
    let (_, reps) = s.get_replicas(&k("a"), Millis(back + ttl + 1)).unwrap();
    assert_eq!(reps.len(), 1);
    assert_eq!(reps[0].segment, seg(0));
    s.check_invariants().unwrap();
}

#[test]
fn upkeep_at_its_usual_pace_forgives_nothing() {
    let policy = Policy::default();
    let ttl = policy.client_ttl.as_millis() as u64;
    let mut s = state_with_policy(&[4 * MIB], policy);
    for t in (0..=ttl + 200).step_by(100) {
        s.tick(Millis(t));
    }
    assert_eq!(
        s.active_owners(),
        0,
        "a silent owner is dropped after its TTL"
    );
}

#[test]
fn tenant_quotas_hold_to_the_byte_through_upserts_and_removals() {
    let policy = Policy {
        client_ttl: Duration::from_secs(3600),
        quotas: [("a".to_string(), 1000u64)].into_iter().collect(),
        ..Policy::default()
    };
    let mut s = state_with_policy(&[64 * MIB], policy);
    let now = Millis(1);
    let a = |key: &str| k(&format!("\0a\0{key}"));
    let start = |s: &mut MasterState, key: &ObjectKey, size: u64, upsert: bool| {
        let config = ReplicateConfig { upsert, ..cfg(1) };
        s.put_start(key, size, &config, now)
    };
    let g = start(&mut s, &a("x"), 600, false).unwrap();
    s.put_end(a("x").as_str(), g.put_id, now).unwrap();
    start(&mut s, &a("y"), 400, false).unwrap();
    let e = start(&mut s, &a("z"), 1, false).unwrap_err();
    assert_eq!(e.code(), Code::NoAvailableHandle);
    assert!(e.to_string().contains("quota of 1000 bytes"), "{e}");
    // Another tenant, and the default one, are not held by a's quota.
    start(&mut s, &k("\0b\0z"), 5000, false).unwrap();
    start(&mut s, &k("z"), 5000, false).unwrap();
    // An upsert counts the bytes it replaces.
    let g = start(&mut s, &a("x"), 600, true).unwrap();
    s.put_end(a("x").as_str(), g.put_id, now).unwrap();
    assert!(start(&mut s, &a("x"), 601, true).is_err());
    s.remove(&a("x"), true, now).unwrap();
    let usage = s.tenant_usage();
    let of = |t: &str| usage.iter().find(|(n, _)| n == t).unwrap().1;
    assert_eq!(
        of("a"),
        TenantUsage {
            keys: 1,
            bytes: 400
        }
    );
    assert_eq!(
        of("b"),
        TenantUsage {
            keys: 1,
            bytes: 5000
        }
    );
    assert_eq!(
        of(""),
        TenantUsage {
            keys: 1,
            bytes: 5000
        }
    );
    start(&mut s, &a("z"), 600, false).unwrap();
    s.check_invariants().unwrap();
}
