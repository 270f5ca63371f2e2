//! What this engine knows of the peers it has reached, by the name the caller gives them: the
//! process behind the name (its pid and host identity, for the same-host path) and its
//! incarnation, a random number every engine draws when it starts.
//!
//! Every request carries the incarnation of the peer as first met under that name, and the peer
//! refuses a request that names another one. A peer that restarted since (a new process behind
//! the same session name, or behind the same etcd name on a new port) has other memory at the
//! addresses the caller knows, so the call fails with `EngineError::Restarted` and moves nothing,
//! where it would otherwise read or write the new process's buffers at stale addresses. The name
//! is then marked restarted, not forgotten: a caller that retries with the addresses it has
//! would otherwise meet the new process and write at them (allocations often come back at the
//! same place, so they pass its region check). Calls to the name keep failing as restarted until
//! the caller looks the peer's buffers up again (`Requester::peer_regions`), which meets the new
//! process.

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

/// What this engine knows of a peer's name.
#[derive(Debug, Clone)]
pub enum Known {
    /// The process met under the name.
    Met(Arc<Hello>),
    /// The process met under the name refused a call as restarted: every call fails so until
    /// the caller looks the peer's buffers up again (`Peers::meet`).
    Restarted,
}

impl Known {
    /// The process met, or the refusal of a call to a restarted one.
    pub fn hello(&self, name: &str) -> Result<Arc<Hello>, EngineError> {
        match self {
            Known::Met(h) => Ok(h.clone()),
            Known::Restarted => Err(EngineError::Restarted {
                target: name.to_string(),
            }),
        }
    }
}

#[derive(Default)]
pub struct Peers {
    known: Mutex<HashMap<String, Known>>,
}

impl Peers {
    /// The peer `name` as first met (at `session`, its current session name), asking it by
    /// `deadline` if this engine has not met it yet; `Restarted` once it refused a call as such.
    pub async fn hello(
        &self,
        name: &str,
        session: &str,
        deadline: Instant,
    ) -> Result<Arc<Hello>, EngineError> {
        if let Some(k) = self.known.lock().get(name) {
            return k.hello(name);
        }
        let hello = Arc::new(asked(name, session, deadline).await?);
        // Two callers meeting the peer at once keep the first answer (or a restart marked
        // meanwhile).
        self.known
            .lock()
            .entry(name.to_string())
            .or_insert(Known::Met(hello))
            .hello(name)
    }

    /// Meets the peer `name` at `session` afresh, whatever was known of it, and clears a restart
    /// mark: for a caller about to learn its buffers, whose addresses are then this process's.
    pub async fn meet(
        &self,
        name: &str,
        session: &str,
        deadline: Instant,
    ) -> Result<Arc<Hello>, EngineError> {
        let hello = Arc::new(asked(name, session, deadline).await?);
        self.met_as(name, hello.clone());
        Ok(hello)
    }

    /// Records `name` as met as `hello`.
    fn met_as(&self, name: &str, hello: Arc<Hello>) {
        self.known
            .lock()
            .insert(name.to_string(), Known::Met(hello));
    }

    /// What this engine knows of `name`, if it met it.
    pub fn known(&self, name: &str) -> Option<Known> {
        self.known.lock().get(name).cloned()
    }

    /// Marks `name` restarted if it is still known as `incarnation` (after that one refused a
    /// call as restarted); a name met afresh since keeps its newer process.
    pub fn restarted(&self, name: &str, incarnation: u64) {
        let mut known = self.known.lock();
        if let Some(k) = known.get_mut(name) {
            if matches!(k, Known::Met(h) if h.incarnation == incarnation) {
                *k = Known::Restarted;
            }
        }
    }
}

/// The answer of the peer `name` at `session` to `PeerHello`, by `deadline`.
async fn asked(name: &str, session: &str, deadline: Instant) -> Result<Hello, EngineError> {
    match tokio::time::timeout_at(deadline, ask(session)).await {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(e)) => Err(EngineError::Invalid(format!(
            "cannot reach transfer engine {name}: {e}"
        ))),
        Err(_) => Err(EngineError::Invalid(format!(
            "timed out: transfer engine {name} did not say who it is by the call's deadline"
        ))),
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
    use std::time::Duration;

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

    fn met(incarnation: u64) -> Arc<Hello> {
        Arc::new(Hello {
            pid: 1,
            incarnation,
            identity: Vec::new(),
        })
    }

    /// A name whose process refused a call as restarted stays refused (it is not met afresh by
    /// the next call, whose addresses are the old process's) until met again on purpose; a
    /// refusal for an older incarnation does not mark the newer one.
    #[tokio::test]
    async fn a_restarted_peer_stays_refused_until_met_again() {
        let peers = Peers::default();
        let name = "127.0.0.1:7002";
        // Nothing listens there: a call that asked the peer would fail as unreachable.
        let (session, deadline) = ("127.0.0.1:1", Instant::now() + Duration::from_secs(2));
        peers.met_as(name, met(1));
        peers.restarted(name, 1);
        for _ in 0..2 {
            let e = peers.hello(name, session, deadline).await.unwrap_err();
            assert!(matches!(e, EngineError::Restarted { .. }), "{e}");
            assert!(e.to_string().contains("looked up again"), "{e}");
            assert!(matches!(peers.known(name), Some(Known::Restarted)));
        }
        peers.met_as(name, met(2));
        peers.restarted(name, 1);
        assert_eq!(
            peers
                .hello(name, session, deadline)
                .await
                .unwrap()
                .incarnation,
            2
        );
        peers.restarted(name, 2);
        assert!(peers.hello(name, session, deadline).await.is_err());
    }
}
