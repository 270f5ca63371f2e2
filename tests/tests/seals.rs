//! Transfers scoped by the master, against real processes: in a cluster with a secret, an owner
//! moves a byte only for a write or read the master sealed, exactly as sealed (owner, key, range,
//! version, kind of access) and before the seal lapses, on TCP and on the same-host path. Every
//! refusal is checked to have moved no byte: the range refused keeps its value, a buffer refused
//! keeps its filler.

use std::{os::unix::fs::PermissionsExt, path::Path, time::Duration};

use mooncake_client::{
    master::FramedMaster,
    transport::{
        local::{Deadlines, LocalOwner},
        TcpTransport,
    },
    Client, ClientConfig, ReplicateConfig,
};
use mooncake_common::{
    auth::{Credential, Seal},
    local::socket_path,
    master_api::Releases,
    tenant::Tenant,
    transport::{DataTransport, ReadItem, TransferError, WriteItem},
    Code, MasterApi, ObjectKey, ReplicaLocation, SegmentName, Stamp,
};
use mooncake_tests::{payload, spawn_master, spawn_owner, ChildGuard, TempDir};

const SECRET: &str = "Zq3v8Rk1Lm5Tn9Wx2Yb6Cd0Fg4Hj7Kp";

struct Sealed {
    _dir: TempDir,
    token: String,
    _master: ChildGuard,
    rpc: String,
    _owner: ChildGuard,
    segment: SegmentName,
    api: FramedMaster,
    tcp: TcpTransport,
}

/// A master (with `master_args`) and one owner sharing a secret; a master API and a raw TCP
/// transport that prove it.
fn start(master_args: &[&str]) -> Sealed {
    let dir = TempDir::new("seals");
    let token = dir.path().join("token").display().to_string();
    std::fs::write(&token, SECRET).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut args = vec!["--auth_token_file", token.as_str()];
    args.extend_from_slice(master_args);
    let (master, rpc, _) = spawn_master(&args);
    let (owner, seg) = spawn_owner(&rpc, "32MiB", &["--auth_token_file", &token]);
    let credential = Credential::cluster_from_file(Path::new(&token)).unwrap();
    let api = FramedMaster::new(
        &rpc,
        Duration::from_secs(3),
        Duration::from_secs(3),
        Duration::ZERO,
        Some(credential.clone()),
        Default::default(),
        None,
    );
    let tcp = transport(credential);
    Sealed {
        _dir: dir,
        token,
        _master: master,
        rpc,
        _owner: owner,
        segment: SegmentName::parse(&seg).unwrap(),
        api,
        tcp,
    }
}

impl Sealed {
    async fn client(&self) -> Client {
        Client::connect(ClientConfig {
            auth_token_file: Some(self.token.clone().into()),
            shared_memory: false,
            ..ClientConfig::new(&self.rpc)
        })
        .await
        .unwrap()
    }

    /// The master's grant for a put of `size` bytes of `key`: its put id and its one replica.
    async fn granted(&self, key: &str, size: u64) -> (u64, ReplicaLocation) {
        let grants = self
            .api
            .put_start(&[(key, size)], &ReplicateConfig::default(), 0)
            .await
            .unwrap();
        let g = grants.results[0].as_ref().unwrap();
        (g.put_id, grants.run(&g.replicas)[0].clone())
    }

    /// The master's answer to a lookup of `key`: its one replica, sealed for reading.
    async fn looked_up(&self, key: &str) -> ReplicaLocation {
        let lookup = self.api.get_replicas(&[key], Releases::NONE).await.unwrap();
        let found = lookup.results()[0].as_ref().unwrap();
        lookup.replicas(found)[0].clone()
    }

    async fn write(
        &self,
        key: &str,
        offset: u64,
        put_id: u64,
        seal: Seal,
        bytes: &[u8],
    ) -> Result<(), TransferError> {
        self.write_on(&self.tcp, key, offset, put_id, seal, bytes)
            .await
    }

    /// `write`, on connections of `tcp`.
    async fn write_on(
        &self,
        tcp: &TcpTransport,
        key: &str,
        offset: u64,
        put_id: u64,
        seal: Seal,
        bytes: &[u8],
    ) -> Result<(), TransferError> {
        let key = ObjectKey::new(key).unwrap();
        let parts = [bytes];
        let item = WriteItem {
            key: &key,
            offset,
            stamp: Stamp::new(put_id, &ReplicateConfig::default()),
            seal,
            parts: &parts,
        };
        tcp.write(&self.segment, &item).await
    }

    /// Reads `len` bytes as `loc` says (with `seal`) into a buffer of 0xAB: the bytes, or the
    /// refusal with the buffer checked untouched.
    async fn read(
        &self,
        key: &str,
        loc: &ReplicaLocation,
        len: usize,
        seal: Seal,
    ) -> Result<Vec<u8>, Code> {
        self.read_on(&self.tcp, key, loc, len, seal).await
    }

    /// `read`, on connections of `tcp`.
    async fn read_on(
        &self,
        tcp: &TcpTransport,
        key: &str,
        loc: &ReplicaLocation,
        len: usize,
        seal: Seal,
    ) -> Result<Vec<u8>, Code> {
        let key = ObjectKey::new(key).unwrap();
        let mut buf = vec![0xABu8; len];
        let r = {
            let mut parts = [&mut buf[..]];
            let mut item = ReadItem {
                key: &key,
                offset: loc.offset,
                put_id: loc.put_id,
                seal,
                parts: &mut parts,
            };
            tcp.read(&self.segment, &mut item).await
        };
        match r {
            Ok(()) => Ok(buf),
            Err(e) => {
                assert!(buf.iter().all(|b| *b == 0xAB), "a refused read moved bytes");
                Err(e.code())
            }
        }
    }
}

/// A raw TCP transport proving `credential`.
fn transport(credential: Credential) -> TcpTransport {
    mooncake_tests::tcp_with(Some(credential))
}

fn denied(r: Result<(), TransferError>) {
    let e = r.expect_err("the owner must refuse");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_widened_or_misused_seals_move_no_byte() {
    let s = start(&[]);
    let client = s.client().await;
    let kept = payload("kept", 65536);
    client
        .put("kept", &kept, &ReplicateConfig::default())
        .await
        .unwrap();
    let at = s.looked_up("kept").await;
    assert!(!at.seal.is_none(), "the master seals what it hands out");
    let intact = async || {
        let mut buf = vec![0u8; kept.len()];
        assert_eq!(client.get("kept", &mut buf).await.unwrap(), kept.len());
        assert!(buf == kept, "a refused write changed a committed value");
    };

    // Writes over "kept": a forged seal, no seal, another put's grant moved onto its range, and
    // the read lease of "kept" itself.
    let junk = vec![0xEEu8; 65536];
    let forged = Seal::new(u64::MAX, [0x5A; 16]);
    denied(
        s.write("kept", at.offset, at.put_id + 1, forged, &junk)
            .await,
    );
    denied(
        s.write("kept", at.offset, at.put_id + 1, Seal::default(), &junk)
            .await,
    );
    let (other_id, other) = s.granted("other", 65536).await;
    assert_ne!(other.offset, at.offset);
    denied(
        s.write("other", at.offset, other_id, other.seal, &junk)
            .await,
    );
    denied(
        s.write("kept", at.offset, other_id, other.seal, &junk)
            .await,
    );
    denied(
        s.write("kept", at.offset, at.put_id + 1, at.seal, &junk)
            .await,
    );
    intact().await;

    // A grant is for its exact range: not wider, not shorter, not under another put id.
    denied(
        s.write(
            "other",
            other.offset,
            other_id,
            other.seal,
            &[0u8; 65536 + 4096],
        )
        .await,
    );
    denied(
        s.write("other", other.offset, other_id, other.seal, &[0u8; 4096])
            .await,
    );
    denied(
        s.write("other", other.offset, other_id + 1, other.seal, &junk)
            .await,
    );
    let value = payload("other", 65536);
    s.write("other", other.offset, other_id, other.seal, &value)
        .await
        .expect("the write as granted lands");
    s.api.put_end(&[("other", other_id)]).await.unwrap();

    // Reads: as sealed they land; widened, under another key, with a write's seal, or with
    // none, they move nothing.
    assert!(s.read("kept", &at, 65536, at.seal).await.unwrap() == kept);
    assert_eq!(
        s.read("kept", &at, 65536 + 4096, at.seal).await,
        Err(Code::PermissionDenied)
    );
    assert_eq!(
        s.read("kept", &at, 65536, Seal::default()).await,
        Err(Code::PermissionDenied)
    );
    let other_at = s.looked_up("other").await;
    assert!(
        s.read("other", &other_at, 65536, other_at.seal)
            .await
            .unwrap()
            == value
    );
    assert_eq!(
        s.read("kept", &at, 65536, other_at.seal).await,
        Err(Code::PermissionDenied)
    );
    assert_eq!(
        s.read("other", &other_at, 65536, other.seal).await,
        Err(Code::PermissionDenied),
        "a write grant does not read"
    );
    intact().await;

    // The same-host path checks the same seals before it locks a range.
    let path = socket_path(&mooncake_tests::socket_dir(), &s.segment);
    let credential = Credential::cluster_from_file(Path::new(&s.token)).unwrap();
    let segment = s.segment.clone();
    let local = tokio::task::spawn_blocking(move || {
        LocalOwner::connect(
            &path,
            &segment,
            Deadlines::both(Duration::from_secs(3)),
            1,
            1,
            Some(credential),
        )
    })
    .await
    .unwrap()
    .unwrap();
    let key = ObjectKey::new("kept").unwrap();
    let parts = [&junk[..]];
    let forged_write = [WriteItem {
        key: &key,
        offset: at.offset,
        stamp: Stamp::new(at.put_id + 1, &ReplicateConfig::default()),
        seal: forged,
        parts: &parts,
    }];
    let r = local.write_batch(&forged_write).await;
    assert_eq!(r[0].as_ref().unwrap_err().code(), Code::PermissionDenied);
    let mut buf = vec![0xABu8; 65536];
    for (seal, want) in [
        (Seal::default(), Err(Code::PermissionDenied)),
        (other_at.seal, Err(Code::PermissionDenied)),
        (at.seal, Ok(())),
    ] {
        let mut parts = [&mut buf[..]];
        let mut items = [ReadItem {
            key: &key,
            offset: at.offset,
            put_id: at.put_id,
            seal,
            parts: &mut parts,
        }];
        let got = local.read_batch(&mut items).await.remove(0);
        assert_eq!(got.map_err(|e| e.code()), want);
        if want.is_err() {
            assert!(
                buf.iter().all(|b| *b == 0xAB),
                "a refused same-host read moved bytes"
            );
        }
    }
    assert!(buf == kept);
    intact().await;
}

/// A version's bytes never change once written: the grant's write seal lives for the put's
/// discard timeout, past the put's end, and a second write under it (a retry whose answer was
/// lost, or a replay with other bytes) is answered as done without touching them. Before, the
/// replay landed: the committed replica diverged from its version's other copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_written_version_is_not_rewritten_under_its_grant() {
    let s = start(&[]);
    let value = payload("first", 8192);
    let (id, loc) = s.granted("once", 8192).await;
    s.write("once", loc.offset, id, loc.seal, &value)
        .await
        .unwrap();
    s.api.put_end(&[("once", id)]).await.unwrap();
    let other = payload("second", 8192);
    s.write("once", loc.offset, id, loc.seal, &other)
        .await
        .unwrap();
    let at = s.looked_up("once").await;
    assert!(s.read("once", &at, 8192, at.seal).await.unwrap() == value);
}

/// A seal is not a bearer token across tenants: a worker that proved tenant A's token (the
/// owner admits every tenant of the cluster) and replays tenant B's seal, seen on the plaintext
/// data plane, is refused on its own connection, as the master would refuse it B's keys. Before,
/// the owner served it: it checked the seal, not who carried it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_seal_is_refused_on_another_tenants_connection() {
    let s = start(&[]);
    let cluster = Credential::cluster_from_file(Path::new(&s.token)).unwrap();
    let tenant = |name: &str| {
        let token = mooncake_common::auth::tenant_token(SECRET.as_bytes(), name);
        transport(Credential::new(name, token.as_bytes()).unwrap())
    };
    let as_b = FramedMaster::new(
        &s.rpc,
        Duration::from_secs(3),
        Duration::from_secs(3),
        Duration::ZERO,
        Some(cluster),
        Tenant::parse("b").unwrap(),
        None,
    );
    let key = Tenant::parse("b").unwrap().scope("obj").into_owned();
    let value = payload("b's", 8192);
    let grants = as_b
        .put_start(&[(&key, 8192)], &ReplicateConfig::default(), 0)
        .await
        .unwrap();
    let g = grants.results[0].as_ref().unwrap();
    let loc = grants.run(&g.replicas)[0].clone();
    let (id, at) = (g.put_id, loc.offset);
    denied(
        s.write_on(&tenant("a"), &key, at, id, loc.seal, &value)
            .await,
    );
    s.write_on(&tenant("b"), &key, at, id, loc.seal, &value)
        .await
        .unwrap();
    as_b.put_end(&[(&key, g.put_id)]).await.unwrap();
    let lookup = as_b.get_replicas(&[&key], Releases::NONE).await.unwrap();
    let found = lookup.results()[0].as_ref().unwrap();
    let at = lookup.replicas(found)[0].clone();
    assert_eq!(
        s.read_on(&tenant("a"), &key, &at, 8192, at.seal).await,
        Err(Code::PermissionDenied)
    );
    assert!(
        s.read_on(&tenant("b"), &key, &at, 8192, at.seal)
            .await
            .unwrap()
            == value
    );
    // The cluster's secret may carry any tenant's seal.
    assert!(s.read(&key, &at, 8192, at.seal).await.unwrap() == value);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_seal_moves_no_byte() {
    // Leases of 100 ms, and puts the master keeps for 1 s.
    let s = start(&[
        "--default_kv_lease_ttl",
        "100",
        "--put_start_discard_timeout_sec",
        "1",
    ]);
    let client = s.client().await;
    let value = payload("lapsing", 8192);
    client
        .put("lapsing", &value, &ReplicateConfig::default())
        .await
        .unwrap();
    let at = s.looked_up("lapsing").await;
    let (late_id, late) = s.granted("late", 8192).await;
    assert!(s.read("lapsing", &at, 8192, at.seal).await.unwrap() == value);
    // Past the seals' lives and the owner's allowance for clock skew.
    let skew = Duration::from_micros(mooncake_owner::seals::CLOCK_SKEW_US);
    tokio::time::sleep(Duration::from_secs(1) + skew + Duration::from_millis(500)).await;
    assert_eq!(
        s.read("lapsing", &at, 8192, at.seal).await,
        Err(Code::PermissionDenied)
    );
    denied(
        s.write("late", late.offset, late_id, late.seal, &value)
            .await,
    );
    // A fresh lookup seals again.
    let again = s.looked_up("lapsing").await;
    assert!(s.read("lapsing", &again, 8192, again.seal).await.unwrap() == value);
}

/// A write whose seal was good when its frame began but lapsed before its last byte landed (a
/// stalled writer: its put revoked or discarded meanwhile) is refused and not recorded: the
/// master's last note that the put is gone comes once the seal has surely lapsed, and a write
/// recorded after it would stay for a later master to adopt. Before, it was recorded (and read
/// back once the put was ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_ends_after_its_seal_lapsed_is_not_recorded() {
    use std::io::{Read, Write};

    use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};

    // Puts the master keeps (and seals) for 1 s.
    let s = start(&["--put_start_discard_timeout_sec", "1"]);
    let (id, at) = s.granted("slow", 8192).await;
    let value = payload("slow", 8192);
    let credential = Credential::cluster_from_file(Path::new(&s.token)).unwrap();
    let addr = s.segment.as_str().to_string();
    let skew = Duration::from_micros(mooncake_owner::seals::CLOCK_SKEW_US);
    let (offset, seal) = (at.offset, at.seal);
    let sent = value.clone();
    let status = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        mooncake_common::auth::authenticate_blocking(&mut conn, &credential).unwrap();
        let mut frame = RequestHeader {
            op: Op::Write,
            key_len: "slow".len() as u16,
            flags: Stamp::new(id, &ReplicateConfig::default()).flags(),
            request_id: 1,
            offset,
            length: sent.len() as u64,
            grant: id,
            seal,
        }
        .encode()
        .to_vec();
        frame.extend_from_slice(b"slow");
        frame.extend_from_slice(&sent[..4096]);
        conn.write_all(&frame).unwrap();
        // The rest once the seal has lapsed.
        std::thread::sleep(Duration::from_secs(1) + skew + Duration::from_millis(500));
        conn.write_all(&sent[4096..]).unwrap();
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        conn.read_exact(&mut h).unwrap();
        ResponseHeader::decode(&h).unwrap().code()
    })
    .await
    .unwrap();
    assert_eq!(status, Code::TransferFail);
    // Ended at the master (it keeps unfinished puts until their release timeout), the object
    // has no bytes at its owner: the write was not recorded.
    assert!(s.api.put_end(&[("slow", id)]).await.unwrap()[0].is_ok());
    let found = s.looked_up("slow").await;
    assert_eq!(
        s.read("slow", &found, 8192, found.seal).await,
        Err(Code::ObjectNotFound)
    );
}

/// Each seal is checked against the clock when its frame arrives: a connection that never lets
/// the owner's read buffer run empty (the start of its next frame always sent with the last)
/// does not keep the clock where the connection started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_seal_is_refused_on_a_connection_that_never_goes_quiet() {
    use std::io::{Read, Write};

    use mooncake_common::wire::{Op, RequestHeader, ResponseHeader, RESPONSE_HEADER_LEN};

    let s = start(&["--default_kv_lease_ttl", "100"]);
    let client = s.client().await;
    let value = payload("unquiet", 4096);
    client
        .put("unquiet", &value, &ReplicateConfig::default())
        .await
        .unwrap();
    let at = s.looked_up("unquiet").await;
    let credential = Credential::cluster_from_file(Path::new(&s.token)).unwrap();
    let addr = s.segment.as_str().to_string();
    let skew = Duration::from_micros(mooncake_owner::seals::CLOCK_SKEW_US);
    let status = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        mooncake_common::auth::authenticate_blocking(&mut conn, &credential).unwrap();
        let header = |op, key_len: usize, request_id| RequestHeader {
            op,
            key_len: key_len as u16,
            flags: 0,
            request_id,
            offset: at.offset,
            length: if op == Op::Read { 4096 } else { 0 },
            grant: at.put_id,
            seal: if op == Op::Read {
                at.seal
            } else {
                Seal::default()
            },
        };
        let ping = header(Op::Ping, 0, 1).encode();
        let mut read = header(Op::Read, "unquiet".len(), 2).encode().to_vec();
        read.extend_from_slice(b"unquiet");
        let answer = |conn: &mut std::net::TcpStream| {
            let mut h = [0u8; RESPONSE_HEADER_LEN];
            conn.read_exact(&mut h).unwrap();
            ResponseHeader::decode(&h).unwrap()
        };
        // A ping, and the first byte of the read after it (the owner answers the ping with
        // the read: it sends answers once no request is waiting).
        conn.write_all(&[&ping[..], &read[..1]].concat()).unwrap();
        // The rest of the read once its seal has lapsed.
        std::thread::sleep(Duration::from_millis(100) + skew + Duration::from_millis(500));
        conn.write_all(&read[1..]).unwrap();
        assert_eq!(answer(&mut conn).code(), Code::Ok, "the ping");
        answer(&mut conn).code()
    })
    .await
    .unwrap();
    assert_eq!(status, Code::PermissionDenied);
}

/// A batch of many writes the owner refuses (no seal), each refusal with its message: the
/// answers outgrow the socket buffers many times over, and every item still comes back refused
/// (PermissionDenied) instead of both sides waiting on each other until the deadline. Before,
/// the client budgeted 24 bytes per write's answer, sent its whole window before reading, and
/// every item failed with a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_writes_is_answered_not_timed_out() {
    let s = start(&[]);
    let n = 50_000;
    let keys: Vec<ObjectKey> = (0..n)
        .map(|i| ObjectKey::new(&format!("{i:0>400}")).unwrap())
        .collect();
    let value = [7u8; 64];
    let parts = [&value[..]];
    let items: Vec<WriteItem> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| WriteItem {
            key,
            offset: (i as u64 * 64) % (16 << 20),
            stamp: Stamp::new(1, &ReplicateConfig::default()),
            seal: Seal::default(),
            parts: &parts,
        })
        .collect();
    // A deadline that a slow debug build under load keeps well within; the two sides waiting
    // on each other would run it out all the same.
    let tcp = TcpTransport::new(mooncake_client::transport::tcp::TcpConfig {
        connect_timeout: Duration::from_secs(3),
        transfer_timeout: Duration::from_secs(60),
        connections_per_owner: 2,
        transfer_threads: 1,
        dedicated_runtime: false,
        credential: Some(Credential::cluster_from_file(Path::new(&s.token)).unwrap()),
    });
    let results = tcp.write_batch(&s.segment, &items).await;
    assert_eq!(results.len(), n);
    for r in results {
        denied(r);
    }
}
