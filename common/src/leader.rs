//! Where the master is. A plain `host:port` names it directly; `etcd://h:p;h:p` names the etcd
//! cluster whose leader key (under the cluster id) holds the address of the elected master, so
//! clients and owners follow failovers. This is the one module of the crate that performs I/O
//! (a read of one etcd key, under a deadline), because clients and owners both need it.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::sync::Mutex;

pub const ETCD_SCHEME: &str = "etcd://";
/// The cluster id when none is configured (Mooncake's default naming).
pub const DEFAULT_CLUSTER_ID: &str = "mooncake";

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
    client: Mutex<Option<Client>>,
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
            endpoints,
            key: leader_key(cluster_id),
            timeout,
            client: Mutex::new(None),
        }
    }

    /// The current leader, or why none can be named (etcd unreachable, or no leader elected).
    pub async fn leader(&self) -> Result<Leader, String> {
        let mut slot = self.client.lock().await;
        let read = async {
            if slot.is_none() {
                let options = ConnectOptions::new()
                    .with_connect_timeout(self.timeout)
                    .with_timeout(self.timeout);
                *slot = Some(
                    Client::connect(&self.endpoints, Some(options))
                        .await
                        .map_err(|e| format!("cannot reach etcd at {:?}: {e}", self.endpoints))?,
                );
            }
            let client = slot.as_mut().expect("connected above");
            let resp = client
                .get(self.key.as_str(), None)
                .await
                .map_err(|e| format!("reading {} from etcd failed: {e}", self.key))?;
            let kv = resp
                .kvs()
                .first()
                .ok_or_else(|| format!("no master is elected (etcd key {} is empty)", self.key))?;
            let address = kv
                .value_str()
                .map_err(|e| format!("leader address is not text: {e}"))?
                .to_string();
            Ok(Leader {
                address,
                term: kv.create_revision(),
            })
        };
        let res = tokio::time::timeout(self.timeout, read)
            .await
            .unwrap_or_else(|_| Err(format!("etcd did not answer within {:?}", self.timeout)));
        if res.is_err() {
            // A fresh connection next time (the endpoint may have died).
            *slot = None;
        }
        res
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
