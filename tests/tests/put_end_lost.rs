//! A put whose end never reached the master, or whose start's answer never came back: the
//! client revokes or abandons it, so the key is free again. Before, the put stayed in flight
//! until the master's discard timeout (30 s) or its release timeout (10 minutes), and a retry
//! was told the key exists (`Ok(AlreadyExists)`) for an object that never came. Real master and
//! owner; the lost call is the one thing faked.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use mooncake_client::{Client, MasterApi, PutOutcome, ReplicateConfig};
use mooncake_common::{
    master_api::{Call, Existence, Grants, Lookup, Releases, SegmentUsage},
    ApiError, Code, ReplicaTaskSpec, ReplicaTaskState,
};
use mooncake_tests::{payload, transport, Cluster};

/// The in-process master, except for lost calls: the first `put_end` on its way (never
/// forwarded), the first `put_start`'s answer on its way back (the start is made), or the
/// first `put_end` and the first `put_revoke` on their way.
struct LosesFirst {
    inner: Arc<dyn MasterApi>,
    what: Lost,
    lost: AtomicBool,
    lost_revoke: AtomicBool,
}

#[derive(PartialEq)]
enum Lost {
    End,
    StartAnswer,
    EndAndRevoke,
    /// The end lost, and the revoke's failure answered as a client following an elected
    /// master answers it: UNAVAILABLE_IN_CURRENT_STATUS ("the master changed"), not RPC_FAIL.
    EndAndRevokeWhileFollowing,
}

impl MasterApi for LosesFirst {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        if self.what == Lost::StartAnswer && !self.lost.swap(true, Ordering::SeqCst) {
            return Box::pin(async move {
                let made = self.inner.put_start(items, config, token).await;
                assert!(made.unwrap().results.iter().all(|r| r.is_ok()));
                Err(ApiError::new(Code::RpcTimeout, "the answer was lost"))
            });
        }
        self.inner.put_start(items, config, token)
    }
    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        self.inner.abandon_put_start(token)
    }
    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        if self.what != Lost::StartAnswer && !self.lost.swap(true, Ordering::SeqCst) {
            return Box::pin(async { Err(ApiError::new(Code::RpcFail, "lost on its way")) });
        }
        self.inner.put_end(puts)
    }
    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        let lost = matches!(
            self.what,
            Lost::EndAndRevoke | Lost::EndAndRevokeWhileFollowing
        );
        if lost && !self.lost_revoke.swap(true, Ordering::SeqCst) {
            let code = if self.what == Lost::EndAndRevoke {
                Code::RpcFail
            } else {
                Code::UnavailableInCurrentStatus
            };
            return Box::pin(async move { Err(ApiError::new(code, "lost on its way")) });
        }
        self.inner.put_revoke(puts)
    }
    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        self.inner.get_replicas(keys, release)
    }
    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        self.inner.exists(keys, release)
    }
    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>> {
        self.inner.remove(keys, force)
    }
    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        self.inner.remove_all(force, key_regex)
    }
    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
        self.inner.list_segments()
    }
    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
        self.inner.release_leases(release)
    }
    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
        self.inner.create_replica_task(key, spec)
    }
    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState> {
        self.inner.query_task(id)
    }
    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        self.inner.replica_clear(keys, segment)
    }
}

/// A client on the in-process master of `c` that loses `what` once.
async fn losing(c: &Cluster, what: Lost) -> Client {
    let master = Arc::new(LosesFirst {
        inner: Arc::new(c.master.in_process()),
        what,
        lost: AtomicBool::new(false),
        lost_revoke: AtomicBool::new(false),
    });
    Client::with_master(master, None, transport(&c.client_config()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_whose_end_was_lost_is_revoked_and_can_be_put_again() {
    let c = Cluster::start(&[16 << 20]).await;
    let client = losing(&c, Lost::End).await;
    let value = payload("k", 100_000);
    let cfg = ReplicateConfig::default();
    let first = client.put("k", &value, &cfg).await;
    assert!(first.is_err(), "{first:?}");
    assert_eq!(
        client.put("k", &value, &cfg).await.unwrap(),
        PutOutcome::Stored,
        "the retry stores the object"
    );
    let mut buf = vec![0u8; value.len()];
    assert_eq!(client.get("k", &mut buf).await.unwrap(), value.len());
    assert!(buf == value);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_whose_start_answer_was_lost_is_abandoned_and_can_be_put_again() {
    let c = Cluster::start(&[16 << 20]).await;
    let client = losing(&c, Lost::StartAnswer).await;
    let value = payload("k", 100_000);
    let cfg = ReplicateConfig::default();
    let first = client.put("k", &value, &cfg).await;
    assert!(first.is_err(), "{first:?}");
    // The start is given up in the background: a retry right after may still find its put in
    // flight, for a moment (within the 30 s discard timeout it otherwise would).
    let mut outcome = PutOutcome::AlreadyExists;
    for _ in 0..50 {
        outcome = client.put("k", &value, &cfg).await.unwrap();
        if outcome == PutOutcome::Stored {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(outcome, PutOutcome::Stored, "a retry stores the object");
    let mut buf = vec![0u8; value.len()];
    assert_eq!(client.get("k", &mut buf).await.unwrap(), value.len());
    assert!(buf == value);
    c.shutdown().await;
}

/// The end is lost and so is the revoke that follows it: the revoke is tried again before the
/// put returns, so the caller's retry stores the object. Before, the key read as a put in
/// flight (`Ok(AlreadyExists)`, nothing stored) until the master's discard timeout (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_whose_end_and_revoke_were_lost_is_revoked_again_and_a_retry_stores_it() {
    for lost in [Lost::EndAndRevoke, Lost::EndAndRevokeWhileFollowing] {
        end_and_revoke_lost(lost).await;
    }
}

/// The same when the revoke's failure comes as a client following an elected master reports
/// it (UNAVAILABLE_IN_CURRENT_STATUS): before, that revoke was not tried again.
async fn end_and_revoke_lost(lost: Lost) {
    let c = Cluster::start(&[16 << 20]).await;
    let client = losing(&c, lost).await;
    let value = payload("k", 100_000);
    let cfg = ReplicateConfig::default();
    let first = client.put("k", &value, &cfg).await;
    assert!(first.is_err(), "{first:?}");
    assert_eq!(
        client.put("k", &value, &cfg).await.unwrap(),
        PutOutcome::Stored,
        "the first retry stores the object"
    );
    let mut buf = vec![0u8; value.len()];
    assert_eq!(client.get("k", &mut buf).await.unwrap(), value.len());
    assert!(buf == value);
    c.shutdown().await;
}

/// An upsert that finds another put of its key in flight stores nothing, so it fails (with
/// "exists"); before, it reported success (`Ok(AlreadyExists)`, as a plain put does) while the
/// other put's value, or none if that put failed, was what a get found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upsert_that_finds_a_put_in_flight_fails() {
    let c = Cluster::start(&[16 << 20]).await;
    let master: Arc<dyn MasterApi> = Arc::new(c.master.in_process());
    let client = Client::with_master(master.clone(), None, transport(&c.client_config()))
        .await
        .unwrap();
    let value = payload("k", 100_000);
    let cfg = ReplicateConfig::default();
    let in_flight = master.put_start(&[("k", 100_000)], &cfg, 7).await.unwrap();
    assert!(in_flight.results[0].is_ok());
    let upsert = ReplicateConfig {
        upsert: true,
        ..ReplicateConfig::default()
    };
    let e = client.put("k", &value, &upsert).await.unwrap_err();
    assert_eq!(e.code(), Code::ObjectAlreadyExists, "{e}");
    assert_eq!(
        client.put("k", &value, &cfg).await.unwrap(),
        PutOutcome::AlreadyExists,
        "a plain put of a key being written is write-once as before"
    );
    // A key repeated in one upsert batch: the first value is stored, the repeat fails.
    let (v1, v2) = (payload("r1", 1000), payload("r2", 1000));
    let both = client
        .batch_put(&[("r", &v1[..]), ("r", &v2[..])], &upsert)
        .await;
    assert_eq!(both[0].as_ref().unwrap(), &PutOutcome::Stored);
    let repeat = both[1].as_ref().unwrap_err();
    assert_eq!(repeat.code(), Code::ObjectAlreadyExists);
    assert!(
        repeat.to_string().contains("repeated in this batch"),
        "{repeat}"
    );
    let mut buf = vec![0u8; 1000];
    client.get("r", &mut buf).await.unwrap();
    assert!(buf == v1);
    // Once the other put is given up, the upsert stores its value.
    master.abandon_put_start(7).await.unwrap();
    assert_eq!(
        client.put("k", &value, &upsert).await.unwrap(),
        PutOutcome::Stored
    );
    let mut buf = vec![0u8; value.len()];
    assert_eq!(client.get("k", &mut buf).await.unwrap(), value.len());
    assert!(buf == value);
    c.shutdown().await;
}
