//! What this engine knows of the peers it has reached, by the name the caller gives them: the
//! process behind the name (its pid and host identity, for the same-host path) and its
//! incarnation, a random number every engine draws when it starts.
//!
//! Every request carries the incarnation of the peer as first met under that name, and the peer
//! refuses a request that names another one. A peer that restarted since (a new process behind
//! the same session name, or behind the same etcd name on a new port) has other memory at the
//! addresses the caller knows, so the call fails with `EngineError::Restarted` and moves nothing,
//! where it would otherwise read or write the new process's buffers at stale addresses. The name
//! is then forgotten: the next call meets the new process afresh (by then the caller has looked
//! its buffers up again, from its bootstrap server say).

use std::{collections::HashMap, io, sync::Arc};

use mooncake_common::{
    wire::{self, Op, RequestHeader, ResponseHeader},
    Code,
};
use parking_lot::Mutex;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    time::Instant,
};

use crate::EngineError;

/// The code of a request refused for naming another incarnation: the segments the caller knew
/// of that peer are not found there.
pub const RESTARTED: Code = Code::SegmentNotFound;

/// A peer's answer to `PeerHello`: `pid u64 | incarnation u64 | host identity`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub pid: u64,
    pub incarnation: u64,
    pub identity: Vec<u8>,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.identity.len());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.extend_from_slice(&self.identity);
        out
    }

    fn decode(body: &[u8]) -> io::Result<Hello> {
        if body.len() < 16 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a hello of {} bytes", body.len()),
            ));
        }
        let word = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
        Ok(Hello {
            pid: word(0),
            incarnation: word(8),
            identity: body[16..].to_vec(),
        })
    }
}

/// A fresh incarnation: random, never 0.
pub fn draw_incarnation() -> u64 {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).expect("the OS random source");
        let v = u64::from_le_bytes(b);
        if v != 0 {
            return v;
        }
    }
}

#[derive(Default)]
pub struct Peers {
    known: Mutex<HashMap<String, Arc<Hello>>>,
}

impl Peers {
    /// The peer `name` as first met (at `session`, its current session name), asking it by
    /// `deadline` if this engine has not met it yet.
    pub async fn hello(
        &self,
        name: &str,
        session: &str,
        deadline: Instant,
    ) -> Result<Arc<Hello>, EngineError> {
        if let Some(h) = self.known.lock().get(name) {
            return Ok(h.clone());
        }
        let hello = match tokio::time::timeout_at(deadline, ask(session)).await {
            Ok(Ok(h)) => Arc::new(h),
            Ok(Err(e)) => {
                return Err(EngineError::Invalid(format!(
                    "cannot reach transfer engine {name}: {e}"
                )))
            }
            Err(_) => {
                return Err(EngineError::Invalid(format!(
                    "timed out: transfer engine {name} did not say who it is by the call's \
                     deadline"
                )))
            }
        };
        // Two callers meeting the peer at once keep the first answer.
        Ok(self
            .known
            .lock()
            .entry(name.to_string())
            .or_insert(hello)
            .clone())
    }

    /// The peer `name` as met, if this engine has met it (and not forgotten it since).
    pub fn known(&self, name: &str) -> Option<Arc<Hello>> {
        self.known.lock().get(name).cloned()
    }

    /// Forgets `name` if it is still known as `incarnation` (after that one refused a call).
    pub fn forget(&self, name: &str, incarnation: u64) {
        let mut known = self.known.lock();
        if known
            .get(name)
            .is_some_and(|h| h.incarnation == incarnation)
        {
            known.remove(name);
        }
    }
}

/// Asks the engine at `session` who it is, on a connection of its own.
async fn ask(session: &str) -> io::Result<Hello> {
    let mut s = TcpStream::connect(session).await?;
    s.set_nodelay(true)?;
    match call(&mut s, Op::PeerHello, 0, 0, session, &[]).await? {
        Ok(body) => Hello::decode(&body),
        Err((_, refused)) => Err(io::Error::other(format!("it refused: {refused}"))),
    }
}

/// One request to the engine `target` on `s` (`grant`: the incarnation it must carry, where it
/// must; `flags`: the op's) and its answer's body; a refusal comes back as
/// `Ok(Err((code, message)))`.
pub async fn call(
    s: &mut TcpStream,
    op: Op,
    flags: u16,
    grant: u64,
    target: &str,
    payload: &[u8],
) -> io::Result<Result<Vec<u8>, (i32, String)>> {
    let h = RequestHeader {
        op,
        key_len: target.len() as u16,
        flags,
        request_id: 1,
        offset: 0,
        length: payload.len() as u64,
        grant,
        seal: Default::default(),
    };
    let mut frame = h.encode().to_vec();
    frame.extend_from_slice(target.as_bytes());
    frame.extend_from_slice(payload);
    s.write_all(&frame).await?;
    let mut hb = [0u8; wire::RESPONSE_HEADER_LEN];
    s.read_exact(&mut hb).await?;
    let r =
        ResponseHeader::decode(&hb).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if r.length > 1 << 20 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "answer too long",
        ));
    }
    let mut body = vec![0u8; r.length as usize];
    s.read_exact(&mut body).await?;
    Ok(if r.status == 0 {
        Ok(body)
    } else {
        Err((r.status, String::from_utf8_lossy(&body).into_owned()))
    })
}

/// The error for a peer's refusal of a request: `Restarted` where it names another incarnation.
pub fn refused(target: &str, code: i32, message: &str) -> EngineError {
    if code == RESTARTED.as_i32() {
        EngineError::Restarted {
            target: target.to_string(),
        }
    } else {
        EngineError::Invalid(format!("{target} refused: {message}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_a_short_one_is_refused() {
        let h = Hello {
            pid: 42,
            incarnation: draw_incarnation(),
            identity: b"boot/ns".to_vec(),
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&h.encode()[..15]).is_err());
        assert_ne!(h.incarnation, 0);
    }
}
