//! The network fuzzer: mutated and truncated frames of every protocol a master and an owner
//! speak (framed RPC, HTTP/2-looking bytes, the auth hello, the data plane, the same-host socket),
//! many connections at once, with a real client's round trip every so often to show that the
//! servers still serve everyone else.

use std::{path::PathBuf, time::Duration};

use mooncake_common::{
    auth::{Seal, HELLO_MAGIC},
    wire::{self, RequestHeader},
};
use mooncake_proto::framed as rpc_wire;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpStream, UnixStream},
    task::JoinSet,
};

use crate::fuzz::{input, target, Rng};

/// What the fuzzer talks to.
#[derive(Clone)]
pub struct Servers {
    /// The master's RPC port.
    pub master: String,
    /// The owner's data port.
    pub owner: String,
    /// The owner's same-host socket, if it offers one.
    pub socket: Option<PathBuf>,
}

#[derive(Debug, Default)]
pub struct NetReport {
    pub frames: u64,
    pub connections: u64,
    /// Round trips of a real client between bursts, and those that failed (with why).
    pub checks: u64,
    pub failed_checks: Vec<String>,
}

/// Sends about `frames` mutated frames, `parallel` connections at a time, and runs `check` (a
/// real client's round trip) after every `check_every` frames and at the end.
pub async fn fuzz_servers<F, Fut>(
    servers: &Servers,
    frames: u64,
    seed: u64,
    parallel: usize,
    check_every: u64,
    mut check: F,
) -> NetReport
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut rng = Rng::new(seed);
    let mut report = NetReport::default();
    let mut next_check = check_every;
    let mut running = JoinSet::new();
    while report.frames < frames {
        while running.len() < parallel && report.frames < frames {
            let (bytes, n, to) = connection(&mut rng, servers);
            report.frames += n;
            report.connections += 1;
            let read_for = Duration::from_millis(rng.below(30) as u64);
            running.spawn(async move { send(to, bytes, read_for).await });
        }
        let _ = running.join_next().await;
        if report.frames >= next_check {
            next_check += check_every;
            report.checks += 1;
            if let Err(e) = check().await {
                report.failed_checks.push(e);
            }
        }
    }
    while running.join_next().await.is_some() {}
    report.checks += 1;
    if let Err(e) = check().await {
        report.failed_checks.push(e);
    }
    report
}

/// A real client's put and verified get of `key` while the fuzzer runs. The servers must answer:
/// a transport failure or a timeout is a failure, wrong bytes always are. A definite refusal is
/// not: in a cluster without a secret anyone may write anything, and a fuzzed write under a made-up
/// newer grant legitimately fences the range the client's put was given (with a secret, the
/// master's seals refuse such writes).
pub async fn round_trip(
    client: &mooncake_client::Client,
    key: &str,
    len: usize,
) -> Result<(), String> {
    use mooncake_common::Code;
    let answered =
        |e: &mooncake_client::ClientError| !matches!(e.code(), Code::RpcFail | Code::RpcTimeout);
    let value = crate::payload(key, len);
    match client
        .put(key, &value, &mooncake_client::ReplicateConfig::default())
        .await
    {
        Ok(_) => {}
        Err(e) if answered(&e) => return Ok(()),
        Err(e) => return Err(format!("put {key}: {e}")),
    }
    let mut buf = vec![0u8; len];
    match client.get(key, &mut buf).await {
        Ok(n) if n == len && buf == value => Ok(()),
        Ok(_) => Err(format!("get {key}: wrong bytes")),
        Err(e) if answered(&e) => Ok(()),
        Err(e) => Err(format!("get {key}: {e}")),
    }
}

enum To {
    Tcp(String),
    Unix(PathBuf),
}

/// Writes `bytes` (giving up after a second), reads whatever comes back for `read_for`, closes.
async fn send(to: To, bytes: Vec<u8>, read_for: Duration) {
    let go = async {
        match to {
            To::Tcp(addr) => {
                if let Ok(s) = TcpStream::connect(&addr).await {
                    let _ = s.set_nodelay(true);
                    exchange(s, &bytes, read_for).await;
                }
            }
            To::Unix(path) => {
                if let Ok(s) = UnixStream::connect(&path).await {
                    exchange(s, &bytes, read_for).await;
                }
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), go).await;
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, bytes: &[u8], read_for: Duration) {
    if tokio::time::timeout(Duration::from_secs(1), s.write_all(bytes))
        .await
        .is_err()
    {
        return;
    }
    let mut sink = vec![0u8; 64 << 10];
    let _ = tokio::time::timeout(read_for, async {
        while let Ok(n) = s.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// One connection's bytes: how many frames they hold and where they go.
fn connection(rng: &mut Rng, servers: &Servers) -> (Vec<u8>, u64, To) {
    let frames = 1 + rng.below(8) as u64;
    let mut out = Vec::new();
    let to = match rng.below(10) {
        0..=2 => {
            framed(rng, &mut out, frames);
            To::Tcp(servers.master.clone())
        }
        3 => {
            // Something else on the RPC port: HTTP/2's preface and garbage, or random bytes.
            if rng.below(2) == 0 {
                out.extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
            }
            let n = rng.below(512);
            out.extend_from_slice(&rng.bytes(n));
            To::Tcp(servers.master.clone())
        }
        4 => {
            hello(rng, &mut out);
            let to = if rng.below(2) == 0 {
                servers.master.clone()
            } else {
                servers.owner.clone()
            };
            To::Tcp(to)
        }
        5 if servers.socket.is_some() => {
            local(rng, &mut out, frames);
            To::Unix(servers.socket.clone().expect("checked"))
        }
        _ => {
            data_plane(rng, &mut out, frames);
            To::Tcp(servers.owner.clone())
        }
    };
    // Now and then the connection is cut short anywhere.
    if rng.below(5) == 0 && !out.is_empty() {
        let at = rng.below(out.len());
        out.truncate(at);
    }
    (out, frames, to)
}

fn framed(rng: &mut Rng, out: &mut Vec<u8>, frames: u64) {
    let mut hello = rpc_wire::hello().to_vec();
    if rng.below(10) == 0 {
        let i = rng.below(hello.len());
        hello[i] ^= 1 << rng.below(8);
    }
    out.extend_from_slice(&hello);
    let seeds = (target("framed").expect("a target").seeds)();
    for _ in 0..frames {
        let body = input(rng, &seeds);
        let method = rng.below(20) as u32;
        let len = match rng.below(8) {
            0 => u32::MAX as usize,
            1 => rpc_wire::MAX_BODY + 1,
            2 => rpc_wire::MAX_BODY,
            3 => body.len() + rng.below(1 << 20),
            _ => body.len(),
        };
        out.extend_from_slice(&rpc_wire::encode_header(len, method, rng.next_u64()));
        out.extend_from_slice(&body);
    }
}

fn hello(rng: &mut Rng, out: &mut Vec<u8>) {
    let seeds = (target("auth").expect("a target").seeds)();
    let mut b = input(rng, &seeds);
    if rng.below(2) == 0 {
        // Keep the magic so the server takes it for a hello.
        let mut h = HELLO_MAGIC.to_vec();
        h.extend_from_slice(&b);
        b = h;
    }
    out.extend_from_slice(&b);
}

fn local(rng: &mut Rng, out: &mut Vec<u8>, frames: u64) {
    let seeds = (target("local").expect("a target").seeds)();
    for _ in 0..frames {
        let mut f = input(rng, &seeds);
        if rng.below(6) == 0 && f.len() >= 4 {
            // A huge declared length.
            f[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        }
        out.extend_from_slice(&f);
    }
}

fn data_plane(rng: &mut Rng, out: &mut Vec<u8>, frames: u64) {
    for _ in 0..frames {
        let key_len = match rng.below(6) {
            0 => 0,
            1 => 4097,
            2 => rng.below(u16::MAX as usize),
            _ => 1 + rng.below(64),
        } as u16;
        let length = match rng.below(6) {
            0 => u64::MAX,
            1 => wire::MAX_PAYLOAD,
            2 => 1 << 30,
            _ => rng.below(70_000) as u64,
        };
        let op_byte = 1 + rng.below(11) as u8;
        let h = RequestHeader {
            op: mooncake_common::wire::Op::Read,
            key_len,
            flags: rng.next_u64() as u16,
            request_id: rng.next_u64(),
            offset: if rng.below(2) == 0 {
                rng.next_u64()
            } else {
                rng.below(64 << 20) as u64
            },
            length,
            grant: rng.next_u64(),
            seal: if rng.below(2) == 0 {
                Seal::default()
            } else {
                Seal::new(rng.next_u64(), [rng.next_u64() as u8; 16])
            },
        };
        let mut head = h.encode();
        head[3] = op_byte;
        if rng.below(10) == 0 {
            let i = rng.below(head.len());
            head[i] = rng.next_u64() as u8;
        }
        out.extend_from_slice(&head);
        let k = (key_len as usize).min(4200);
        out.extend(std::iter::repeat_n(b'k', k));
        let payload = (length as usize).min(rng.below(80_000));
        let bytes = rng.bytes(payload.min(4096));
        out.extend_from_slice(&bytes);
        out.extend(std::iter::repeat_n(0xAB, payload.saturating_sub(4096)));
    }
}

/// A master and an owner (32 MiB) to fuzz, from the binaries `bin` names, with their logs in
/// `logs` (so panics in them can be counted with `panics_logged`).
pub fn start_servers(
    logs: &std::path::Path,
    bin: impl Fn(&str) -> PathBuf,
) -> (crate::ChildGuard, crate::ChildGuard, Servers) {
    let spawn = |name: &str, log: &str, args: &[&str]| {
        let err = std::fs::File::create(logs.join(log)).expect("a log file");
        crate::ChildGuard::spawn_cmd(
            std::process::Command::new(bin(name))
                .args(args)
                .stderr(std::process::Stdio::from(err)),
        )
    };
    let master = spawn(
        "mooncake_master",
        "master.log",
        &[
            "--rpc_address",
            "127.0.0.1",
            "--rpc_port",
            "0",
            "--metrics_port",
            "0",
        ],
    );
    let line = master.wait_line("mooncake_master ready", Duration::from_secs(20));
    let rpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("rpc="))
        .expect("rpc= in the ready line")
        .to_string();
    let mut owner = spawn(
        "mooncake_ownerd",
        "owner.log",
        &[
            "--master",
            &rpc,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "32MiB",
            "--no-mlock",
        ],
    );
    let line = owner.wait_line("mooncake_ownerd ready", Duration::from_secs(20));
    let segment = line
        .rsplit("segment=")
        .next()
        .expect("a segment")
        .to_string();
    let socket = mooncake_common::local::socket_path(
        &crate::socket_dir(),
        &mooncake_common::SegmentName::parse(&segment).expect("a segment name"),
    );
    // A killed owner cannot remove its same-host socket; the guard does.
    owner.remove_on_drop(socket.clone());
    let servers = Servers {
        master: rpc,
        owner: segment,
        socket: socket.exists().then_some(socket),
    };
    (master, owner, servers)
}

/// Panics the servers `start_servers` started wrote to their logs.
pub fn panics_logged(logs: &std::path::Path) -> usize {
    ["master.log", "owner.log"]
        .iter()
        .map(|l| {
            std::fs::read_to_string(logs.join(l))
                .unwrap_or_default()
                .matches("panicked")
                .count()
        })
        .sum()
}

/// A process's resident memory in KiB (0 if it is gone).
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
