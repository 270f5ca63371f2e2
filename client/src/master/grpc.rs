//! The gRPC adapter: `MasterApi` over the master's tonic service, for masters behind
//! gRPC-aware proxies. Requests are built as generated messages; answers are read into the same
//! domain types as the framed RPC's.

use std::{future::Future, time::Duration};

use mooncake_common::{
    auth::{grpc_channel, Credential},
    master_api::{Call, Existence, Grants, Lookup, MasterApi, Releases, SegmentUsage},
    tenant::Tenant,
    ApiError, Code, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig,
};
use mooncake_proto::master::{self as pb, master_client::MasterClient};
use tonic::{
    transport::{Channel, Endpoint},
    Response, Status,
};

use super::{
    answers::{
        self, config_pb, removed, replica_task_pb, segments_from_pb, task_created, task_state,
    },
    check_len, exists_codes, expect_len, unit_codes, within,
};

/// Names the client's tenant on every request (nothing for the default tenant).
#[derive(Clone)]
pub struct TenantHeader(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for TenantHeader {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut()
                .insert(mooncake_common::tenant::GRPC_HEADER, v.clone());
        }
        Ok(req)
    }
}

type Client = MasterClient<tonic::service::interceptor::InterceptedService<Channel, TenantHeader>>;

/// A `MasterApi` speaking gRPC.
pub struct GrpcMaster {
    client: Client,
    timeout: Duration,
}

impl GrpcMaster {
    /// A master at `addr` ("host:port"); the channel connects on first use. None: the address
    /// does not make a URI. With a credential, each connection proves it first.
    pub fn new(
        addr: &str,
        timeout: Duration,
        connect_timeout: Duration,
        credential: Option<Credential>,
        tenant: &Tenant,
        tls: Option<mooncake_common::tls::TlsClient>,
    ) -> Option<Self> {
        let header = TenantHeader(if tenant.is_default() {
            None
        } else {
            Some(tenant.name().parse().ok()?)
        });
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .ok()?
            .connect_timeout(connect_timeout)
            .timeout(timeout)
            .tcp_nodelay(true);
        Some(GrpcMaster {
            client: MasterClient::with_interceptor(
                grpc_channel(endpoint, addr, credential, tls),
                header,
            )
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20),
            timeout,
        })
    }

    /// One call under the RPC deadline, tonic's status turned into the call's error.
    async fn unary<Resp, Fut>(&self, call: impl FnOnce(Client) -> Fut) -> Result<Resp, ApiError>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let timeout = self.timeout;
        within(timeout, async {
            match call(self.client.clone()).await {
                Ok(r) => Ok(r.into_inner()),
                Err(s) => Err(status_error(&s, timeout)),
            }
        })
        .await
    }
}

fn status_error(s: &Status, timeout: Duration) -> ApiError {
    match s.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => ApiError::new(
            Code::RpcTimeout,
            format!("master call timed out after {timeout:?}"),
        ),
        tonic::Code::InvalidArgument => ApiError::new(Code::InvalidParams, s.message()),
        tonic::Code::Unauthenticated => ApiError::new(Code::Unauthenticated, s.message()),
        tonic::Code::PermissionDenied => ApiError::new(Code::PermissionDenied, s.message()),
        // The connection's proof failed (the connector reports it as an I/O error).
        _ if mooncake_common::auth::refused_proof(s) => {
            ApiError::new(Code::Unauthenticated, format!("{s}"))
        }
        // A master that is not (or no longer) the elected leader.
        tonic::Code::Unavailable if mooncake_common::leader::is_not_leading(s.message()) => {
            ApiError::new(Code::UnavailableInCurrentStatus, s.message())
        }
        c => ApiError::rpc(format!("{c}: {}", s.message())),
    }
}

fn put_refs(puts: &[(&str, u64)]) -> Vec<pb::PutRef> {
    puts.iter()
        .map(|&(k, put_id)| pb::PutRef {
            key: k.to_string(),
            put_id,
        })
        .collect()
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

impl MasterApi for GrpcMaster {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        Box::pin(async move {
            let req = pb::BatchPutStartRequest {
                token,
                items: items
                    .iter()
                    .map(|&(k, size)| pb::PutStartItem {
                        key: k.to_string(),
                        size,
                    })
                    .collect(),
                config: Some(config_pb(config)),
            };
            let resp = self
                .unary(|mut c| async move { c.batch_put_start(req).await })
                .await?;
            let grants = answers::grants_from_pb(resp)?;
            check_len("put start", grants.results.len(), items.len())?;
            Ok(grants)
        })
    }

    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        Box::pin(async move {
            let req = pb::AbandonPutStartRequest { token };
            let resp = self
                .unary(|mut c| async move { c.abandon_put_start(req).await })
                .await?;
            Ok(resp.revoked)
        })
    }

    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move {
            let req = pb::BatchPutEndRequest {
                items: put_refs(puts),
            };
            let resp = self
                .unary(|mut c| async move { c.batch_put_end(req).await })
                .await?;
            Ok(unit_codes(expect_len("put end", resp.codes, puts.len())?))
        })
    }

    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move {
            let req = pb::BatchPutRevokeRequest {
                items: put_refs(puts),
            };
            let resp = self
                .unary(|mut c| async move { c.batch_put_revoke(req).await })
                .await?;
            Ok(unit_codes(expect_len("revoke", resp.codes, puts.len())?))
        })
    }

    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        Box::pin(async move {
            let req = pb::BatchGetReplicasRequest {
                keys: owned(keys),
                release: owned(release.now().keys),
                release_epoch: release.epoch,
            };
            let resp = self
                .unary(|mut c| async move { c.batch_get_replicas(req).await })
                .await?;
            let lookup = answers::lookup_from_pb(resp)?;
            check_len("lookup", lookup.results().len(), keys.len())?;
            Ok(lookup)
        })
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        Box::pin(async move {
            let req = pb::BatchExistsRequest {
                keys: owned(keys),
                release: owned(release.now().keys),
                release_epoch: release.epoch,
            };
            let resp = self
                .unary(|mut c| async move { c.batch_exists(req).await })
                .await?;
            let found = exists_codes(expect_len("exists", resp.codes, keys.len())?);
            Ok(Existence {
                found,
                lease_ttl: Duration::from_millis(resp.lease_ttl_ms),
                epoch: resp.epoch,
            })
        })
    }

    fn remove<'a>(&'a self, keys: &'a [&'a str], force: bool) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move {
            let req = pb::BatchRemoveRequest {
                keys: owned(keys),
                force,
            };
            let resp = self
                .unary(|mut c| async move { c.batch_remove(req).await })
                .await?;
            Ok(unit_codes(expect_len("remove", resp.codes, keys.len())?))
        })
    }

    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        Box::pin(async move {
            let req = pb::RemoveAllRequest {
                force,
                key_regex: key_regex.unwrap_or_default().to_string(),
            };
            let resp = self
                .unary(|mut c| async move { c.remove_all(req).await })
                .await?;
            removed(resp)
        })
    }

    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
        Box::pin(async move {
            let resp = self
                .unary(|mut c| async move { c.list_segments(pb::ListSegmentsRequest {}).await })
                .await?;
            segments_from_pb(resp.segments)
        })
    }

    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
        Box::pin(async move {
            let req = pb::BatchReleaseLeasesRequest {
                keys: owned(release.now().keys),
                epoch: release.epoch,
            };
            self.unary(|mut c| async move { c.batch_release_leases(req).await })
                .await?;
            Ok(())
        })
    }

    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
        Box::pin(async move {
            let req = replica_task_pb(key, spec);
            let resp = self
                .unary(|mut c| async move { c.create_replica_task(req).await })
                .await?;
            task_created(resp)
        })
    }

    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState> {
        Box::pin(async move {
            let req = pb::QueryTaskRequest { task_id: id };
            let resp = self
                .unary(|mut c| async move { c.query_task(req).await })
                .await?;
            task_state(resp)
        })
    }

    fn replica_clear<'a>(
        &'a self,
        keys: &'a [&'a str],
        segment: Option<&'a str>,
    ) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(async move {
            let req = pb::BatchReplicaClearRequest {
                keys: owned(keys),
                segment: segment.unwrap_or_default().to_string(),
            };
            let resp = self
                .unary(|mut c| async move { c.batch_replica_clear(req).await })
                .await?;
            Ok(unit_codes(expect_len(
                "replica clear",
                resp.codes,
                keys.len(),
            )?))
        })
    }
}
