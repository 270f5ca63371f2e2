//! The owner's link to the master: mount at start-up (retrying until a deadline), heartbeat, mount
//! again when the master has forgotten this owner, unmount at shutdown. Every call has a deadline.

use std::time::{Duration, Instant};

use std::sync::Arc;

use mooncake_common::{ClientId, Code, ObjectKey, SegmentName};
use mooncake_proto::master::{self as pb, master_client::MasterClient};
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

use crate::ssd::SsdStore;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("invalid master address {0:?}: expected HOST:PORT")]
    BadAddress(String),
    #[error("master {master} did not answer: {message}")]
    Unreachable { master: String, message: String },
    #[error("master {master} refused to mount segment {segment}: {code}: {message}")]
    Refused {
        master: String,
        segment: SegmentName,
        code: Code,
        message: String,
    },
}

#[derive(Clone)]
pub struct MasterLink {
    master: String,
    client: MasterClient<Channel>,
    owner: ClientId,
    segment: SegmentName,
    size: u64,
    rpc_timeout: Duration,
    ssd: Option<Arc<SsdStore>>,
}

impl MasterLink {
    pub fn new(
        master: &str,
        owner: ClientId,
        segment: SegmentName,
        size: u64,
        rpc_timeout: Duration,
        ssd: Option<Arc<SsdStore>>,
    ) -> Result<Self, LinkError> {
        let endpoint = Endpoint::from_shared(format!("http://{master}"))
            .map_err(|_| LinkError::BadAddress(master.to_string()))?
            .connect_timeout(rpc_timeout)
            .timeout(rpc_timeout)
            .tcp_nodelay(true);
        Ok(MasterLink {
            master: master.to_string(),
            client: MasterClient::new(endpoint.connect_lazy()),
            owner,
            segment,
            size,
            rpc_timeout,
            ssd,
        })
    }

    fn unreachable(&self, message: impl ToString) -> LinkError {
        LinkError::Unreachable {
            master: self.master.clone(),
            message: message.to_string(),
        }
    }

    pub async fn mount(&self) -> Result<(), LinkError> {
        let req = pb::MountSegmentRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            size: self.size,
            disk_capacity: self.ssd.as_ref().map_or(0, |s| s.stats().capacity),
        };
        let resp = tokio::time::timeout(self.rpc_timeout, self.client.clone().mount_segment(req))
            .await
            .map_err(|_| self.unreachable(format!("no answer within {:?}", self.rpc_timeout)))?
            .map_err(|s| self.unreachable(s.message()))?
            .into_inner();
        if resp.code != 0 {
            return Err(LinkError::Refused {
                master: self.master.clone(),
                segment: self.segment.clone(),
                code: Code::from_i32(resp.code),
                message: resp.message,
            });
        }
        Ok(())
    }

    /// Mounts, retrying unreachable-master errors until `deadline`; a refusal is final.
    pub async fn mount_until(&self, deadline: Duration) -> Result<(), LinkError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.mount().await {
                Ok(()) => return Ok(()),
                Err(e @ LinkError::Unreachable { .. }) if start.elapsed() + backoff < deadline => {
                    tracing::warn!(error = %e, "mount failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Returns whether the master asked for a remount.
    pub async fn heartbeat(&self) -> Result<bool, LinkError> {
        let req = pb::HeartbeatRequest {
            client_id: self.owner.to_string(),
            disk: self.ssd.as_ref().map(|s| s.stats().into()),
        };
        let resp = tokio::time::timeout(self.rpc_timeout, self.client.clone().heartbeat(req))
            .await
            .map_err(|_| self.unreachable(format!("no answer within {:?}", self.rpc_timeout)))?
            .map_err(|s| self.unreachable(s.message()))?;
        Ok(resp.into_inner().remount)
    }

    pub async fn unmount(&self) -> Result<(), LinkError> {
        let req = pb::UnmountSegmentRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
        };
        tokio::time::timeout(self.rpc_timeout, self.client.clone().unmount_segment(req))
            .await
            .map_err(|_| self.unreachable(format!("no answer within {:?}", self.rpc_timeout)))?
            .map_err(|s| self.unreachable(s.message()))?;
        Ok(())
    }

    /// Runs one call under the RPC deadline (plus `extra`, for long polls).
    async fn call<T>(
        &self,
        extra: Duration,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, LinkError> {
        let after = self.rpc_timeout + extra;
        tokio::time::timeout(after, f)
            .await
            .map_err(|_| self.unreachable(format!("no answer within {after:?}")))?
            .map(|r| r.into_inner())
            .map_err(|s| self.unreachable(s.message()))
    }

    /// Waits up to `wait` for SSD-tier work.
    pub async fn poll_tasks(
        &self,
        max_tasks: u32,
        wait: Duration,
    ) -> Result<pb::PollTasksResponse, LinkError> {
        let req = pb::PollTasksRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            max_tasks,
            wait_ms: wait.as_millis() as u64,
        };
        self.call(wait, self.client.clone().poll_tasks(req)).await
    }

    /// Reports finished tasks; returns the master's code for each.
    pub async fn report_tasks(&self, results: Vec<pb::TaskResult>) -> Result<Vec<i32>, LinkError> {
        let req = pb::ReportTasksRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            results,
        };
        Ok(self
            .call(Duration::ZERO, self.client.clone().report_tasks(req))
            .await?
            .codes)
    }

    /// Tells the master these disk records are about to be overwritten.
    pub async fn disk_dropped<'k>(
        &self,
        records: impl IntoIterator<Item = (&'k ObjectKey, u64)>,
    ) -> Result<(), LinkError> {
        let items = records
            .into_iter()
            .map(|(key, put_id)| pb::PutRef {
                key: key.to_string(),
                put_id,
            })
            .collect();
        let req = pb::DiskDroppedRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            items,
        };
        self.call(Duration::ZERO, self.client.clone().disk_dropped(req))
            .await
            .map(|_| ())
    }

    /// Registers records found on disk; the master answers a code and a version for each.
    pub async fn register_disk(
        &self,
        items: Vec<pb::DiskObject>,
    ) -> Result<pb::RegisterDiskResponse, LinkError> {
        let req = pb::RegisterDiskRequest {
            client_id: self.owner.to_string(),
            segment: self.segment.to_string(),
            items,
        };
        self.call(Duration::ZERO, self.client.clone().register_disk(req))
            .await
    }

    /// Heartbeats every `interval` until `stop`; remounts when the master asks for it.
    pub async fn heartbeat_loop(self, interval: Duration, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            match self.heartbeat().await {
                Ok(false) => {}
                Ok(true) => {
                    tracing::warn!(segment = %self.segment, "master does not know this owner; mounting again");
                    match self.mount().await {
                        Ok(()) => {
                            if let Some(ssd) = &self.ssd {
                                crate::ssd::worker::register_all(&self, ssd).await;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "remount failed; will retry"),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
            }
        }
    }
}
