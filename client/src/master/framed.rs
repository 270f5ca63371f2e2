//! The framed-RPC adapter: `MasterApi` over plain length-prefixed frames on the master's RPC
//! port, from a small pool of connections (one request in flight on each). The hot calls write
//! their keys into the frame borrowed and read the answer without message structs.

use std::{io, time::Duration};

use mooncake_common::{
    auth::{prove, Credential},
    master_api::{Call, Existence, Grants, Lookup, MasterApi, Releases, SegmentUsage},
    tenant::Tenant,
    tls::{ClientStream, TlsClient},
    ApiError, Code, ReplicaTaskSpec, ReplicaTaskState, ReplicateConfig,
};
use mooncake_proto::{
    framed::{self as rpc_wire, fields, keys, Method},
    master as pb,
};
use parking_lot::Mutex;
use prost::Message;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::Semaphore,
};

use super::{
    answers::{
        self, config_pb, removed, replica_task_pb, segments_from_pb, task_created, task_state,
    },
    check_len, exists_codes, expect_len, unit_codes, within,
};

/// A `MasterApi` speaking the framed RPC.
pub struct FramedMaster {
    pool: FramedPool,
    timeout: Duration,
}

impl FramedMaster {
    /// A master at `addr` ("host:port"); connections are made on first use.
    pub fn new(
        addr: &str,
        timeout: Duration,
        connect_timeout: Duration,
        spin: Duration,
        credential: Option<Credential>,
        tenant: Tenant,
        tls: Option<TlsClient>,
    ) -> Self {
        FramedMaster {
            pool: FramedPool {
                addr: addr.to_string(),
                connect_timeout,
                spin,
                credential,
                tenant,
                tls,
                idle: Mutex::new(Vec::new()),
                permits: Semaphore::new(8),
            },
            timeout,
        }
    }

    /// One exchange under the RPC deadline; `encode` appends the `len`-byte request body.
    async fn raw(
        &self,
        method: Method,
        len: usize,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<Vec<u8>, ApiError> {
        within(self.timeout, self.pool.call_raw(method, len, encode)).await
    }

    /// An exchange of generated messages.
    async fn call<Resp: Message + Default>(
        &self,
        method: Method,
        req: &impl Message,
    ) -> Result<Resp, ApiError> {
        let body = self
            .raw(method, req.encoded_len(), |buf| {
                req.encode(buf).expect("a Vec grows as needed")
            })
            .await?;
        Resp::decode(&body[..]).map_err(|e| self.undecodable(e))
    }

    fn undecodable(&self, e: impl std::fmt::Display) -> ApiError {
        ApiError::rpc(format!(
            "master {} sent an undecodable answer: {e}",
            self.pool.addr
        ))
    }

    /// A call whose request is a list of (key, put id) and whose answer a code per item.
    async fn by_refs(
        &self,
        method: Method,
        puts: &[(&str, u64)],
    ) -> Result<Vec<Result<(), Code>>, ApiError> {
        let body = self
            .raw(method, keys::keyed_len(fields::PUT_REFS, puts), |buf| {
                keys::encode_keyed(fields::PUT_REFS, puts, buf)
            })
            .await?;
        // `BatchPutEndResponse` and `BatchPutRevokeResponse` are both `repeated int32 codes`.
        let resp = pb::BatchPutEndResponse::decode(&body[..]).map_err(|e| self.undecodable(e))?;
        Ok(unit_codes(expect_len("put", resp.codes, puts.len())?))
    }
}

/// A lookup's or an existence check's request: its keys, and the holds it hands back if it goes
/// out in time for them (`Releases::now`, when it is written); the most bytes it takes.
fn keys_and_release<'a>(
    keys: &'a [&'a str],
    release: Releases<'a>,
) -> (usize, impl FnOnce(&mut Vec<u8>) + 'a) {
    let len = keys::strings_len(fields::KEYS, keys)
        + keys::strings_len(fields::RELEASE, release.keys)
        + keys::u64_field_len(fields::RELEASE_EPOCH, release.epoch);
    let encode = move |buf: &mut Vec<u8>| {
        let release = release.now();
        keys::encode_strings(fields::KEYS, keys, buf);
        keys::encode_strings(fields::RELEASE, release.keys, buf);
        keys::encode_u64(fields::RELEASE_EPOCH, release.epoch, buf);
    };
    (len, encode)
}

impl MasterApi for FramedMaster {
    fn put_start<'a>(
        &'a self,
        items: &'a [(&'a str, u64)],
        config: &'a ReplicateConfig,
        token: u64,
    ) -> Call<'a, Grants> {
        use fields::put_start_request::{CONFIG, ITEMS, TOKEN};
        Box::pin(async move {
            let config = config_pb(config);
            let len = keys::keyed_len(ITEMS, items)
                + prost::encoding::message::encoded_len(CONFIG, &config)
                + keys::u64_field_len(TOKEN, token);
            let body = self
                .raw(Method::BatchPutStart, len, |buf| {
                    keys::encode_keyed(ITEMS, items, buf);
                    prost::encoding::message::encode(CONFIG, &config, buf);
                    keys::encode_u64(TOKEN, token, buf);
                })
                .await?;
            let grants = answers::grants_from_frame(&body)?;
            check_len("put start", grants.results.len(), items.len())?;
            Ok(grants)
        })
    }

    fn abandon_put_start(&self, token: u64) -> Call<'_, u32> {
        Box::pin(async move {
            let req = pb::AbandonPutStartRequest { token };
            let body = self
                .raw(Method::AbandonPutStart, req.encoded_len(), |buf| {
                    req.encode_raw(buf)
                })
                .await?;
            let resp =
                pb::AbandonPutStartResponse::decode(&body[..]).map_err(|e| self.undecodable(e))?;
            Ok(resp.revoked)
        })
    }

    fn put_end<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(self.by_refs(Method::BatchPutEnd, puts))
    }

    fn put_revoke<'a>(&'a self, puts: &'a [(&'a str, u64)]) -> Call<'a, Vec<Result<(), Code>>> {
        Box::pin(self.by_refs(Method::BatchPutRevoke, puts))
    }

    fn get_replicas<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Lookup> {
        Box::pin(async move {
            let (len, encode) = keys_and_release(keys, release);
            let body = self.raw(Method::BatchGetReplicas, len, encode).await?;
            let lookup = answers::lookup_from_frame(&body)?;
            check_len("lookup", lookup.results().len(), keys.len())?;
            Ok(lookup)
        })
    }

    fn exists<'a>(&'a self, keys: &'a [&'a str], release: Releases<'a>) -> Call<'a, Existence> {
        Box::pin(async move {
            let (len, encode) = keys_and_release(keys, release);
            let body = self.raw(Method::BatchExists, len, encode).await?;
            let resp =
                pb::BatchExistsResponse::decode(&body[..]).map_err(|e| self.undecodable(e))?;
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
                keys: keys.iter().map(|k| k.to_string()).collect(),
                force,
            };
            let resp: pb::BatchRemoveResponse = self.call(Method::BatchRemove, &req).await?;
            Ok(unit_codes(expect_len("remove", resp.codes, keys.len())?))
        })
    }

    fn remove_all<'a>(&'a self, force: bool, key_regex: Option<&'a str>) -> Call<'a, u64> {
        Box::pin(async move {
            let req = pb::RemoveAllRequest {
                force,
                key_regex: key_regex.unwrap_or_default().to_string(),
            };
            let resp: pb::RemoveAllResponse = self.call(Method::RemoveAll, &req).await?;
            removed(resp)
        })
    }

    fn list_segments(&self) -> Call<'_, Vec<SegmentUsage>> {
        Box::pin(async move {
            let resp: pb::ListSegmentsResponse = self
                .call(Method::ListSegments, &pb::ListSegmentsRequest {})
                .await?;
            segments_from_pb(resp.segments)
        })
    }

    fn release_leases<'a>(&'a self, release: Releases<'a>) -> Call<'a, ()> {
        Box::pin(async move {
            // `BatchReleaseLeasesRequest`: `repeated string keys = 1; uint64 epoch = 2;`.
            let len = keys::strings_len(1, release.keys) + keys::u64_field_len(2, release.epoch);
            let encode = |buf: &mut Vec<u8>| {
                let release = release.now();
                keys::encode_strings(1, release.keys, buf);
                keys::encode_u64(2, release.epoch, buf);
            };
            self.raw(Method::BatchReleaseLeases, len, encode).await?;
            Ok(())
        })
    }

    fn create_replica_task<'a>(&'a self, key: &'a str, spec: ReplicaTaskSpec<'a>) -> Call<'a, u64> {
        Box::pin(async move {
            let req = replica_task_pb(key, spec);
            let resp: pb::CreateReplicaTaskResponse =
                self.call(Method::CreateReplicaTask, &req).await?;
            task_created(resp)
        })
    }

    fn query_task(&self, id: u64) -> Call<'_, ReplicaTaskState> {
        Box::pin(async move {
            let req = pb::QueryTaskRequest { task_id: id };
            let resp: pb::QueryTaskResponse = self.call(Method::QueryTask, &req).await?;
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
                keys: keys.iter().map(|k| k.to_string()).collect(),
                segment: segment.unwrap_or_default().to_string(),
            };
            let resp: pb::BatchReplicaClearResponse =
                self.call(Method::BatchReplicaClear, &req).await?;
            Ok(unit_codes(expect_len(
                "replica clear",
                resp.codes,
                keys.len(),
            )?))
        })
    }
}

/// Pooled framed-RPC connections to the master; one request in flight per connection. A
/// connection that saw any error is dropped (the caller's deadline bounds everything).
struct FramedPool {
    addr: String,
    connect_timeout: Duration,
    /// How long to poll for an answer before parking (see `ClientConfig::master_spin`).
    spin: Duration,
    /// Proved on every new connection.
    credential: Option<Credential>,
    /// Named on every new connection (unless it is the default tenant).
    tenant: Tenant,
    /// TLS on every connection, where the master runs it.
    tls: Option<TlsClient>,
    idle: Mutex<Vec<FramedConn>>,
    permits: Semaphore,
}

struct FramedConn {
    stream: ClientStream,
    next_id: u64,
}

impl FramedConn {
    /// Sends one request (its `len`-byte body appended by `encode`) and reads the answer:
    /// its status and body. Polls up to `spin` for the answer before parking (plain TCP only).
    async fn exchange(
        &mut self,
        addr: &str,
        method: Method,
        len: usize,
        encode: impl FnOnce(&mut Vec<u8>),
        spin: Duration,
    ) -> Result<(i32, Vec<u8>), ApiError> {
        let rpc_err = |e: io::Error| ApiError::rpc(format!("master {addr} connection failed: {e}"));
        let too_large = |len: usize| {
            // The master would drop the connection (and a retry would send it again).
            ApiError::new(
                Code::InvalidParams,
                format!(
                    "a request of {len} bytes exceeds the frame limit of {} bytes: split the batch",
                    rpc_wire::MAX_BODY
                ),
            )
        };
        if len > rpc_wire::MAX_BODY {
            return Err(too_large(len));
        }
        let id = self.next_id;
        self.next_id += 1;
        // `len` is at least the body: the body may leave out what is late by now (releases).
        let mut frame = Vec::with_capacity(rpc_wire::HEADER_LEN + len);
        frame.resize(rpc_wire::HEADER_LEN, 0);
        encode(&mut frame);
        let len = frame.len() - rpc_wire::HEADER_LEN;
        if len > rpc_wire::MAX_BODY {
            return Err(too_large(len));
        }
        frame[..rpc_wire::HEADER_LEN].copy_from_slice(&rpc_wire::encode_header(
            len,
            method as u32,
            id,
        ));
        self.stream.write_all(&frame).await.map_err(rpc_err)?;
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        // The answer is usually microseconds away: poll for it before parking the thread.
        // (Not through TLS: its bytes must go through the session.)
        let early = match self.stream.plain() {
            Some(tcp) => match crate::spin::read_now(tcp, &mut h, spin) {
                Ok(Some(0)) => return Err(rpc_err(io::ErrorKind::UnexpectedEof.into())),
                Ok(Some(n)) => n,
                Ok(None) => 0,
                Err(e) => return Err(rpc_err(e)),
            },
            None => 0,
        };
        self.stream
            .read_exact(&mut h[early..])
            .await
            .map_err(rpc_err)?;
        let (len, status, got) = rpc_wire::decode_header(&h)
            .map_err(|e| ApiError::rpc(format!("master {addr}: {e}")))?;
        if got != id {
            return Err(ApiError::rpc(format!(
                "master {addr} answered request {got}, expected {id}"
            )));
        }
        let out = mooncake_common::body::read_new_body(&mut self.stream, len)
            .await
            .map_err(rpc_err)?;
        Ok((status as i32, out))
    }
}

/// The error of a framed answer whose status is not OK (`text`: its body).
fn status_error(addr: &str, status: i32, text: &[u8]) -> ApiError {
    let text = String::from_utf8_lossy(text);
    match status {
        rpc_wire::STATUS_BAD_REQUEST => ApiError::new(Code::InvalidParams, text.into_owned()),
        rpc_wire::STATUS_UNAUTHENTICATED => {
            ApiError::new(Code::Unauthenticated, format!("master {addr}: {text}"))
        }
        rpc_wire::STATUS_DENIED => {
            ApiError::new(Code::PermissionDenied, format!("master {addr}: {text}"))
        }
        rpc_wire::STATUS_UNAVAILABLE => ApiError::new(
            Code::UnavailableInCurrentStatus,
            format!("master {addr}: {text}"),
        ),
        _ => ApiError::rpc(format!("master {addr}: {text}")),
    }
}

impl FramedPool {
    /// One exchange whose request body (`len` bytes) `encode` appends to the frame buffer;
    /// the answer's bytes undecoded.
    async fn call_raw(
        &self,
        method: Method,
        len: usize,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<Vec<u8>, ApiError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("semaphore never closed");
        let mut conn = match self.idle_open() {
            Some(c) => c,
            None => self.connect().await.map_err(|mut e| {
                e.message = format!("{}; {}", e.message, mooncake_common::leader::NOT_SENT);
                e
            })?,
        };
        let (status, out) = conn
            .exchange(&self.addr, method, len, encode, self.spin)
            .await?;
        // The master closes a connection it answered UNAUTHENTICATED; any other answer leaves
        // it usable.
        if status != rpc_wire::STATUS_UNAUTHENTICATED {
            self.idle.lock().push(conn);
        }
        match status {
            rpc_wire::STATUS_OK => Ok(out),
            _ => Err(status_error(&self.addr, status, &out)),
        }
    }

    /// An idle connection the master has not closed meanwhile (it restarted, or an idle
    /// timeout on the way cut it), if any: the others are dropped. A call on a closed one
    /// would fail although the master is up and the request never reached it.
    fn idle_open(&self) -> Option<FramedConn> {
        loop {
            let conn = self.idle.lock().pop()?;
            if conn.stream.idle_and_open() {
                return Some(conn);
            }
        }
    }

    async fn connect(&self) -> Result<FramedConn, ApiError> {
        let fail =
            |e: io::Error| ApiError::rpc(format!("cannot connect to master {}: {e}", self.addr));
        let mut stream = ClientStream::connect(&self.addr, self.tls.as_ref(), self.connect_timeout)
            .await
            .map_err(|e| {
                let code = if e.kind() == io::ErrorKind::TimedOut {
                    Code::RpcTimeout
                } else {
                    Code::RpcFail
                };
                ApiError::new(code, format!("cannot connect to master {}: {e}", self.addr))
            })?;
        prove(&mut stream, self.credential.as_ref(), self.connect_timeout)
            .await
            .map_err(|e| ApiError::new(e.code(), format!("master {}: {e}", self.addr)))?;
        stream.write_all(&rpc_wire::hello()).await.map_err(fail)?;
        let mut hello = [0u8; rpc_wire::HELLO_LEN];
        stream.read_exact(&mut hello).await.map_err(fail)?;
        rpc_wire::check_hello(&hello)
            .map_err(|e| ApiError::rpc(format!("master {}: {e}", self.addr)))?;
        let mut conn = FramedConn { stream, next_id: 1 };
        if !self.tenant.is_default() {
            self.use_tenant(&mut conn).await?;
        }
        Ok(conn)
    }

    /// Asks the master to take this connection's calls as the client's tenant's.
    async fn use_tenant(&self, conn: &mut FramedConn) -> Result<(), ApiError> {
        let name = self.tenant.name().as_bytes();
        let (status, out) = conn
            .exchange(
                &self.addr,
                Method::UseTenant,
                name.len(),
                |b| b.extend_from_slice(name),
                Duration::ZERO,
            )
            .await?;
        match status {
            rpc_wire::STATUS_OK => Ok(()),
            _ => Err(status_error(&self.addr, status, &out)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A framed client of `addr`, without credential or tenant, under 2 s deadlines.
    fn master(addr: &str) -> FramedMaster {
        FramedMaster::new(
            addr,
            Duration::from_secs(2),
            Duration::from_secs(2),
            Duration::ZERO,
            None,
            Tenant::default(),
            None,
        )
    }

    /// A master that answers one call per connection (an empty segment list), then closes it,
    /// as a master that restarted leaves its clients' idle connections.
    async fn one_call_per_connection() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut hello = [0u8; rpc_wire::HELLO_LEN];
                    s.read_exact(&mut hello).await.unwrap();
                    s.write_all(&rpc_wire::hello()).await.unwrap();
                    let mut h = [0u8; rpc_wire::HEADER_LEN];
                    s.read_exact(&mut h).await.unwrap();
                    let (len, _, id) = rpc_wire::decode_header(&h).unwrap();
                    let mut body = vec![0u8; len];
                    s.read_exact(&mut body).await.unwrap();
                    let out = pb::ListSegmentsResponse::default().encode_to_vec();
                    s.write_all(&rpc_wire::encode_header(out.len(), 0, id))
                        .await
                        .unwrap();
                    s.write_all(&out).await.unwrap();
                });
            }
        });
        addr
    }

    /// A release goes out only in time: a request written after its `send_by` (it waited for
    /// a connection, say) leaves the holds out, since the lease may have run out by then.
    #[tokio::test]
    async fn releases_written_too_late_are_left_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; rpc_wire::HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&rpc_wire::hello()).await.unwrap();
            loop {
                let mut h = [0u8; rpc_wire::HEADER_LEN];
                if s.read_exact(&mut h).await.is_err() {
                    return;
                }
                let (len, _, id) = rpc_wire::decode_header(&h).unwrap();
                let mut body = vec![0u8; len];
                s.read_exact(&mut body).await.unwrap();
                let req = pb::BatchGetReplicasRequest::decode(&body[..]).unwrap();
                seen_tx.send(req.release).unwrap();
                let out = pb::BatchGetReplicasResponse::default().encode_to_vec();
                s.write_all(&rpc_wire::encode_header(out.len(), 0, id))
                    .await
                    .unwrap();
                s.write_all(&out).await.unwrap();
            }
        });
        let m = master(&addr);
        let keys = ["a", "b"];
        let now = std::time::Instant::now();
        for (send_by, want) in [
            (now + Duration::from_secs(10), vec!["a", "b"]),
            (now - Duration::from_millis(1), vec![]),
        ] {
            let release = Releases {
                keys: &keys,
                epoch: 7,
                send_by: Some(send_by),
            };
            m.get_replicas(&[], release).await.unwrap();
            assert_eq!(seen.recv().await.unwrap(), want);
        }
    }

    #[tokio::test]
    async fn a_pooled_connection_the_master_closed_is_not_used() {
        let m = master(&one_call_per_connection().await);
        for i in 0..3 {
            // The connection the last call left in the pool is closed by now.
            assert!(m.list_segments().await.unwrap().is_empty(), "call {i}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
