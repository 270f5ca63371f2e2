//! A real etcd for tests (Debian's `etcd-server`): one member on free loopback ports, or a
//! cluster of members on hosts of a fault lab (`netns`), each with a data directory of its own,
//! killed and removed when dropped.

use std::{process::Command, time::Duration};

use crate::{
    free_port,
    netns::{Host, Lab},
    ChildGuard, TempDir,
};

pub struct Member {
    /// "ip:port" of the member's client endpoint.
    pub endpoint: String,
    pub guard: ChildGuard,
    _dir: TempDir,
}

pub struct Etcd {
    pub members: Vec<Member>,
}

const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;

fn etcd_bin() -> std::path::PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| {
            p.to_str()?
                .split(':')
                .map(|d| std::path::Path::new(d).join("etcd"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| panic!("etcd not found: install Debian's etcd-server (.ci/run does)"))
}

/// The member's flags: `name` at `ip` with the given ports, in a cluster of `initial`.
fn member_args(
    name: &str,
    dir: &TempDir,
    ip: &str,
    client: u16,
    peer: u16,
    initial: &str,
) -> Vec<String> {
    let client_url = format!("http://{ip}:{client}");
    let peer_url = format!("http://{ip}:{peer}");
    let mut a: Vec<String> = vec!["--name".into(), name.into(), "--data-dir".into()];
    a.push(dir.path().display().to_string());
    for (flag, v) in [
        ("--listen-client-urls", &client_url),
        ("--advertise-client-urls", &client_url),
        ("--listen-peer-urls", &peer_url),
        ("--initial-advertise-peer-urls", &peer_url),
    ] {
        a.push(flag.into());
        a.push(v.clone());
    }
    a.extend(["--initial-cluster".into(), initial.into()]);
    a.extend(["--log-level".into(), "error".into()]);
    // Fast failure detection for the fault tests.
    a.extend([
        "--heartbeat-interval".into(),
        "50".into(),
        "--election-timeout".into(),
        "500".into(),
    ]);
    a
}

async fn wait_healthy(endpoint: &str) {
    let healthy = crate::eventually(Duration::from_secs(30), async || {
        tokio::net::TcpStream::connect(endpoint).await.is_ok()
            && crate::http_get(endpoint, "/health")
                .await
                .1
                .contains("true")
    })
    .await;
    assert!(healthy, "etcd at {endpoint} did not become healthy");
}

impl Etcd {
    /// A one-member etcd on loopback.
    pub async fn start() -> Etcd {
        let dir = TempDir::new("etcd");
        let (client, peer) = (free_port(), free_port());
        let initial = format!("t=http://127.0.0.1:{peer}");
        let args = member_args("t", &dir, "127.0.0.1", client, peer, &initial);
        let guard = ChildGuard::spawn_cmd(
            Command::new(etcd_bin())
                .args(&args)
                .stderr(std::process::Stdio::null()),
        );
        let endpoint = format!("127.0.0.1:{client}");
        wait_healthy(&endpoint).await;
        Etcd {
            members: vec![Member {
                endpoint,
                guard,
                _dir: dir,
            }],
        }
    }

    /// One member on each of `hosts` of `lab`, forming one cluster.
    pub async fn on_hosts(lab: &Lab, hosts: &[&Host]) -> Etcd {
        let initial = hosts
            .iter()
            .map(|h| format!("{}=http://{}:{PEER_PORT}", h.name, h.ip))
            .collect::<Vec<_>>()
            .join(",");
        let bin = etcd_bin();
        let mut members = Vec::new();
        for h in hosts {
            let dir = TempDir::new("etcd");
            let args = member_args(&h.name, &dir, &h.ip, CLIENT_PORT, PEER_PORT, &initial);
            // etcd logs raft chatter to stderr whatever the level: keep it out of test output.
            let guard = ChildGuard::spawn_cmd(
                lab.command(h, &bin)
                    .args(&args)
                    .stderr(std::process::Stdio::null()),
            );
            members.push(Member {
                endpoint: format!("{}:{CLIENT_PORT}", h.ip),
                guard,
                _dir: dir,
            });
        }
        for m in &members {
            wait_healthy(&m.endpoint).await;
        }
        Etcd { members }
    }

    /// The first member's endpoint.
    pub fn endpoint(&self) -> &str {
        &self.members[0].endpoint
    }

    /// Every member's endpoint, "a;b;c".
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| m.endpoint.as_str())
            .collect::<Vec<_>>()
            .join(";")
    }

    /// The master address that follows this etcd's elected master.
    pub fn master_url(&self) -> String {
        format!("etcd://{}", self.endpoints())
    }
}
