//! The previous term's lease, retired before a new term answers. A leader key deleted while its
//! lease lives on (an operator forcing a failover, a cleanup of the prefix) lets a standby win
//! while the old leader still answers: it learns that it was deposed only at its next seat
//! check, up to a keepalive period later, and until then two masters would hand out the same
//! ranges. So every term records its lease id (`leader_lease`), and the next one revokes that
//! lease if it still lives and waits out its TTL before it answers: the old leader's own view of
//! its lease (see `Leadership`) ends by then, whether or not it has noticed. A lease that
//! lapsed (a crashed or paused leader) or was given up (a step-down) costs no wait.

use std::time::Duration;

use etcd_client::Client;

pub(super) fn lease_key(cluster: &str) -> String {
    format!("mooncake-store/{cluster}/leader_lease")
}

/// Margin over the TTL for the two processes' clocks not running at exactly the same rate.
const CLOCK_MARGIN: Duration = Duration::from_millis(200);

/// Revokes the lease recorded under `key` if it is alive and not `own`; returns how long the
/// holder may still consider itself leader (zero when there is none).
pub(super) async fn retire(etcd: &mut Client, key: &str, own: i64) -> anyhow::Result<Duration> {
    let recorded = etcd.get(key, None).await?;
    let Some(previous) = recorded
        .kvs()
        .first()
        .and_then(|kv| kv.value_str().ok()?.parse::<i64>().ok())
        .filter(|&id| id != own)
    else {
        return Ok(Duration::ZERO);
    };
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
