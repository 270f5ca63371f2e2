//! The framed RPC on the master's RPC port (see `mooncake_common::rpc_wire`): the same service
//! methods as gRPC, decoded from plain length-prefixed frames. Connections are told apart from
//! gRPC ones by their first bytes, so one port serves both.

use std::{future::Future, io, sync::Arc, time::Duration};

use mooncake_common::{
    pbkeys,
    rpc_wire::{self, Method},
};
use mooncake_proto::master::{self as pb, master_server::Master};
use prost::Message;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter},
    net::TcpStream,
    sync::watch,
};
use tonic::{Request, Response, Status};

use crate::service::MasterService;

/// Whether a connection whose first bytes are `peeked` speaks the framed RPC.
pub fn is_framed(peeked: &[u8]) -> bool {
    peeked.starts_with(&rpc_wire::MAGIC)
}

/// Serves one framed connection until the peer closes it or `stop` turns true. Requests are
/// answered in order; a frame that started must arrive within `frame_timeout`.
pub async fn serve(
    stream: TcpStream,
    svc: Arc<MasterService>,
    frame_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let mut r = BufReader::with_capacity(64 << 10, r);
    let mut w = BufWriter::with_capacity(64 << 10, w);
    let mut hello = [0u8; rpc_wire::HELLO_LEN];
    tokio::time::timeout(frame_timeout, r.read_exact(&mut hello)).await??;
    rpc_wire::check_hello(&hello).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    w.write_all(&rpc_wire::hello()).await?;
    w.flush().await?;
    let mut body = Vec::new();
    loop {
        let mut h = [0u8; rpc_wire::HEADER_LEN];
        tokio::select! {
            r = r.read_exact(&mut h[..1]) => { if r.is_err() { return Ok(()); } }
            _ = stop.changed() => return Ok(()),
        }
        let frame = async {
            r.read_exact(&mut h[1..]).await?;
            let (len, method, id) = rpc_wire::decode_header(&h)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            body.resize(len, 0);
            r.read_exact(&mut body).await?;
            Ok::<_, io::Error>((method, id))
        };
        let (method, id) = tokio::time::timeout(frame_timeout, frame)
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "peer did not finish a frame")
            })??;
        let (status, out) = match Method::from_u32(method) {
            Some(m) => dispatch(&svc, m, &body).await,
            None => (
                rpc_wire::STATUS_BAD_REQUEST,
                format!("unknown method {method}").into_bytes(),
            ),
        };
        w.write_all(&rpc_wire::encode_header(out.len(), status as u32, id))
            .await?;
        w.write_all(&out).await?;
        w.flush().await?;
    }
}

async fn call<Req, Resp, F, Fut>(body: &[u8], f: F) -> (i32, Vec<u8>)
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
    match f(Request::new(req)).await {
        Ok(resp) => (rpc_wire::STATUS_OK, resp.into_inner().encode_to_vec()),
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

/// A request that is a list of (key, put id) (`repeated PutRef items = 1`), keys borrowed from
/// the frame, answered by `answer`.
fn by_refs(body: &[u8], answer: impl FnOnce(&[(&str, u64)]) -> Vec<u8>) -> (i32, Vec<u8>) {
    match pbkeys::decode_keyed(body, 1, |_, _| Ok(())) {
        Ok(refs) => (rpc_wire::STATUS_OK, answer(&refs)),
        Err(e) => bad_request(e),
    }
}

async fn dispatch(svc: &MasterService, m: Method, body: &[u8]) -> (i32, Vec<u8>) {
    match m {
        Method::MountSegment => {
            call::<pb::MountSegmentRequest, _, _, _>(body, |r| svc.mount_segment(r)).await
        }
        Method::UnmountSegment => {
            call::<pb::UnmountSegmentRequest, _, _, _>(body, |r| svc.unmount_segment(r)).await
        }
        Method::Heartbeat => {
            call::<pb::HeartbeatRequest, _, _, _>(body, |r| svc.heartbeat(r)).await
        }
        Method::BatchPutStart => {
            // Items borrowed from the frame; the config (field 2) merged as protobuf merges
            // repeated occurrences of a message field.
            let mut config: Option<pb::ReplicateConfig> = None;
            let items = pbkeys::decode_keyed(body, 1, |field, bytes| {
                if field == 2 {
                    config
                        .get_or_insert_with(Default::default)
                        .merge(bytes)
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            });
            match items {
                Ok(items) => (
                    rpc_wire::STATUS_OK,
                    svc.put_start_encoded(&items, config).await,
                ),
                Err(e) => bad_request(e),
            }
        }
        Method::BatchPutEnd => by_refs(body, |refs| {
            pb::BatchPutEndResponse {
                codes: svc.put_end_refs(refs),
            }
            .encode_to_vec()
        }),
        Method::BatchPutRevoke => by_refs(body, |refs| {
            pb::BatchPutRevokeResponse {
                codes: svc.put_revoke_refs(refs),
            }
            .encode_to_vec()
        }),
        Method::BatchGetReplicas => match pbkeys::decode_strings(body, 1) {
            Ok(keys) => (rpc_wire::STATUS_OK, svc.get_replicas_encoded(&keys)),
            Err(e) => bad_request(e),
        },
        Method::BatchExists => match pbkeys::decode_strings(body, 1) {
            Ok(keys) => (rpc_wire::STATUS_OK, svc.exists_strs(&keys).encode_to_vec()),
            Err(e) => bad_request(e),
        },
        Method::BatchRemove => {
            call::<pb::BatchRemoveRequest, _, _, _>(body, |r| svc.batch_remove(r)).await
        }
        Method::RemoveAll => {
            call::<pb::RemoveAllRequest, _, _, _>(body, |r| svc.remove_all(r)).await
        }
        Method::ListSegments => {
            call::<pb::ListSegmentsRequest, _, _, _>(body, |r| svc.list_segments(r)).await
        }
    }
}
