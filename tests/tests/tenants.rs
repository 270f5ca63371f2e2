//! Tenants against real processes: a master with the cluster's token and three tenants (two with
//! their own token files, one with a quota only) and an owner. Each tenant's keys are invisible
//! to the others (exists, get, overwrite, remove, remove_all), a tenant's token acts as that
//! tenant only and makes no owner's call, a quota holds to the byte, and `/metrics` counts keys
//! and bytes per tenant.

use std::{os::unix::fs::PermissionsExt, path::Path, sync::Arc, time::Duration};

use mooncake_client::{
    master::FramedMaster, Client, ClientConfig, ClientError, MasterProtocol, PutOutcome,
    ReplicateConfig,
};
use mooncake_common::{auth::Credential, tenant::Tenant, Code, MasterApi};
use mooncake_tests::{bin_path, http_get, spawn_master, spawn_owner, ChildGuard, TempDir};

const SECRET: &str = "t3nants-share-this-cluster-0123456789";
const QUOTA_A: u64 = 1 << 20;

struct Cluster {
    dir: TempDir,
    cluster_token: String,
    _master: ChildGuard,
    rpc: String,
    http: String,
    _owner: ChildGuard,
    segment: String,
}

fn write_secret(dir: &TempDir, name: &str, text: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, format!("{text}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// Tenant `name`'s token, made the way an operator makes it.
fn tenant_token(dir: &TempDir, cluster_token: &str, name: &str) -> String {
    let out = std::process::Command::new(bin_path("mooncake_master"))
        .args([
            "--auth_token_file",
            cluster_token,
            "--print_tenant_token",
            name,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    write_secret(
        dir,
        &format!("{name}.token"),
        String::from_utf8(out.stdout).unwrap().trim(),
    )
}

fn start() -> Cluster {
    let dir = TempDir::new("tenants");
    let cluster_token = write_secret(&dir, "cluster.token", SECRET);
    let a = tenant_token(&dir, &cluster_token, "a");
    let b = tenant_token(&dir, &cluster_token, "b");
    let config = dir.path().join("master.toml");
    std::fs::write(
        &config,
        format!(
            "[[tenants]]\nname = \"a\"\nquota = {QUOTA_A}\ntoken_file = \"{a}\"\n\n\
             [[tenants]]\nname = \"b\"\ntoken_file = \"{b}\"\n\n\
             [[tenants]]\nname = \"c\"\nquota = \"64KiB\"\n"
        ),
    )
    .unwrap();
    let (master, rpc, http) = spawn_master(&[
        "--config",
        config.to_str().unwrap(),
        "--auth_token_file",
        &cluster_token,
    ]);
    let (owner, segment) = spawn_owner(&rpc, "32MiB", &["--auth_token_file", &cluster_token]);
    Cluster {
        dir,
        cluster_token,
        _master: master,
        rpc,
        http,
        _owner: owner,
        segment,
    }
}

impl Cluster {
    fn token(&self, name: &str) -> String {
        self.dir
            .path()
            .join(format!("{name}.token"))
            .display()
            .to_string()
    }

    fn config(&self, token: &str, tenant: Option<&str>, protocol: MasterProtocol) -> ClientConfig {
        ClientConfig {
            auth_token_file: Some(token.into()),
            tenant_id: tenant.map(Into::into),
            master_protocol: protocol,
            rpc_timeout: Duration::from_secs(3),
            transfer_timeout: Duration::from_secs(3),
            ..ClientConfig::new(&self.rpc)
        }
    }

    async fn client(&self, token: &str, tenant: Option<&str>, protocol: MasterProtocol) -> Client {
        Client::connect(self.config(token, tenant, protocol))
            .await
            .unwrap()
    }
}

fn put_ok(r: Result<PutOutcome, ClientError>) {
    assert!(matches!(r, Ok(PutOutcome::Stored)), "{r:?}");
}

async fn read(c: &Client, key: &str) -> Result<Vec<u8>, ClientError> {
    c.batch_get_owned(&[key]).await.pop().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cannot_see_read_overwrite_or_remove_each_others_keys() {
    let c = start();
    let rc = ReplicateConfig::default();
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        // Tenant a by its own token; tenant b by the cluster's token acting as b.
        let a = c.client(&c.token("a"), None, protocol).await;
        let b = c.client(&c.cluster_token, Some("b"), protocol).await;
        assert_eq!(a.tenant().name(), "a");
        assert_eq!(b.tenant().name(), "b");
        let shared = format!("shared-{protocol:?}");
        let only_a = format!("only-a-{protocol:?}");
        put_ok(a.put(&shared, b"value of a", &rc).await);
        put_ok(a.put(&only_a, b"secret of a", &rc).await);
        // The same key in b is b's own object, not an overwrite of a's.
        put_ok(b.put(&shared, b"value of b", &rc).await);
        assert_eq!(read(&a, &shared).await.unwrap(), b"value of a");
        assert_eq!(read(&b, &shared).await.unwrap(), b"value of b");
        // A tenant's empty key is refused as the default tenant's is (it was stored).
        let empty = a.put("", b"v", &rc).await.unwrap_err();
        assert_eq!(empty.code().as_i32(), -600, "{empty}");
        // A tenant's token gets no same-host mapping of the pool (all tenants' bytes are in
        // it): its transfers went over TCP. The cluster's token may map it.
        let (ta, tb) = (a.transfer_stats(), b.transfer_stats());
        assert!(ta.local_bytes == 0 && ta.tcp_bytes > 0, "{ta:?}");
        assert!(tb.local_bytes > 0, "{tb:?}");

        // b cannot see, read or remove a's key.
        assert!(!b.exists(&only_a).await.unwrap());
        assert_eq!(
            read(&b, &only_a).await.unwrap_err().code(),
            Code::ObjectNotFound
        );
        assert_eq!(
            b.remove(&only_a, true).await.unwrap_err().code(),
            Code::ObjectNotFound
        );
        assert_eq!(b.remove_by_regex("only-a", true).await.unwrap(), 0);
        // b's remove_all takes b's objects only.
        assert_eq!(b.remove_all(true).await.unwrap(), 1);
        assert_eq!(read(&a, &only_a).await.unwrap(), b"secret of a");
        assert_eq!(read(&a, &shared).await.unwrap(), b"value of a");
        // a's replica tasks are a's: b does not find them.
        let task = a.create_copy_task(&only_a, &[&c.segment]).await.unwrap();
        a.query_task(task).await.unwrap();
        let e = b.query_task(task).await.unwrap_err();
        assert_eq!(e.code(), Code::ObjectNotFound, "{e}");
        // b writing a's key makes b's object; a's bytes stay.
        put_ok(b.put(&only_a, b"b's try", &rc).await);
        assert_eq!(read(&a, &only_a).await.unwrap(), b"secret of a");

        // The default tenant (the cluster's token) sees neither, and a key spelling a's
        // stored form is refused.
        let d = c.client(&c.cluster_token, None, protocol).await;
        assert!(!d.exists(&shared).await.unwrap());
        let forged = Tenant::parse("a").unwrap().scope(&only_a).into_owned();
        let e = d.exists(&forged).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        let e = read(&d, &forged).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        assert_eq!(d.remove_all(true).await.unwrap(), 0);
        assert_eq!(read(&a, &only_a).await.unwrap(), b"secret of a");
        // a's regex sees a's keys as a knows them.
        assert_eq!(a.remove_by_regex("^only-a-", true).await.unwrap(), 1);
        assert_eq!(a.remove_all(true).await.unwrap(), 1);
        assert_eq!(b.remove_all(true).await.unwrap(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_token_acts_as_that_tenant_only() {
    let c = start();
    // The client refuses a config whose tenant_id contradicts its token.
    let e = Client::connect(c.config(&c.token("a"), Some("b"), MasterProtocol::Framed))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::InvalidParams, "{e}");
    assert!(e.to_string().contains("tenant a's token"), "{e}");

    // A hand-built connection proving a's token and asking to act as b is refused.
    let cred = Credential::from_file(Path::new(&c.token("a"))).unwrap();
    assert_eq!(cred.tenant(), Some("a"));
    let as_b = FramedMaster::new(
        &c.rpc,
        Duration::from_secs(3),
        Duration::from_secs(3),
        Duration::ZERO,
        Some(cred.clone()),
        Tenant::parse("b").unwrap(),
        None,
    );
    let e = as_b.list_segments().await.unwrap_err();
    assert_eq!(e.code, Code::PermissionDenied, "{e}");

    // Nor may it make an owner's calls, on either protocol.
    use mooncake_proto::master::{self as pb, master_client::MasterClient};
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", c.rpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(3));
    let mut grpc = MasterClient::new(mooncake_common::auth::grpc_channel(
        endpoint,
        &c.rpc,
        Some(cred.clone()),
        None,
    ));
    let status = grpc
        .heartbeat(pb::HeartbeatRequest {
            client_id: "0123456789abcdef0123456789abcdef".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status}");
    let as_a: Arc<dyn MasterApi> = Arc::new(FramedMaster::new(
        &c.rpc,
        Duration::from_secs(3),
        Duration::from_secs(3),
        Duration::ZERO,
        Some(cred),
        Tenant::parse("a").unwrap(),
        None,
    ));
    // Its own tenant's calls work.
    assert_eq!(as_a.list_segments().await.unwrap().len(), 1);

    // A token of a tenant the master does not list is refused (owners would admit it, but
    // without the master's seals it moves no byte).
    let d_token = tenant_token(&c.dir, &c.cluster_token, "d");
    let e = Client::connect(c.config(&d_token, None, MasterProtocol::Framed))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    // A made-up tenant token (not derived from the cluster's secret) is refused too.
    let fake = write_secret(
        &c.dir,
        "fake.token",
        &format!("tenant/a/{}", "0".repeat(64)),
    );
    let e = Client::connect(c.config(&fake, None, MasterProtocol::Framed))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_to_the_byte_and_metrics_count_per_tenant() {
    let c = start();
    let rc = ReplicateConfig::default();
    let a = c.client(&c.token("a"), None, MasterProtocol::Framed).await;
    let quarter = vec![7u8; (QUOTA_A / 4) as usize];
    for i in 0..3 {
        put_ok(a.put(&format!("q{i}"), &quarter, &rc).await);
    }
    // Fill to one byte below the quota, then to the quota exactly.
    put_ok(a.put("q3", &quarter[1..], &rc).await);
    put_ok(a.put("one", b"x", &rc).await);
    let e = a.put("over", b"y", &rc).await.unwrap_err();
    assert_eq!(e.code(), Code::NoAvailableHandle, "{e}");
    assert!(
        e.to_string().contains(&format!("quota of {QUOTA_A} bytes")),
        "{e}"
    );
    // Other tenants are not held by a's quota.
    let b = c.client(&c.token("b"), None, MasterProtocol::Framed).await;
    put_ok(b.put("over", &quarter, &rc).await);
    // Room comes back with a removal.
    a.remove("one", false).await.unwrap();
    put_ok(a.put("over", b"y", &rc).await);

    // Tenant c (no token file of its own: the cluster's token acts as it) has 64 KiB.
    let cc = c
        .client(&c.cluster_token, Some("c"), MasterProtocol::Grpc)
        .await;
    put_ok(cc.put("fits", &vec![1u8; 64 << 10], &rc).await);
    let e = cc.put("no", b"z", &rc).await.unwrap_err();
    assert_eq!(e.code(), Code::NoAvailableHandle, "{e}");

    let (status, m) = http_get(&c.http, "/metrics").await;
    assert_eq!(status, 200);
    let series = |name: &str, tenant: &str| -> u64 {
        let prefix = format!("{name}{{tenant=\"{tenant}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{prefix} missing in\n{m}"))
            .parse()
            .unwrap()
    };
    assert_eq!(series("master_tenant_keys", "a"), 5);
    assert_eq!(series("master_tenant_bytes", "a"), QUOTA_A);
    assert_eq!(series("master_tenant_quota_bytes", "a"), QUOTA_A);
    assert_eq!(series("master_tenant_keys", "b"), 1);
    assert_eq!(series("master_tenant_bytes", "b"), QUOTA_A / 4);
    assert_eq!(series("master_tenant_keys", "c"), 1);
    assert_eq!(series("master_tenant_bytes", "c"), 64 << 10);
    assert_eq!(series("master_tenant_keys", "default"), 0);
}

/// An owner started with a tenant's token (not the cluster's) is refused its mount, and says so
/// at once: before, the refusal read as "master did not answer" and was retried until the
/// mount timeout ran out.
#[test]
fn an_owner_with_a_tenants_token_is_refused_at_once() {
    let c = start();
    let token = c.token("a");
    let mut owner = ChildGuard::spawn(
        "mooncake_ownerd",
        &[
            "--master",
            &c.rpc,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "8MiB",
            "--no-mlock",
            "--auth_token_file",
            &token,
            "--mount-timeout",
            "60s",
        ],
    );
    let status = owner.wait_exit(Duration::from_secs(20));
    let status = status.expect("the refused owner exits well before its mount timeout");
    assert!(!status.success());
}
