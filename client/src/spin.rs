//! Waiting for an answer due within microseconds without going to sleep.
//!
//! A reply from the master or an owner on the same network is usually back within tens of
//! microseconds. A thread that parks in `epoll_wait` for it lets its CPU go idle, and waking an
//! idle CPU (an interrupt to a halted core, on a VM an exit to the hypervisor) costs as much as
//! the work itself. So the caller first polls the socket for a short, bounded time, and only then
//! hands the wait to the runtime. The spin is per wait and capped (`ClientConfig::master_spin`), so
//! it costs at most that much CPU per round trip; zero turns it off.

use std::{
    io::{self, Read},
    time::{Duration, Instant},
};

use socket2::SockRef;
use tokio::net::TcpStream;

/// Reads what `stream` has into `buf` without blocking, polling again until something arrives or
/// `spin` has passed. `Ok(Some(0))` is end of stream; `Ok(None)` means nothing arrived in time.
pub(crate) fn read_now(
    stream: &TcpStream,
    buf: &mut [u8],
    spin: Duration,
) -> io::Result<Option<usize>> {
    if buf.is_empty() {
        return Ok(Some(0));
    }
    let sock = SockRef::from(stream);
    let mut started: Option<Instant> = None;
    loop {
        // The socket is non-blocking (tokio set it so): this returns at once.
        match (&*sock).read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        let t0 = *started.get_or_insert_with(Instant::now);
        if spin.is_zero() || t0.elapsed() >= spin {
            return Ok(None);
        }
        std::hint::spin_loop();
    }
}
