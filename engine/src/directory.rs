//! Where peers are, with an `etcd://` metadata server (Mooncake's engine with etcd metadata):
//! each engine publishes the session name it serves on (`host:port`) under its own name (the
//! `local_hostname` it was started with) for as long as it lives (an etcd lease, kept alive in the
//! background), and callers name peers by those names. Without it (`P2PHANDSHAKE`) a peer's name
//! is its session name. Lookups are cached; a failed transfer forgets the peer's entry, so a
//! restarted peer (new port) is found again.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc,
    },
    time::Duration,
};

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

/// Keeps the entry alive until `stopped`: a keepalive every third of the TTL; when a keepalive
/// fails or etcd says the lease is gone (a partition, a lost leader), a new keepalive stream, and
/// if that does not help a new lease with the entry put again.
async fn keep_published(
    mut client: Client,
    key: String,
    session: String,
    lease: Arc<AtomicI64>,
    mut stopped: watch::Receiver<bool>,
) {
    let period = Duration::from_secs(LEASE_TTL as u64 / 3);
    let mut stream = None;
    loop {
        let id = lease.load(Ordering::Relaxed);
        let alive = async {
            if stream.is_none() {
                stream = Some(client.lease_keep_alive(id).await.ok()?);
            }
            let (keeper, acks) = stream.as_mut()?;
            keeper.keep_alive().await.ok()?;
            let ack = tokio::time::timeout(period, acks.message())
                .await
                .ok()?
                .ok()??;
            (ack.ttl() > 0).then_some(())
        };
        if alive.await.is_none() {
            stream = None;
            tracing::warn!(%key, "transfer engine: its etcd lease lapsed or etcd did not answer; publishing again");
            let again = async {
                let id = client.lease_grant(LEASE_TTL, None).await.ok()?.id();
                let opts = PutOptions::new().with_lease(id);
                client
                    .put(key.as_str(), session.as_str(), Some(opts))
                    .await
                    .ok()?;
                Some(id)
            };
            if let Ok(Some(id)) = tokio::time::timeout(period, again).await {
                lease.store(id, Ordering::Relaxed);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stopped.changed() => return,
        }
    }
}

pub struct Directory {
    client: tokio::sync::Mutex<Client>,
    endpoints: Vec<String>,
    timeout: Duration,
    cache: Mutex<HashMap<String, String>>,
    keeper: JoinHandle<()>,
    /// The lease the entry lives under now (a new one after etcd lost the old).
    lease: Arc<AtomicI64>,
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
        let (stop, stopped) = watch::channel(false);
        let current = Arc::new(AtomicI64::new(lease));
        let keeper = tokio::spawn(keep_published(
            client.clone(),
            key(name),
            session.to_string(),
            current.clone(),
            stopped,
        ));
        tracing::info!(%name, %session, "transfer engine published in etcd");
        Ok(Directory {
            client: tokio::sync::Mutex::new(client),
            endpoints,
            timeout,
            cache: Mutex::new(HashMap::new()),
            keeper,
            lease: current,
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
            client
                .lease_revoke(self.lease.load(Ordering::Relaxed))
                .await
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
