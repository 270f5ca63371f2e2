//! Following the elected master through etcd (`etcd://h:p;h:p`): the leader's address is read
//! from the cluster's leader key, calls go to it over the configured wire adapter, and a call
//! that fails because the master is gone or no longer leads is tried again on whoever leads
//! now, within the caller's deadline (the RPC timeout). Lookups are always tried again; a call
//! that changes state only when the master refused it unexecuted ("not the leader") or when the
//! leader changed meanwhile (the old one is gone, so what it did is gone with it: the owners'
//! reports rebuild only what landed). Ending or revoking a put is never carried over to a new
//! leader, which never heard of the put: the caller gets UNAVAILABLE_IN_CURRENT_STATUS and puts
//! again (the put then succeeds, or finds the object the owners reported already there). A call to a master that went silent (paused, cut off) is
//! not waited out: while it is in flight the leader key is read every half second, and once it
//! names another master the call is abandoned and goes to the new one.

use std::{sync::Arc, time::Duration};

use mooncake_common::{
    leader::{Leader, LeaderLookup},
    master_api::{Call, Existence, Grants, Lookup, Releases, SegmentUsage},
    ApiError, Code, MasterApi, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig,
};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::first_try;

/// Builds the wire adapter for a leader's address (or says why the address is no good).
pub type Connector = Box<dyn Fn(&str) -> Result<Arc<dyn MasterApi>, String> + Send + Sync>;

const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// How often the leader key is read while a call is in flight.
const WATCH_EVERY: Duration = Duration::from_millis(500);
const LONGEST_PAUSE: Duration = Duration::from_millis(500);

pub struct Following {
    lookup: LeaderLookup,
    connect: Connector,
    deadline: Duration,
    current: Mutex<Option<(Leader, Arc<dyn MasterApi>)>>,
}

impl Following {
    pub fn new(lookup: LeaderLookup, connect: Connector, deadline: Duration) -> Self {
        Following {
            lookup,
            connect,
            deadline,
            current: Mutex::new(None),
        }
    }

    /// The leader's adapter (asking etcd when none is known).
    async fn leader(&self) -> Result<(Leader, Arc<dyn MasterApi>), ApiError> {
        if let Some((l, m)) = self.current.lock().clone() {
            return Ok((l, m));
        }
        let leader = self.lookup.leader().await.map_err(ApiError::rpc)?;
        let master = (self.connect)(&leader.address).map_err(ApiError::rpc)?;
        let mut current = self.current.lock();
        if let Some((newer, m)) = current.as_ref().filter(|(l, _)| l.term > leader.term) {
            // Another call's lookup, made later, found a newer term meanwhile: this one read
            // etcd before the election and must not put the deposed leader back.
            return Ok((newer.clone(), m.clone()));
        }
        tracing::info!(leader = %leader.address, term = leader.term, "following the elected master");
        *current = Some((leader.clone(), master.clone()));
        Ok((leader, master))
    }

    /// Finishes once etcd names a leader other than `called` (never while it still leads).
    async fn moved_from(&self, called: &Leader) {
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            if let Ok(now) = self.lookup.leader().await {
                if now != *called {
                    return;
                }
            }
        }
    }

    /// Forgets `failed` as the leader, so the next call asks etcd again.
    fn forget(&self, failed: &Leader) {
        let mut current = self.current.lock();
        if current.as_ref().is_some_and(|(l, _)| l == failed) {
            *current = None;
        }
    }
}

/// Which calls go again after a failure on the leader.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Lookups: always (they change nothing).
    Always,
    /// Calls that change state: on a new leader only.
    NewLeader,
    /// A put's end or revoke: never (a new leader did not start the put).
    Never,
}

/// Whether an error says the master that answered is gone or does not lead. A code in an
/// answer (a remove-all refused while the master rebuilds: UNAVAILABLE_IN_CURRENT_STATUS too)
/// is the leader's own word, not trouble with it.
fn leader_trouble(e: &ApiError) -> bool {
    match e.code {
        Code::RpcFail => true,
        Code::UnavailableInCurrentStatus => mooncake_common::leader::is_not_leading(&e.message),
        _ => false,
    }
}

/// Runs `$call` (an expression using `$m`, the leader's adapter) against the leader, trying
/// again on a new leader as described in the module's doc.
macro_rules! on_leader {
    ($self:ident, $retry:expr, |$m:ident| $call:expr) => {
        Box::pin(async move {
            let give_up = Instant::now() + $self.deadline;
            let mut pause = FIRST_PAUSE;
            let mut tried: Option<Leader> = None;
            // After the first attempt, each one gets only what is left of the deadline (a
            // lookup in etcd and a call could each take a whole timeout of their own).
            let mut bounded = false;
            loop {
                let found = if bounded {
                    match tokio::time::timeout_at(give_up, $self.leader()).await {
                        Ok(found) => found,
                        Err(_) => return Err(ApiError::new(Code::RpcTimeout, "no leader answered within the deadline")),
                    }
                } else {
                    $self.leader().await
                };
                let (leader, $m) = match found {
                    Ok(x) => x,
                    Err(e) if Instant::now() + pause < give_up => {
                        tracing::debug!(error = %e, "no leader yet");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(LONGEST_PAUSE);
                        // Later lookups, and the call, get what is left of the deadline.
                        bounded = true;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                // A state-changing call that failed in flight goes again only to a new leader.
                if $retry != Retry::Always && tried.as_ref().is_some_and(|t| *t == leader) {
                    if Instant::now() + pause >= give_up {
                        return Err(ApiError::new(Code::RpcTimeout, "the master failed mid-call and no new leader took over within the deadline"));
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(LONGEST_PAUSE);
                    $self.forget(&leader);
                    continue;
                }
                let res = tokio::select! {
                    r = $call => r,
                    _ = $self.moved_from(&leader) => Err(ApiError::rpc(format!(
                        "master {} stopped leading during the call", leader.address
                    ))),
                    _ = tokio::time::sleep_until(give_up), if bounded => Err(ApiError::new(Code::RpcTimeout, format!(
                        "master {} did not answer a retried call within the deadline", leader.address
                    ))),
                };
                bounded = true;
                match &res {
                    // A put's end or revoke means nothing to a leader that did not start it.
                    Err(e) if leader_trouble(e) && $retry == Retry::Never => {
                        $self.forget(&leader);
                        return Err(ApiError::new(
                            Code::UnavailableInCurrentStatus,
                            format!("the master changed before the put ended ({}): put again (it succeeds, or finds the object already stored)", e.message),
                        ));
                    }
                    Err(e) if leader_trouble(e) && Instant::now() + pause < give_up => {
                        tracing::debug!(error = %e, leader = %leader.address, "master call failed; asking etcd for the leader");
                        $self.forget(&leader);
                        // Refused unexecuted, or never sent (a new leader not listening yet): it
                        // may go to the same master again.
                        let unexecuted = e.code == Code::UnavailableInCurrentStatus
                            || mooncake_common::leader::was_not_sent(&e.message);
                        if !unexecuted {
                            tried = Some(leader);
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(LONGEST_PAUSE);
                    }
                    _ => return res,
                }
            }
        })
    };
}

impl MasterApi for Following {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        on_leader!(self, Retry::NewLeader, |m| m
            .put_start(items, config, token))
    }

    // Idempotent: a leader that never saw the start only remembers the token.
    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        on_leader!(self, Retry::Always, |m| m.abandon_put_start(token))
    }

    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        on_leader!(self, Retry::Never, |m| m.put_end(puts))
    }

    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        on_leader!(self, Retry::Never, |m| m.put_revoke(puts))
    }

    // A lookup may go again (to another leader, or after a broken call): its releases go with
    // the first try only, so that no hold is handed back twice.
    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        let first = std::sync::atomic::AtomicBool::new(true);
        on_leader!(self, Retry::Always, |m| m
            .get_replicas(keys, first_try(&first, release)))
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        let first = std::sync::atomic::AtomicBool::new(true);
        on_leader!(self, Retry::Always, |m| m
            .exists(keys, first_try(&first, release)))
    }

    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>> {
        on_leader!(self, Retry::NewLeader, |m| m.remove(keys, force))
    }

    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        on_leader!(self, Retry::NewLeader, |m| m.remove_all(force, key_regex))
    }

    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
        on_leader!(self, Retry::Always, |m| m.list_segments())
    }

    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
        on_leader!(self, Retry::Never, |m| m.release_leases(release))
    }

    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
        on_leader!(self, Retry::NewLeader, |m| m.create_replica_task(key, spec))
    }

    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState> {
        on_leader!(self, Retry::Always, |m| m.query_task(id))
    }

    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        on_leader!(self, Retry::NewLeader, |m| m.replica_clear(keys, segment))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_call_level_refusal_is_trouble_with_the_leader() {
        let not_leading = ApiError::new(
            Code::UnavailableInCurrentStatus,
            format!(
                "master 10.0.0.1:50051: {}",
                mooncake_common::leader::NOT_LEADING
            ),
        );
        assert!(leader_trouble(&not_leading));
        assert!(leader_trouble(&ApiError::rpc("connection reset")));
        // The leader's own answer: a remove-all refused while it rebuilds.
        let busy = ApiError::new(Code::UnavailableInCurrentStatus, "remove_all refused");
        assert!(!leader_trouble(&busy));
        assert!(!leader_trouble(&ApiError::new(
            Code::ObjectNotFound,
            "gone"
        )));
    }
}
