//! The service over the state machine, on an injected clock: what a call does across its
//! steps (a put start's rounds of eviction, a removal's view of dropped segments).

use std::{sync::Arc, time::Duration};

use mooncake_common::{ClientId, ObjectKey, ReplicateConfig, SegmentName, Stamp};

use super::*;
use crate::{
    clock::{ManualClock, Millis},
    core::{MountReport, Policy, Reported},
};

const MIB: u64 = 1 << 20;

fn seg(i: u16) -> SegmentName {
    SegmentName::parse(&format!("127.0.0.1:{}", 4000 + i)).unwrap()
}

fn owner(i: u16) -> ClientId {
    ClientId::from_u128(i as u128 + 1)
}

/// A service over a state with one segment per size, owners that expire after `client_ttl`
/// without a heartbeat, and a clock at 0 that moves only when told.
fn service(sizes: &[u64], client_ttl: Duration) -> (MasterService, Arc<ManualClock>) {
    let mut state = MasterState::with_seed(
        Policy {
            client_ttl,
            ..Policy::default()
        },
        5,
    );
    for (i, size) in sizes.iter().enumerate() {
        let i = i as u16;
        state
            .mount_segment(
                owner(i),
                seg(i),
                *size,
                0,
                MountReport::default(),
                Millis(0),
            )
            .unwrap();
    }
    let clock = Arc::new(ManualClock::new(Millis(0)));
    let shared = Shared::new(state, clock.clone(), Arc::new(Leadership::always()));
    (MasterService::new(Arc::new(shared), None), clock)
}

fn with<R>(svc: &MasterService, f: impl FnOnce(&mut MasterState) -> R) -> R {
    f(&mut svc.shared.state.lock())
}

async fn put(svc: &MasterService, caller: &Caller, key: &str, size: u64, on: Option<u16>) -> u64 {
    let config = ReplicateConfig {
        preferred_segments: on.map(seg).into_iter().collect(),
        ..Default::default()
    };
    let g = svc.put_start(caller, &[(key, size)], &config, 0).await;
    let put_id = g[0].as_ref().unwrap().put_id;
    svc.put_end(caller, &[(key, put_id)])[0].as_ref().unwrap();
    put_id
}

/// A put that no eviction can place (the only segment is full, and objects being read sit
/// every 8 MiB, so no 16 MiB hole can form) fails after its start's own rounds: before, the
/// service evicted round after round while anything came free, and emptied the cache.
#[tokio::test]
async fn a_put_that_cannot_be_placed_does_not_empty_the_cache() {
    let (svc, _) = service(&[64 * MIB], Duration::from_secs(3600));
    let caller = Caller::cluster();
    for i in 0..64 {
        put(&svc, &caller, &format!("k{i}"), MIB, None).await;
    }
    with(&svc, |s| assert_eq!(s.allocated(), 64 * MIB));
    let read: Vec<String> = (0..64).step_by(8).map(|i| format!("k{i}")).collect();
    let read: Vec<&str> = read.iter().map(String::as_str).collect();
    svc.get_replicas(&caller, &read, Releases::NONE, |r| assert!(r.is_ok()));
    let g = svc
        .put_start(
            &caller,
            &[("big", 16 * MIB)],
            &ReplicateConfig::default(),
            0,
        )
        .await;
    assert!(
        matches!(g[0], Err(MasterError::NoSpace { .. })),
        "{:?}",
        g[0].as_ref().err()
    );
    let left = with(&svc, |s| s.key_count());
    assert!(
        left >= 32,
        "two rounds of 16 MiB at most: {left} objects left"
    );
}

/// A removal of everything by the default tenant leaves other tenants' objects that a dropped
/// segment held: should its owner come back, they are adopted. Before, with no other tenant's
/// object in the table at that moment, the removal took every key the master remembered.
#[tokio::test]
async fn a_default_tenant_remove_all_spares_other_tenants_on_dropped_segments() {
    let (svc, clock) = service(&[4 * MIB, 4 * MIB], Duration::from_secs(1));
    let tenant = Caller::resolve(None, Some("t")).unwrap();
    let put_id = put(&svc, &tenant, "\0t\0c", 1000, Some(0)).await;
    put(&svc, &Caller::cluster(), "d", 1000, Some(1)).await;
    let offset = with(&svc, |s| {
        let (_, locs) = s
            .get_replicas(&ObjectKey::new("\0t\0c").unwrap(), Millis(0))
            .unwrap();
        locs[0].offset
    });
    // Segment 0's owner goes silent and is dropped; segment 1's stays.
    let mut now = 0;
    while now < 1_500 {
        now += 200;
        clock.advance(Duration::from_millis(200));
        with(&svc, |s| {
            s.heartbeat(owner(1), Millis(now));
            s.tick(Millis(now));
        });
    }
    assert_eq!(with(&svc, |s| s.key_count()), 1, "only d is left");
    assert_eq!(
        svc.remove_all(&Caller::cluster(), false, None)
            .await
            .unwrap(),
        1
    );
    // The owner is back and reports what its pool holds.
    let adopted = with(&svc, |s| {
        let report = MountReport {
            newest_grant: put_id,
            objects: 1,
            disk_records: 0,
        };
        s.mount_segment(owner(0), seg(0), 4 * MIB, 0, report, Millis(now + 10))
            .unwrap();
        let item = Reported {
            key: ObjectKey::new("\0t\0c").unwrap(),
            offset,
            size: 1000,
            stamp: Stamp {
                put_id,
                replica_num: 1,
                ..Stamp::default()
            },
        };
        s.catalog_reported(owner(0), &seg(0), vec![item], true, Millis(now + 20))
            .unwrap()
            .unwrap()
    });
    assert_eq!((adopted.registered, adopted.refused), (1, 0));
}

/// An abandoned start's token is its tenant's: tenant B abandoning token 7 (guessed, or its own
/// that happens to match) refuses no start of tenant A's with that token. Before, the token was
/// refused for every tenant until the discard timeout.
#[tokio::test]
async fn a_tenants_abandoned_token_refuses_no_other_tenants_start() {
    let (svc, _) = service(&[64 * MIB], Duration::from_secs(3600));
    let a = Caller::resolve(None, Some("a")).unwrap();
    let b = Caller::resolve(None, Some("b")).unwrap();
    assert_eq!(svc.abandon_put_start(&b, 7), 0);
    let key_a = "\0a\0k";
    let g = svc
        .put_start(&a, &[(key_a, 1000)], &ReplicateConfig::default(), 7)
        .await;
    assert!(g[0].is_ok(), "{:?}", g[0]);
    let key_b = "\0b\0k";
    let g = svc
        .put_start(&b, &[(key_b, 1000)], &ReplicateConfig::default(), 7)
        .await;
    assert!(
        matches!(&g[0], Err(MasterError::Invalid(m)) if m.contains("abandoned")),
        "{:?}",
        g[0]
    );
}
