//! The client's view of the master: one method per batch RPC, each under the RPC deadline, with
//! transport failures turned into RPC_FAIL / RPC_TIMEOUT.

use std::{future::Future, time::Duration};

use mooncake_proto::master::{self as pb, master_client::MasterClient};
use tonic::{
    transport::{Channel, Endpoint},
    Response, Status,
};

use crate::error::ClientError;

#[derive(Clone)]
pub struct MasterRpc {
    client: MasterClient<Channel>,
    timeout: Duration,
}

impl MasterRpc {
    pub fn new(
        addr: &str,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Self, ClientError> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|_| {
                ClientError::Config(format!(
                    "invalid master address {addr:?}: expected HOST:PORT"
                ))
            })?
            .connect_timeout(connect_timeout)
            .timeout(timeout)
            .tcp_nodelay(true);
        let client = MasterClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        Ok(MasterRpc { client, timeout })
    }

    async fn call<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: FnOnce(MasterClient<Channel>) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        match tokio::time::timeout(self.timeout, f(self.client.clone())).await {
            Err(_) => Err(ClientError::RpcTimeout(self.timeout)),
            Ok(Err(s))
                if s.code() == tonic::Code::DeadlineExceeded
                    || s.code() == tonic::Code::Cancelled =>
            {
                Err(ClientError::RpcTimeout(self.timeout))
            }
            Ok(Err(s)) => Err(ClientError::Rpc(format!("{}: {}", s.code(), s.message()))),
            Ok(Ok(r)) => Ok(r.into_inner()),
        }
    }

    pub async fn put_start(
        &self,
        req: pb::BatchPutStartRequest,
    ) -> Result<pb::BatchPutStartResponse, ClientError> {
        self.call(|mut c| async move { c.batch_put_start(req).await })
            .await
    }

    pub async fn put_end(&self, items: Vec<pb::PutRef>) -> Result<Vec<i32>, ClientError> {
        let r = self
            .call(|mut c| async move { c.batch_put_end(pb::BatchPutEndRequest { items }).await });
        Ok(r.await?.codes)
    }

    pub async fn put_revoke(&self, items: Vec<pb::PutRef>) -> Result<Vec<i32>, ClientError> {
        let r = self.call(|mut c| async move {
            c.batch_put_revoke(pb::BatchPutRevokeRequest { items })
                .await
        });
        Ok(r.await?.codes)
    }

    pub async fn get_replicas(
        &self,
        keys: Vec<String>,
    ) -> Result<pb::BatchGetReplicasResponse, ClientError> {
        self.call(|mut c| async move {
            c.batch_get_replicas(pb::BatchGetReplicasRequest { keys })
                .await
        })
        .await
    }

    pub async fn exists(&self, keys: Vec<String>) -> Result<pb::BatchExistsResponse, ClientError> {
        self.call(|mut c| async move { c.batch_exists(pb::BatchExistsRequest { keys }).await })
            .await
    }

    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Result<Vec<i32>, ClientError> {
        let r = self.call(|mut c| async move {
            c.batch_remove(pb::BatchRemoveRequest { keys, force }).await
        });
        Ok(r.await?.codes)
    }

    pub async fn remove_all(&self, force: bool) -> Result<u64, ClientError> {
        let r =
            self.call(|mut c| async move { c.remove_all(pb::RemoveAllRequest { force }).await });
        Ok(r.await?.removed)
    }

    pub async fn list_segments(&self) -> Result<Vec<pb::SegmentInfo>, ClientError> {
        let r = self.call(|mut c| async move { c.list_segments(pb::ListSegmentsRequest {}).await });
        Ok(r.await?.segments)
    }
}
