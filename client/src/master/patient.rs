//! Patience with a master that cannot answer yet: a master rebuilding its catalog from the
//! owners' reports answers UNAVAILABLE_IN_CURRENT_STATUS for keys it does not know yet, and a
//! restarted one refuses the connections of its predecessor. A lookup that gets either answer
//! (for any key, or for the call) is asked again, with a growing pause, until the answer is
//! definite or the caller's deadline (the RPC timeout) would pass. Lookups (`get_replicas`,
//! `exists`) are retried: they change nothing, so asking twice is safe. So are removals, but only
//! what the master answered "not known yet" (it removed nothing of that): the keys of a `remove`
//! so answered, a `remove_all` refused as a whole; and a put start whose every key was so
//! answered (it granted nothing). The other calls pass through.

use std::{sync::Arc, time::Duration};

use mooncake_common::{
    master_api::{Call, Existence, Grants, Lookup, Releases, SegmentUsage},
    Code, MasterApi, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig,
};
use tokio::time::Instant;

use super::first_try;

const FIRST_PAUSE: Duration = Duration::from_millis(20);
const LONGEST_PAUSE: Duration = Duration::from_millis(250);

/// The pauses between the tries of one call: growing, within the call's deadline.
struct Backoff {
    give_up: Instant,
    pause: Duration,
}

impl Backoff {
    fn new(deadline: Duration) -> Self {
        Backoff {
            give_up: Instant::now() + deadline,
            pause: FIRST_PAUSE,
        }
    }

    /// Waits before the next try; false, without waiting, when that would pass the deadline.
    async fn wait(&mut self) -> bool {
        if Instant::now() + self.pause >= self.give_up {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(LONGEST_PAUSE);
        true
    }
}

pub struct Patient {
    inner: Arc<dyn MasterApi>,
    deadline: Duration,
}

impl Patient {
    pub fn new(inner: Arc<dyn MasterApi>, deadline: Duration) -> Self {
        Patient { inner, deadline }
    }

    /// Runs `call` until `pending` says no answer asks to wait, or until waiting more would
    /// pass the deadline (then the last answer stands). Once a retry's answer replaces one,
    /// the holds that `hits` names in the replaced answer (keys, epoch, lease TTL) go back:
    /// nobody reads under them. Only within the first half of their TTL from when they were
    /// asked for, as every release: later, the master may have granted the key to another
    /// reader, whose hold it would end.
    fn until_definite<'a, T: Send + 'a>(
        &'a self,
        call: impl Fn() -> Call<'a, T> + Send + 'a,
        pending: impl Fn(&T) -> bool + Send + 'a,
        hits: impl Fn(&T) -> (Vec<&'a str>, u64, Duration) + Send + 'a,
    ) -> Call<'a, T> {
        Box::pin(async move {
            let mut backoff = Backoff::new(self.deadline);
            let give_up = backoff.give_up;
            let mut asked = std::time::Instant::now();
            let mut answer = call().await;
            loop {
                let again = match &answer {
                    Ok(a) => pending(a),
                    // The connection broke (a master restarting): a new one may answer.
                    Err(e) => e.code == Code::RpcFail,
                };
                if !again || !backoff.wait().await {
                    return answer;
                }
                // A retry gets only what is left of the deadline (each try on its own could take
                // a whole RPC timeout); past it the last answer stands, with its holds.
                let next_asked = std::time::Instant::now();
                let next = match tokio::time::timeout_at(give_up, call()).await {
                    Ok(next) => next,
                    Err(_) => return answer,
                };
                let replaced = std::mem::replace(&mut answer, next);
                let replaced_asked = std::mem::replace(&mut asked, next_asked);
                // Only once replaced: the caller reads under the new answer's holds.
                if let Ok(replaced) = &replaced {
                    let (keys, epoch, ttl) = hits(replaced);
                    let send_by = crate::leases::Granted {
                        asked: replaced_asked,
                        ttl,
                        epoch,
                    }
                    .send_by();
                    if !keys.is_empty() && std::time::Instant::now() < send_by {
                        // Best effort: a hold not handed back ends at its TTL.
                        let release = self.inner.release_leases(Releases {
                            send_by: Some(send_by),
                            ..Releases::of(&keys, epoch)
                        });
                        let _ = tokio::time::timeout_at(give_up, release).await;
                    }
                }
            }
        })
    }
}

fn not_yet(code: &Code) -> bool {
    *code == Code::UnavailableInCurrentStatus
}

/// The keys whose answer `held` says took a hold (a lookup's or existence check's hits).
fn hits_of<'a, R>(keys: &[&'a str], answers: &[R], held: impl Fn(&R) -> bool) -> Vec<&'a str> {
    keys.iter()
        .zip(answers)
        .filter(|(_, a)| held(a))
        .map(|(k, _)| *k)
        .collect()
}

impl MasterApi for Patient {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        // Asked again only when every key was answered "not known yet": nothing was granted,
        // so asking twice starts nothing twice. (A batch partly granted returns as it is: its
        // other keys fail with the code, to be put again. A broken connection is not asked
        // again: the start may have been made.)
        Box::pin(async move {
            let mut backoff = Backoff::new(self.deadline);
            loop {
                let answer = self.inner.put_start(items, config, token).await;
                let nothing_granted = answer.as_ref().is_ok_and(|g| {
                    !g.results.is_empty()
                        && g.results
                            .iter()
                            .all(|r| r.as_ref().is_err_and(|e| not_yet(&e.code)))
                });
                if !nothing_granted || !backoff.wait().await {
                    return answer;
                }
            }
        })
    }

    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        self.inner.abandon_put_start(token)
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
            move |l: &Lookup| {
                (
                    hits_of(keys, l.results(), Result::is_ok),
                    l.epoch,
                    l.lease_ttl,
                )
            },
        )
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        let first = std::sync::atomic::AtomicBool::new(true);
        self.until_definite(
            move || self.inner.exists(keys, first_try(&first, release)),
            |e: &Existence| e.found.iter().any(|r| r.as_ref().is_err_and(not_yet)),
            move |e: &Existence| {
                (
                    hits_of(keys, &e.found, |r| *r == Ok(true)),
                    e.epoch,
                    e.lease_ttl,
                )
            },
        )
    }

    // Only the keys answered "not known yet" are asked again: the others' answers stand (a
    // removed key asked again would read "not found").
    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(self.per_key_until_known(keys, PerKey::Remove(force)))
    }

    // Refused as a whole while the master rebuilds (nothing was removed): asked again.
    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        Box::pin(async move {
            let mut backoff = Backoff::new(self.deadline);
            loop {
                let answer = self.inner.remove_all(force, key_regex).await;
                let again = answer.as_ref().is_err_and(|e| not_yet(&e.code));
                if !again || !backoff.wait().await {
                    return answer;
                }
            }
        })
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

    // As `remove`: only the keys answered "not known yet" are asked again.
    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(self.per_key_until_known(keys, PerKey::Clear(segment)))
    }
}

/// A call answered key by key that `Patient` asks again for the keys not known yet.
#[derive(Clone, Copy)]
enum PerKey<'a> {
    Remove(bool),
    Clear(Option<&'a str>),
}

impl Patient {
    /// `op` of `keys`, asked again (with backoff, within the deadline) for the keys answered
    /// "not known yet" while the master rebuilds; the other keys' answers stand.
    async fn per_key_until_known(
        &self,
        keys: &[&str],
        op: PerKey<'_>,
    ) -> Result<Vec<Result<(), Code>>, mooncake_common::ApiError> {
        let mut backoff = Backoff::new(self.deadline);
        let mut answers = self.per_key(keys, op).await?;
        loop {
            let waiting: Vec<usize> = (0..answers.len())
                .filter(|i| answers[*i].as_ref().is_err_and(not_yet))
                .collect();
            if waiting.is_empty() || !backoff.wait().await {
                return Ok(answers);
            }
            let again: Vec<&str> = waiting.iter().map(|i| keys[*i]).collect();
            let Ok(Ok(next)) =
                tokio::time::timeout_at(backoff.give_up, self.per_key(&again, op)).await
            else {
                return Ok(answers);
            };
            for (i, a) in waiting.into_iter().zip(next) {
                answers[i] = a;
            }
        }
    }

    fn per_key<'a>(
        &'a self,
        keys: &'a [&'a str],
        op: PerKey<'a>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        match op {
            PerKey::Remove(force) => self.inner.remove(keys, force),
            PerKey::Clear(segment) => self.inner.replica_clear(keys, segment),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_common::master_api::ApiError;

    /// A master rebuilding its catalog for `rebuilding`: it knows only `known` keys yet (and
    /// leases them), the others answer "not yet". Then it knows every key, or with `silent` it
    /// goes silent (paused, or its host gone): each call's own deadline is left to the wire
    /// adapter, so here a silent call never ends. Holds handed back are kept in `released`.
    struct Rebuilding {
        started: Instant,
        rebuilding: Duration,
        known: &'static [&'static str],
        silent: bool,
        released: std::sync::Mutex<Vec<(Vec<String>, u64)>>,
        /// Calls answered (not met by the silence).
        answered: std::sync::atomic::AtomicUsize,
        removed: std::sync::Mutex<Vec<String>>,
        /// The lease its hits get.
        lease_ttl: Duration,
    }

    impl Rebuilding {
        fn new(rebuilding: Duration, known: &'static [&'static str], silent: bool) -> Self {
            Rebuilding {
                started: Instant::now(),
                rebuilding,
                known,
                silent,
                released: Default::default(),
                answered: Default::default(),
                removed: Default::default(),
                lease_ttl: Duration::from_secs(10),
            }
        }
    }

    impl MasterApi for Rebuilding {
        fn put_start<'a>(
            &'a self,
            _: &'a [(&'a str, u64)],
            _: &'a ReplicateConfig,
            _: u64,
        ) -> Call<'a, Grants> {
            unreachable!("only lookups are asked")
        }
        fn abandon_put_start(&self, _: u64) -> Call<'_, u32> {
            unreachable!("only lookups are asked")
        }
        fn put_end<'a>(&'a self, _: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
            unreachable!("only lookups are asked")
        }
        fn put_revoke<'a>(&'a self, _: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
            unreachable!("only lookups are asked")
        }
        fn get_replicas<'a>(&'a self, _: &'a [&'a str], _: Releases<'a>) -> Call<'a, Lookup> {
            unreachable!("only exists is asked")
        }
        fn exists<'a>(&'a self, keys: &'a [&'a str], _: Releases<'a>) -> Call<'a, Existence> {
            Box::pin(async move {
                let rebuilt = self.started.elapsed() >= self.rebuilding;
                if rebuilt && self.silent {
                    std::future::pending::<()>().await;
                }
                self.answered
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let answer = |k: &&str| {
                    if rebuilt || self.known.contains(k) {
                        Ok(true)
                    } else {
                        Err(Code::UnavailableInCurrentStatus)
                    }
                };
                Ok(Existence {
                    found: keys.iter().map(answer).collect(),
                    lease_ttl: self.lease_ttl,
                    epoch: 1,
                })
            })
        }
        // Every key exists once: a removal of one known (or, once rebuilt, of any) takes it.
        fn remove<'a>(&'a self, keys: &'a [&'a str], _: bool) -> Call<'a, Vec<Result<(), Code>>> {
            Box::pin(async move {
                let rebuilt = self.started.elapsed() >= self.rebuilding;
                let mut removed = self.removed.lock().unwrap();
                Ok(keys
                    .iter()
                    .map(|k| {
                        if removed.iter().any(|r| r == k) {
                            Err(Code::ObjectNotFound)
                        } else if rebuilt || self.known.contains(k) {
                            removed.push(k.to_string());
                            Ok(())
                        } else {
                            Err(Code::UnavailableInCurrentStatus)
                        }
                    })
                    .collect())
            })
        }
        fn remove_all<'a>(&'a self, _: bool, _: Option<&'a str>) -> Call<'a, u64> {
            Box::pin(async move {
                self.answered
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if self.started.elapsed() < self.rebuilding {
                    return Err(ApiError::new(
                        Code::UnavailableInCurrentStatus,
                        "rebuilding",
                    ));
                }
                Ok(3)
            })
        }
        fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
            unreachable!("only lookups are asked")
        }
        fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
            let keys = release.keys.iter().map(|k| k.to_string()).collect();
            self.released.lock().unwrap().push((keys, release.epoch));
            Box::pin(async { Ok(()) })
        }
        fn create_replica_task<'a>(&'a self, _: &'a str, _: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
            unreachable!("only lookups are asked")
        }
        fn query_task(&self, _: u64) -> Call<'_, ReplicaTaskState> {
            unreachable!("only lookups are asked")
        }
        // A whole object's clear is its removal.
        fn replica_clear<'a>(
            &'a self,
            keys: &'a [&'a str],
            _: Option<&'a str>,
        ) -> Call<'a, Vec<Result<(), Code>>> {
            self.remove(keys, false)
        }
    }

    /// Keys a rebuilding master does not know yet are asked again until it does; keys it removed
    /// at the first try keep that answer (asked again, they would read "not found").
    #[tokio::test]
    async fn a_removal_asks_again_only_for_keys_not_known_yet() {
        let master = Arc::new(Rebuilding::new(Duration::from_millis(50), &["a"], false));
        let patient = Patient::new(master.clone(), Duration::from_secs(5));
        let answer = patient.remove(&["a", "b"], false).await.unwrap();
        assert_eq!(answer, vec![Ok(()), Ok(())]);
        assert_eq!(*master.removed.lock().unwrap(), vec!["a", "b"]);
        let answer = patient.remove(&["a"], false).await.unwrap();
        assert_eq!(answer, vec![Err(Code::ObjectNotFound)]);
    }

    /// The same for a replica clear (refused for every key while the master rebuilds): asked
    /// again for the keys not known yet. Before, "not known yet" went back to the caller.
    #[tokio::test]
    async fn a_replica_clear_asks_again_for_keys_not_known_yet() {
        let master = Arc::new(Rebuilding::new(Duration::from_millis(50), &["a"], false));
        let patient = Patient::new(master.clone(), Duration::from_secs(5));
        let answer = patient.replica_clear(&["a", "b"], None).await.unwrap();
        assert_eq!(answer, vec![Ok(()), Ok(())]);
        assert_eq!(*master.removed.lock().unwrap(), vec!["a", "b"]);
    }

    /// A removal of everything refused while the master rebuilds is asked again; past the
    /// deadline the refusal stands.
    #[tokio::test]
    async fn remove_all_waits_out_a_rebuild_within_the_deadline() {
        let master = Arc::new(Rebuilding::new(Duration::from_millis(50), &[], false));
        let patient = Patient::new(master.clone(), Duration::from_secs(5));
        assert_eq!(patient.remove_all(false, None).await.unwrap(), 3);
        assert!(master.answered.load(std::sync::atomic::Ordering::Relaxed) >= 2);
        let master = Arc::new(Rebuilding::new(Duration::from_secs(60), &[], false));
        let patient = Patient::new(master, Duration::from_millis(100));
        let refused = patient.remove_all(false, None).await.unwrap_err();
        assert_eq!(refused.code, Code::UnavailableInCurrentStatus);
    }

    /// A retry gets only what is left of the deadline: a master that goes silent late in a
    /// rebuild leaves the caller with the last "not yet" at the deadline, not a second wait.
    #[tokio::test]
    async fn a_retry_that_meets_a_silent_master_ends_at_the_deadline() {
        let deadline = Duration::from_millis(300);
        // Tries at 0, 20, 60 and 140 ms: the last meets the silence.
        let patient = Patient::new(
            Arc::new(Rebuilding::new(Duration::from_millis(100), &[], true)),
            deadline,
        );
        let asked = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            patient.exists(&["k"], Releases::NONE),
        )
        .await
        .expect("the lookup ended by its deadline");
        assert!(asked.elapsed() >= Duration::from_millis(140));
        assert_eq!(
            answer.unwrap().found,
            vec![Err(Code::UnavailableInCurrentStatus)]
        );
    }

    /// A retry's answer replaces the one before, so the hits of that one (leased for nobody)
    /// are handed back, each time: only the last answer's holds stay with the caller.
    #[tokio::test]
    async fn a_retry_hands_back_the_holds_of_the_answer_it_replaces() {
        let master = Arc::new(Rebuilding::new(Duration::from_millis(50), &["a"], false));
        let patient = Patient::new(master.clone(), Duration::from_secs(5));
        // Tries at 0, 20 and 60 ms: "b" is known at the third.
        let answer = patient.exists(&["a", "b"], Releases::NONE).await.unwrap();
        assert_eq!(answer.found, vec![Ok(true), Ok(true)]);
        let released = master.released.lock().unwrap().clone();
        assert_eq!(released, vec![(vec!["a".to_string()], 1); 2]);
    }

    /// A replaced answer's holds go back only within the first half of their TTL from when
    /// they were asked for (as every release): later, the master may have leased the key to
    /// another reader, whose hold the release would end. Here the TTL is 30 ms and each retry
    /// comes at least 20 ms after the try it replaces: nothing goes back. Before, every
    /// replaced answer's holds went back whenever the retry was answered.
    #[tokio::test]
    async fn a_replaced_answers_holds_go_back_only_in_time() {
        let master = Arc::new(Rebuilding {
            lease_ttl: Duration::from_millis(30),
            ..Rebuilding::new(Duration::from_millis(50), &["a"], false)
        });
        let patient = Patient::new(master.clone(), Duration::from_secs(5));
        let answer = patient.exists(&["a", "b"], Releases::NONE).await.unwrap();
        assert_eq!(answer.found, vec![Ok(true), Ok(true)]);
        assert!(master.released.lock().unwrap().is_empty());
    }

    /// An answer goes back only once another has replaced it: a retry that meets the deadline
    /// leaves the caller the last answer with its holds, which the caller reads under and
    /// hands back itself (handed back here too, one would take another reader's hold).
    #[tokio::test]
    async fn the_answer_a_retry_could_not_replace_keeps_its_holds() {
        // Tries at 0, 20, 60 and 140 ms (later on a loaded machine): the last meets the
        // silence, at the deadline.
        let master = Arc::new(Rebuilding::new(Duration::from_millis(100), &["a"], true));
        let patient = Patient::new(master.clone(), Duration::from_millis(300));
        let answer = patient.exists(&["a", "b"], Releases::NONE).await.unwrap();
        assert_eq!(
            answer.found,
            vec![Ok(true), Err(Code::UnavailableInCurrentStatus)]
        );
        let answered = master.answered.load(std::sync::atomic::Ordering::Relaxed);
        let released = master.released.lock().unwrap().clone();
        assert!(answered >= 1);
        assert_eq!(
            released,
            vec![(vec!["a".to_string()], 1); answered - 1],
            "each answer replaced, and not the last"
        );
    }
}
