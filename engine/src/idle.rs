//! Idle connections kept per peer for the next call. A peer that restarts comes back under
//! another session name (a new port), so the connections to the old one would stay open (the
//! peer closed its end) for the life of the engine: whenever a peer not seen before is added,
//! the connections their peers closed are dropped. The names stay (a few bytes each), so that
//! a peer whose connections are all out on loan is not taken for a new one.

use std::{collections::HashMap, io};

use parking_lot::Mutex;

/// A connection that can tell, without waiting, whether its peer closed it.
pub trait Probe {
    /// False once the peer closed its end (or sent bytes nobody asked for, which leaves the
    /// stream out of step).
    fn is_open(&self) -> bool;
}

impl Probe for std::net::TcpStream {
    fn is_open(&self) -> bool {
        let mut byte = [0u8; 1];
        if self.set_nonblocking(true).is_err() {
            return false;
        }
        let peeked = self.peek(&mut byte);
        let restored = self.set_nonblocking(false).is_ok();
        restored && matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Probe for tokio::net::TcpStream {
    fn is_open(&self) -> bool {
        mooncake_common::data_socket::idle_and_open(self)
    }
}

pub struct IdleConns<S> {
    by_peer: Mutex<HashMap<String, Vec<S>>>,
}

impl<S> Default for IdleConns<S> {
    fn default() -> Self {
        IdleConns {
            by_peer: Mutex::new(HashMap::new()),
        }
    }
}

impl<S: Probe> IdleConns<S> {
    /// An idle connection to `peer` that is still open, if one is kept (those the peer closed
    /// meanwhile go: a peer restarted on the same address would fail the call on them).
    pub fn take(&self, peer: &str) -> Option<S> {
        loop {
            let conn = self.by_peer.lock().get_mut(peer).and_then(Vec::pop)?;
            if conn.is_open() {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` for the next call to `peer`.
    pub fn put(&self, peer: &str, conn: S) {
        let mut by_peer = self.by_peer.lock();
        if let Some(conns) = by_peer.get_mut(peer) {
            conns.push(conn);
            return;
        }
        for conns in by_peer.values_mut() {
            conns.retain(Probe::is_open);
        }
        by_peer.insert(peer.to_string(), vec![conn]);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn count<S>(idle: &IdleConns<S>) -> usize {
        idle.by_peer.lock().values().map(Vec::len).sum()
    }

    /// Gives the close of `peer`'s `i`th kept connection time to arrive (on loopback at once,
    /// but a test must not race it).
    fn wait_closed(idle: &IdleConns<TcpStream>, peer: &str, i: usize) {
        let probe = idle.by_peer.lock()[peer][i].try_clone().unwrap();
        for _ in 0..100 {
            if !probe.is_open() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A connection to a listener on loopback, with the listener's end.
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let near = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (far, _) = listener.accept().unwrap();
        (near, far)
    }

    #[test]
    fn a_new_peer_sweeps_out_the_connections_closed_by_theirs() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let idle = IdleConns::default();
        let (gone, gone_far) = pair(&listener);
        let (kept, _kept_far) = pair(&listener);
        idle.put("peer-a:1", gone);
        idle.put("peer-b:1", kept);
        drop(gone_far);
        // Until a peer not seen before comes, nothing is looked at.
        let (again, _again_far) = pair(&listener);
        idle.put("peer-b:1", again);
        assert_eq!(count(&idle), 3);
        wait_closed(&idle, "peer-a:1", 0);
        let (new, _new_far) = pair(&listener);
        idle.put("peer-c:1", new);
        assert_eq!(count(&idle), 3, "the closed connection went");
        assert!(idle.take("peer-a:1").is_none());
        // A peer whose connections were all taken stays known (a new one would sweep again).
        assert!(idle.by_peer.lock().contains_key("peer-a:1"));
        assert!(idle.take("peer-b:1").is_some_and(|s| s.is_open()));
        assert!(idle.take("peer-c:1").is_some());
    }

    /// A connection the peer closed is never handed out: the next one kept is, or none.
    #[test]
    fn a_closed_connection_is_not_taken() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let idle = IdleConns::default();
        let (open, _open_far) = pair(&listener);
        let (closed, closed_far) = pair(&listener);
        idle.put("peer:1", open);
        idle.put("peer:1", closed);
        drop(closed_far);
        wait_closed(&idle, "peer:1", 1);
        assert!(idle.take("peer:1").is_some_and(|s| s.is_open()));
        assert!(idle.take("peer:1").is_none());
    }
}
