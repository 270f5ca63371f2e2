//! Single small transfers from a thread that waits for them anyway (the binding's synchronous
//! calls): plain blocking sockets, the request in one write, and a short spin on the answer
//! before sleeping in the kernel, so that the reply of a 4 KiB write is picked up in the
//! microseconds it takes to arrive instead of after a wake-up through the runtime.

use std::{
    io::{self, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use mooncake_common::wire::{self, Op, RequestHeader, ResponseHeader};

use crate::{idle::IdleConns, peers, EngineError};

/// Transfers at most this long take this path.
pub const MAX: u64 = 64 << 10;
/// How long to poll for the answer before blocking.
const SPIN: Duration = Duration::from_micros(40);

/// Which way one small transfer goes, with its local bytes.
pub enum Dir<'a> {
    Write(&'a [u8]),
    Read(&'a mut [u8]),
}

pub struct Small {
    timeout: Duration,
    idle: IdleConns<TcpStream>,
}

impl Small {
    pub fn new(timeout: Duration) -> Self {
        Small {
            timeout,
            idle: IdleConns::default(),
        }
    }

    fn fail(target: &str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Invalid(format!("transfer with {target} failed: {e}"))
    }

    /// Moves one range: `Dir::Write` sends its bytes to `remote` of `target` (met as
    /// `incarnation`), `Dir::Read` fills its buffer from there; all of it, a connection made
    /// included, by `deadline` (the call's, at most the transfer timeout from now).
    pub fn transfer(
        &self,
        target: &str,
        incarnation: u64,
        remote: u64,
        mut dir: Dir<'_>,
        deadline: Instant,
    ) -> Result<(), EngineError> {
        let deadline = deadline.min(Instant::now() + self.timeout);
        let exchange = Exchange {
            target,
            incarnation,
            remote,
        };
        let pooled = self.idle.take(target);
        let (mut s, reused) = match pooled {
            Some(s) => (s, true),
            None => (
                self.connect(target, deadline)
                    .map_err(|e| Self::fail(target, e))?,
                false,
            ),
        };
        let mut outcome = exchange.run(&mut s, &mut dir, deadline);
        let closed = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionAborted
            )
        };
        if reused && outcome.as_ref().is_err_and(closed) {
            // An idle connection the peer closed meanwhile (it restarted, say): once more on a
            // fresh one, under the same deadline. Both directions are idempotent.
            s = self
                .connect(target, deadline)
                .map_err(|e| Self::fail(target, e))?;
            outcome = exchange.run(&mut s, &mut dir, deadline);
        }
        match outcome {
            Ok(Ok(())) => {
                self.idle.put(target, s);
                Ok(())
            }
            // Refused: the stream is at a frame boundary and stays usable.
            Ok(Err((code, refused))) => {
                self.idle.put(target, s);
                Err(peers::refused(target, code, &refused))
            }
            Err(e) => Err(Self::fail(target, e)),
        }
    }

    fn connect(&self, target: &str, deadline: Instant) -> io::Result<TcpStream> {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(target)?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the transfer's deadline passed before it could connect",
            ));
        }
        let s = TcpStream::connect_timeout(&addr, left)?;
        s.set_nodelay(true)?;
        s.set_write_timeout(Some(self.timeout))?;
        Ok(s)
    }
}

/// One small transfer's request: to whom, met as which incarnation, and where.
struct Exchange<'a> {
    target: &'a str,
    incarnation: u64,
    remote: u64,
}

impl Exchange<'_> {
    /// Sends the request and takes the answer; a refusal comes back as `Ok(Err((code,
    /// message)))`, the stream still at a frame boundary.
    fn run(
        &self,
        s: &mut TcpStream,
        dir: &mut Dir<'_>,
        deadline: Instant,
    ) -> io::Result<Result<(), (i32, String)>> {
        let (target, remote) = (self.target, self.remote);
        let (op, len) = match dir {
            Dir::Write(d) => (Op::PeerWrite, d.len()),
            Dir::Read(d) => (Op::PeerRead, d.len()),
        };
        let h = RequestHeader {
            op,
            key_len: target.len() as u16,
            flags: 0,
            request_id: 1,
            offset: remote,
            length: len as u64,
            grant: self.incarnation,
            seal: Default::default(),
        };
        let mut frame = Vec::with_capacity(wire::REQUEST_HEADER_LEN + target.len() + len);
        frame.extend_from_slice(&h.encode());
        frame.extend_from_slice(target.as_bytes());
        if let Dir::Write(d) = dir {
            frame.extend_from_slice(d);
        }
        s.write_all(&frame)?;
        let mut hb = [0u8; wire::RESPONSE_HEADER_LEN];
        read_spinning(s, &mut hb, deadline)?;
        let r = ResponseHeader::decode(&hb)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if r.status != 0 {
            let mut msg = vec![0u8; r.length.min(wire::MAX_ERROR_MESSAGE) as usize];
            read_spinning(s, &mut msg, deadline)?;
            return Ok(Err((r.status, String::from_utf8_lossy(&msg).into_owned())));
        }
        let expect = if op == Op::PeerWrite { 0 } else { len as u64 };
        if r.length != expect || r.op != op {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an answer of {} bytes to a {op:?} of {len}", r.length),
            ));
        }
        if let Dir::Read(d) = dir {
            read_spinning(s, d, deadline)?;
        }
        Ok(Ok(()))
    }
}

/// Fills `buf`: polls without blocking for a short while, then blocks until `deadline`.
fn read_spinning(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    let spin_until = Instant::now() + SPIN;
    s.set_nonblocking(true)?;
    while got < buf.len() && Instant::now() < spin_until {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    s.set_nonblocking(false)?;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer did not answer in time",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not answer in time",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
