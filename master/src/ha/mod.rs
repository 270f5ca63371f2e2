//! High availability on etcd (never a home-made consensus). Several `mooncake_master` processes
//! of one cluster campaign for the cluster's leader key (`mooncake-store/<cluster>/master_view`):
//! the one whose transaction creates it, bound to its etcd lease, leads and publishes its address
//! there; the others watch the key and campaign again when it disappears (the leader's lease
//! lapsed: killed, paused, cut off from etcd, or stepped down).
//!
//! A term starts a fresh master: the owners remount and report what they hold (see
//! `core::rebuild`), so nothing but the leader key, the put-id reservation and the names of the
//! mounted segments (so the next leader knows whose reports to wait for) lives in etcd, and
//! nothing on a per-object path touches it. The leader keeps its lease alive every third of the
//! TTL; `Leadership` refuses every call from the instant the lease may have lapsed, and the term
//! ends (the master is shut down and the process campaigns again) when a keepalive fails.
//!
//! Put ids stay increasing across terms on different hosts: a leader reserves ids ahead in etcd
//! (`grant_ceiling`) and never issues one it has not reserved; the next leader starts above the
//! last reservation. Every write besides the key is fenced on the key being this term's (see
//! `fenced`). A master talks to one etcd member at a time and moves to the next when a call
//! fails, and a standby looks at the key again every lease TTL, so a member cut off from its
//! cluster keeps neither a leader flapping nor a standby waiting for a change it cannot see.

mod fenced;
mod leadership;

use std::{collections::BTreeSet, future::Future, sync::Arc, time::Duration};

use mooncake_common::SegmentName;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use tokio::time::Instant;

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

/// Campaigns, leads, steps down and campaigns again until `stop` completes.
pub async fn run(
    config: MasterConfig,
    ha: HaConfig,
    events: &dyn Events,
    stop: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    tokio::pin!(stop);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    // One member at a time, the next one after each failure: a member that fails (down, or cut
    // off from its cluster) is left at once, and a working one is kept. A channel balanced over
    // all members would keep landing streams (a watch, a keepalive) on the bad one.
    let mut member = 0usize;
    loop {
        let endpoint = ha.endpoints[member % ha.endpoints.len()].clone();
        let attempt = async {
            let mut etcd = connect(&endpoint, ha.lease_ttl).await?;
            let won = campaign(&mut etcd, &ha, clock.as_ref(), events).await?;
            let lease = won.lease;
            let outcome = lead(&mut etcd, &config, &ha, clock.clone(), won, events).await;
            // Give the key up at once if etcd still listens (a clean hand-over, also when the
            // term failed to start); a lapsed lease is gone anyway.
            let _ = tokio::time::timeout(Duration::from_secs(1), etcd.lease_revoke(lease)).await;
            outcome
        };
        tokio::select! {
            r = attempt => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, etcd = %endpoint, "leadership attempt ended; campaigning again");
                }
                member = member.wrapping_add(1);
                // A short pause, so a flapping etcd does not turn into a busy loop.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = &mut stop => return Ok(()),
                }
            }
            _ = &mut stop => return Ok(()),
        }
    }
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
        let resp = etcd.txn(txn).await?;
        if resp.succeeded() {
            let term = resp.header().map_or(0, |h| h.revision());
            return Ok(Won {
                lease,
                term,
                granted_at,
            });
        }
        let _ = etcd.lease_revoke(lease).await;
        let current = etcd.get(key.as_str(), None).await?;
        let Some(kv) = current.kvs().first() else {
            continue; // gone meanwhile: campaign at once
        };
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

/// Serves one term: starts a fresh master, keeps the lease alive and the put-id reservation
/// ahead, and ends the term (shutting the master down) when the lease cannot be kept.
async fn lead(
    etcd: &mut Client,
    config: &MasterConfig,
    ha: &HaConfig,
    clock: Arc<dyn Clock>,
    won: Won,
    events: &dyn Events,
) -> anyhow::Result<()> {
    let leadership = Arc::new(Leadership::until(won.granted_at.plus(ha.lease_ttl)));
    let seat = Seat {
        leader_key: mooncake_common::leader::leader_key(&ha.cluster_id),
        term: won.term,
    };
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
        ha,
        &clock,
        &leadership,
        &master,
        &mut books,
        won.lease,
    )
    .await;
    leadership.revoke();
    tracing::warn!(term = won.term, reason = ?outcome.as_ref().err(), "leadership lost; stepping down");
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
        for gone in self.published.difference(&mounted) {
            self.seat
                .delete(etcd, &format!("{}{gone}", self.prefix))
                .await?;
        }
        for new in mounted.difference(&self.published) {
            self.seat
                .put(etcd, &format!("{}{new}", self.prefix), "")
                .await?;
        }
        self.published = mounted;
        Ok(())
    }
}

async fn keep_leading(
    etcd: &mut Client,
    ha: &HaConfig,
    clock: &Arc<dyn Clock>,
    leadership: &Leadership,
    master: &RunningMaster,
    books: &mut Books,
    lease: i64,
) -> anyhow::Result<()> {
    let (mut keeper, mut acks) = etcd.lease_keep_alive(lease).await?;
    let period = ha.lease_ttl / 3;
    let mut last_reserve = Instant::now();
    loop {
        let sent = clock.now();
        keeper.keep_alive().await?;
        match tokio::time::timeout(period, acks.message()).await {
            Ok(Ok(Some(ack))) if ack.ttl() > 0 => leadership.extend_to(sent.plus(ha.lease_ttl)),
            Ok(Ok(Some(_))) => anyhow::bail!("the lease expired in etcd"),
            Ok(Ok(None)) => anyhow::bail!("etcd closed the keepalive stream"),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => anyhow::bail!("etcd did not acknowledge a keepalive within {period:?}"),
        }
        if !leadership.holds(clock.now()) {
            anyhow::bail!("the lease may have lapsed (this process was paused or etcd was slow)");
        }
        if last_reserve.elapsed() >= Duration::from_secs(1) {
            books.reserve(etcd, master).await?;
            last_reserve = Instant::now();
        }
        books.publish_segments(etcd, master, clock.now()).await?;
        tokio::time::sleep(period.saturating_sub(Duration::from_millis(10))).await;
        if !leadership.holds(clock.now()) {
            anyhow::bail!("the lease may have lapsed (this process was paused)");
        }
    }
}
