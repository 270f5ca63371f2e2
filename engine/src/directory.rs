//! Where peers are, with an `etcd://` metadata server (Mooncake's engine with etcd metadata):
//! each engine publishes the session name it serves on (`host:port`) under its own name (the
//! `local_hostname` it was started with) for as long as it lives (an etcd lease, kept alive in the
//! background), and callers name peers by those names. Without it (`P2PHANDSHAKE`) a peer's name
//! is its session name. Lookups are cached; a failed transfer forgets the peer's entry, so a
//! restarted peer (new port) is found again.

use std::{collections::HashMap, time::Duration};

use etcd_client::{Client, ConnectOptions, PutOptions};
use parking_lot::Mutex;
use tokio::{sync::watch, task::JoinHandle};

use crate::EngineError;

/// The etcd key of an engine's name.
fn key(name: &str) -> String {
    format!("mooncake-engine/{name}")
}

/// How long a dead engine's entry outlives it.
const LEASE_TTL: i64 = 10;

pub struct Directory {
    client: tokio::sync::Mutex<Client>,
    endpoints: Vec<String>,
    timeout: Duration,
    cache: Mutex<HashMap<String, String>>,
    keeper: JoinHandle<()>,
    lease: i64,
    stop: watch::Sender<bool>,
}

fn etcd_err(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Invalid(format!("etcd metadata server: {what}: {e}"))
}

impl Directory {
    /// Publishes `name` -> `session` under a lease kept alive until `withdraw` (or drop).
    pub async fn publish(
        endpoints: Vec<String>,
        name: &str,
        session: &str,
        timeout: Duration,
    ) -> Result<Directory, EngineError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let connect = Client::connect(endpoints.clone(), Some(options));
        let mut client = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| etcd_err("connect", format!("no answer within {timeout:?}")))?
            .map_err(|e| etcd_err("connect", e))?;
        let lease = client
            .lease_grant(LEASE_TTL, None)
            .await
            .map_err(|e| etcd_err("lease", e))?
            .id();
        client
            .put(
                key(name),
                session,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| etcd_err("publish", e))?;
        let (stop, mut stopped) = watch::channel(false);
        let mut keep = client.clone();
        let keeper = tokio::spawn(async move {
            let Ok((mut keeper, mut acks)) = keep.lease_keep_alive(lease).await else {
                tracing::warn!("transfer engine: cannot keep its etcd entry alive");
                return;
            };
            loop {
                if keeper.keep_alive().await.is_err() || acks.message().await.is_err() {
                    tracing::warn!("transfer engine: etcd keepalive failed; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(LEASE_TTL as u64 / 3)) => {}
                    _ = stopped.changed() => return,
                }
            }
        });
        tracing::info!(%name, %session, "transfer engine published in etcd");
        Ok(Directory {
            client: tokio::sync::Mutex::new(client),
            endpoints,
            timeout,
            cache: Mutex::new(HashMap::new()),
            keeper,
            lease,
            stop,
        })
    }

    /// The session name of the engine called `name`.
    pub async fn resolve(&self, name: &str) -> Result<String, EngineError> {
        if let Some(s) = self.cache.lock().get(name) {
            return Ok(s.clone());
        }
        let ask = async {
            let mut client = self.client.lock().await;
            client.get(key(name), None).await
        };
        let resp = tokio::time::timeout(self.timeout, ask)
            .await
            .map_err(|_| etcd_err("lookup", format!("no answer within {:?}", self.timeout)))?
            .map_err(|e| etcd_err("lookup", e))?;
        let session = resp
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok())
            .map(str::to_string)
            .ok_or_else(|| {
                EngineError::Invalid(format!(
                    "no engine named {name:?} is registered at etcd {}",
                    self.endpoints.join(";")
                ))
            })?;
        self.cache.lock().insert(name.to_string(), session.clone());
        Ok(session)
    }

    /// Forgets what `name` resolved to (its transfer failed: it may have moved).
    pub fn forget(&self, name: &str) {
        self.cache.lock().remove(name);
    }

    /// Removes this engine's entry now instead of when its lease runs out.
    pub async fn withdraw(&self) {
        let _ = self.stop.send(true);
        let revoke = async {
            let mut client = self.client.lock().await;
            client.lease_revoke(self.lease).await
        };
        let _ = tokio::time::timeout(self.timeout, revoke).await;
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.keeper.abort();
    }
}
