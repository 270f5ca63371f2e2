//! High availability on etcd (never a home-made consensus). Several `mooncake_master` processes
//! of one cluster campaign for the cluster's leader key (`mooncake-store/<cluster>/master_view`):
//! the one whose transaction creates it, bound to its etcd lease, leads and publishes its address
//! there; the others watch the key and campaign again when it disappears (the leader's lease
//! lapsed: killed, paused, cut off from etcd, or stepped down), and answer on their HTTP port as
//! standbys meanwhile (see `standby`).
//!
//! A term starts a fresh master: the owners remount and report what they hold (see
//! `core::rebuild`), so nothing but the leader key, the leader's lease id (see `predecessor`), the
//! put-id reservation and the names of the mounted segments (so the next leader knows whose
//! reports to wait for) lives in etcd, and
//! nothing on a per-object path touches it. The leader keeps its lease alive every third of the
//! TTL; `Leadership` refuses every call from the instant the lease may have lapsed, and the term
//! ends (the master is shut down and the process campaigns again) when the lease may have
//! lapsed; a keepalive or write etcd does not answer is tried again meanwhile, on another
//! connection.
//!
//! Put ids stay increasing across terms on different hosts: a leader reserves ids ahead in etcd
//! (`grant_ceiling`) and never issues one it has not reserved; the next leader starts above the
//! last reservation. Every write besides the key is fenced on the key being this term's (see
//! `fenced`). A master talks to one etcd member at a time and moves to the next when a call
//! fails, and a standby looks at the key again every lease TTL, so a member cut off from its
//! cluster keeps neither a leader flapping nor a standby waiting for a change it cannot see.

mod fenced;
mod leadership;
mod predecessor;
mod standby;

use std::{collections::BTreeSet, future::Future, sync::Arc, time::Duration};

use mooncake_common::SegmentName;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use tokio::{sync::watch, time::Instant};

pub use fenced::Seat;
pub use leadership::Leadership;

use crate::{
    clock::{Clock, SystemClock},
    config::MasterConfig,
    server::{wall_clock_micros, RunningMaster, Term},
};

/// Ids reserved ahead of the next one to issue; a reservation is renewed every second, so it runs
/// out only past four billion puts a second.
const RESERVE: u64 = 1 << 32;

/// The HA settings (Mooncake's flags: `--enable_ha --etcd_endpoints --cluster_id`).
#[derive(Debug, Clone)]
pub struct HaConfig {
    pub endpoints: Vec<String>,
    pub cluster_id: String,
    /// The leader's etcd lease: a dead leader is replaced within it (plus an election).
    pub lease_ttl: Duration,
    /// The address clients and owners reach this master at (published when it leads).
    pub advertise: String,
}

fn ceiling_key(cluster: &str) -> String {
    format!("mooncake-store/{cluster}/grant_ceiling")
}

fn segments_prefix(cluster: &str) -> String {
    format!("mooncake-store/{cluster}/segments/")
}

/// What a term reports to whoever runs the loop (the binary prints it; tests wait for it).
pub trait Events: Send + Sync {
    fn leading(&self, master: &RunningMaster, term: i64);
    fn standing_by(&self, leader: Option<&str>);
}

/// Campaigns, leads, steps down and campaigns again until `stop` completes. A leader then ends
/// its term as on a step-down: it gives the key up first, so a standby takes over at once.
pub async fn run(
    config: MasterConfig,
    ha: HaConfig,
    events: &dyn Events,
    stop: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // What would fail every term it wins fails the process now, before it campaigns.
    crate::RunningMaster::check_can_serve(&config).await?;
    let (stopping, stopped) = watch::channel(false);
    let terms = campaign_and_lead(config, ha, events, stopped);
    tokio::pin!(stop, terms);
    tokio::select! {
        r = &mut terms => return r,
        _ = &mut stop => {}
    }
    let _ = stopping.send(true);
    // A term under way ends cleanly (the key given up, the master shut down), within bounds.
    if tokio::time::timeout(Duration::from_secs(15), terms)
        .await
        .is_err()
    {
        tracing::warn!("the term did not end within 15 s of the stop; leaving it");
    }
    Ok(())
}

/// Whether the process was asked to stop; waits until it is.
async fn stop_asked(stopped: &mut watch::Receiver<bool>) {
    // An error means the sender went: the process is going anyway.
    let _ = stopped.wait_for(|s| *s).await;
}

async fn campaign_and_lead(
    config: MasterConfig,
    ha: HaConfig,
    events: &dyn Events,
    stopped: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    // One member at a time, the next one after each failure: a member that fails (down, or cut
    // off from its cluster) is left at once, and a working one is kept. A channel balanced over
    // all members would keep landing streams (a watch, a keepalive) on the bad one.
    let mut member = 0usize;
    let announcing = standby::Announcing {
        events,
        leader: watch::channel(None).0,
    };
    // Serves the HTTP port while this process does not lead.
    let mut standby = None;
    loop {
        let endpoint = ha.endpoints[member % ha.endpoints.len()].clone();
        let mut stop = stopped.clone();
        if standby.is_none() {
            let leader = announcing.leader.subscribe();
            standby =
                standby::StandbyHttp::start(&config.bind_address, config.metrics_port, leader)
                    .await;
        }
        let attempt = async {
            let mut etcd = connect(&endpoint, ha.lease_ttl).await?;
            let won = tokio::select! {
                won = campaign(&mut etcd, &ha, clock.as_ref(), &announcing) => won?,
                _ = stop_asked(&mut stop) => return Ok(()),
            };
            // The term's master binds the port; the leader a later standby names is read anew.
            if let Some(http) = standby.take() {
                http.stop().await;
            }
            announcing.leader.send_replace(None);
            let candidate = Candidate {
                config: &config,
                ha: &ha,
                clock: clock.clone(),
                events,
                member,
            };
            lead(&mut etcd, &candidate, won, stop).await
        };
        let outcome = attempt.await;
        if *stopped.borrow() {
            return Ok(());
        }
        if let Err(e) = outcome {
            tracing::warn!(error = %e, etcd = %endpoint, "leadership attempt ended; campaigning again");
        }
        member = member.wrapping_add(1);
        // A short pause, so a flapping etcd does not turn into a busy loop.
        let mut stop = stopped.clone();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop_asked(&mut stop) => return Ok(()),
        }
    }
}

/// Gives the leader key up at once if etcd still listens (a clean hand-over); a lapsed lease is
/// gone anyway.
async fn give_up(etcd: &mut Client, lease: i64) {
    let _ = tokio::time::timeout(Duration::from_secs(1), etcd.lease_revoke(lease)).await;
}

async fn connect(endpoint: &str, lease_ttl: Duration) -> anyhow::Result<Client> {
    let timeout = lease_ttl.min(Duration::from_secs(5));
    let options = ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_timeout(timeout)
        .with_keep_alive(Duration::from_secs(1), timeout);
    Ok(Client::connect([endpoint], Some(options)).await?)
}

/// A won election: the lease that holds the leader key, and the term (the revision that created
/// the key, larger for every later election).
struct Won {
    lease: i64,
    term: i64,
    /// The lease that held the leader key while this process stood by (the last it saw).
    watched: Option<i64>,
    /// When the lease was asked for: etcd counts its TTL from about then, so the local view of
    /// the lease must too.
    granted_at: crate::clock::Millis,
}

/// Tries to create the leader key under a fresh lease; while another master holds it, waits for
/// the key to go and tries again.
async fn campaign(
    etcd: &mut Client,
    ha: &HaConfig,
    clock: &dyn Clock,
    events: &dyn Events,
) -> anyhow::Result<Won> {
    let key = mooncake_common::leader::leader_key(&ha.cluster_id);
    // The leader last announced, so the periodic look does not announce it again.
    let mut announced: Option<Option<String>> = None;
    // The lease of the leader key last seen (see `predecessor`).
    let mut watched: Option<i64> = None;
    loop {
        let ttl = ha.lease_ttl.as_secs().max(1) as i64;
        let granted_at = clock.now();
        let lease = etcd.lease_grant(ttl, None).await?.id();
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                ha.advertise.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let resp = match etcd.txn(txn).await {
            Ok(resp) => resp,
            Err(e) => {
                // It may have been applied with its answer lost: the key must not stay bound
                // to a lease nobody keeps alive for a whole TTL.
                give_up(etcd, lease).await;
                return Err(e.into());
            }
        };
        if resp.succeeded() {
            let term = resp.header().map_or(0, |h| h.revision());
            return Ok(Won {
                lease,
                term,
                watched,
                granted_at,
            });
        }
        let _ = etcd.lease_revoke(lease).await;
        let current = etcd.get(key.as_str(), None).await?;
        let Some(kv) = current.kvs().first() else {
            continue; // gone meanwhile: campaign at once
        };
        if kv.lease() != 0 {
            watched = Some(kv.lease());
        }
        let leader = kv.value_str().ok().map(str::to_string);
        if announced.as_ref() != Some(&leader) {
            events.standing_by(leader.as_deref());
            announced = Some(leader);
        }
        let from = current.header().map_or(0, |h| h.revision()) + 1;
        // Looked at again every lease TTL, whatever the watch says: a watch that stays silent
        // (its member stalled without losing its leader) delays a takeover by one TTL at most.
        let recheck = ha.lease_ttl.max(Duration::from_secs(1));
        if let Ok(deleted) = tokio::time::timeout(recheck, wait_for_delete(etcd, &key, from)).await
        {
            deleted?;
        }
    }
}

/// Returns once `key` is deleted (at or after revision `from`).
async fn wait_for_delete(etcd: &mut Client, key: &str, from: i64) -> anyhow::Result<()> {
    let mut stream = etcd
        .watch(key, Some(WatchOptions::new().with_start_revision(from)))
        .await?;
    while let Some(resp) = stream.message().await? {
        if resp
            .events()
            .iter()
            .any(|e| e.event_type() == EventType::Delete)
        {
            return Ok(());
        }
    }
    anyhow::bail!("etcd closed the watch of {key}")
}

/// What every term of this process runs with.
struct Candidate<'a> {
    config: &'a MasterConfig,
    ha: &'a HaConfig,
    clock: Arc<dyn Clock>,
    events: &'a dyn Events,
    /// The etcd member (an index into the endpoints) this term was won on.
    member: usize,
}

/// Serves one term: starts a fresh master, keeps the lease alive and the put-id reservation
/// ahead, and ends the term (shutting the master down) when the lease cannot be kept or the
/// process stops. The key is given up however the term ends.
async fn lead(
    etcd: &mut Client,
    candidate: &Candidate<'_>,
    won: Won,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let lease = won.lease;
    let mut given_up = false;
    let outcome = serve_term(etcd, candidate, won, stop, &mut given_up).await;
    if !given_up {
        // The term failed to start: the key goes all the same.
        give_up(etcd, lease).await;
    }
    outcome
}

/// A won election's term; sets `given_up` once the key is given up (see `lead`).
async fn serve_term(
    etcd: &mut Client,
    candidate: &Candidate<'_>,
    won: Won,
    stop: watch::Receiver<bool>,
    given_up: &mut bool,
) -> anyhow::Result<()> {
    let Candidate {
        config,
        ha,
        ref clock,
        events,
        ..
    } = *candidate;
    let leadership = Arc::new(Leadership::until(won.granted_at.plus(ha.lease_ttl)));
    let seat = Seat {
        leader_key: mooncake_common::leader::leader_key(&ha.cluster_id),
        term: won.term,
    };
    // Two masters never answer at once: a previous leader whose lease outlived its key is
    // retired first. This term's lease is recorded for the next only once it is done: should
    // it end during the wait, the lease is left to lapse (not given up), so that the next term
    // cannot start before this one's wait would have ended (with the same TTL).
    let lease_key = predecessor::lease_key(&ha.cluster_id);
    let wait = predecessor::retire(etcd, &seat, &lease_key, won.lease, won.watched).await?;
    if !wait.is_zero() {
        let waited = wait_out(
            etcd,
            won.lease,
            ha.lease_ttl,
            &leadership,
            clock.as_ref(),
            wait,
            stop.clone(),
        )
        .await;
        if !matches!(waited, Ok(true)) {
            *given_up = true;
            return waited.map(|_| ());
        }
    }
    seat.put(etcd, &lease_key, &won.lease.to_string()).await?;
    let ceiling_key = ceiling_key(&ha.cluster_id);
    let floor = etcd
        .get(ceiling_key.as_str(), Some(GetOptions::new()))
        .await?
        .kvs()
        .first()
        .and_then(|kv| kv.value_str().ok()?.parse::<u64>().ok())
        .unwrap_or(0);
    // Reserve the first block before issuing anything.
    let first_floor = floor.max(wall_clock_micros());
    let ceiling = first_floor + RESERVE;
    seat.put(etcd, &ceiling_key, &ceiling.to_string()).await?;
    // The segments the previous leader had: the rebuild waits for their reports.
    let prefix = segments_prefix(&ha.cluster_id);
    let published: BTreeSet<String> = etcd
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await?
        .kvs()
        .iter()
        .filter_map(|kv| {
            kv.key_str()
                .ok()?
                .strip_prefix(prefix.as_str())
                .map(str::to_string)
        })
        .collect();
    let term = Term {
        leadership: leadership.clone(),
        grant_floor: first_floor,
        grant_ceiling: ceiling,
        expected_segments: published
            .iter()
            .filter_map(|n| SegmentName::parse(n).ok())
            .collect(),
    };
    // From here a lapse of the lease ends the term (see `Leadership::extend_to`).
    leadership.serve();
    let master = RunningMaster::start_term(config.clone(), clock.clone(), term).await?;
    tracing::info!(term = won.term, rpc = %master.rpc_addr, "elected leader");
    events.leading(&master, won.term);

    let mut books = Books {
        seat,
        ceiling_key,
        ceiling,
        prefix,
        published,
    };
    let outcome = keep_leading(
        etcd,
        candidate,
        &leadership,
        &master,
        &mut books,
        won.lease,
        stop,
    )
    .await;
    leadership.revoke();
    match &outcome {
        Ok(()) => tracing::info!(term = won.term, "stopping; giving the leadership up"),
        Err(e) => tracing::warn!(term = won.term, reason = %e, "leadership lost; stepping down"),
    }
    // The key goes before the master's shutdown (which waits for the owners' long polls): a
    // standby campaigns at once instead of waiting out the lease. This master refuses every
    // call from now on.
    give_up(etcd, won.lease).await;
    *given_up = true;
    master.shutdown().await;
    outcome
}

/// What a leader keeps in etcd besides its key: the put-id reservation and the segment names.
struct Books {
    seat: Seat,
    ceiling_key: String,
    ceiling: u64,
    prefix: String,
    published: BTreeSet<String>,
}

impl Books {
    /// Keeps the reservation a block ahead of what is issued.
    async fn reserve(&mut self, etcd: &mut Client, master: &RunningMaster) -> anyhow::Result<()> {
        let next = master.with_state(|s| s.next_grant());
        if next + RESERVE / 2 > self.ceiling {
            let wanted = next + RESERVE;
            self.seat
                .put(etcd, &self.ceiling_key, &wanted.to_string())
                .await?;
            self.ceiling = wanted;
            master.with_state_mut(|s| s.reserve_grants(wanted));
        }
        Ok(())
    }

    /// Publishes the mounted segments' names (only the changes; none while a rebuild may still
    /// bring back segments of the previous leader).
    async fn publish_segments(
        &mut self,
        etcd: &mut Client,
        master: &RunningMaster,
        now: crate::clock::Millis,
    ) -> anyhow::Result<()> {
        let (rebuilding, names) = master.with_state(|s| (s.rebuilding(now), s.segment_names()));
        if rebuilding {
            return Ok(());
        }
        let mounted: BTreeSet<String> = names.iter().map(|n| n.to_string()).collect();
        // Many at once when a cluster starts: a transaction per `MAX_OPS` changes, not one per
        // segment, so the writes take a few round trips, well within a keepalive period.
        let ops: Vec<TxnOp> = self
            .published
            .difference(&mounted)
            .map(|gone| TxnOp::delete(format!("{}{gone}", self.prefix), None))
            .chain(
                mounted
                    .difference(&self.published)
                    .map(|new| TxnOp::put(format!("{}{new}", self.prefix), "", None)),
            )
            .collect();
        let mut ops = ops.into_iter().peekable();
        while ops.peek().is_some() {
            let chunk: Vec<TxnOp> = ops.by_ref().take(fenced::MAX_OPS).collect();
            self.seat.write_all(etcd, chunk, "segment names").await?;
        }
        self.published = mounted;
        Ok(())
    }
}

/// Keeps the lease alive every third of its TTL, the seat confirmed, and the books written,
/// until `stop`. A call etcd does not answer (a slow or stalled member, a broken connection)
/// does not end the term: it is tried again on a new connection, to the next member, for as
/// long as the lease may still be alive. Only a lapsed lease, or a leader key that is no longer
/// this term's (deleted, or another term's), ends it. The key is watched, and looked at every
/// period besides: a key deleted while the lease lives on lets a standby win (which revokes
/// this lease and waits out its TTL before answering, see `predecessor`), and this term ends as
/// soon as it notices; a key deleted with its lease (revoked) costs the standby no wait, and
/// the watch ends this term as etcd tells of it.
async fn keep_leading(
    etcd: &mut Client,
    candidate: &Candidate<'_>,
    leadership: &Leadership,
    master: &RunningMaster,
    books: &mut Books,
    lease: i64,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let (ha, clock) = (candidate.ha, &candidate.clock);
    let period = ha.lease_ttl / 3;
    let mut keepalive = None;
    let mut last_reserve = Instant::now();
    let mut member = candidate.member;
    // The leader key, watched from the term's creation on: its deletion (the lease revoked by an
    // operator, an etcd restored empty) ends the term at once, not at the next seat check a
    // period later, while a standby that found no live lease to wait out may already answer.
    let mut seat_watch = SeatWatch::new(books.seat.term);
    loop {
        // The next keepalive goes a period after this one, however long the writes take.
        let mut next = Instant::now() + period.saturating_sub(Duration::from_millis(10));
        let tended = async {
            renew(
                etcd,
                &mut keepalive,
                lease,
                ha.lease_ttl,
                leadership,
                clock.as_ref(),
            )
            .await?;
            // Each within a period: a write etcd does not answer (a stalled disk holds
            // commits while keepalives are still answered) must not hold the next keepalive
            // back until the lease lapses. It is tried again, on a new connection, below.
            within(period, "confirming the seat", books.seat.confirm(etcd)).await?;
            if last_reserve.elapsed() >= Duration::from_secs(1) {
                within(period, "reserving put ids", books.reserve(etcd, master)).await?;
                last_reserve = Instant::now();
            }
            let now = clock.now();
            within(
                period,
                "publishing segments",
                books.publish_segments(etcd, master, now),
            )
            .await
        };
        if let Err(e) = tended.await {
            if ends_term(&e) || !leadership.holds(clock.now()) {
                return Err(e);
            }
            tracing::warn!(error = %e, "etcd did not answer; keeping the term while its lease lasts, on a new connection");
            keepalive = None;
            member = member.wrapping_add(1);
            let endpoint = &ha.endpoints[member % ha.endpoints.len()];
            let left = leadership.left(clock.now());
            match tokio::time::timeout(left, connect(endpoint, ha.lease_ttl)).await {
                Ok(Ok(c)) => *etcd = c,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, etcd = %endpoint, "cannot connect to etcd")
                }
                Err(_) => {}
            }
            // Tried again soon: the lease lasts only so long.
            next = Instant::now() + RETRY.min(period);
        } else {
            seat_watch.open(etcd, &books.seat.leader_key, period).await;
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                _ = stop_asked(&mut stop) => return Ok(()),
                lost = seat_watch.lost() => if lost {
                    leadership.revoke();
                    anyhow::bail!("the leader key was deleted or taken (its lease revoked?)");
                },
            }
        }
        if !leadership.holds(clock.now()) {
            anyhow::bail!(
                "the lease may have lapsed (this process was paused or etcd did not answer)"
            );
        }
    }
}

/// A watch of the leader key, open while etcd answers (opened again after it breaks).
struct SeatWatch {
    term: i64,
    stream: Option<etcd_client::WatchStream>,
    /// Where the next watch starts: just after the key's creation, so that nothing since is
    /// missed; from the present once that revision is compacted or a watch broke (the seat
    /// was confirmed just before each new one).
    from: Option<i64>,
}

impl SeatWatch {
    fn new(term: i64) -> Self {
        SeatWatch {
            term,
            stream: None,
            from: Some(term + 1),
        }
    }

    /// Opens the watch if none is open; a failure leaves it closed until the next try (the
    /// periodic seat check still stands).
    async fn open(&mut self, etcd: &mut Client, key: &str, within: Duration) {
        if self.stream.is_some() {
            return;
        }
        let options = self
            .from
            .map(|rev| WatchOptions::new().with_start_revision(rev));
        match tokio::time::timeout(within, etcd.watch(key, options)).await {
            Ok(Ok(stream)) => self.stream = Some(stream),
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot watch the leader key; trying again"),
            Err(_) => tracing::debug!("etcd did not open a watch of the leader key in time"),
        }
    }

    /// Completes with true once the key is deleted or is another term's, with false once the
    /// watch broke (closed: opened again later); pending while no watch is open.
    async fn lost(&mut self) -> bool {
        let Some(stream) = self.stream.as_mut() else {
            return std::future::pending().await;
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) if resp.canceled() || resp.compact_revision() > 0 => break,
                Ok(Some(resp)) => {
                    let lost = resp.events().iter().any(|e| {
                        e.event_type() == EventType::Delete
                            || e.kv().is_some_and(|kv| kv.create_revision() != self.term)
                    });
                    if lost {
                        return true;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.stream = None;
        self.from = None;
        false
    }
}

/// Keeps `lease` alive for `wait` before the term starts answering (see `predecessor`); false
/// when the process is asked to stop meanwhile.
async fn wait_out(
    etcd: &mut Client,
    lease: i64,
    ttl: Duration,
    leadership: &Leadership,
    clock: &dyn Clock,
    wait: Duration,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<bool> {
    let until = Instant::now() + wait;
    let mut keepalive = None;
    loop {
        let mut next = ttl / 3;
        if let Err(e) = renew(etcd, &mut keepalive, lease, ttl, leadership, clock).await {
            // As while leading: tried again while the lease may still be alive.
            if ends_term(&e) || !leadership.holds(clock.now()) {
                return Err(e);
            }
            tracing::warn!(error = %e, "etcd did not answer a keepalive; trying again");
            keepalive = None;
            next = RETRY;
        }
        let now = Instant::now();
        if now >= until {
            return Ok(true);
        }
        tokio::select! {
            _ = tokio::time::sleep((until - now).min(next)) => {}
            _ = stop_asked(&mut stop) => return Ok(false),
        }
    }
}

/// `write` (`what`), or an error once `period` passed without etcd's answer.
async fn within(
    period: Duration,
    what: &str,
    write: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    tokio::time::timeout(period, write)
        .await
        .map_err(|_| anyhow::anyhow!("etcd did not answer {what} within {period:?}"))?
}

/// How soon a keepalive or a write etcd did not answer is tried again.
const RETRY: Duration = Duration::from_millis(200);

/// The lease is gone in etcd itself: no keepalive brings it back.
#[derive(Debug, thiserror::Error)]
#[error("the lease expired in etcd")]
struct LeaseExpired;

/// Whether `e` ends the term, rather than being worth another try while the lease lasts.
fn ends_term(e: &anyhow::Error) -> bool {
    e.is::<LeaseExpired>() || e.is::<fenced::Deposed>()
}

/// One keepalive of `lease` (on `keepalive`, opened first if there is none), answered within a
/// third of `ttl`: the leadership then lasts `ttl` from when it was sent.
async fn renew(
    etcd: &mut Client,
    keepalive: &mut Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
    lease: i64,
    ttl: Duration,
    leadership: &Leadership,
    clock: &dyn Clock,
) -> anyhow::Result<()> {
    let period = ttl / 3;
    let sent = clock.now();
    let (keeper, acks) = match keepalive {
        Some(k) => k,
        None => keepalive.insert(
            tokio::time::timeout(period, etcd.lease_keep_alive(lease))
                .await
                .map_err(|_| {
                    anyhow::anyhow!("etcd did not open a keepalive stream within {period:?}")
                })??,
        ),
    };
    keeper.keep_alive().await?;
    match tokio::time::timeout(period, acks.message()).await {
        Ok(Ok(Some(ack))) if ack.ttl() > 0 => {
            if leadership.extend_to(sent.plus(ttl), clock.now()) {
                Ok(())
            } else {
                // Acknowledged after the lease's local view lapsed: the term is over.
                Err(LeaseExpired.into())
            }
        }
        Ok(Ok(Some(_))) => Err(LeaseExpired.into()),
        Ok(Ok(None)) => anyhow::bail!("etcd closed the keepalive stream"),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => anyhow::bail!("etcd did not acknowledge a keepalive within {period:?}"),
    }
}
