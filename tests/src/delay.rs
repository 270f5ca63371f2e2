//! Delay on a host's link where the kernel has no netem (`tc qdisc ... netem` answers "Specified
//! qdisc kind is unknown"): a relay inside the host's network namespace that every new TCP
//! connection to one port of the host is redirected through (iptables REDIRECT, in the host),
//! holding each chunk the host sends back for the delay before passing it on, as netem on the
//! host's egress would. What the peer sends reaches the host at once.
//!
//! The relay runs on a thread of the test process that entered the namespace (setns), so its
//! sockets live there; it stops, and its connections close, when the `DelayRelay` is dropped.

use std::{net::SocketAddr, thread::JoinHandle, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{mpsc, oneshot},
    time::Instant,
};

pub struct DelayRelay {
    /// The port the relay listens on, inside the namespace.
    pub port: u16,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl DelayRelay {
    /// A relay in namespace `ns` (a name under /var/run/netns) passing connections on to
    /// `target` and delaying what `target` sends back by `delay`.
    pub fn start(ns: &str, target: SocketAddr, delay: Duration) -> DelayRelay {
        let path = format!("/var/run/netns/{ns}");
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::spawn(move || {
            enter_namespace(&path);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the delay relay");
            rt.block_on(async move {
                let listener = TcpListener::bind("0.0.0.0:0").await.expect("relay bind");
                let port = listener.local_addr().expect("relay address").port();
                port_tx.send(port).expect("the starter waits for the port");
                tokio::select! {
                    _ = stopped => {}
                    _ = accept_loop(listener, target, delay) => {}
                }
            });
            // Dropping the runtime cancels every connection's tasks and closes their sockets.
        });
        let port = port_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the delay relay did not start");
        DelayRelay {
            port,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Moves the calling thread into the network namespace at `path`.
fn enter_namespace(path: &str) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("cannot open {path}: {e}"));
    use std::os::fd::AsRawFd;
    // SAFETY: setns on a namespace file descriptor we hold open; it only changes this thread's
    // network namespace, which is what the relay thread is for.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns({path}): {}", std::io::Error::last_os_error());
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, delay: Duration) {
    while let Ok((peer, _)) = listener.accept().await {
        tokio::spawn(async move {
            if let Ok(host) = TcpStream::connect(target).await {
                relay(peer, host, delay).await;
            }
        });
    }
}

/// Relays one connection until either side closes it.
async fn relay(peer: TcpStream, host: TcpStream, delay: Duration) {
    let _ = peer.set_nodelay(true);
    let _ = host.set_nodelay(true);
    let (mut peer_rx, mut peer_tx) = peer.into_split();
    let (mut host_rx, mut host_tx) = host.into_split();
    let forward = async {
        let _ = tokio::io::copy(&mut peer_rx, &mut host_tx).await;
        let _ = host_tx.shutdown().await;
    };
    // Chunks the host sent, each with the instant it may go on.
    let (chunks_tx, mut chunks_rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read_back = async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = host_rx.read(&mut buf).await {
            if n == 0
                || chunks_tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    };
    let write_back = async move {
        while let Some((due, chunk)) = chunks_rx.recv().await {
            tokio::time::sleep_until(due).await;
            if peer_tx.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = peer_tx.shutdown().await;
    };
    tokio::join!(forward, read_back, write_back);
}
