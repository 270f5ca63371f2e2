//! Runs an owner: creates the pool, binds and serves the data plane, mounts at the master, signals
//! readiness, heartbeats, and on shutdown unmounts and stops serving.

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use mooncake_common::{auth::ServerAuth, ClientId, SegmentName};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    catalog::Catalog,
    config::OwnerConfig,
    dataplane,
    master_link::{tasks::Worker, LinkError, MasterLink},
    pool::MemoryPool,
    seals::{Gate, Seals},
    ssd::{SsdError, SsdStore},
};

#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot create a memory pool of {size} bytes: {source}")]
    Pool { size: u64, source: std::io::Error },
    #[error("cannot bind the data plane to {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot open the ssd tier: {0}")]
    Ssd(#[from] SsdError),
    #[error("cannot mount the segment: {0}")]
    Mount(#[from] LinkError),
    #[error("cannot write the ready file {path}: {source}")]
    ReadyFile {
        path: String,
        source: std::io::Error,
    },
}

/// An owner serving on the current tokio runtime.
pub struct RunningOwner {
    pub segment: SegmentName,
    pub data_addr: SocketAddr,
    pub client_id: ClientId,
    link: MasterLink,
    pool: Arc<MemoryPool>,
    catalog: Arc<Catalog>,
    ssd: Option<Arc<SsdStore>>,
    /// The work queue's worker (SSD tier, copies) and the heartbeats, with their own stop
    /// signal: they stop before the unmount, so the worker's last reports reach a master that
    /// still knows this owner, and no remount lands after the unmount.
    worker: (watch::Sender<bool>, JoinHandle<()>),
    heartbeats: JoinHandle<()>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// How long a shutdown waits for the work under way (SSD-tier work, copies from other owners)
/// to end and be reported; what is still running then is left to the master's task timeout.
const WORK_DRAIN: Duration = Duration::from_secs(2);
/// How long a shutdown waits for a heartbeat (or a remount) under way.
const HEARTBEAT_DRAIN: Duration = Duration::from_secs(1);
/// How long the unmount (the leader's lookup included) and the SSD tier's sync may take; an
/// owner not unmounted is dropped by the master after its client TTL.
const UNMOUNT_WITHIN: Duration = Duration::from_secs(4);
/// How long the serving tasks get to see the stop.
const SERVING_DRAIN: Duration = Duration::from_millis(500);
/// The most a shutdown takes: the stages' bounds. `scripts/mooncake_owner` waits 10 s before
/// SIGKILL, and `mooncake_ownerd` bounds a stop signal's whole handling by `STOP_WITHIN`.
pub const SHUTDOWN_WITHIN: Duration = Duration::from_millis(
    (WORK_DRAIN.as_millis()
        + HEARTBEAT_DRAIN.as_millis()
        + UNMOUNT_WITHIN.as_millis()
        + SERVING_DRAIN.as_millis()) as u64,
);

impl RunningOwner {
    pub async fn start(config: OwnerConfig) -> Result<RunningOwner, OwnerError> {
        config.validate().map_err(OwnerError::Config)?;
        let auth = match &config.auth_token_file {
            Some(path) => Some(ServerAuth::from_file(path).map_err(OwnerError::Config)?),
            None => None,
        };
        let size = config.segment_size.bytes();
        let pool = Arc::new(
            MemoryPool::create(size, config.lock_memory)
                .map_err(|source| OwnerError::Pool { size, source })?,
        );
        let addr = format!("{}:{}", config.host, config.port);
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| OwnerError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let data_addr = listener
            .local_addr()
            .map_err(|source| OwnerError::Bind { addr, source })?;
        let segment = SegmentName::from_host_port(&config.host, data_addr.port())
            .map_err(|e| OwnerError::Config(e.to_string()))?;
        let client_id = ClientId::from_u128(rand::random());
        let catalog = Arc::new(Catalog::default());
        let ssd = match &config.ssd_path {
            Some(dir) => Some(
                SsdStore::open(
                    dir,
                    config.ssd_size.bytes(),
                    config.ssd_engine,
                    config.ssd_queue_depth,
                    config.ssd_read_budget.bytes(),
                )
                .await?
                .0,
            ),
            None => None,
        };
        let gate = auth.as_ref().map(|a| {
            Arc::new(Gate {
                seals: Seals::new(a.seals.clone(), segment.clone()),
                keyring: a.keyring.clone().with_derived_tenants(a.secret()),
            })
        });
        let (stop, stopped) = watch::channel(false);
        let mut tasks = vec![tokio::spawn(dataplane::serve(
            listener,
            pool.clone(),
            catalog.clone(),
            ssd.clone(),
            gate.clone(),
            config.frame_timeout,
            stopped.clone(),
        ))];

        let local_socket = if config.shared_memory {
            let path = mooncake_common::local::socket_path(&config.socket_dir, &segment);
            match crate::local::bind(&path) {
                Ok(listener) => {
                    let server = Arc::new(crate::local::LocalServer {
                        pool: pool.clone(),
                        catalog: catalog.clone(),
                        segment: segment.clone(),
                        frame_timeout: config.frame_timeout,
                        path: path.clone(),
                        gate: gate.clone(),
                        tenants_share_memory: config.tenants_share_memory,
                    });
                    tasks.push(tokio::spawn(server.serve(listener, stopped.clone())));
                    Some(path)
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "cannot offer the same-host path; local clients will use TCP");
                    None
                }
            }
        } else {
            None
        };
        let link = MasterLink::new(
            &config.master,
            &config.cluster_id,
            client_id,
            segment.clone(),
            size,
            config.rpc_timeout,
            ssd.clone(),
            catalog.clone(),
            auth.as_ref(),
            config.master_tls().map_err(OwnerError::Config)?,
        )?;
        if let Err(e) = link.mount_until(config.mount_timeout).await {
            let _ = stop.send(true);
            if let Some(path) = &local_socket {
                let _ = std::fs::remove_file(path);
            }
            return Err(e.into());
        }
        if let Some(store) = &ssd {
            link.register_ssd_records(store).await;
        }
        // The master's work queue: SSD-tier work, and copies for replica tasks.
        let w = Arc::new(Worker {
            link: link.clone(),
            store: ssd.clone(),
            pool: pool.clone(),
            catalog: catalog.clone(),
            concurrency: config.ssd_concurrency,
            // Two thirds of the frame timeout (20 s of 30 by default): with the defaults, well
            // inside the master's task timeout (30 s); keep frame_timeout at most 1.5 times
            // the master's offload_timeout where either is changed.
            copy_timeout: config.frame_timeout * 2 / 3,
        });
        let (tx, rx) = watch::channel(false);
        let heartbeats = tokio::spawn(
            link.clone()
                .heartbeat_loop(config.heartbeat_interval, rx.clone()),
        );
        let worker = (tx, tokio::spawn(w.run(rx)));
        let owner = RunningOwner {
            segment,
            data_addr,
            client_id,
            link,
            pool,
            catalog,
            ssd,
            worker,
            heartbeats,
            stop,
            tasks,
        };
        if let Some(path) = &config.ready_file {
            if let Err(source) = write_ready_file(path, &owner.segment) {
                // Mounted already: stopped in order (unmounted), not left for the master to
                // place puts on until it expires this owner.
                owner.shutdown().await;
                return Err(OwnerError::ReadyFile {
                    path: path.display().to_string(),
                    source,
                });
            }
        }
        tracing::info!(segment = %owner.segment, size, locked = owner.pool.is_locked(), %client_id,
            local_socket = ?local_socket,
            ssd = ?owner.ssd.as_ref().map(|s| s.path().display().to_string()), "owner serving");
        Ok(owner)
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    pub fn ssd(&self) -> Option<&Arc<SsdStore>> {
        self.ssd.as_ref()
    }

    /// Stops in order, within `SHUTDOWN_WITHIN` whatever the master and the disk do: the work
    /// under way ends and is reported (or is left to the master's task timeout), heartbeats
    /// stop, the segment is unmounted while the SSD tier syncs, then serving stops. Until the
    /// unmount the master may still send reads here, so serving goes on until then.
    pub async fn shutdown(self) {
        self.link.stop_mounting();
        let (stop_work, mut worker) = self.worker;
        let _ = stop_work.send(true);
        if tokio::time::timeout(WORK_DRAIN, &mut worker).await.is_err() {
            worker.abort();
            tracing::warn!(
                "work under way did not end within {WORK_DRAIN:?}; the master times it out"
            );
        }
        let mut heartbeats = self.heartbeats;
        if tokio::time::timeout(HEARTBEAT_DRAIN, &mut heartbeats)
            .await
            .is_err()
        {
            heartbeats.abort();
        }
        let unmount = async {
            match tokio::time::timeout(UNMOUNT_WITHIN, self.link.unmount()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e,
                    "unmount at shutdown failed; the master will expire this owner"),
                Err(_) => tracing::warn!(
                    "no unmount within {UNMOUNT_WITHIN:?}; the master will expire this owner"
                ),
            }
        };
        let sync = async {
            let Some(ssd) = &self.ssd else { return };
            match tokio::time::timeout(UNMOUNT_WITHIN, ssd.sync()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "syncing the ssd tier at shutdown failed"),
                Err(_) => {
                    tracing::warn!("the ssd tier's sync did not end within {UNMOUNT_WITHIN:?}")
                }
            }
        };
        tokio::join!(unmount, sync);
        let _ = self.stop.send(true);
        let serving = futures::future::join_all(self.tasks);
        let _ = tokio::time::timeout(SERVING_DRAIN, serving).await;
    }
}

/// Writes the segment name to `path` via a rename, so a watcher never sees a partial file.
fn write_ready_file(path: &Path, segment: &SegmentName) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{segment}\n"))?;
    std::fs::rename(&tmp, path)
}
