//! The previous term's lease, retired before a new term answers. A leader key deleted while its
//! lease lives on (an operator forcing a failover, a cleanup of the prefix) lets a standby win
//! while the old leader still answers: it learns that it was deposed only at its next seat
//! check, up to a keepalive period later, and until then two masters would hand out the same
//! ranges. So the new term revokes the old lease if it still lives and waits out its TTL before
//! it answers: the old leader's own view of its lease (see `Leadership`) ends by then, whether
//! or not it has noticed. A lease that lapsed (a crashed or paused leader) or was given up (a
//! step-down) costs no wait.
//!
//! Which lease: the one the standby saw holding the leader key while it waited (it knows that
//! one even when the whole prefix was deleted), and the one every term records under
//! `leader_lease` once it answers (for a candidate that never saw the old leader). The record
//! is read fenced on the new term's seat, so a candidate deposed before it got there never
//! revokes its successor's lease.

use std::time::Duration;

use etcd_client::Client;

use super::Seat;

pub(super) fn lease_key(cluster: &str) -> String {
    format!("mooncake-store/{cluster}/leader_lease")
}

/// Margin over the TTL for the two processes' clocks not running at exactly the same rate.
const CLOCK_MARGIN: Duration = Duration::from_millis(200);

/// Revokes the predecessors' leases (`watched`, the one that held the key while this process
/// stood by, and the one recorded under `key`) that are alive and not `own`; returns how long
/// their holders may still consider themselves leader (zero when none).
pub(super) async fn retire(
    etcd: &mut Client,
    seat: &Seat,
    key: &str,
    own: i64,
    watched: Option<i64>,
) -> anyhow::Result<Duration> {
    let recorded = match seat.read(etcd, key).await? {
        Some(v) => match v.parse::<i64>() {
            Ok(id) => Some(id),
            Err(_) => {
                tracing::warn!(key, value = %v, "the recorded leader lease is not a lease id; ignoring it");
                None
            }
        },
        None => None,
    };
    let mut wait = Duration::ZERO;
    let mut leases: Vec<i64> = watched.into_iter().chain(recorded).collect();
    leases.dedup();
    for previous in leases.into_iter().filter(|&id| id != own) {
        wait = wait.max(retire_one(etcd, previous).await?);
    }
    Ok(wait)
}

async fn retire_one(etcd: &mut Client, previous: i64) -> anyhow::Result<Duration> {
    let granted = match etcd.lease_time_to_live(previous, None).await {
        Ok(r) if r.ttl() > 0 => Duration::from_secs(r.granted_ttl().max(r.ttl()) as u64),
        Ok(_) => return Ok(Duration::ZERO), // expired or revoked: nobody holds it
        Err(e) if e.to_string().contains("not found") => return Ok(Duration::ZERO),
        Err(e) => return Err(e.into()),
    };
    // From the revoke on, no keepalive of that lease succeeds, and the holder's view of it ends
    // within its TTL of the last one that did.
    match etcd.lease_revoke(previous).await {
        Ok(_) => {}
        Err(e) if e.to_string().contains("not found") => {}
        Err(e) => return Err(e.into()),
    }
    tracing::warn!(
        lease = previous,
        wait = ?granted + CLOCK_MARGIN,
        "the previous leader's lease was still alive (its key was deleted under it); revoked it, \
         and waiting out its TTL before answering so that two masters never answer at once"
    );
    Ok(granted + CLOCK_MARGIN)
}
