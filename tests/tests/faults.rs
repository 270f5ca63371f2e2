//! The multi-host fault suite: etcd, two HA masters and two owners, each on a "host" of its own
//! (a network namespace on a bridge), and a client in the root namespace running a mixed put/get
//! load while a fault is injected: the leader killed, the leader cut off from etcd, the leader
//! paused for three lease TTLs, an owner cut off from the client mid-batch, one of three etcd
//! members down, the standby watching from an etcd member cut off from its cluster, 50 ms of delay on an owner's link (netem, or where the kernel has none a relay in
//! the owner's host that holds back what it sends). Each asserts that no call outlived its
//! deadline, that no get returned a wrong byte, and that every object whose put ended OK is read
//! back exactly afterwards (all owners survive these faults). Each prints a row of the table
//! `scripts/faults` collects; that script runs the same cases with a longer load
//! (FAULTS_LOAD_SECS) and ten failovers (FAULTS_FAILOVERS).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_tests::{
    bin_path,
    etcd::Etcd,
    netns::{Host, Lab},
    payload, ChildGuard,
};

const CLUSTER: &str = "faults";
const TTL_SECS: u64 = 2;
const SIZE: usize = 16 << 10;
/// No call may take longer: a put is a put start, the writes and a put end, each under its own
/// deadline (5 s RPC, 2 s transfer), plus a leader change.
const HANG: Duration = Duration::from_secs(15);
/// Objects a load commits at most, well below what the owners hold (2 x 256 MiB), so nothing is
/// evicted and every committed object must still be there; past it the load only reads.
const BUDGET: usize = 12_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn load_secs() -> u64 {
    env_u64("FAULTS_LOAD_SECS", 6)
}

struct World {
    // Dropped last: the lab removes the namespaces once every process in them is gone.
    lab: Lab,
    etcd: Etcd,
    etcd_hosts: Vec<Host>,
    masters: Vec<(Host, Option<ChildGuard>)>,
    /// Each owner's host, process and segment name (its data address).
    owners: Vec<(Host, ChildGuard, String)>,
    client: Client,
}

impl World {
    async fn start(etcd_members: usize) -> World {
        let mut lab = Lab::new();
        let etcd_hosts: Vec<Host> = (0..etcd_members)
            .map(|i| lab.host(&format!("etcd{i}")))
            .collect();
        let etcd = Etcd::on_hosts(&lab, &etcd_hosts.iter().collect::<Vec<_>>()).await;
        let mut masters = Vec::new();
        for i in 0..2 {
            let h = lab.host(&format!("m{i}"));
            let g = spawn_master(&lab, &h, &etcd);
            let line = if i == 0 {
                "mooncake_master ready"
            } else {
                "mooncake_master standby leader="
            };
            g.wait_line(line, Duration::from_secs(30));
            masters.push((h, Some(g)));
        }
        let url = etcd.master_url();
        let owner_bin = bin_path("mooncake_ownerd");
        let mut owners = Vec::new();
        for i in 0..2 {
            let h = lab.host(&format!("o{i}"));
            let g = lab.spawn(
                &h,
                &owner_bin,
                &[
                    "--master",
                    &url,
                    "--cluster-id",
                    CLUSTER,
                    "--host",
                    &h.ip,
                    "--port",
                    "0",
                    "--segment-size",
                    "256MiB",
                    "--no-mlock",
                    "--no-shm",
                    "--heartbeat-interval",
                    "200ms",
                ],
            );
            let ready = g.wait_line("mooncake_ownerd ready", Duration::from_secs(30));
            let segment = ready
                .split_once("segment=")
                .expect("the ready line names the segment")
                .1
                .trim()
                .to_string();
            owners.push((h, g, segment));
        }
        let client = Client::connect(ClientConfig {
            cluster_id: CLUSTER.into(),
            rpc_timeout: Duration::from_secs(5),
            transfer_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            shared_memory: false,
            ..ClientConfig::new(&url)
        })
        .await
        .unwrap();
        World {
            lab,
            etcd,
            etcd_hosts,
            masters,
            owners,
            client,
        }
    }

    /// The index of the master that leads now (by asking etcd through a fresh lookup).
    async fn leader(&self) -> usize {
        let lookup = mooncake_common::leader::LeaderLookup::new(
            self.etcd
                .members
                .iter()
                .map(|m| m.endpoint.clone())
                .collect(),
            CLUSTER,
            Duration::from_secs(2),
        );
        for _ in 0..200 {
            if let Ok(l) = lookup.leader().await {
                if let Some(i) = self
                    .masters
                    .iter()
                    .position(|(h, _)| l.address.starts_with(&format!("{}:", h.ip)))
                {
                    return i;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no leader elected");
    }

    fn master(&mut self, i: usize) -> &mut ChildGuard {
        self.masters[i].1.as_mut().expect("running")
    }

    /// Starts master `i` again (after it was killed); it stands by.
    fn restart_master(&mut self, i: usize) {
        let g = spawn_master(&self.lab, &self.masters[i].0, &self.etcd);
        g.wait_line("mooncake_master standby leader=", Duration::from_secs(30));
        self.masters[i].1 = Some(g);
    }
}

fn spawn_master(lab: &Lab, h: &Host, etcd: &Etcd) -> ChildGuard {
    let eps = etcd.endpoints();
    let ttl = TTL_SECS.to_string();
    lab.spawn(
        h,
        &bin_path("mooncake_master"),
        &[
            "--enable_ha",
            "--etcd_endpoints",
            &eps,
            "--cluster_id",
            CLUSTER,
            "--ha_lease_ttl",
            &ttl,
            "--rpc_address",
            &h.ip,
            "--rpc_port",
            "50051",
            "--metrics_port",
            "9003",
        ],
    )
}

/// What a load saw.
#[derive(Default)]
struct Tally {
    calls: u64,
    /// (operation, code) -> count.
    errors: BTreeMap<(&'static str, i32), u64>,
    wrong_bytes: u64,
    worst: Duration,
    committed: Vec<String>,
    /// Keys whose put failed: put again afterwards, each must succeed or find the object there.
    failed_puts: Vec<String>,
}

/// Puts fresh keys and gets committed ones, in batches of 8, until `until`. Puts are spread over
/// the whole load (the budget is reached only at its end), so a fault meets writes too.
async fn load(client: &Client, tag: &str, until: Instant, tally: &Mutex<Tally>) {
    let start = Instant::now();
    let span = until
        .saturating_duration_since(start)
        .as_secs_f64()
        .max(0.001);
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let allowed = (BUDGET as f64 * start.elapsed().as_secs_f64() / span) as usize;
        if tally.lock().unwrap().committed.len() <= allowed {
            put_batch(client, tag, n, tally).await;
        }
        get_batch(client, n, tally).await;
    }
}

async fn put_batch(client: &Client, tag: &str, n: u64, tally: &Mutex<Tally>) {
    let keys: Vec<String> = (0..8).map(|i| format!("{tag}/{n}/{i}")).collect();
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| payload(k, SIZE)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|k| k.as_str())
        .zip(vals.iter().map(|v| v.as_slice()))
        .collect();
    let t = Instant::now();
    let res = client.batch_put(&items, &ReplicateConfig::default()).await;
    let took = t.elapsed();
    let mut s = tally.lock().unwrap();
    s.calls += 1;
    s.worst = s.worst.max(took);
    for (k, r) in keys.iter().zip(&res) {
        match r {
            Ok(_) => s.committed.push(k.clone()),
            Err(e) => {
                *s.errors.entry(("put", e.code().as_i32())).or_default() += 1;
                s.failed_puts.push(k.clone());
            }
        }
    }
}

async fn get_batch(client: &Client, n: u64, tally: &Mutex<Tally>) {
    let sample: Vec<String> = {
        let s = tally.lock().unwrap();
        let c = &s.committed;
        (0..8.min(c.len()))
            .map(|i| c[(n as usize * 7 + i * 13) % c.len()].clone())
            .collect()
    };
    if sample.is_empty() {
        return;
    }
    let refs: Vec<&str> = sample.iter().map(|k| k.as_str()).collect();
    let mut bufs: Vec<Vec<u8>> = sample.iter().map(|_| vec![0u8; SIZE]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let t = Instant::now();
    let res = client.batch_get(&refs, &mut slices).await;
    let took = t.elapsed();
    let mut s = tally.lock().unwrap();
    s.calls += 1;
    s.worst = s.worst.max(took);
    for (i, r) in res.iter().enumerate() {
        match r {
            Ok(len) if *len == SIZE && bufs[i] == payload(&sample[i], SIZE) => {}
            Ok(_) => s.wrong_bytes += 1,
            Err(e) => *s.errors.entry(("get", e.code().as_i32())).or_default() += 1,
        }
    }
}

/// Runs two loads for `load_secs()` while `fault` runs, then checks every committed object.
async fn under_load<F: std::future::Future<Output = String>>(w: &World, name: &str, fault: F) {
    let until = Instant::now() + Duration::from_secs(load_secs());
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let (tag_a, tag_b) = (format!("{name}/a"), format!("{name}/b"));
    let (_, _, note) = tokio::join!(
        load(&w.client, &tag_a, until, &tally),
        load(&w.client, &tag_b, until, &tally),
        fault,
    );
    // A put that failed during the fault, put again: it succeeds, or finds the object stored
    // (its bytes landed before the failure); either way the object then reads back exactly.
    let retried = std::mem::take(&mut tally.lock().unwrap().failed_puts);
    for k in &retried {
        let mut outcome = w
            .client
            .put(k, &payload(k, SIZE), &ReplicateConfig::default())
            .await;
        // While the cluster settles a retry may itself meet a retryable code.
        for _ in 0..20 {
            match &outcome {
                Err(e) if e.code().is_retryable() => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    outcome = w
                        .client
                        .put(k, &payload(k, SIZE), &ReplicateConfig::default())
                        .await;
                }
                _ => break,
            }
        }
        assert!(outcome.is_ok(), "{name}: putting {k} again: {outcome:?}");
        tally.lock().unwrap().committed.push(k.clone());
    }
    // Afterwards every committed object reads back exactly (retried within the deadline while
    // the cluster settles).
    let committed = tally.lock().unwrap().committed.clone();
    let mut lost = 0u64;
    for chunk in committed.chunks(64) {
        let refs: Vec<&str> = chunk.iter().map(|k| k.as_str()).collect();
        let mut bufs: Vec<Vec<u8>> = chunk.iter().map(|_| vec![0u8; SIZE]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let res = w.client.batch_get(&refs, &mut slices).await;
        for (i, r) in res.iter().enumerate() {
            match r {
                Ok(_) if bufs[i] == payload(&chunk[i], SIZE) => {}
                Ok(_) => tally.lock().unwrap().wrong_bytes += 1,
                Err(e) => {
                    eprintln!("{name}: committed {} unreadable: {e}", chunk[i]);
                    lost += 1;
                }
            }
        }
    }
    let s = tally.lock().unwrap();
    let errors: Vec<String> = s
        .errors
        .iter()
        .map(|((op, c), n)| format!("{op} {c}: {n}"))
        .collect();
    println!(
        "FAULTS | {name} | {:.0}s | {} | {} | {} | {} | {} | {:.2}s | {note}; {} failed puts put again",
        started.elapsed().as_secs_f64(),
        s.calls,
        s.committed.len(),
        if errors.is_empty() { "-".into() } else { errors.join(" ") },
        s.wrong_bytes,
        lost,
        s.worst.as_secs_f64(),
        retried.len(),
    );
    assert_eq!(s.wrong_bytes, 0, "{name}: wrong bytes");
    assert_eq!(lost, 0, "{name}: committed objects lost");
    assert!(s.worst < HANG, "{name}: a call took {:?}", s.worst);
    assert!(!s.committed.is_empty(), "{name}: nothing was committed");
}

fn third() -> Duration {
    Duration::from_millis(load_secs() * 1000 / 3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_under_load() {
    let mut w = World::start(1).await;
    let failovers = env_u64("FAULTS_FAILOVERS", 1);
    let probe = format!("probe/{}", std::process::id());
    // Pinned: whatever the load does, the probe stays in memory.
    let pinned = ReplicateConfig {
        hard_pin: true,
        ..ReplicateConfig::default()
    };
    w.client
        .put(&probe, &payload(&probe, SIZE), &pinned)
        .await
        .unwrap();
    let mut times = Vec::new();
    for round in 0..failovers {
        let leader = w.leader().await;
        let kill = async {
            tokio::time::sleep(third()).await;
            w.masters[leader].1.as_ref().unwrap().signal(libc::SIGKILL);
            let killed = Instant::now();
            // A running client's first successful get of an old key after the kill.
            let mut buf = vec![0u8; SIZE];
            loop {
                if w.client.get(&probe, &mut buf).await.is_ok() {
                    assert!(buf == payload(&probe, SIZE));
                    break;
                }
                assert!(killed.elapsed() < HANG, "no get succeeded after the kill");
            }
            let took = killed.elapsed();
            format!("failover {:.2}s", took.as_secs_f64())
        };
        let name = format!("leader-kill-9#{round}");
        under_load(&w, &name, async {
            let note = kill.await;
            times.push(note.clone());
            note
        })
        .await;
        w.master(leader).wait_exit(Duration::from_secs(5));
        w.restart_master(leader);
    }
    println!("FAULTS-FAILOVERS | {}", times.join(" "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_cut_off_from_etcd_but_not_from_clients() {
    let mut w = World::start(1).await;
    let leader = w.leader().await;
    let etcd_ip = w.etcd_hosts[0].ip.clone();
    let fault = async {
        tokio::time::sleep(third()).await;
        w.lab.cut(&w.masters[leader].0, &etcd_ip);
        let cut = Instant::now();
        // The cut-off leader steps down; the other one leads.
        let other = 1 - leader;
        w.masters[other]
            .1
            .as_ref()
            .unwrap()
            .wait_line("mooncake_master ready", Duration::from_secs(20));
        format!("new leader after {:.2}s", cut.elapsed().as_secs_f64())
    };
    under_load(&w, "leader-cut-from-etcd", fault).await;
    // The old leader answers nobody while it cannot reach etcd.
    let direct = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(2),
        shared_memory: false,
        ..ClientConfig::new(format!("{}:50051", w.masters[leader].0.ip))
    })
    .await;
    if let Ok(c) = direct {
        let e = c.exists("anything").await.unwrap_err();
        assert!(matches!(e.code().as_i32(), -1010 | -900 | -901), "{e}");
    }
    w.lab.heal(&w.masters[leader].0, &etcd_ip);
    w.master(leader)
        .wait_line("mooncake_master standby", Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_paused_for_three_lease_ttls() {
    let mut w = World::start(1).await;
    let leader = w.leader().await;
    let fault = async {
        tokio::time::sleep(third()).await;
        w.masters[leader].1.as_ref().unwrap().stop();
        tokio::time::sleep(Duration::from_secs(3 * TTL_SECS)).await;
        w.masters[leader].1.as_ref().unwrap().signal(libc::SIGCONT);
        "paused 3 TTLs".to_string()
    };
    under_load(&w, "leader-sigstop-3ttl", fault).await;
    w.master(leader)
        .wait_line("mooncake_master standby", Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_off_from_the_client_mid_batch() {
    let w = World::start(1).await;
    let gateway = w.lab.gateway.clone();
    let fault = async {
        tokio::time::sleep(third()).await;
        w.lab.cut(&w.owners[0].0, &gateway);
        tokio::time::sleep(Duration::from_secs(3)).await;
        w.lab.heal(&w.owners[0].0, &gateway);
        "cut 3s".to_string()
    };
    under_load(&w, "owner-cut-mid-batch", fault).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_etcd_members_down_then_the_leader_killed() {
    let w = World::start(3).await;
    let fault = async {
        tokio::time::sleep(third()).await;
        w.etcd.members[2].guard.signal(libc::SIGKILL);
        tokio::time::sleep(third() / 2).await;
        let leader = w.leader().await;
        w.masters[leader].1.as_ref().unwrap().signal(libc::SIGKILL);
        let other = 1 - leader;
        w.masters[other]
            .1
            .as_ref()
            .unwrap()
            .wait_line("mooncake_master ready", Duration::from_secs(20));
        "etcd 2/3, then leader killed".to_string()
    };
    under_load(&w, "etcd-member-down", fault).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_ms_of_delay_on_an_owner_link() {
    let w = World::start(1).await;
    let (host, _, segment) = &w.owners[0];
    let port: u16 = segment.rsplit_once(':').unwrap().1.parse().unwrap();
    let delay = w.lab.delay(host, port, 50);
    // The delay is real: a get of an object on o0 takes at least 50 ms (a lower bound only;
    // how much longer depends on the machine).
    let config = ReplicateConfig {
        preferred_segments: vec![mooncake_common::SegmentName::parse(segment).unwrap()],
        ..ReplicateConfig::default()
    };
    w.client
        .put("probe/o0", &payload("probe/o0", SIZE), &config)
        .await
        .unwrap();
    let mut buf = vec![0u8; SIZE];
    let started = Instant::now();
    w.client.get("probe/o0", &mut buf).await.unwrap();
    let took = started.elapsed();
    assert!(buf == payload("probe/o0", SIZE));
    assert!(
        took >= Duration::from_millis(50),
        "a get from o0 took {took:?}"
    );
    let how = delay.how();
    let fault = async move { format!("50ms on o0 ({how}); a get from o0 took {took:.0?}") };
    under_load(&w, "owner-delay-50ms", fault).await;
    drop(delay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_watching_from_an_etcd_member_cut_off_from_its_cluster() {
    let w = World::start(3).await;
    let first = w.leader().await;
    let standby = &w.masters[1 - first].0;
    let etcd_ips: Vec<String> = w.etcd_hosts.iter().map(|h| h.ip.clone()).collect();
    let fault = async {
        // The standby reaches only etcd2, so it watches the leader key there...
        w.lab.cut(standby, &etcd_ips[0]);
        w.lab.cut(standby, &etcd_ips[1]);
        // (the keepalive drops its connections to the others within a lease TTL, and it
        // campaigns and watches again through etcd2)
        tokio::time::sleep(Duration::from_secs(4 * TTL_SECS)).await;
        // ...then etcd2 loses its cluster: it still serves, but sees no change any more. The
        // standby reaches every member again.
        w.lab.cut(&w.etcd_hosts[2], &etcd_ips[0]);
        w.lab.cut(&w.etcd_hosts[2], &etcd_ips[1]);
        w.lab.heal(standby, &etcd_ips[0]);
        w.lab.heal(standby, &etcd_ips[1]);
        // Whoever leads now (a leader whose keepalive went through etcd2 stepped down) is
        // killed; the other master must take over.
        let leader = w.leader().await;
        w.masters[leader].1.as_ref().unwrap().signal(libc::SIGKILL);
        let killed = Instant::now();
        let survivor = &w.masters[1 - leader].0;
        let lookup = mooncake_common::leader::LeaderLookup::new(
            w.etcd.members.iter().map(|m| m.endpoint.clone()).collect(),
            CLUSTER,
            Duration::from_secs(2),
        );
        loop {
            if let Ok(l) = lookup.leader().await {
                if l.address.starts_with(&format!("{}:", survivor.ip)) {
                    break;
                }
            }
            assert!(
                killed.elapsed() < Duration::from_secs(20),
                "the standby did not take over within 20 s of the leader's death"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        format!(
            "etcd2 cut off under the standby's watch; took over {:.2}s after the kill",
            killed.elapsed().as_secs_f64()
        )
    };
    under_load(&w, "standby-on-cut-off-etcd-member", fault).await;
}
