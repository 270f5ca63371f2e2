//! Reading a replica from another owner's data plane, for a copy task: one request on a fresh
//! connection, the value checked against the object's version by the owner that serves it (a
//! range that holds another key or version is refused there, never sent).

use std::time::Duration;

use mooncake_common::{
    auth::{authenticate, Credential, Seal},
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code, ObjectKey, SegmentName,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// The longest refusal message read from a peer.
const MAX_REFUSAL: u64 = 64 << 10;

/// What a copy reads: `size` bytes of version `put_id` of `key`, from memory at `offset` of the
/// owner at `segment`, or from that owner's SSD tier.
pub struct PeerRead<'a> {
    pub segment: &'a SegmentName,
    pub key: &'a ObjectKey,
    pub put_id: u64,
    pub offset: u64,
    pub size: u64,
    pub from_disk: bool,
    /// Proved on the connection (the peer refuses one without it when it has a keyring).
    pub credential: Option<&'a Credential>,
    /// The seal on this read (this owner's own, as a holder of the cluster's secret).
    pub seal: Seal,
}

/// Why a peer read failed: the code for the master and a message for people.
pub type PeerError = (Code, String);

/// Reads the value, within `deadline` for the whole exchange.
pub async fn read(r: PeerRead<'_>, deadline: Duration) -> Result<Vec<u8>, PeerError> {
    match tokio::time::timeout(deadline, exchange(&r)).await {
        Ok(res) => res,
        Err(_) => Err((
            Code::RpcTimeout,
            format!(
                "reading {} from {} took longer than {deadline:?}",
                r.key, r.segment
            ),
        )),
    }
}

async fn exchange(r: &PeerRead<'_>) -> Result<Vec<u8>, PeerError> {
    let io = |e: std::io::Error| (Code::TransferFail, format!("{}: {e}", r.segment));
    let mut stream = TcpStream::connect(r.segment.as_str()).await.map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    // The whole exchange, proof included, runs under the caller's deadline.
    if let Some(credential) = r.credential {
        authenticate(&mut stream, credential)
            .await
            .map_err(|e| (e.code(), format!("{}: {e}", r.segment)))?;
    }
    let op = if r.from_disk { Op::ReadDisk } else { Op::Read };
    let header = RequestHeader {
        op,
        key_len: r.key.as_str().len() as u16,
        flags: 0,
        request_id: 1,
        offset: r.offset,
        length: r.size,
        grant: r.put_id,
        seal: r.seal,
    };
    let mut request = header.encode().to_vec();
    request.extend_from_slice(r.key.as_str().as_bytes());
    stream.write_all(&request).await.map_err(io)?;
    let mut head = [0u8; wire::RESPONSE_HEADER_LEN];
    stream.read_exact(&mut head).await.map_err(io)?;
    let answer = ResponseHeader::decode(&head)
        .map_err(|e| (Code::TransferFail, format!("{}: {e}", r.segment)))?;
    if answer.status != 0 {
        // A refusal's message is a line of text: a peer claiming more is not trusted with an
        // allocation of its size (the connection is dropped after this read anyway).
        let mut message = vec![0u8; answer.length.min(MAX_REFUSAL) as usize];
        stream.read_exact(&mut message).await.map_err(io)?;
        return Err((
            answer.code(),
            format!(
                "{} refused the read: {}",
                r.segment,
                String::from_utf8_lossy(&message)
            ),
        ));
    }
    if answer.length != r.size {
        return Err((
            Code::TransferFail,
            format!(
                "{} sent {} bytes of {}, expected {}",
                r.segment, answer.length, r.key, r.size
            ),
        ));
    }
    let mut value = vec![0u8; r.size as usize];
    stream.read_exact(&mut value).await.map_err(io)?;
    Ok(value)
}
