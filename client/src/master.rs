//! The client's view of the master: one method per batch RPC, each under the RPC deadline, with
//! transport failures turned into RPC_FAIL / RPC_TIMEOUT. Two wire forms carry the same protobuf
//! messages: the framed RPC (default; plain length-prefixed frames on the master's RPC port, a
//! pool of connections) and gRPC.

use std::{future::Future, io, sync::Arc, time::Duration};

use mooncake_common::{
    pbkeys, pbreplicas,
    rpc_wire::{self, Method},
};
use mooncake_proto::master::{self as pb, master_client::MasterClient};
use parking_lot::Mutex;
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::Semaphore,
};
use tonic::{
    transport::{Channel, Endpoint},
    Response, Status,
};

use crate::{
    error::ClientError,
    lookup::{Lookup, Starts},
};

/// How the client talks to the master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MasterProtocol {
    /// Length-prefixed protobuf frames over plain TCP: the lowest latency.
    #[default]
    Framed,
    /// gRPC (HTTP/2), for masters behind gRPC-aware proxies.
    Grpc,
}

#[derive(Clone)]
pub struct MasterRpc {
    backend: Backend,
    timeout: Duration,
}

#[derive(Clone)]
enum Backend {
    Grpc(MasterClient<Channel>),
    Framed(Arc<FramedPool>),
}

impl MasterRpc {
    pub fn new(
        addr: &str,
        timeout: Duration,
        connect_timeout: Duration,
        protocol: MasterProtocol,
        spin: Duration,
    ) -> Result<Self, ClientError> {
        let bad = || {
            ClientError::Config(format!(
                "invalid master address {addr:?}: expected HOST:PORT"
            ))
        };
        let backend = match protocol {
            MasterProtocol::Grpc => {
                let endpoint = Endpoint::from_shared(format!("http://{addr}"))
                    .map_err(|_| bad())?
                    .connect_timeout(connect_timeout)
                    .timeout(timeout)
                    .tcp_nodelay(true);
                Backend::Grpc(
                    MasterClient::new(endpoint.connect_lazy())
                        .max_decoding_message_size(256 << 20)
                        .max_encoding_message_size(256 << 20),
                )
            }
            MasterProtocol::Framed => {
                if addr
                    .rsplit_once(':')
                    .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
                {
                    return Err(bad());
                }
                Backend::Framed(Arc::new(FramedPool {
                    addr: addr.to_string(),
                    connect_timeout,
                    spin,
                    idle: Mutex::new(Vec::new()),
                    permits: Semaphore::new(8),
                }))
            }
        };
        Ok(MasterRpc { backend, timeout })
    }

    /// `call` under the RPC deadline.
    async fn within<T>(
        &self,
        call: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or(Err(ClientError::RpcTimeout(self.timeout)))
    }

    async fn unary<Req, Resp, F, Fut>(
        &self,
        method: Method,
        req: Req,
        grpc: F,
    ) -> Result<Resp, ClientError>
    where
        Req: Message,
        Resp: Message + Default,
        F: FnOnce(MasterClient<Channel>, Req) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let call = async {
            match &self.backend {
                Backend::Grpc(c) => match grpc(c.clone(), req).await {
                    Ok(r) => Ok(r.into_inner()),
                    Err(s)
                        if s.code() == tonic::Code::DeadlineExceeded
                            || s.code() == tonic::Code::Cancelled =>
                    {
                        Err(ClientError::RpcTimeout(self.timeout))
                    }
                    Err(s) => Err(ClientError::Rpc(format!("{}: {}", s.code(), s.message()))),
                },
                Backend::Framed(pool) => pool.call(method, &req).await,
            }
        };
        self.within(call).await
    }

    /// Starts puts of (key, size): space for each, or why not. On the framed RPC the keys go
    /// into the frame borrowed and the answer is read without a message struct.
    pub async fn put_start(
        &self,
        items: &[(&str, u64)],
        config: pb::ReplicateConfig,
    ) -> Result<Starts, ClientError> {
        let pool = match &self.backend {
            Backend::Framed(pool) => pool,
            Backend::Grpc(_) => {
                let req = pb::BatchPutStartRequest {
                    items: items
                        .iter()
                        .map(|&(k, size)| pb::PutStartItem {
                            key: k.to_string(),
                            size,
                        })
                        .collect(),
                    config: Some(config),
                };
                let resp: pb::BatchPutStartResponse = self
                    .unary(Method::BatchPutStart, req, |mut c, r| async move {
                        c.batch_put_start(r).await
                    })
                    .await?;
                return Ok(Starts::from_pb(resp));
            }
        };
        let len = pbkeys::keyed_len(1, items) + prost::encoding::message::encoded_len(2, &config);
        let call = pool.call_raw(Method::BatchPutStart, len, |buf| {
            pbkeys::encode_keyed(1, items, buf);
            prost::encoding::message::encode(2, &config, buf);
        });
        let body = self.within(call).await?;
        let (starts, replicas) = pbreplicas::decode_put_start(&body).map_err(|e| {
            ClientError::Rpc(format!(
                "master {} sent an undecodable answer: {e}",
                pool.addr
            ))
        })?;
        Ok(Starts::from_decoded(starts, replicas))
    }

    /// Ends the puts named by (key, put id); a code per put.
    pub async fn put_end(&self, refs: &[(&str, u64)]) -> Result<Vec<i32>, ClientError> {
        let r: pb::BatchPutEndResponse = self
            .by_refs(
                Method::BatchPutEnd,
                refs,
                |items| pb::BatchPutEndRequest { items },
                |mut c, r| async move { c.batch_put_end(r).await },
            )
            .await?;
        Ok(r.codes)
    }

    /// Revokes the puts named by (key, put id); a code per put.
    pub async fn put_revoke(&self, refs: &[(&str, u64)]) -> Result<Vec<i32>, ClientError> {
        let r: pb::BatchPutRevokeResponse = self
            .by_refs(
                Method::BatchPutRevoke,
                refs,
                |items| pb::BatchPutRevokeRequest { items },
                |mut c, r| async move { c.batch_put_revoke(r).await },
            )
            .await?;
        Ok(r.codes)
    }

    /// A call whose request is a list of (key, put id): on the framed RPC the keys go into the
    /// frame borrowed; on gRPC, `request` builds the message.
    async fn by_refs<Req, Resp, F, Fut>(
        &self,
        method: Method,
        refs: &[(&str, u64)],
        request: impl FnOnce(Vec<pb::PutRef>) -> Req,
        grpc: F,
    ) -> Result<Resp, ClientError>
    where
        Req: Message,
        Resp: Message + Default,
        F: FnOnce(MasterClient<Channel>, Req) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let Backend::Framed(pool) = &self.backend else {
            let items = refs
                .iter()
                .map(|&(k, put_id)| pb::PutRef {
                    key: k.to_string(),
                    put_id,
                })
                .collect();
            return self.unary(method, request(items), grpc).await;
        };
        let call = pool.call_with(method, pbkeys::keyed_len(1, refs), |buf| {
            pbkeys::encode_keyed(1, refs, buf)
        });
        self.within(call).await
    }

    /// Where each key's replicas are (leasing the hits). On the framed RPC the keys go into
    /// the frame borrowed and the answer is read without a message struct.
    pub async fn get_replicas(&self, keys: &[&str]) -> Result<Lookup, ClientError> {
        let pool = match &self.backend {
            Backend::Framed(pool) => pool,
            Backend::Grpc(_) => {
                let req = pb::BatchGetReplicasRequest {
                    keys: keys.iter().map(|k| k.to_string()).collect(),
                };
                let resp: pb::BatchGetReplicasResponse = self
                    .unary(Method::BatchGetReplicas, req, |mut c, r| async move {
                        c.batch_get_replicas(r).await
                    })
                    .await?;
                return Ok(Lookup::from_pb(resp));
            }
        };
        let len = pbkeys::encoded_len(1, keys);
        let call = pool.call_raw(Method::BatchGetReplicas, len, |buf| {
            pbkeys::encode_strings(1, keys, buf)
        });
        let body = self.within(call).await?;
        let decoded = pbreplicas::decode(&body).map_err(|e| {
            ClientError::Rpc(format!(
                "master {} sent an undecodable answer: {e}",
                pool.addr
            ))
        })?;
        Ok(Lookup::from_decoded(decoded))
    }

    pub async fn exists(&self, keys: Vec<String>) -> Result<pb::BatchExistsResponse, ClientError> {
        let req = pb::BatchExistsRequest { keys };
        self.unary(Method::BatchExists, req, |mut c, r| async move {
            c.batch_exists(r).await
        })
        .await
    }

    /// `exists` over borrowed keys: on the framed RPC they are encoded straight into the frame.
    pub async fn exists_strs(&self, keys: &[&str]) -> Result<pb::BatchExistsResponse, ClientError> {
        let Backend::Framed(pool) = &self.backend else {
            return self
                .exists(keys.iter().map(|k| k.to_string()).collect())
                .await;
        };
        let len = pbkeys::encoded_len(1, keys);
        let call = pool.call_with(Method::BatchExists, len, |buf| {
            pbkeys::encode_strings(1, keys, buf)
        });
        self.within(call).await
    }

    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Result<Vec<i32>, ClientError> {
        let req = pb::BatchRemoveRequest { keys, force };
        let r: pb::BatchRemoveResponse = self
            .unary(Method::BatchRemove, req, |mut c, r| async move {
                c.batch_remove(r).await
            })
            .await?;
        Ok(r.codes)
    }

    pub async fn remove_all(&self, force: bool) -> Result<u64, ClientError> {
        let req = pb::RemoveAllRequest { force };
        let r: pb::RemoveAllResponse = self
            .unary(Method::RemoveAll, req, |mut c, r| async move {
                c.remove_all(r).await
            })
            .await?;
        Ok(r.removed)
    }

    pub async fn list_segments(&self) -> Result<Vec<pb::SegmentInfo>, ClientError> {
        let req = pb::ListSegmentsRequest {};
        let r: pb::ListSegmentsResponse = self
            .unary(Method::ListSegments, req, |mut c, r| async move {
                c.list_segments(r).await
            })
            .await?;
        Ok(r.segments)
    }
}

/// Pooled framed-RPC connections to the master; one request in flight per connection. A
/// connection that saw any error is dropped (the caller's deadline bounds everything).
struct FramedPool {
    addr: String,
    connect_timeout: Duration,
    /// How long to poll for an answer before parking (see `ClientConfig::master_spin`).
    spin: Duration,
    idle: Mutex<Vec<FramedConn>>,
    permits: Semaphore,
}

struct FramedConn {
    stream: TcpStream,
    next_id: u64,
}

impl FramedPool {
    async fn call<Req: Message, Resp: Message + Default>(
        &self,
        method: Method,
        req: &Req,
    ) -> Result<Resp, ClientError> {
        self.call_with(method, req.encoded_len(), |buf| {
            req.encode(buf).expect("a Vec grows as needed")
        })
        .await
    }

    /// One exchange whose request body (`len` bytes) `encode` appends to the frame buffer.
    async fn call_with<Resp: Message + Default>(
        &self,
        method: Method,
        len: usize,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<Resp, ClientError> {
        let out = self.call_raw(method, len, encode).await?;
        Resp::decode(&out[..]).map_err(|e| {
            ClientError::Rpc(format!(
                "master {} sent an undecodable answer: {e}",
                self.addr
            ))
        })
    }

    /// `call_with`, returning the answer's bytes undecoded.
    async fn call_raw(
        &self,
        method: Method,
        len: usize,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<Vec<u8>, ClientError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("semaphore never closed");
        let pooled = self.idle.lock().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect().await?,
        };
        let rpc_err =
            |e: io::Error| ClientError::Rpc(format!("master {} connection failed: {e}", self.addr));
        let id = conn.next_id;
        conn.next_id += 1;
        let mut frame = Vec::with_capacity(rpc_wire::HEADER_LEN + len);
        frame.extend_from_slice(&rpc_wire::encode_header(len, method as u32, id));
        encode(&mut frame);
        debug_assert_eq!(frame.len(), rpc_wire::HEADER_LEN + len);
        conn.stream.write_all(&frame).await.map_err(rpc_err)?;
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        // The answer is usually microseconds away: poll for it before parking the thread.
        let early = match crate::spin::read_now(&conn.stream, &mut h, self.spin) {
            Ok(Some(0)) => return Err(rpc_err(io::ErrorKind::UnexpectedEof.into())),
            Ok(Some(n)) => n,
            Ok(None) => 0,
            Err(e) => return Err(rpc_err(e)),
        };
        conn.stream
            .read_exact(&mut h[early..])
            .await
            .map_err(rpc_err)?;
        let (len, status, got) = rpc_wire::decode_header(&h)
            .map_err(|e| ClientError::Rpc(format!("master {}: {e}", self.addr)))?;
        if got != id {
            return Err(ClientError::Rpc(format!(
                "master {} answered request {got}, expected {id}",
                self.addr
            )));
        }
        let mut out = vec![0u8; len];
        conn.stream.read_exact(&mut out).await.map_err(rpc_err)?;
        let status = status as i32;
        if status != rpc_wire::STATUS_OK {
            self.idle.lock().push(conn);
            let text = String::from_utf8_lossy(&out);
            return Err(if status == rpc_wire::STATUS_BAD_REQUEST {
                ClientError::Invalid(text.into_owned())
            } else {
                ClientError::Rpc(format!("master {}: {text}", self.addr))
            });
        }
        self.idle.lock().push(conn);
        Ok(out)
    }

    async fn connect(&self) -> Result<FramedConn, ClientError> {
        let fail =
            |e: io::Error| ClientError::Rpc(format!("cannot connect to master {}: {e}", self.addr));
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| ClientError::RpcTimeout(self.connect_timeout))?
            .map_err(fail)?;
        stream.set_nodelay(true).map_err(fail)?;
        let mut stream = stream;
        stream.write_all(&rpc_wire::hello()).await.map_err(fail)?;
        let mut hello = [0u8; rpc_wire::HELLO_LEN];
        stream.read_exact(&mut hello).await.map_err(fail)?;
        rpc_wire::check_hello(&hello)
            .map_err(|e| ClientError::Rpc(format!("master {}: {e}", self.addr)))?;
        Ok(FramedConn { stream, next_id: 1 })
    }
}
