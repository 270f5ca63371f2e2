//! The requester-only client: batch put and get between caller memory and owners, with the
//! master deciding placement, leases and commit. One master round trip per phase per batch;
//! transfers of a batch run concurrently. Put and get live in `put` and `get`; this file holds
//! the client itself and the calls that only ask the master.

use std::borrow::Cow;
use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};
use std::time::Instant;

use mooncake_common::{
    master_api::SegmentUsage,
    tenant::Tenant,
    transport::{DataTransport, TransferStats},
    Code, MasterApi, ObjectKey, ReplicaLocation, ReplicaTaskSpec, ReplicaTaskState, SegmentName,
    Tier,
};

use crate::{
    config::ClientConfig,
    error::ClientError,
    leases::Granted,
    transport::{tcp::TcpConfig, HybridConfig, HybridTransport},
};

/// Where an object's replicas are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectDesc {
    pub size: u64,
    pub replicas: Vec<ReplicaLocation>,
}

pub struct Client {
    pub(crate) master: Arc<dyn MasterApi>,
    pub(crate) transport: Arc<dyn DataTransport>,
    pub(crate) preferred: Option<SegmentName>,
    pub(crate) tiers: TierCounters,
    /// The read leases this client holds, handed back when its reads are done.
    pub(crate) leases: Arc<crate::leases::Leases>,
    /// Whose namespace the keys live in: every key is scoped before it leaves the client.
    pub(crate) tenant: Tenant,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.leases.close();
    }
}

/// Keys and bytes of successful gets, by the tier that served them.
#[derive(Default)]
pub(crate) struct TierCounters {
    memory_keys: AtomicU64,
    memory_bytes: AtomicU64,
    disk_keys: AtomicU64,
    disk_bytes: AtomicU64,
    /// Keys gets looked up, hit or not.
    pub(crate) get_keys: AtomicU64,
    /// Keys and bytes puts stored.
    pub(crate) put_keys: AtomicU64,
    pub(crate) put_bytes: AtomicU64,
}

impl TierCounters {
    pub(crate) fn add(&self, tier: Tier, keys: u64, bytes: u64) {
        let (k, b) = match tier {
            Tier::Memory => (&self.memory_keys, &self.memory_bytes),
            Tier::Disk => (&self.disk_keys, &self.disk_bytes),
        };
        k.fetch_add(keys, Ordering::Relaxed);
        b.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl Client {
    /// Connects to the master the config names (checking it answers within the RPC deadline),
    /// with the config's preferred segment and the default transport. The config is taken as
    /// it is: apply the environment first with `ClientConfig::with_process_env` where it should
    /// count. The client contributes no memory.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        let preferred = config.preferred()?;
        let transport = Self::default_transport(&config)?;
        Self::connect_with(config, preferred, transport).await
    }

    /// The transport `connect` uses: the same-host path where available (unless turned off in
    /// the config), TCP elsewhere. Fails only when the config's auth token file cannot be read.
    pub fn default_transport(config: &ClientConfig) -> Result<Arc<dyn DataTransport>, ClientError> {
        Ok(Arc::new(HybridTransport::new(HybridConfig {
            tcp: TcpConfig {
                connect_timeout: config.connect_timeout,
                transfer_timeout: config.transfer_timeout,
                connections_per_owner: config.connections_per_owner,
                transfer_threads: config.transfer_threads,
                dedicated_runtime: config.dedicated_runtime,
                credential: config.credential()?,
            },
            shared_memory: config.shared_memory,
            socket_dir: config.socket_dir.clone(),
            copy_threads: config.copy_threads,
            probe_again_after: crate::transport::hybrid::PROBE_AGAIN_AFTER,
        })))
    }

    /// Like `connect`, with an explicit preferred segment and transport.
    pub async fn connect_with(
        config: ClientConfig,
        preferred: Option<SegmentName>,
        transport: Arc<dyn DataTransport>,
    ) -> Result<Client, ClientError> {
        config.validate()?;
        let tenant = config.tenant()?;
        let master = crate::master::connect(&config)?;
        master.list_segments().await?;
        let idle_between_calls = config.dedicated_runtime
            && tokio::runtime::Handle::current().runtime_flavor()
                == tokio::runtime::RuntimeFlavor::CurrentThread;
        let leases = if idle_between_calls {
            let c = config.clone();
            let connect = move || crate::master::connect(&c);
            crate::leases::Leases::start_on_thread(connect, master.clone())
        } else {
            crate::leases::Leases::start(master.clone())
        };
        let mut client = Self::assemble(master, preferred, transport, leases);
        client.tenant = tenant;
        Ok(client)
    }

    /// A client over any `MasterApi` (e.g. the master's in-process one), checking that it
    /// answers.
    pub async fn with_master(
        master: Arc<dyn MasterApi>,
        preferred: Option<SegmentName>,
        transport: Arc<dyn DataTransport>,
    ) -> Result<Client, ClientError> {
        master.list_segments().await?;
        let leases = crate::leases::Leases::start(master.clone());
        Ok(Self::assemble(master, preferred, transport, leases))
    }

    fn assemble(
        master: Arc<dyn MasterApi>,
        preferred: Option<SegmentName>,
        transport: Arc<dyn DataTransport>,
        leases: Arc<crate::leases::Leases>,
    ) -> Client {
        Client {
            tiers: TierCounters::default(),
            leases,
            master,
            transport,
            preferred,
            tenant: Tenant::default(),
        }
    }

    /// The tenant whose keys this client reads and writes.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// `key` as stored (see `mooncake_common::tenant`), checked.
    pub(crate) fn object_key(&self, key: &str) -> Result<ObjectKey, ClientError> {
        // Checked before scoping: a tenant's scoped empty key is not empty.
        ObjectKey::validate(key)
            .and_then(|()| ObjectKey::new(&self.tenant.scope(key)))
            .map_err(|e| ClientError::Invalid(e.to_string()))
    }

    /// `keys` as stored: None where they are stored as they are (the default tenant).
    pub(crate) fn scoped(&self, keys: &[&str]) -> Option<Vec<String>> {
        (!self.tenant.is_default()).then(|| {
            keys.iter()
                .map(|k| self.tenant.scope(k).into_owned())
                .collect()
        })
    }

    pub fn preferred_segment(&self) -> Option<&SegmentName> {
        self.preferred.as_ref()
    }

    /// Bytes moved so far through the same-host path and over TCP, and keys and bytes of gets
    /// served from memory and from disk.
    pub fn transfer_stats(&self) -> TransferStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferStats {
            memory_keys: load(&self.tiers.memory_keys),
            memory_bytes: load(&self.tiers.memory_bytes),
            disk_keys: load(&self.tiers.disk_keys),
            disk_bytes: load(&self.tiers.disk_bytes),
            get_keys: load(&self.tiers.get_keys),
            put_keys: load(&self.tiers.put_keys),
            put_bytes: load(&self.tiers.put_bytes),
            ..self.transport.stats()
        }
    }

    pub async fn exists(&self, key: &str) -> Result<bool, ClientError> {
        self.batch_exists(&[key])
            .await?
            .pop()
            .expect("one result per key")
    }

    /// Existence of each key; hits are leased. The outer error is a failed master call.
    pub async fn batch_exists(
        &self,
        keys: &[&str],
    ) -> Result<Vec<Result<bool, ClientError>>, ClientError> {
        let scoped = self.scoped(keys);
        let keys = &refs(&scoped, keys)[..];
        let asked = Instant::now();
        let found = self.check(keys).await;
        // The holds of the previous call's checks go back; a get of these hits usually follows.
        self.leases.call_ended();
        let found = found?;
        self.leases.keep(
            keys.iter()
                .zip(&found.found)
                .filter(|(_, r)| matches!(r, Ok(true)))
                .map(|(k, _)| *k),
            Granted::by_check(asked, &found),
        );
        Ok(found
            .found
            .into_iter()
            .map(|r| r.map_err(|c| ClientError::master(c, "exists")))
            .collect())
    }

    pub async fn remove(&self, key: &str, force: bool) -> Result<(), ClientError> {
        self.batch_remove(&[key], force)
            .await?
            .pop()
            .expect("one result per key")
    }

    pub async fn batch_remove(
        &self,
        keys: &[&str],
        force: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let scoped = self.scoped(keys);
        Ok(self
            .master
            .remove(&refs(&scoped, keys), force)
            .await?
            .into_iter()
            .zip(keys)
            .map(|(r, k)| r.map_err(|c| ClientError::master(c, format!("remove {k}"))))
            .collect())
    }

    /// Removes every object of this client's tenant (leased ones only with `force`); returns
    /// how many.
    pub async fn remove_all(&self, force: bool) -> Result<u64, ClientError> {
        Ok(self.master.remove_all(force, None).await?)
    }

    /// Removes the objects whose keys `pattern` matches anywhere (ECMAScript-style syntax, as
    /// Mooncake's `std::regex` search; leased
    /// ones only with `force`); answers how many. A pattern that does not compile is
    /// INVALID_PARAMS.
    pub async fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<u64, ClientError> {
        Ok(self.master.remove_all(force, Some(pattern)).await?)
    }

    /// Starts copying `key` to each of `targets` (segment names, "host:port"); answers the
    /// task's id for `query_task`. The object stays readable throughout.
    pub async fn create_copy_task(&self, key: &str, targets: &[&str]) -> Result<u64, ClientError> {
        let spec = ReplicaTaskSpec::Copy { targets };
        Ok(self
            .master
            .create_replica_task(&self.tenant.scope(key), spec)
            .await?)
    }

    /// Starts moving `key`'s replica on `source` to `target`: copied first, then dropped from
    /// `source` (after the reads leased on it).
    pub async fn create_move_task(
        &self,
        key: &str,
        source: &str,
        target: &str,
    ) -> Result<u64, ClientError> {
        let spec = ReplicaTaskSpec::Move { source, target };
        Ok(self
            .master
            .create_replica_task(&self.tenant.scope(key), spec)
            .await?)
    }

    /// A copy or move task's state.
    pub async fn query_task(&self, id: u64) -> Result<ReplicaTaskState, ClientError> {
        Ok(self.master.query_task(id).await?)
    }

    /// Drops each key's memory replica on `segment` (the object goes when nothing else holds
    /// it), or whole objects without one; per key, whether it was cleared.
    pub async fn batch_replica_clear(
        &self,
        keys: &[&str],
        segment: Option<&str>,
    ) -> Result<Vec<Result<(), Code>>, ClientError> {
        let scoped = self.scoped(keys);
        Ok(self
            .master
            .replica_clear(&refs(&scoped, keys), segment)
            .await?)
    }

    /// Where each key's replicas are (leases the hits, like a get).
    pub async fn batch_get_replica_desc(
        &self,
        keys: &[&str],
    ) -> Result<Vec<Result<ObjectDesc, ClientError>>, ClientError> {
        let scoped = self.scoped(keys);
        let keys = &refs(&scoped, keys)[..];
        let asked = Instant::now();
        let lookup = self.lookup(keys).await;
        self.leases.call_ended();
        let lookup = lookup?;
        self.leases.keep(
            crate::leases::found(keys, &lookup),
            Granted::by_lookup(asked, &lookup),
        );
        Ok(lookup
            .results()
            .iter()
            .map(|r| match r {
                Ok(found) => Ok(ObjectDesc {
                    size: found.size,
                    replicas: lookup.replicas(found).to_vec(),
                }),
                Err(c) => Err(ClientError::master(*c, "get replica list")),
            })
            .collect())
    }

    /// Hands back the read leases this client still holds and stops sending releases, waiting
    /// up to `within` for the master to take them; call it before the runtime stops (dropping
    /// the client alone leaves that to a runtime that may no longer run). Leases of calls made
    /// after this end at their TTL.
    pub async fn close(&self, within: std::time::Duration) {
        self.leases.finish(within).await;
    }

    /// Mounted segments with their capacity and allocated bytes.
    pub async fn list_segments(&self) -> Result<Vec<SegmentUsage>, ClientError> {
        Ok(self.master.list_segments().await?)
    }
}

/// The keys a call sends: the scoped ones where there are any, else the caller's own.
pub(crate) fn refs<'a>(scoped: &'a Option<Vec<String>>, keys: &'a [&'a str]) -> Cow<'a, [&'a str]> {
    match scoped {
        Some(s) => Cow::Owned(s.iter().map(String::as_str).collect()),
        None => Cow::Borrowed(keys),
    }
}
