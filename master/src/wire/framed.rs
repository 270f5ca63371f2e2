//! The framed RPC adapter on the master's RPC port (see `mooncake_proto::framed`): the same
//! calls as gRPC, from plain length-prefixed frames. The hot batch calls read their keys
//! borrowed from the frame and encode the answer straight from the service's results; the cold
//! ones decode the message and go through the gRPC adapter's handlers. Connections are told
//! apart from gRPC ones by their first bytes, so one port serves both.

use std::{future::Future, io, time::Duration};

use mooncake_common::master_api::Releases;
use mooncake_proto::{
    framed::{self as rpc_wire, fields, keys, replicas::Encoder, Method},
    master::{self as pb, master_server::Master},
};
use prost::Message;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufStream},
    sync::watch,
};
use tonic::{Request, Response, Status};

use super::{
    code, code_and_message,
    grpc::{self, GrpcMaster},
    replica_ref, replicate_config,
};
use crate::service::{Caller, MasterService};

/// Whether a connection whose first bytes are `peeked` speaks the framed RPC.
pub fn is_framed(peeked: &[u8]) -> bool {
    peeked.starts_with(&rpc_wire::MAGIC)
}

/// Serves one framed connection until the peer closes it or `stop` turns true. Requests are
/// answered in order; a frame that started must arrive within `frame_timeout`.
pub async fn serve<S: AsyncRead + AsyncWrite + Send + Unpin>(
    stream: S,
    svc: GrpcMaster,
    identity: Option<String>,
    frame_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> io::Result<()> {
    // One buffered stream both ways: requests and answers alternate, so no split is needed.
    let mut s = BufStream::with_capacity(64 << 10, 64 << 10, stream);
    let mut hello = [0u8; rpc_wire::HELLO_LEN];
    tokio::time::timeout(frame_timeout, s.read_exact(&mut hello)).await??;
    rpc_wire::check_hello(&hello).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    s.write_all(&rpc_wire::hello()).await?;
    s.flush().await?;
    let identity = identity.as_deref();
    let mut caller = Caller::resolve(identity, None)
        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))?;
    let mut body = Vec::new();
    loop {
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        tokio::select! {
            r = s.read_exact(&mut h[..1]) => { if r.is_err() { return Ok(()); } }
            _ = stop.changed() => return Ok(()),
        }
        let frame = async {
            s.read_exact(&mut h[1..]).await?;
            let (len, method, id) = rpc_wire::decode_header(&h)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            mooncake_common::body::read_body(&mut s, len, &mut body).await?;
            Ok::<_, io::Error>((method, id))
        };
        let (method, id) = tokio::time::timeout(frame_timeout, frame)
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "peer did not finish a frame")
            })??;
        let (status, out) = match Method::from_u32(method) {
            Some(_) if !svc.0.leading() => (
                rpc_wire::STATUS_UNAVAILABLE,
                crate::server::NOT_LEADING.as_bytes().to_vec(),
            ),
            Some(Method::UseTenant) => {
                let declared = String::from_utf8_lossy(&body);
                match Caller::resolve(identity, Some(&declared)) {
                    Ok(c) => {
                        caller = c;
                        (rpc_wire::STATUS_OK, Vec::new())
                    }
                    Err(e) => (status_of(&e), e.to_string().into_bytes()),
                }
            }
            Some(m) => match dispatch(&svc, &caller, m, &body).await {
                // A call that waited (a put start waits for offloads) across the lease's lapse:
                // its answer may come from a deposed term, so it is not given.
                _ if !svc.0.leading() => (
                    rpc_wire::STATUS_UNAVAILABLE,
                    crate::server::NOT_LEADING.as_bytes().to_vec(),
                ),
                answer => answer,
            },
            None => (
                rpc_wire::STATUS_BAD_REQUEST,
                format!("unknown method {method}").into_bytes(),
            ),
        };
        let (status, out) = if out.len() > rpc_wire::MAX_BODY {
            (
                rpc_wire::STATUS_BAD_REQUEST,
                format!(
                    "the answer of {} bytes exceeds the frame limit of {}: ask for fewer keys per call",
                    out.len(),
                    rpc_wire::MAX_BODY
                )
                .into_bytes(),
            )
        } else {
            (status, out)
        };
        // A peer that stops reading its answers does not keep this task (and the state it
        // holds) past the frame timeout, nor past a stop.
        let answer = async {
            s.write_all(&rpc_wire::encode_header(out.len(), status as u32, id))
                .await?;
            s.write_all(&out).await?;
            s.flush().await
        };
        tokio::select! {
            r = tokio::time::timeout(frame_timeout, answer) => r.map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "peer did not read its answer")
            })??,
            _ = stop.changed() => return Ok(()),
        }
    }
}

/// Answers a framed connection that did not authenticate where the master requires it: the
/// hello, then its first request with `STATUS_UNAUTHENTICATED` and the reason, then closes.
pub async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    timeout: Duration,
) -> io::Result<()> {
    let (mut r, mut w) = tokio::io::split(stream);
    let exchange = async {
        let mut hello = [0u8; rpc_wire::HELLO_LEN];
        r.read_exact(&mut hello).await?;
        w.write_all(&rpc_wire::hello()).await?;
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        r.read_exact(&mut h).await?;
        let (len, _, id) = rpc_wire::decode_header(&h)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        // Read the request (when small) so that closing does not reset the connection before
        // the peer has read the answer.
        if len <= 1 << 20 {
            mooncake_common::body::read_new_body(&mut r, len).await?;
        }
        let why = mooncake_common::auth::AUTH_REQUIRED.as_bytes();
        w.write_all(&rpc_wire::encode_header(
            why.len(),
            rpc_wire::STATUS_UNAUTHENTICATED as u32,
            id,
        ))
        .await?;
        w.write_all(why).await?;
        w.flush().await
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
}

/// The framed status of a refused call.
fn status_of(e: &crate::error::MasterError) -> i32 {
    match e.code() {
        mooncake_common::Code::PermissionDenied => rpc_wire::STATUS_DENIED,
        _ => rpc_wire::STATUS_BAD_REQUEST,
    }
}

async fn call<Req, Resp, F, Fut>(caller: &Caller, body: &[u8], f: F) -> (i32, Vec<u8>)
where
    Req: Message + Default,
    Resp: Message,
    F: FnOnce(Request<Req>) -> Fut,
    Fut: Future<Output = Result<Response<Resp>, Status>>,
{
    let req = match Req::decode(body) {
        Ok(r) => r,
        Err(e) => return bad_request(e),
    };
    let mut req = Request::new(req);
    req.extensions_mut().insert(caller.clone());
    match f(req).await {
        Ok(resp) => (rpc_wire::STATUS_OK, resp.into_inner().encode_to_vec()),
        Err(s) if s.code() == tonic::Code::PermissionDenied => {
            (rpc_wire::STATUS_DENIED, s.message().as_bytes().to_vec())
        }
        Err(s) if s.code() == tonic::Code::InvalidArgument => (
            rpc_wire::STATUS_BAD_REQUEST,
            s.message().as_bytes().to_vec(),
        ),
        Err(s) => (rpc_wire::STATUS_INTERNAL, s.message().as_bytes().to_vec()),
    }
}

fn bad_request(e: impl std::fmt::Display) -> (i32, Vec<u8>) {
    (
        rpc_wire::STATUS_BAD_REQUEST,
        format!("cannot decode the request: {e}").into_bytes(),
    )
}

/// A request that is a list of (key, put id) (`repeated PutRef items`), keys borrowed from the
/// frame, answered with a code per item.
fn by_refs(
    body: &[u8],
    answer: impl FnOnce(&[(&str, u64)]) -> Vec<Result<(), crate::error::MasterError>>,
) -> (i32, Vec<u8>) {
    let refs = match keys::decode_keyed(body, fields::PUT_REFS, &[], |_, _| Ok(())) {
        Ok(refs) => refs,
        Err(e) => return bad_request(e),
    };
    if let Err(e) = super::batch_size(refs.len(), "puts") {
        return bad_request(e.0);
    }
    // `BatchPutEndResponse` and `BatchPutRevokeResponse` are both `repeated int32 codes`.
    let codes = answer(&refs).iter().map(code).collect();
    (
        rpc_wire::STATUS_OK,
        pb::BatchPutEndResponse { codes }.encode_to_vec(),
    )
}

/// `BatchPutStart`: items borrowed from the frame, the config merged as protobuf merges
/// repeated occurrences of a message field, the answer encoded straight from the grants.
async fn put_start(svc: &MasterService, caller: &Caller, body: &[u8]) -> (i32, Vec<u8>) {
    let mut config: Option<pb::ReplicateConfig> = None;
    let items = keys::decode_keyed(
        body,
        fields::put_start_request::ITEMS,
        &[fields::put_start_request::CONFIG],
        |field, bytes| {
            if field == fields::put_start_request::CONFIG {
                config
                    .get_or_insert_with(Default::default)
                    .merge(bytes)
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        },
    );
    let items = match items {
        Ok(items) => items,
        Err(e) => return bad_request(e),
    };
    if let Err(e) = super::batch_size(items.len(), "puts") {
        return bad_request(e.0);
    }
    let token = match keys::decode_u64(body, fields::put_start_request::TOKEN) {
        Ok(t) => t,
        Err(e) => return bad_request(e),
    };
    let results = match replicate_config(config) {
        Ok(config) => svc.put_start(caller, &items, &config, token).await,
        Err(e) => svc.refuse_put_start(items.len(), &e),
    };
    let mut enc = Encoder::with_capacity(results.len() * 48);
    for r in &results {
        let (code, message) = code_and_message(r);
        match r {
            Ok(g) => enc.put_start_result(code, "", g.put_id, g.replicas.iter().map(replica_ref)),
            Err(_) => enc.put_start_result(code, &message, 0, std::iter::empty()),
        }
    }
    let out = enc.finish_put_start();
    if out.len() > rpc_wire::MAX_BODY {
        // The answer cannot go out, so nobody would write or end these puts: given up now,
        // not left as puts in flight (each key refused as "already exists") until the discard
        // timeout.
        let granted: Vec<(&str, u64)> = items
            .iter()
            .zip(&results)
            .filter_map(|(&(k, _), r)| Some((k, r.as_ref().ok()?.put_id)))
            .collect();
        svc.put_revoke(caller, &granted);
    }
    (rpc_wire::STATUS_OK, out)
}

/// `BatchGetReplicas`: keys borrowed from the frame, the answer encoded straight from the
/// state (no message structs, no `String` per replica).
fn get_replicas(svc: &MasterService, caller: &Caller, body: &[u8]) -> (i32, Vec<u8>) {
    let (keys, release, release_epoch) = match keys_and_release(body) {
        Ok(k) => k,
        Err(e) => return bad_request(e),
    };
    let release = Releases::of(&release, release_epoch);
    let mut enc = Encoder::with_capacity(keys.len() * 48);
    // The keys found (each leased), in case the answer cannot go out.
    let mut leased_keys = Vec::new();
    let mut next = keys.iter();
    let leased = svc.get_replicas(caller, &keys, release, |found| {
        let code = code(&found);
        let key = next.next().expect("one answer per key");
        match found {
            Ok((size, replicas)) => {
                leased_keys.push(*key);
                enc.result(code, size, replicas.iter().map(replica_ref))
            }
            Err(_) => enc.result(code, 0, std::iter::empty()),
        }
    });
    let out = enc.finish(grpc::millis(leased.ttl), leased.epoch);
    if out.len() > rpc_wire::MAX_BODY {
        // Refused for its size (see `serve`): nobody reads these keys, so their holds go back.
        svc.release_leases(caller, Releases::of(&leased_keys, leased.epoch));
    }
    (rpc_wire::STATUS_OK, out)
}

/// A lookup's or existence check's keys, the holds it hands back, and their epoch.
fn keys_and_release(body: &[u8]) -> Result<(Vec<&str>, Vec<&str>, u64), String> {
    let keys = keys::decode_strings(body, fields::KEYS)?;
    let release = keys::decode_strings(body, fields::RELEASE)?;
    super::batch_size(keys.len(), "keys").map_err(|e| e.0)?;
    super::batch_size(release.len(), "holds handed back").map_err(|e| e.0)?;
    Ok((
        keys,
        release,
        keys::decode_u64(body, fields::RELEASE_EPOCH)?,
    ))
}

async fn dispatch(grpc: &GrpcMaster, caller: &Caller, m: Method, body: &[u8]) -> (i32, Vec<u8>) {
    let svc = &*grpc.0;
    match m {
        Method::MountSegment => {
            call::<pb::MountSegmentRequest, _, _, _>(caller, body, |r| grpc.mount_segment(r)).await
        }
        Method::UnmountSegment => {
            call::<pb::UnmountSegmentRequest, _, _, _>(caller, body, |r| grpc.unmount_segment(r))
                .await
        }
        Method::Heartbeat => {
            call::<pb::HeartbeatRequest, _, _, _>(caller, body, |r| grpc.heartbeat(r)).await
        }
        Method::BatchPutStart => put_start(svc, caller, body).await,
        Method::BatchPutEnd => by_refs(body, |refs| svc.put_end(caller, refs)),
        Method::BatchPutRevoke => by_refs(body, |refs| svc.put_revoke(caller, refs)),
        Method::BatchGetReplicas => get_replicas(svc, caller, body),
        Method::BatchExists => match keys_and_release(body) {
            Ok((keys, release, epoch)) => {
                let release = Releases::of(&release, epoch);
                (
                    rpc_wire::STATUS_OK,
                    grpc::exists(svc, caller, &keys, release).encode_to_vec(),
                )
            }
            Err(e) => bad_request(e),
        },
        Method::BatchRemove => {
            call::<pb::BatchRemoveRequest, _, _, _>(caller, body, |r| grpc.batch_remove(r)).await
        }
        Method::RemoveAll => {
            call::<pb::RemoveAllRequest, _, _, _>(caller, body, |r| grpc.remove_all(r)).await
        }
        Method::ListSegments => {
            call::<pb::ListSegmentsRequest, _, _, _>(caller, body, |r| grpc.list_segments(r)).await
        }
        Method::CreateReplicaTask => {
            call::<pb::CreateReplicaTaskRequest, _, _, _>(caller, body, |r| {
                grpc.create_replica_task(r)
            })
            .await
        }
        Method::QueryTask => {
            call::<pb::QueryTaskRequest, _, _, _>(caller, body, |r| grpc.query_task(r)).await
        }
        Method::AbandonPutStart => {
            call::<pb::AbandonPutStartRequest, _, _, _>(caller, body, |r| grpc.abandon_put_start(r))
                .await
        }
        Method::BatchReleaseLeases => {
            call::<pb::BatchReleaseLeasesRequest, _, _, _>(caller, body, |r| {
                grpc.batch_release_leases(r)
            })
            .await
        }
        Method::BatchReplicaClear => {
            call::<pb::BatchReplicaClearRequest, _, _, _>(caller, body, |r| {
                grpc.batch_replica_clear(r)
            })
            .await
        }
        // Answered by the connection's loop; never dispatched.
        Method::UseTenant => (
            rpc_wire::STATUS_INTERNAL,
            b"UseTenant reached the dispatcher".to_vec(),
        ),
    }
}
