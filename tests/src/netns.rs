//! A small lab of "hosts" on one machine, for fault tests that need real partitions: each host is
//! a network namespace with its own address on a bridge (veth pairs), made and removed by the
//! test as root with iproute2; processes run inside with `ip netns exec`; a link is cut both ways
//! with iptables in the hosts at its ends. The test process stays in the root namespace and
//! reaches every host through the bridge's address.

use std::{
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use crate::{delay::DelayRelay, ChildGuard};

/// Runs a command that sets the lab up or down; panics with its output if it fails.
fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e} (install iproute2 and iptables)"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `run` inside namespace `ns`.
fn run_in(ns: &str, args: &[&str]) {
    let mut all = vec!["ip", "netns", "exec", ns];
    all.extend_from_slice(args);
    run(&all);
}

/// Whether this process may build a lab (root, with `ip` and `iptables`).
pub fn available() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("network namespaces need root".into());
    }
    for tool in [["ip", "-V"], ["iptables", "--version"]] {
        let ok = Command::new(tool[0])
            .arg(tool[1])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err(format!(
                "{} is missing (install iproute2 and iptables)",
                tool[0]
            ));
        }
    }
    Ok(())
}

pub struct Host {
    pub name: String,
    pub ns: String,
    pub ip: String,
    /// The host's end of its veth pair.
    dev: String,
}

pub struct Lab {
    id: u32,
    bridge: String,
    /// The root namespace's address on the bridge.
    pub gateway: String,
    hosts: Vec<String>,
    next: u8,
}

impl Lab {
    pub fn new() -> Lab {
        available().unwrap_or_else(|e| panic!("the fault lab cannot run here: {e}"));
        static SEQ: AtomicU32 = AtomicU32::new(0);
        // Unique per process and lab, short enough for interface names (15 bytes).
        let id = (std::process::id() % 4000) * 16 + SEQ.fetch_add(1, Ordering::Relaxed) % 16;
        let bridge = format!("mcb{id}");
        let subnet = format!("10.{}.{}", 100 + id / 256 % 100, id % 256);
        let gateway = format!("{subnet}.1");
        // A leftover of a killed run with the same id goes first.
        let _ = Command::new("ip").args(["link", "del", &bridge]).output();
        run(&["ip", "link", "add", &bridge, "type", "bridge"]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{gateway}/24"),
            "dev",
            &bridge,
        ]);
        run(&["ip", "link", "set", &bridge, "up"]);
        Lab {
            id,
            bridge,
            gateway,
            hosts: Vec::new(),
            next: 2,
        }
    }

    fn subnet(&self) -> String {
        self.gateway.rsplit_once('.').expect("dotted").0.to_string()
    }

    /// A new host on the bridge.
    pub fn host(&mut self, name: &str) -> Host {
        let k = self.next;
        self.next += 1;
        let ns = format!("mc{}-{name}", self.id);
        let (outer, inner) = (format!("mcv{}x{k}", self.id), format!("mci{}x{k}", self.id));
        let dev = "eth0".to_string();
        let ip = format!("{}.{k}", self.subnet());
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        run(&["ip", "netns", "add", &ns]);
        self.hosts.push(ns.clone());
        run(&[
            "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]);
        run(&["ip", "link", "set", &inner, "netns", &ns]);
        run(&["ip", "link", "set", &outer, "master", &self.bridge]);
        run(&["ip", "link", "set", &outer, "up"]);
        run_in(&ns, &["ip", "link", "set", &inner, "name", &dev]);
        run_in(
            &ns,
            &["ip", "addr", "add", &format!("{ip}/24"), "dev", &dev],
        );
        run_in(&ns, &["ip", "link", "set", &dev, "up"]);
        run_in(&ns, &["ip", "link", "set", "lo", "up"]);
        run_in(
            &ns,
            &["ip", "route", "add", "default", "via", &self.gateway],
        );
        Host {
            name: name.to_string(),
            ns,
            ip,
            dev,
        }
    }

    /// A command that runs `bin` (a path) inside `host`.
    pub fn command(&self, host: &Host, bin: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &host.ns]).arg(bin);
        c
    }

    /// Starts `bin` with `args` inside `host`.
    pub fn spawn(&self, host: &Host, bin: &std::path::Path, args: &[&str]) -> ChildGuard {
        ChildGuard::spawn_cmd(self.command(host, bin).args(args))
    }

    /// Drops every packet between `host` and `peer_ip`, both ways.
    pub fn cut(&self, host: &Host, peer_ip: &str) {
        Self::drop_rules(host, peer_ip, "-I");
    }

    /// Undoes `cut`.
    pub fn heal(&self, host: &Host, peer_ip: &str) {
        Self::drop_rules(host, peer_ip, "-D");
    }

    /// Inserts (`-I`) or deletes (`-D`) the rules dropping traffic with `peer_ip`.
    fn drop_rules(host: &Host, peer_ip: &str, action: &str) {
        for (chain, dir) in [("INPUT", "-s"), ("OUTPUT", "-d")] {
            run_in(
                &host.ns,
                &["iptables", action, chain, dir, peer_ip, "-j", "DROP"],
            );
        }
    }

    /// Delays what `host` sends by `ms` until the returned guard is dropped: every packet
    /// leaving it (netem), or, where the kernel has no netem, what it sends on new connections
    /// to its TCP `port` (a relay in the host, see `delay`).
    pub fn delay(&self, host: &Host, port: u16, ms: u32) -> Delay {
        let netem = [
            "tc", "qdisc", "add", "dev", &host.dev, "root", "netem", "delay",
        ];
        let ok = Command::new("ip")
            .args(["netns", "exec", &host.ns])
            .args(netem)
            .arg(format!("{ms}ms"))
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Delay {
                ns: host.ns.clone(),
                undo: vec!["tc", "qdisc", "del", "dev", &host.dev, "root"]
                    .into_iter()
                    .map(String::from)
                    .collect(),
                relay: None,
            };
        }
        let target = format!("{}:{port}", host.ip).parse().expect("an address");
        let relay = DelayRelay::start(
            &host.ns,
            target,
            std::time::Duration::from_millis(ms.into()),
        );
        let rule = |action: &str| -> Vec<String> {
            let (port, to) = (port.to_string(), relay.port.to_string());
            [
                "iptables",
                "-t",
                "nat",
                action,
                "PREROUTING",
                "-p",
                "tcp",
                "--dport",
                &port,
                "-j",
                "REDIRECT",
                "--to-ports",
                &to,
            ]
            .into_iter()
            .map(String::from)
            .collect()
        };
        let add = rule("-A");
        run_in(
            &host.ns,
            &add.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        Delay {
            ns: host.ns.clone(),
            undo: rule("-D"),
            relay: Some(relay),
        }
    }
}

/// A delay on a host's link (see `Lab::delay`); removed when dropped.
pub struct Delay {
    ns: String,
    undo: Vec<String>,
    relay: Option<DelayRelay>,
}

impl Delay {
    /// How the delay is made, for the table: "netem" or "relay".
    pub fn how(&self) -> &'static str {
        if self.relay.is_some() {
            "relay"
        } else {
            "netem"
        }
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .args(&self.undo)
            .output();
        self.relay.take();
    }
}

impl Default for Lab {
    fn default() -> Self {
        Lab::new()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth end and the peer with it.
        for ns in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}
