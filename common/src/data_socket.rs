//! Socket options of every data-plane connection (store owners, clients, transfer engines), set in
//! one place so that both ends of a transfer agree.
//!
//! - No Nagle delay: a request or answer header goes out at once.
//! - A fixed, modest send buffer (`SEND_BUFFER`). With the kernel's autotuning a bulk sender's
//!   buffer grows to `tcp_wmem`'s maximum (4 MiB by default), so megabytes sit between the two
//!   copies every TCP byte costs: they leave the CPU caches before the receiver copies them out.
//!   Measured on loopback here (2 cores, 16 MiB L3; transfer engine, 16 x 4 MiB batches, medians
//!   of 15): reads 4.3 GiB/s with autotuning against 5.0-5.1 with a 1 MiB send buffer;
//!   256 KiB and 2 MiB did worse than 1 MiB. Between hosts 1 MiB in flight per connection still
//!   carries 10 GB/s at a 100 us round trip, and a batch spreads over several connections.
//! - Within one host (a loopback peer, or a peer at this socket's own address), congestion control
//!   `cubic` (`SAME_HOST_CONGESTION`) whatever the system default is. There is no link to pace
//!   for on loopback, and a pacing algorithm such as `bbr` (the default on some distributions and
//!   VMs) still paces: timers and small bursts on the sending core, which on loopback also runs
//!   the receiver's protocol work. Measured here (2 cores, system default `bbr`, kvbench over
//!   TCP, 3 interleaved rounds, medians): gets 5-35 % faster with `cubic` on both ends (256 KiB
//!   x8 2.58 -> 2.94 GiB/s, 4 MiB x32 3.94 -> 5.31), puts the same to 20 % faster. Between hosts
//!   the system's choice stands. Where `cubic` is not allowed (`tcp_allowed_congestion_control`),
//!   the connection keeps the default.
//! - TCP keepalive (`KEEPALIVE`): a server waits for a peer's next request without a deadline,
//!   so a peer whose host died, or whose flow a NAT or firewall dropped silently, would keep its
//!   connection (a task, a socket, its buffers) for ever, and enough of them the port's file
//!   descriptors. Probed after a minute idle, such a connection ends within two.

use std::io;

use socket2::SockRef;
use tokio::net::TcpStream;

/// What is asked of the kernel for a data connection's send buffer; Linux doubles it (for its
/// bookkeeping), so the buffer holds 1 MiB.
pub const SEND_BUFFER: usize = 512 << 10;

/// Idle time before the first keepalive probe, the time between probes, and how many go
/// unanswered before the kernel ends the connection (see the module docs).
pub const KEEPALIVE: (std::time::Duration, std::time::Duration, u32) = (
    std::time::Duration::from_secs(60),
    std::time::Duration::from_secs(10),
    6,
);

/// Congestion control of connections within one host (see the module docs).
pub const SAME_HOST_CONGESTION: &[u8] = b"cubic";

/// Sets a freshly connected or accepted data-plane stream's options (see the module docs).
pub fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    sock.set_send_buffer_size(SEND_BUFFER)?;
    keepalive(stream)?;
    if same_host(stream) {
        if let Err(e) = sock.set_tcp_congestion(SAME_HOST_CONGESTION) {
            // Not built or not allowed here: the default serves, only slower.
            tracing::debug!(error = %e, "same-host data connection keeps the default congestion control");
        }
    }
    Ok(())
}

/// Turns on TCP keepalive (`KEEPALIVE`) on a connection a server waits on without a deadline:
/// data connections, and the master's RPC connections (see the module docs).
pub fn keepalive(stream: &TcpStream) -> io::Result<()> {
    let (idle, interval, probes) = KEEPALIVE;
    SockRef::from(stream).set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(probes),
    )
}

/// Whether an idle connection is still usable: its peer has not closed it and sent nothing
/// nobody asked for (which would leave the stream out of step). Never waits. Asks the socket
/// itself: tokio's `try_read` answers "would block" without a system call while the runtime has
/// not yet seen the connection readable, and a close the I/O driver has not processed yet
/// passed as open.
pub fn idle_and_open(stream: &impl std::os::fd::AsFd) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match SockRef::from(stream).peek(&mut byte) {
        Ok(_) => false,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
    }
}

/// Whether the peer is this host: a loopback address, or the socket's own address.
pub fn same_host(stream: &TcpStream) -> bool {
    match (stream.local_addr(), stream.peer_addr()) {
        (Ok(local), Ok(peer)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A close is seen at once, even before the runtime's I/O driver ran (a current-thread
    /// runtime busy elsewhere).
    #[tokio::test(flavor = "current_thread")]
    async fn a_closed_idle_connection_is_seen_before_the_driver_runs() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
        assert!(idle_and_open(&client));
        drop(server);
        // No await between the close and the check: the driver has not run.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!idle_and_open(&client), "the peer closed it");
    }

    /// The same for the same-host path's Unix sockets, where tokio's `try_read` (used before)
    /// answered "would block" for a socket its driver had not seen readable since its last
    /// check, so a connection the owner closed passed as open.
    #[tokio::test(flavor = "current_thread")]
    async fn a_unix_socket_close_is_seen_at_once() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        assert!(idle_and_open(&ours));
        let mut byte = [0u8; 1];
        assert!(ours.try_read(&mut byte).is_err(), "would block");
        drop(theirs);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!idle_and_open(&ours), "the peer closed it");
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let std_theirs = theirs.into_std().unwrap();
        (&std_theirs).write_all(b"x").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        assert!(!idle_and_open(&ours), "bytes nobody asked for");
    }

    /// (And keepalive: a dead peer's connection ends instead of being held for ever.)
    #[tokio::test]
    async fn both_ends_get_the_send_buffer_and_no_delay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
        for s in [&client, &server] {
            let before = SockRef::from(s).send_buffer_size().unwrap();
            tune(s).unwrap();
            assert!(s.nodelay().unwrap());
            let sock = SockRef::from(s);
            assert!(sock.keepalive().unwrap(), "keepalive on");
            assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE.0);
            assert_eq!(sock.tcp_keepalive_interval().unwrap(), KEEPALIVE.1);
            assert_eq!(sock.tcp_keepalive_retries().unwrap(), KEEPALIVE.2);
            let after = SockRef::from(s).send_buffer_size().unwrap();
            // Linux reports twice what was asked; autotuning no longer changes it.
            assert!(
                (SEND_BUFFER..=2 * SEND_BUFFER).contains(&after),
                "{before} -> {after}"
            );
        }
    }

    #[tokio::test]
    async fn a_loopback_connection_runs_cubic_where_the_kernel_allows_it() {
        let sysctl = |name: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).unwrap_or_default()
        };
        let allowed = sysctl("tcp_allowed_congestion_control");
        let default = sysctl("tcp_congestion_control");
        // Allowed to every process, or available and this one may set any (CAP_NET_ADMIN, as
        // root): a probe socket says which.
        let probe =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let expected = if probe.set_tcp_congestion(SAME_HOST_CONGESTION).is_ok() {
            SAME_HOST_CONGESTION
        } else {
            default.trim().as_bytes()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
        for s in [&client, &server] {
            tune(s).unwrap();
            let now = SockRef::from(s).tcp_congestion().unwrap();
            let now = now.split(|b| *b == 0).next().unwrap_or_default();
            assert_eq!(
                String::from_utf8_lossy(now),
                String::from_utf8_lossy(expected),
                "allowed: {allowed:?}, default: {default:?}"
            );
        }
    }
}
