//! A real etcd for tests (Debian's `etcd-server`): one member on free loopback ports with a data
//! directory of its own, killed and removed when dropped.

use std::{process::Command, time::Duration};

use crate::{free_port, ChildGuard, TempDir};

pub struct Etcd {
    /// "127.0.0.1:port" of the client endpoint.
    pub endpoint: String,
    // Dropped in order: the process first, then its directory.
    _child: ChildGuard,
    _dir: TempDir,
}

impl Etcd {
    /// Starts a one-member etcd and waits until it serves.
    pub async fn start() -> Etcd {
        let bin = which("etcd").unwrap_or_else(|| {
            panic!("etcd not found: install Debian's etcd-server (.ci/run does)")
        });
        let dir = TempDir::new("etcd");
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = ChildGuard::spawn_cmd(
            Command::new(bin)
                .args(["--name", "t", "--data-dir"])
                .arg(dir.path())
                .args(["--listen-client-urls", &client_url])
                .args(["--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("t={peer_url}")])
                .args(["--log-level", "error"])
                .stderr(std::process::Stdio::null()),
        );
        let endpoint = format!("127.0.0.1:{client}");
        let healthy = crate::eventually(Duration::from_secs(20), async || {
            tokio::net::TcpStream::connect(&endpoint).await.is_ok()
                && crate::http_get(&endpoint, "/health")
                    .await
                    .1
                    .contains("true")
        })
        .await;
        assert!(healthy, "etcd at {endpoint} did not become healthy");
        Etcd {
            endpoint,
            _child: child,
            _dir: dir,
        }
    }

    /// The master address that follows this etcd's elected master.
    pub fn master_url(&self) -> String {
        format!("etcd://{}", self.endpoint)
    }
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.is_file())
}
