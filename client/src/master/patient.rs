//! Patience with a master that cannot answer yet: a master rebuilding its catalog from the
//! owners' reports answers UNAVAILABLE_IN_CURRENT_STATUS for keys it does not know yet, and a
//! restarted one refuses the connections of its predecessor. A lookup that gets either answer
//! (for any key, or for the call) is asked again, with a growing pause, until the answer is
//! definite or the caller's deadline (the RPC timeout) would pass. Only lookups (`get_replicas`,
//! `exists`) are retried: they change nothing, so asking twice is safe. The other calls pass
//! through.

use std::{sync::Arc, time::Duration};

use mooncake_common::{
    master_api::{Call, Existence, Grants, Lookup, Releases, SegmentUsage},
    Code, MasterApi, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig,
};
use tokio::time::Instant;

use super::first_try;

const FIRST_PAUSE: Duration = Duration::from_millis(20);
const LONGEST_PAUSE: Duration = Duration::from_millis(250);

pub struct Patient {
    inner: Arc<dyn MasterApi>,
    deadline: Duration,
}

impl Patient {
    pub fn new(inner: Arc<dyn MasterApi>, deadline: Duration) -> Self {
        Patient { inner, deadline }
    }

    /// Runs `call` until `pending` says no answer asks to wait, or until waiting more would
    /// pass the deadline (then the last answer stands).
    fn until_definite<'a, T: Send + 'a>(
        &'a self,
        call: impl Fn() -> Call<'a, T> + Send + 'a,
        pending: impl Fn(&T) -> bool + Send + 'a,
    ) -> Call<'a, T> {
        Box::pin(async move {
            let give_up = Instant::now() + self.deadline;
            let mut pause = FIRST_PAUSE;
            loop {
                let answer = call().await;
                let again = match &answer {
                    Ok(a) => pending(a),
                    // The connection broke (a master restarting): a new one may answer.
                    Err(e) => e.code == Code::RpcFail,
                };
                if !again || Instant::now() + pause >= give_up {
                    return answer;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
        })
    }
}

fn not_yet(code: &Code) -> bool {
    *code == Code::UnavailableInCurrentStatus
}

impl MasterApi for Patient {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
    ) -> Call<'a, Grants> {
        self.inner.put_start(items, config)
    }

    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        self.inner.put_end(puts)
    }

    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        self.inner.put_revoke(puts)
    }

    // Releases go with the first try only (see `first_try`).
    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        let first = std::sync::atomic::AtomicBool::new(true);
        self.until_definite(
            move || self.inner.get_replicas(keys, first_try(&first, release)),
            |l: &Lookup| l.results().iter().any(|r| r.as_ref().is_err_and(not_yet)),
        )
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        let first = std::sync::atomic::AtomicBool::new(true);
        self.until_definite(
            move || self.inner.exists(keys, first_try(&first, release)),
            |e: &Existence| e.found.iter().any(|r| r.as_ref().is_err_and(not_yet)),
        )
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
