//! Where the master is. A plain `host:port` names it directly; `etcd://h:p;h:p` names the etcd
//! cluster whose leader key (under the cluster id) holds the address of the elected master, so
//! clients and owners follow failovers. This is the one module of the crate that performs I/O
//! (a read of one etcd key, under a deadline), because clients and owners both need it.

use std::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use etcd_client::{Client, ConnectOptions};
use tokio::sync::Mutex;

pub const ETCD_SCHEME: &str = "etcd://";
/// The cluster id when none is configured (Mooncake's default naming).
pub const DEFAULT_CLUSTER_ID: &str = "mooncake";

/// Why a master that lost (or never had) its etcd lease refuses a call: the text of that
/// call-level refusal on both wires, by which callers tell it from an answer's own codes.
pub const NOT_LEADING: &str =
    "this master is not the elected leader (its etcd lease lapsed); ask etcd for the leader";

/// Whether `message` is (or wraps) the call-level refusal of a master that does not lead.
pub fn is_not_leading(message: &str) -> bool {
    message.contains(NOT_LEADING)
}

/// Ends the message of a call that failed before any of it was sent (no connection to the
/// master could be made, as to a new leader not listening yet): it was not executed, so it may
/// go again, also to the same master.
pub const NOT_SENT: &str = "the call was not sent";

/// Whether `message` says its call was not sent (see `NOT_SENT`).
pub fn was_not_sent(message: &str) -> bool {
    message.contains(NOT_SENT)
}

/// The etcd key under which the leader of `cluster_id` publishes its address.
pub fn leader_key(cluster_id: &str) -> String {
    format!("mooncake-store/{cluster_id}/master_view")
}

/// How a master address reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MasterAddress {
    /// `host:port`.
    Fixed(String),
    /// `etcd://h:p;h:p`: the endpoints of the etcd cluster to ask.
    Etcd(Vec<String>),
}

impl MasterAddress {
    pub fn parse(s: &str) -> Result<MasterAddress, String> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix(ETCD_SCHEME) {
            let endpoints = parse_endpoints(rest)?;
            return Ok(MasterAddress::Etcd(endpoints));
        }
        check_host_port(s).map(|()| MasterAddress::Fixed(s.to_string()))
    }
}

/// `h:p;h:p` (also comma-separated) into its endpoints, each checked to be `host:port`.
pub fn parse_endpoints(list: &str) -> Result<Vec<String>, String> {
    let endpoints: Vec<String> = list
        .split([';', ','])
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("http://").unwrap_or(e).to_string())
        .collect();
    if endpoints.is_empty() {
        return Err(format!(
            "no etcd endpoint in {list:?}: expected HOST:PORT;HOST:PORT"
        ));
    }
    for e in &endpoints {
        check_host_port(e)?;
    }
    Ok(endpoints)
}

fn check_host_port(s: &str) -> Result<(), String> {
    match s.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => Ok(()),
        _ => Err(format!(
            "invalid master address {s:?}: expected HOST:PORT or etcd://HOST:PORT;HOST:PORT"
        )),
    }
}

/// Reads the elected master's address from etcd; keeps one connection and makes a new one when
/// a read fails.
pub struct LeaderLookup {
    endpoints: Vec<String>,
    key: String,
    timeout: Duration,
    /// One client per endpoint (with a number telling connections apart), connected when
    /// first needed and dropped when a read through it fails. Callers share it: the lock is
    /// held only to take a copy (a client multiplexes its calls).
    clients: Vec<Mutex<Option<(u64, Client)>>>,
    /// The number of the next connection made.
    connections: AtomicU64,
    /// The endpoint that answered last: asked first next time.
    last_good: AtomicUsize,
}

/// The leader as published: its address and its term (the revision that created the key, which
/// grows with every election).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    pub address: String,
    pub term: i64,
}

impl LeaderLookup {
    pub fn new(endpoints: Vec<String>, cluster_id: &str, timeout: Duration) -> Self {
        LeaderLookup {
            clients: endpoints.iter().map(|_| Mutex::new(None)).collect(),
            connections: AtomicU64::new(0),
            endpoints,
            key: leader_key(cluster_id),
            timeout,
            last_good: AtomicUsize::new(0),
        }
    }

    /// The current leader, or why none can be named (etcd unreachable, or no leader elected).
    /// Members are asked one at a time, the one that answered last first, each with its share
    /// of the time left, so a member that is down costs only its share, not the whole deadline.
    pub async fn leader(&self) -> Result<Leader, String> {
        let deadline = Instant::now() + self.timeout;
        let n = self.endpoints.len();
        let first = self.last_good.load(Ordering::Relaxed) % n.max(1);
        let mut failures = Vec::new();
        for k in 0..n {
            let i = (first + k) % n;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let share = left / (n - k) as u32;
            let used = std::sync::Mutex::new(None);
            let asked = tokio::time::timeout(share, self.ask(i, share, &used)).await;
            match asked {
                Ok(Ok(answer)) => {
                    self.last_good.store(i, Ordering::Relaxed);
                    return answer;
                }
                Ok(Err(e)) => failures.push(format!("{}: {e}", self.endpoints[i])),
                Err(_) => {
                    failures.push(format!("{}: no answer within {share:?}", self.endpoints[i]))
                }
            }
            // A fresh connection next time (the member may have died): unless this call never
            // got to use one, or another caller replaced it meanwhile.
            let failed = *used.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(failed) = failed {
                let mut slot = self.clients[i].lock().await;
                if slot.as_ref().is_some_and(|(id, _)| *id == failed) {
                    *slot = None;
                }
            }
        }
        if failures.is_empty() {
            failures.push(format!(
                "no etcd endpoint answered within {:?}",
                self.timeout
            ));
        }
        Err(format!("cannot reach etcd: {}", failures.join("; ")))
    }

    /// Reads the leader key from member `i`. The outer error is the member's (unreachable,
    /// failed read): another may answer. The inner result is etcd's answer, which every member
    /// would give (reads are linearizable).
    /// `used` is set to the number of the connection the read went through.
    async fn ask(
        &self,
        i: usize,
        timeout: Duration,
        used: &std::sync::Mutex<Option<u64>>,
    ) -> Result<Result<Leader, String>, String> {
        let (id, mut client) = {
            let mut slot = self.clients[i].lock().await;
            if slot.is_none() {
                let options = ConnectOptions::new()
                    .with_connect_timeout(timeout)
                    .with_timeout(timeout);
                let client = Client::connect([self.endpoints[i].as_str()], Some(options))
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                *slot = Some((self.connections.fetch_add(1, Ordering::Relaxed), client));
            }
            slot.clone().expect("connected above")
        };
        *used.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
        let resp = client
            .get(self.key.as_str(), None)
            .await
            .map_err(|e| format!("reading {}: {e}", self.key))?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(Err(format!(
                "no master is elected (etcd key {} is empty)",
                self.key
            )));
        };
        Ok(kv
            .value_str()
            .map_err(|e| format!("leader address is not text: {e}"))
            .map(|address| Leader {
                address: address.to_string(),
                term: kv.create_revision(),
            }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_bad_ones_are_named() {
        assert_eq!(
            MasterAddress::parse("10.0.0.1:50051").unwrap(),
            MasterAddress::Fixed("10.0.0.1:50051".into())
        );
        assert_eq!(
            MasterAddress::parse("etcd://a:2379;b:2379").unwrap(),
            MasterAddress::Etcd(vec!["a:2379".into(), "b:2379".into()])
        );
        assert_eq!(
            MasterAddress::parse("etcd://http://a:1,b:2").unwrap(),
            MasterAddress::Etcd(vec!["a:1".into(), "b:2".into()])
        );
        for bad in ["etcd://", "etcd://a", "nohost", ":1", "h:notaport"] {
            assert!(MasterAddress::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(leader_key("c1"), "mooncake-store/c1/master_view");
    }
}
