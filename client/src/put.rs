//! Batch put: validate locally, one put start for the batch, every replica written at once (one
//! transport batch per owner), then one put end for what was written and one revoke for what
//! was not.

use std::{
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use futures::future::join_all;
use mooncake_common::{
    master_api::Grants,
    transport::{parts_len, WriteItem},
    ApiError, Code, MasterApi, ObjectKey, ReplicateConfig, SegmentName, Stamp,
};

use crate::{client::Client, error::ClientError, group::Groups};

/// A successful put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    /// The key was already there (or being written by another put): objects are write-once.
    /// Never an upsert's outcome: one that finds a put of its key in flight fails.
    AlreadyExists,
}

type PutResult = Result<PutOutcome, ClientError>;

impl Client {
    pub async fn put(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> PutResult {
        self.batch_put(&[(key, value)], config)
            .await
            .pop()
            .expect("one result per item")
    }

    /// Puts every (key, value); one result per item, in order.
    pub async fn batch_put(
        &self,
        items: &[(&str, &[u8])],
        config: &ReplicateConfig,
    ) -> Vec<PutResult> {
        let parts: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<(&str, &[&[u8]])> = items
            .iter()
            .zip(&parts)
            .map(|((k, _), p)| (*k, &p[..]))
            .collect();
        self.batch_put_parts(&items, config).await
    }

    /// Puts objects each given as the concatenation of several buffers (e.g. K and V), sent
    /// without first being copied together; one result per item, in order.
    pub async fn batch_put_parts(
        &self,
        items: &[(&str, &[&[u8]])],
        config: &ReplicateConfig,
    ) -> Vec<PutResult> {
        let mut results: Vec<Option<PutResult>> = (0..items.len()).map(|_| None).collect();
        // Validate locally; only valid items go to the master.
        let mut valid: Vec<(usize, ObjectKey)> = Vec::with_capacity(items.len());
        for (i, (key, parts)) in items.iter().enumerate() {
            match self.object_key(key) {
                Err(e) => results[i] = Some(Err(e)),
                Ok(_) if parts.iter().all(|p| p.is_empty()) => {
                    results[i] = Some(Err(ClientError::Invalid(format!(
                        "value of {key} is empty"
                    ))))
                }
                Ok(k) => valid.push((i, k)),
            }
        }
        if !valid.is_empty() {
            self.put_valid(items, &valid, config, &mut results).await;
        }
        let (mut keys, mut bytes) = (0u64, 0u64);
        for ((_, parts), r) in items.iter().zip(&results) {
            if matches!(r, Some(Ok(PutOutcome::Stored))) {
                keys += 1;
                bytes += parts.iter().map(|p| p.len() as u64).sum::<u64>();
            }
        }
        self.tiers.put_keys.fetch_add(keys, Ordering::Relaxed);
        self.tiers.put_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.leases.call_ended();
        results
            .into_iter()
            .map(|r| r.expect("every item answered"))
            .collect()
    }

    async fn put_valid(
        &self,
        items: &[(&str, &[&[u8]])],
        valid: &[(usize, ObjectKey)],
        config: &ReplicateConfig,
        results: &mut [Option<PutResult>],
    ) {
        let preferred_default;
        let config = match &self.preferred {
            Some(p) if config.preferred_segments.is_empty() => {
                preferred_default = ReplicateConfig {
                    preferred_segments: vec![p.clone()],
                    ..config.clone()
                };
                &preferred_default
            }
            _ => config,
        };
        let starts: Vec<(&str, u64)> = valid
            .iter()
            .map(|(i, k)| (k.as_str(), parts_len(items[*i].1)))
            .collect();
        // Names this start, should its answer not come back (see `Unsettled`).
        let token = rand::random::<u64>().max(1);
        let starting = Unsettled::start(&self.master, token);
        let grants = match self.master.put_start(&starts, config, token).await {
            Ok(g) => g,
            Err(e) => {
                if !unanswered(&e) {
                    starting.settled(); // the master's own refusal: it granted nothing
                }
                return fill(results, valid, &e.into());
            }
        };
        let unsettled = starting.granted(valid, &grants);

        let write_errors = self.write_replicas(items, valid, &grants, config).await;
        self.end_or_revoke(valid, &grants, write_errors, config.upsert, results)
            .await;
        unsettled.settled();
        share_fate_of_repeats(valid, &grants, results);
    }

    /// Writes every replica of every granted put, one batch per owner, all owners at once; the
    /// first error of each put, by its position in `valid`.
    async fn write_replicas(
        &self,
        items: &[(&str, &[&[u8]])],
        valid: &[(usize, ObjectKey)],
        grants: &Grants,
        config: &ReplicateConfig,
    ) -> Vec<Option<ClientError>> {
        let mut write_errors: Vec<Option<ClientError>> = (0..valid.len()).map(|_| None).collect();
        let mut groups: Groups<SegmentName, WriteItem<'_>> = Groups::new();
        for (slot, ((i, key), grant)) in valid.iter().zip(&grants.results).enumerate() {
            let Ok(grant) = grant else { continue };
            for rep in grants.run(&grant.replicas) {
                groups.push(
                    rep.segment.clone(),
                    slot,
                    WriteItem {
                        key,
                        offset: rep.offset,
                        stamp: Stamp::new(grant.put_id, config),
                        seal: rep.seal,
                        parts: items[*i].1,
                    },
                );
            }
        }
        let batches = groups
            .iter_mut()
            .map(|g| async move { (&g.slots, self.transport.write_batch(&g.to, &g.items).await) });
        for (slots, res) in join_all(batches).await {
            for (slot, r) in slots.iter().zip(res) {
                if let Err(e) = r {
                    tracing::debug!(key = %valid[*slot].1, error = %e, "replica write failed; revoking the put");
                    write_errors[*slot].get_or_insert(e.into());
                }
            }
        }
        write_errors
    }

    /// Ends the puts whose replicas were all written and revokes the others; fills in every
    /// put's result. An upsert refused as "exists" found another put of its key in flight
    /// (a stored value it would have replaced): it stored nothing, so it fails.
    async fn end_or_revoke(
        &self,
        valid: &[(usize, ObjectKey)],
        grants: &Grants,
        mut write_errors: Vec<Option<ClientError>>,
        upsert: bool,
        results: &mut [Option<PutResult>],
    ) {
        let (mut end, mut revoke) = (Vec::new(), Vec::new());
        // Keys this batch was granted: an upsert's repeat is refused for its own first one.
        let granted: std::collections::HashSet<&str> = valid
            .iter()
            .zip(&grants.results)
            .filter(|(_, g)| g.is_ok())
            .map(|((_, k), _)| k.as_str())
            .collect();
        for (slot, ((i, key), grant)) in valid.iter().zip(&grants.results).enumerate() {
            match grant {
                Err(e) if e.code == Code::ObjectAlreadyExists && !upsert => {
                    results[*i] = Some(Ok(PutOutcome::AlreadyExists))
                }
                Err(e) if e.code == Code::ObjectAlreadyExists => {
                    let why = if granted.contains(key.as_str()) {
                        "the key is repeated in this batch: its first value was upserted, not this one"
                    } else {
                        "the upsert stored nothing, as another put of the key is in flight; retry once it ends"
                    };
                    results[*i] = Some(Err(ClientError::master(
                        e.code,
                        format!("{}: {why}", e.message),
                    )))
                }
                Err(e) => results[*i] = Some(Err(ClientError::master(e.code, e.message.clone()))),
                Ok(g) => match write_errors[slot].take() {
                    Some(e) => {
                        results[*i] = Some(Err(e));
                        revoke.push((key.as_str(), g.put_id));
                    }
                    None => end.push((*i, (key.as_str(), g.put_id))),
                },
            }
        }
        if !revoke.is_empty() {
            self.revoke(&revoke).await;
        }
        if end.is_empty() {
            return;
        }
        let (idx, puts): (Vec<usize>, Vec<(&str, u64)>) = end.into_iter().unzip();
        match self.master.put_end(&puts).await {
            Ok(codes) => {
                for (i, code) in idx.into_iter().zip(codes) {
                    results[i] = Some(match code {
                        Ok(()) => Ok(PutOutcome::Stored),
                        Err(c) => Err(ClientError::master(c, "put end refused")),
                    });
                }
            }
            Err(e) => {
                // The puts may not have ended: revoked, so that a retry is not told the key
                // exists (another writer's put in flight) for an object that never comes. One
                // that did end stays (the master refuses to revoke it).
                self.revoke(&puts).await;
                let e = ClientError::from(e);
                for i in idx {
                    results[i] = Some(Err(e.for_each_key()));
                }
            }
        }
    }
}

impl Client {
    /// Revokes `puts`. A revoke that goes unanswered (the connection broke, the master
    /// restarted) is tried again at once while that takes little time (`REVOKE_INLINE`), so a
    /// caller retrying on the error does not find its own put still in flight; then in the
    /// background (`give_up`), so the keys do not read as puts in flight until the master's
    /// discard timeout.
    async fn revoke(&self, puts: &[(&str, u64)]) {
        let until = tokio::time::Instant::now() + REVOKE_INLINE;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.master.put_revoke(puts).await {
                Ok(_) => return,
                Err(e) if try_again(&e) && tokio::time::Instant::now() + pause < until => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(e) if try_again(&e) => {
                    tracing::debug!(error = %e, puts = puts.len(), "a revoke went unanswered; trying again in the background");
                    let owned = puts
                        .iter()
                        .filter_map(|&(k, id)| Some((ObjectKey::new(k).ok()?, id)))
                        .collect();
                    spawn_give_up(self.master.clone(), Pending::Granted(owned));
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the master refused to revoke failed puts; it reclaims them after its release timeout");
                    return;
                }
            }
        }
    }
}

/// How long an unanswered revoke is tried again before its put's result is returned.
const REVOKE_INLINE: Duration = Duration::from_secs(1);

/// How long puts are given up in the background: past the master's discard timeout (30 s by
/// default) it gives them up by itself.
const GIVE_UP_WITHIN: Duration = Duration::from_secs(30);

/// Gives `pending` up on a task of its own (`give_up`), if there is a runtime to run it.
fn spawn_give_up(master: Arc<dyn MasterApi>, pending: Pending) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!("puts given up outside a runtime; the master reclaims their space after its release timeout");
        return;
    };
    runtime.spawn(give_up(master, pending));
}

/// Abandons a start or revokes granted puts at the master, again (backing off up to 2 s) while
/// the call goes unanswered, within `GIVE_UP_WITHIN`.
async fn give_up(master: Arc<dyn MasterApi>, pending: Pending) {
    let until = tokio::time::Instant::now() + GIVE_UP_WITHIN;
    let mut pause = Duration::from_millis(100);
    loop {
        let answer = match &pending {
            Pending::Start(token) => master.abandon_put_start(*token).await.map(|_| ()),
            Pending::Granted(puts) => {
                let refs: Vec<(&str, u64)> = puts.iter().map(|(k, id)| (k.as_str(), *id)).collect();
                master.put_revoke(&refs).await.map(|_| ())
            }
        };
        match answer {
            Ok(()) => return,
            Err(e) if try_again(&e) && tokio::time::Instant::now() + pause < until => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot give up puts that were not ended; their keys read as puts in flight until the master's discard timeout");
                return;
            }
        }
    }
}

/// Whether a failed call may have reached the master, its answer lost: it timed out, or its
/// connection broke.
fn unanswered(e: &ApiError) -> bool {
    matches!(e.code, Code::RpcTimeout | Code::RpcFail)
}

/// Whether giving a put up (a revoke, an abandoned start) goes again after `e`: unanswered, or
/// refused unexecuted, which is how a client following an elected master reports a failure
/// mid-call (the leader may be the same one, still holding the put). Sent again, it is done,
/// or refused by a master that does not know the put.
fn try_again(e: &ApiError) -> bool {
    unanswered(e) || e.code == Code::UnavailableInCurrentStatus
}

/// Puts started and not yet ended or revoked. Should the put be dropped before (its caller's
/// timeout, a `select!`), or its start's answer never come, they are given up in the
/// background: otherwise each key would stay a put in flight, refusing every other put of it
/// (which reads as "already exists") with no object coming, until the master's discard
/// timeout, and its space held until the release timeout. A revoke of a put that did end is
/// refused by the master, so nothing stored goes.
#[must_use = "gives the puts up when dropped unless settled"]
struct Unsettled {
    master: Arc<dyn MasterApi>,
    pending: Pending,
}

enum Pending {
    /// The start is on its way under this token: what it grants is not known.
    Start(u64),
    /// The puts it granted, by key and put id.
    Granted(Vec<(ObjectKey, u64)>),
}

impl Unsettled {
    fn start(master: &Arc<dyn MasterApi>, token: u64) -> Self {
        Unsettled {
            master: master.clone(),
            pending: Pending::Start(token),
        }
    }

    /// The start's answer came: what it granted is pending now.
    fn granted(mut self, valid: &[(usize, ObjectKey)], grants: &Grants) -> Self {
        let puts = valid
            .iter()
            .zip(&grants.results)
            .filter_map(|((_, key), g)| Some((key.clone(), g.as_ref().ok()?.put_id)))
            .collect();
        self.pending = Pending::Granted(puts);
        self
    }

    /// Every put was ended or revoked (or is being given up in the background).
    fn settled(mut self) {
        self.pending = Pending::Granted(Vec::new());
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        let pending = std::mem::replace(&mut self.pending, Pending::Granted(Vec::new()));
        if matches!(&pending, Pending::Granted(puts) if puts.is_empty()) {
            return;
        }
        spawn_give_up(self.master.clone(), pending);
    }
}

/// A key repeated in one batch: the master grants its first occurrence and answers the others
/// "already exists" (a put of it is in flight). If that put then failed, the object is not
/// there, so the repeats failed with it rather than reporting an object that does not exist.
fn share_fate_of_repeats(
    valid: &[(usize, ObjectKey)],
    grants: &Grants,
    results: &mut [Option<PutResult>],
) {
    let repeats = grants
        .results
        .iter()
        .any(|g| matches!(g, Err(e) if e.code == Code::ObjectAlreadyExists));
    if !repeats || valid.len() < 2 {
        return;
    }
    let written: std::collections::HashMap<&str, usize> = valid
        .iter()
        .zip(&grants.results)
        .filter(|(_, g)| g.is_ok())
        .map(|((i, k), _)| (k.as_str(), *i))
        .collect();
    for ((i, key), grant) in valid.iter().zip(&grants.results) {
        let Err(e) = grant else { continue };
        if e.code != Code::ObjectAlreadyExists {
            continue;
        }
        let Some(&w) = written.get(key.as_str()) else {
            continue;
        };
        if let Some(Err(failed)) = &results[w] {
            results[*i] = Some(Err(failed.for_each_key()));
        }
    }
}

/// Every valid item of a batch failed with `e`.
pub(crate) fn fill<T>(
    results: &mut [Option<Result<T, ClientError>>],
    valid: &[(usize, ObjectKey)],
    e: &ClientError,
) {
    for (i, _) in valid {
        results[*i] = Some(Err(e.for_each_key()));
    }
}
