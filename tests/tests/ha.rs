//! High availability with a real etcd and real processes: two masters campaign, the leader is
//! killed with SIGKILL under a running client and the standby takes over (owners follow and
//! report, the client follows, nothing committed is lost); a leader paused for three lease TTLs
//! loses its lease, refuses to answer once it resumes, and campaigns again as a standby; a
//! deposed leader's late writes to etcd (its put-id reservation) do not land; a leader stopped
//! with SIGTERM gives its key up, so the standby takes over at once rather than after the TTL.

use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, ReplicateConfig};
use mooncake_tests::{
    check_payloads, etcd::Etcd, free_port, get_code, http_get, loopback_master_args, metric,
    payload, put_payloads, spawn_owner, ChildGuard,
};

const TTL: &str = "2";
const SIZE: usize = 32 << 10;

struct Master {
    guard: ChildGuard,
    addr: String,
}

fn ha_master(etcd: &Etcd) -> Master {
    ha_master_with_ttl(etcd, TTL)
}

fn ha_master_with_ttl(etcd: &Etcd, ttl: &str) -> Master {
    ha_master_on(etcd, ttl, "0")
}

/// An HA master whose HTTP port is `metrics_port`.
fn ha_master_on(etcd: &Etcd, ttl: &str, metrics_port: &str) -> Master {
    let port = free_port().to_string();
    let mut args = vec![
        "--enable_ha",
        "--etcd_endpoints",
        etcd.endpoint(),
        "--cluster_id",
        "ha-test",
        "--ha_lease_ttl",
        ttl,
    ];
    let mut loopback = loopback_master_args(&port);
    loopback[5] = metrics_port;
    args.extend(loopback);
    let guard = ChildGuard::spawn("mooncake_master", &args);
    Master {
        guard,
        addr: format!("127.0.0.1:{port}"),
    }
}

fn client_config(master: &str) -> ClientConfig {
    ClientConfig {
        cluster_id: "ha-test".into(),
        rpc_timeout: Duration::from_secs(10),
        ..ClientConfig::new(master)
    }
}

async fn put_all(client: &Client, keys: &[String]) {
    put_payloads(client, keys, SIZE, &ReplicateConfig::default()).await
}

async fn all_exact(client: &Client, keys: &[String]) {
    check_payloads(client, keys, SIZE).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_killed_or_paused_leader_and_nothing_is_lost() {
    let etcd = Etcd::start().await;
    let mut a = ha_master(&etcd);
    a.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let b = ha_master(&etcd);
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));

    let url = etcd.master_url();
    let beat = ["--heartbeat-interval", "200ms", "--cluster-id", "ha-test"];
    let (_o1, _) = spawn_owner(&url, "32MiB", &beat);
    let (_o2, _) = spawn_owner(&url, "32MiB", &beat);
    let client = Client::connect(client_config(&url)).await.unwrap();
    let old: Vec<String> = (0..100).map(|i| format!("old/{i}")).collect();
    put_all(&client, &old).await;
    all_exact(&client, &old).await;

    // Failover 1: SIGKILL of the leader. The client's next get waits through the election and
    // the rebuild, and finds every committed object.
    a.guard.signal(libc::SIGKILL);
    a.guard.wait_exit(Duration::from_secs(5));
    let killed = Instant::now();
    let mut buf = vec![0u8; SIZE];
    assert_eq!(get_code(&client.get(&old[0], &mut buf).await), SIZE as i64);
    let took = killed.elapsed();
    assert!(buf == payload(&old[0], SIZE));
    assert!(took < Duration::from_secs(10), "failover took {took:?}");
    b.guard
        .wait_line("mooncake_master ready", Duration::from_secs(1));
    all_exact(&client, &old).await;
    let new: Vec<String> = (0..50).map(|i| format!("new/{i}")).collect();
    put_all(&client, &new).await;

    // The killed master comes back as a standby.
    let a2 = ha_master(&etcd);
    a2.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));

    // Failover 2: the leader is paused for three TTLs; the standby takes over meanwhile.
    b.guard.stop();
    a2.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    all_exact(&client, &old).await;
    all_exact(&client, &new).await;
    // Resumed, the old leader refuses to answer (its lease lapsed while it was paused) and
    // campaigns again as a standby.
    b.guard.signal(libc::SIGCONT);
    let direct = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(2),
        ..ClientConfig::new(&b.addr)
    })
    .await;
    if let Ok(direct) = direct {
        let err = direct.exists(&old[0]).await.unwrap_err();
        assert!(
            matches!(err.code().as_i32(), -1010 | -900 | -901),
            "a deposed leader answered: {err}"
        );
    }
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(10));
    all_exact(&client, &old).await;
    all_exact(&client, &new).await;
}

/// A leader's writes besides its key (the put-id reservation, the segment names) land only while
/// the key is still its term's: a deposed leader's late write does not overwrite the next
/// leader's reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leaders_late_write_does_not_land() {
    use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
    use mooncake_master::ha::Seat;

    let etcd = Etcd::start().await;
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let leader_key = mooncake_common::leader::leader_key("fenced");
    let ceiling = "mooncake-store/fenced/grant_ceiling";
    // Takes the leader key under a fresh lease, as a campaign does.
    async fn elect(c: &mut etcd_client::Client, key: &str) -> (i64, Seat) {
        let lease = c.lease_grant(30, None).await.unwrap().id();
        let txn = Txn::new()
            .when([Compare::version(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                "127.0.0.1:1",
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let resp = c.txn(txn).await.unwrap();
        assert!(resp.succeeded(), "the key is free");
        let term = resp.header().unwrap().revision();
        (
            lease,
            Seat {
                leader_key: key.to_string(),
                term,
            },
        )
    }
    let (lease, first) = elect(&mut c, &leader_key).await;
    first.put(&mut c, ceiling, "100").await.unwrap();
    first
        .put(&mut c, "mooncake-store/fenced/segments/a", "")
        .await
        .unwrap();
    // The first term's lease lapses; the next leader reserves above it.
    c.lease_revoke(lease).await.unwrap();
    let (_, second) = elect(&mut c, &leader_key).await;
    assert!(second.term > first.term);
    second.put(&mut c, ceiling, "200").await.unwrap();
    // The deposed leader's writes, arriving late, are refused.
    let late = first.put(&mut c, ceiling, "150").await.unwrap_err();
    assert!(late.to_string().contains("another master leads"), "{late}");
    first
        .delete(&mut c, "mooncake-store/fenced/segments/a")
        .await
        .unwrap_err();
    let stored = c.get(ceiling, None).await.unwrap();
    assert_eq!(stored.kvs()[0].value_str().unwrap(), "200");
    let segment = c
        .get("mooncake-store/fenced/segments/a", None)
        .await
        .unwrap();
    assert_eq!(segment.kvs().len(), 1, "the deposed leader's delete landed");
}

/// A leader stopped with SIGTERM gives the leader key up before it shuts down: the standby
/// leads within moments, not after the lease's TTL (20 s here). Before, the stopping process
/// dropped its term without revoking the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_with_sigterm_hands_over_at_once() {
    let etcd = Etcd::start().await;
    let mut a = ha_master_with_ttl(&etcd, "20");
    a.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let b = ha_master_with_ttl(&etcd, "20");
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));
    let url = etcd.master_url();
    let beat = ["--heartbeat-interval", "200ms", "--cluster-id", "ha-test"];
    let (_o1, _) = spawn_owner(&url, "16MiB", &beat);
    let client = Client::connect(client_config(&url)).await.unwrap();
    let keys: Vec<String> = (0..10).map(|i| format!("k/{i}")).collect();
    put_all(&client, &keys).await;

    let stopped = Instant::now();
    a.guard.signal(libc::SIGTERM);
    b.guard
        .wait_line("mooncake_master ready", Duration::from_secs(15));
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the standby took over after {took:?}"
    );
    assert!(
        a.guard.wait_exit(Duration::from_secs(15)).is_some(),
        "the old leader exited"
    );
    all_exact(&client, &keys).await;
}

/// Whether the master `client` talks to answered a call as leader: with a result, or with a
/// code of its own (a rebuilding master answers `exists` with -1010), not with a refusal to lead
/// or a failed call.
async fn answers(client: &Client) -> bool {
    matches!(
        client.exists("probe").await,
        Ok(_) | Err(mooncake_client::ClientError::Master { .. })
    )
}

/// A leader whose key is deleted while its lease lives on (an operator forcing a failover, a
/// cleanup of the prefix) steps down, and the standby that takes the key answers only after the
/// old leader stopped answering: it revokes the old lease and waits out its TTL. Probed every
/// 20 ms, the old leader's last answer comes before the new one's first. Before, the old leader
/// went on answering for up to a keepalive period (3 s here) beside the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_key_is_deleted_steps_down_before_the_next_answers() {
    the_next_leader_answers_only_after_the_old_one(Depose::Key, "9").await;
}

/// The same when the whole prefix is deleted (a cleanup), the recorded lease id with it: the
/// standby retires the lease it saw holding the key while it waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_of_the_prefix_under_a_leader_leaves_one_answering_at_a_time() {
    the_next_leader_answers_only_after_the_old_one(Depose::Prefix, "9").await;
}

/// The same when the leader's lease is revoked (an operator): the key goes with it, and the
/// standby finds no live lease to wait out, so the old leader must stop as etcd tells of the
/// deletion. Before, it went on answering until its next keepalive, a third of the TTL later
/// (10 s here), beside the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_is_revoked_stops_before_the_next_answers() {
    the_next_leader_answers_only_after_the_old_one(Depose::Lease, "30").await;
}

/// How the leader is deposed.
enum Depose {
    /// Its key deleted.
    Key,
    /// The cluster's whole prefix deleted.
    Prefix,
    /// Its lease revoked.
    Lease,
}

async fn the_next_leader_answers_only_after_the_old_one(how: Depose, ttl: &str) {
    let etcd = Etcd::start().await;
    let a = ha_master_with_ttl(&etcd, ttl);
    a.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let b = ha_master_with_ttl(&etcd, ttl);
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));
    let direct = |addr: &str| ClientConfig {
        rpc_timeout: Duration::from_millis(300),
        connect_timeout: Duration::from_millis(300),
        ..ClientConfig::new(addr)
    };
    // Short deadlines for the probes below; the first answer is waited for (a loaded machine).
    let mut to_a = None;
    for _ in 0..50 {
        if let Ok(c) = Client::connect(direct(&a.addr)).await {
            to_a = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let to_a = to_a.expect("the leader never answered a connect");
    assert!(
        mooncake_tests::eventually(Duration::from_secs(10), async || answers(&to_a).await).await,
        "the leader never answered"
    );
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let key = mooncake_common::leader::leader_key("ha-test");
    match how {
        Depose::Key => {
            c.delete(key, None).await.unwrap();
        }
        Depose::Prefix => {
            c.delete(
                "mooncake-store/ha-test/",
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        }
        Depose::Lease => {
            let held = c.get(key, None).await.unwrap();
            let lease = held.kvs().first().expect("no leader key").lease();
            c.lease_revoke(lease).await.unwrap();
        }
    }
    let deleted = Instant::now();

    let mut a_last = None;
    let mut b_first = None;
    let mut to_b = None;
    while deleted.elapsed() < Duration::from_secs(25) {
        if answers(&to_a).await {
            a_last = Some(deleted.elapsed());
        }
        // A is watched for a second after B's first answer.
        if let Some(first) = b_first {
            if deleted.elapsed() > first + Duration::from_secs(1) {
                break;
            }
        } else {
            if to_b.is_none() {
                to_b = Client::connect(direct(&b.addr)).await.ok();
            }
            if let Some(to_b) = &to_b {
                if answers(to_b).await {
                    b_first = Some(deleted.elapsed());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b_first = b_first.expect("the standby never answered");
    assert!(
        a_last.is_none_or(|a| a < b_first),
        "both answered: the old leader last at {a_last:?}, the new one first at {b_first:?}"
    );
    // A campaigns again, and finds B leading.
    let stepped_down = a
        .guard
        .line_within("mooncake_master standby leader=", Duration::from_secs(8));
    assert!(stepped_down.is_some(), "the old leader still leads");
}

/// etcd stalling for longer than a keepalive period but shorter than the lease does not end the
/// leader's term: the keepalive is tried again (on a new connection) while the lease lasts, and
/// the leader serves throughout, with no new election and no rebuild. Before, the first
/// keepalive not answered within a third of the TTL ended the term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_keeps_its_term_through_an_etcd_stall_shorter_than_its_lease() {
    let etcd = Etcd::start().await;
    let a = ha_master_with_ttl(&etcd, "15");
    let ready = a
        .guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let url = etcd.master_url();
    let beat = ["--heartbeat-interval", "200ms", "--cluster-id", "ha-test"];
    let (_o1, _) = spawn_owner(&url, "16MiB", &beat);
    let client = Client::connect(client_config(&url)).await.unwrap();
    let before: Vec<String> = (0..10).map(|i| format!("before/{i}")).collect();
    put_all(&client, &before).await;

    // 6 s: longer than a keepalive period (5 s), shorter than the lease (15 s), which leaves
    // the leader a few seconds to reconnect on a loaded machine.
    let member = &etcd.members[0].guard;
    member.stop();
    let stalled = tokio::time::Instant::now();
    let during: Vec<String> = (0..10).map(|i| format!("during/{i}")).collect();
    put_all(&client, &during).await;
    tokio::time::sleep_until(stalled + Duration::from_secs(6)).await;
    member.signal(libc::SIGCONT);

    // A step-down would be followed by a campaign: a "standby" or a new "ready" line.
    let changed = a
        .guard
        .line_within("mooncake_master", Duration::from_secs(8));
    assert_eq!(changed, None, "the term ended (it began with {ready:?})");
    all_exact(&client, &before).await;
    all_exact(&client, &during).await;
}

/// A new leader named in etcd before it listens (it waits out its predecessor's lease first)
/// refuses connections meanwhile; a state-changing call is tried on it again until it answers,
/// within the call's deadline. Before, the first refused connection marked the new leader as
/// tried, as if the call had reached it, and the call failed with RPC_TIMEOUT at its deadline
/// though the leader answered seconds earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_a_new_leader_that_is_not_listening_yet() {
    let etcd = Etcd::start().await;
    let a = ha_master_with_ttl(&etcd, "9");
    a.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let b = ha_master_with_ttl(&etcd, "9");
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));
    // Following A.
    let client = Client::connect(ClientConfig {
        rpc_timeout: Duration::from_secs(20),
        ..client_config(&etcd.master_url())
    })
    .await
    .unwrap();
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let key = mooncake_common::leader::leader_key("ha-test");
    c.delete(key.as_str(), None).await.unwrap();
    // B wins the key, and waits out A's lease (9 s) before it listens.
    let named = Instant::now();
    loop {
        let got = c.get(key.as_str(), None).await.unwrap();
        if got
            .kvs()
            .first()
            .is_some_and(|kv| String::from_utf8_lossy(kv.value()).contains(&b.addr))
        {
            break;
        }
        assert!(named.elapsed() < Duration::from_secs(20), "B never won");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A stepped down (it answers nobody; within a keepalive period, 3 s), B still waits.
    assert!(a
        .guard
        .line_within("mooncake_master standby leader=", Duration::from_secs(8))
        .is_some());
    let answer = client.remove("never-put", false).await;
    let e = answer.expect_err("nothing to remove");
    assert_eq!(
        e.code(),
        mooncake_common::Code::ObjectNotFound,
        "the new leader's answer, not a timeout: {e}"
    );
}

/// A master that campaigns with a setting every term would fail on (here: a token file that is
/// not there) exits at once and says why, before it campaigns. Before, it won the election,
/// failed to start its term, gave the key up and campaigned again for ever, sending clients to
/// an address nobody served. No etcd is needed: the check comes first.
#[test]
fn an_ha_master_that_cannot_serve_exits_before_it_campaigns() {
    let port = free_port().to_string();
    let mut args = vec![
        "--enable_ha",
        "--etcd_endpoints",
        "127.0.0.1:1",
        "--auth_token_file",
        "/nonexistent/mooncake-token",
    ];
    args.extend(loopback_master_args(&port));
    let mut child = std::process::Command::new(mooncake_tests::bin_path("mooncake_master"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("mooncake-token"), "{err}");
}

/// Every master of an HA cluster answers on its HTTP port: a standby's `/health` names the
/// leader, its `/metrics` says `master_leading 0`, and its segment list refuses (it holds
/// none); the port passes to the term's master when the standby leads, and back when it steps
/// down. Before, a standby did not listen at all (probes and scrapes saw a dead process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_answers_on_its_http_port_and_hands_it_to_its_term() {
    let etcd = Etcd::start().await;
    let (http_a, http_b, http_c) = (free_port(), free_port(), free_port());
    let on = |port: u16| format!("127.0.0.1:{port}");
    let (pa, pb, pc) = (http_a.to_string(), http_b.to_string(), http_c.to_string());
    let a = ha_master_on(&etcd, TTL, &pa);
    a.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    let b = ha_master_on(&etcd, TTL, &pb);
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));

    let standby_says = async |http: &str, leader: &str| {
        let (status, body) = http_get(http, "/health").await;
        assert_eq!(
            (status, body.trim()),
            (200, format!("OK standby leader={leader}").as_str())
        );
        let (status, m) = http_get(http, "/metrics").await;
        assert_eq!((status, metric(&m, "master_leading")), (200, 0));
        let (status, body) = http_get(http, "/get_all_segments").await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(leader), "{body}");
    };
    let leads = async |http: &str| {
        let (status, body) = http_get(http, "/health").await;
        assert_eq!((status, body.trim()), (200, "OK"));
        let (_, m) = http_get(http, "/metrics").await;
        assert_eq!(metric(&m, "master_leading"), 1);
    };
    standby_says(&on(http_b), &a.addr).await;
    leads(&on(http_a)).await;

    // A stops (a clean hand-over): B leads, on the same HTTP port.
    a.guard.signal(libc::SIGTERM);
    b.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    leads(&on(http_b)).await;
    let c = ha_master_on(&etcd, TTL, &pc);
    c.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));
    standby_says(&on(http_c), &b.addr).await;

    // B's key is deleted: B steps down, C leads, and B's port answers as a standby again.
    let mut etcd_c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    etcd_c
        .delete(mooncake_common::leader::leader_key("ha-test"), None)
        .await
        .unwrap();
    c.guard
        .wait_line("mooncake_master ready", Duration::from_secs(20));
    b.guard
        .wait_line("mooncake_master standby leader=", Duration::from_secs(20));
    standby_says(&on(http_b), &c.addr).await;
    leads(&on(http_c)).await;
}
