//! Fuzzing on stable Rust, without a fuzzing toolchain: every decoder of bytes that come from the
//! network or back from disk is a target, fed mutations of valid encodings (bit flips, bytes and
//! integers set to edge values, truncation, extension, splices) and plain random bytes from a
//! seeded generator. A target must neither panic nor ask for memory out of proportion to its input
//! (a declared length is not a reason to allocate). `mooncake_fuzz` drives the targets for as many
//! inputs as asked and keeps any input that fails one under `tests/fuzz_corpus/<target>/`, where
//! the `fuzz` test replays it forever after; `network` (in `fuzz_net`) does the same to live
//! servers.

use std::{
    cell::Cell,
    panic::{catch_unwind, AssertUnwindSafe},
    path::{Path, PathBuf},
    time::Duration,
};

use mooncake_common::{
    auth::{self, Access, Credential, Keyring, Scope, Seal, SealKey},
    local::{frame_header, FrameReader, FrameWriter, Item, LocalOp},
    wire::{self, Op, RequestHeader, ResponseHeader},
};
use mooncake_proto::{
    framed::{self as rpc_wire, fields, keys, replicas},
    master as pb,
};
use prost::Message;

/// A decoder under test: its name, valid encodings to mutate, and the run of one input.
pub struct Target {
    pub name: &'static str,
    pub seeds: fn() -> Vec<Vec<u8>>,
    pub run: fn(&[u8]),
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "wire",
        seeds: wire_seeds,
        run: wire_run,
    },
    Target {
        name: "framed",
        seeds: framed_seeds,
        run: framed_run,
    },
    Target {
        name: "local",
        seeds: local_seeds,
        run: local_run,
    },
    Target {
        name: "ssd",
        seeds: ssd_seeds,
        run: ssd_run,
    },
    Target {
        name: "auth",
        seeds: auth_seeds,
        run: auth_run,
    },
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// xorshift64*: fast, seeded, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

const EDGE_BYTES: [u8; 8] = [0, 1, 0x7f, 0x80, 0xfe, 0xff, b'M', b'C'];
const EDGE_INTS: [u64; 10] = [
    0,
    1,
    0x7f,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// One input: a mutation of a seed (most of the time) or random bytes.
pub fn input(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    if seeds.is_empty() || rng.below(10) == 0 {
        let n = rng.below(256);
        return rng.bytes(n);
    }
    let mut b = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        mutate(rng, &mut b, seeds);
    }
    b
}

fn mutate(rng: &mut Rng, b: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    match rng.below(8) {
        0 if !b.is_empty() => {
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
        }
        1 if !b.is_empty() => {
            let i = rng.below(b.len());
            b[i] = EDGE_BYTES[rng.below(EDGE_BYTES.len())];
        }
        2 if b.len() >= 8 => {
            // An integer field (2, 4 or 8 bytes, either endianness) set to an edge value.
            let w = [2, 4, 8][rng.below(3)];
            let i = rng.below(b.len() - w + 1);
            let v = EDGE_INTS[rng.below(EDGE_INTS.len())].to_le_bytes();
            b[i..i + w].copy_from_slice(&v[..w]);
        }
        3 if !b.is_empty() => b.truncate(rng.below(b.len())),
        4 => {
            let n = rng.below(64);
            let extra = rng.bytes(n);
            b.extend_from_slice(&extra);
        }
        5 if !b.is_empty() => {
            let i = rng.below(b.len());
            b.remove(i);
        }
        6 => {
            let other = &seeds[rng.below(seeds.len())];
            let at = rng.below(b.len() + 1);
            let from = rng.below(other.len() + 1);
            b.truncate(at);
            b.extend_from_slice(&other[from..]);
        }
        _ => {
            let i = rng.below(b.len() + 1);
            b.insert(i, rng.next_u64() as u8);
        }
    }
}

thread_local! {
    /// The largest allocation since the last reset (see `CountingAlloc`).
    pub static LARGEST_ALLOC: Cell<usize> = const { Cell::new(0) };
}

/// An allocator that notes the largest request, so a driver can tell a decoder that trusts a
/// declared length. Install it with `#[global_allocator]` in the driver binary.
pub struct CountingAlloc;

// SAFETY: every call is forwarded unchanged to the system allocator; the thread-local note
// allocates nothing.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = LARGEST_ALLOC.try_with(|c| c.set(c.get().max(layout.size())));
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = LARGEST_ALLOC.try_with(|c| c.set(c.get().max(layout.size())));
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        let _ = LARGEST_ALLOC.try_with(|c| c.set(c.get().max(new)));
        // SAFETY: forwarded unchanged.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

/// Why one input failed a target.
#[derive(Debug)]
pub enum Finding {
    Panic(String),
    /// It asked for this many bytes at once for an input of `input` bytes.
    Allocation {
        bytes: usize,
        input: usize,
    },
}

/// The most a decoder may allocate at once for an input: generous, but far below what a declared
/// length of gigabytes would ask.
fn allocation_cap(input: usize) -> usize {
    (1 << 20) + 64 * input
}

/// Runs one input through a target.
pub fn check(t: &Target, input: &[u8]) -> Result<(), Finding> {
    LARGEST_ALLOC.with(|c| c.set(0));
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (t.run)(input))) {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        return Err(Finding::Panic(msg));
    }
    let largest = LARGEST_ALLOC.with(|c| c.get());
    if largest > allocation_cap(input.len()) {
        return Err(Finding::Allocation {
            bytes: largest,
            input: input.len(),
        });
    }
    Ok(())
}

/// What a run of a target found.
#[derive(Debug, Default)]
pub struct Report {
    pub inputs: u64,
    pub findings: Vec<(Vec<u8>, Finding)>,
}

/// Feeds `n` inputs from `seed` to `t`, keeping at most a few failing ones.
pub fn fuzz(t: &Target, n: u64, seed: u64) -> Report {
    let seeds = (t.seeds)();
    let mut rng = Rng::new(seed);
    let mut report = Report::default();
    for _ in 0..n {
        let input = input(&mut rng, &seeds);
        report.inputs += 1;
        if let Err(f) = check(t, &input) {
            if report.findings.len() < 16 {
                report.findings.push((input, f));
            }
        }
    }
    report
}

/// Where the inputs that once failed a target are kept.
pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz_corpus")
        .join(target)
}

// ---- wire: the data plane's headers ----

fn wire_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for op in [
        Op::Write,
        Op::Read,
        Op::Ping,
        Op::ReadDisk,
        Op::PeerWrite,
        Op::PeerGrant,
    ] {
        let h = RequestHeader {
            op,
            key_len: if op == Op::Ping { 0 } else { 9 },
            flags: 0x81,
            request_id: 7,
            offset: 4096,
            length: 65536,
            grant: 42,
            seal: Seal::new(1 << 50, [3; 16]),
        };
        seeds.push(h.encode().to_vec());
    }
    let r = ResponseHeader {
        op: Op::Read,
        status: -704,
        request_id: 7,
        length: 100,
    };
    seeds.push(r.encode().to_vec());
    seeds
}

fn wire_run(b: &[u8]) {
    let mut h = [0u8; wire::REQUEST_HEADER_LEN];
    let n = b.len().min(h.len());
    h[..n].copy_from_slice(&b[..n]);
    if let Ok(req) = RequestHeader::decode(&h) {
        // What decodes must encode back to itself and stay within the sanity bounds.
        assert_eq!(RequestHeader::decode(&req.encode()), Ok(req));
        assert!(req.length <= wire::MAX_PAYLOAD);
        let _ = req.body_len();
    }
    let mut r = [0u8; wire::RESPONSE_HEADER_LEN];
    let n = b.len().min(r.len());
    r[..n].copy_from_slice(&b[..n]);
    if let Ok(resp) = ResponseHeader::decode(&r) {
        assert_eq!(ResponseHeader::decode(&resp.encode()), Ok(resp));
        let _ = resp.code();
    }
}

// ---- framed: the master's framed RPC (server and client side) ----

fn framed_seeds() -> Vec<Vec<u8>> {
    let mut seeds = vec![rpc_wire::hello().to_vec()];
    let items = [("a/key", 4096u64), ("another/key", 1 << 20)];
    let mut body = Vec::new();
    keys::encode_keyed(fields::put_start_request::ITEMS, &items, &mut body);
    let config = pb::ReplicateConfig {
        replica_num: 2,
        preferred_segments: vec!["127.0.0.1:7000".into()],
        ..Default::default()
    };
    prost::encoding::message::encode(fields::put_start_request::CONFIG, &config, &mut body);
    seeds.push(frame(2, &body));
    let mut body = Vec::new();
    keys::encode_strings(fields::KEYS, &["k1", "k2", "k3"], &mut body);
    keys::encode_strings(fields::RELEASE, &["k0"], &mut body);
    seeds.push(frame(4, &body));
    let mut enc = replicas::Encoder::default();
    let seal = [5u8; 24];
    let rep = |offset| replicas::ReplicaRef {
        segment: "127.0.0.1:7000",
        offset,
        size: 4096,
        tier: 0,
        put_id: 9,
        seal: &seal,
    };
    enc.result(0, 4096, [rep(0), rep(4096)]);
    enc.result(-704, 0, []);
    seeds.push(frame(0, &enc.finish(10_000, 42)));
    let mut enc = replicas::Encoder::default();
    enc.put_start_result(0, "", 11, [rep(8192)]);
    enc.put_start_result(-705, "exists", 0, []);
    seeds.push(frame(0, &enc.finish_put_start()));
    seeds.push(frame(
        1,
        &pb::MountSegmentRequest {
            segment: "127.0.0.1:7000".into(),
            size: 1 << 30,
            ..Default::default()
        }
        .encode_to_vec(),
    ));
    seeds
}

fn frame(method: u32, body: &[u8]) -> Vec<u8> {
    let mut f = rpc_wire::encode_header(body.len(), method, 1).to_vec();
    f.extend_from_slice(body);
    f
}

fn framed_run(b: &[u8]) {
    if let Some(h) = b.first_chunk::<{ rpc_wire::HELLO_LEN }>() {
        let _ = rpc_wire::check_hello(h);
    }
    let body = match b.first_chunk::<{ rpc_wire::HEADER_LEN }>() {
        Some(h) => {
            if let Ok((len, method, _)) = rpc_wire::decode_header(h) {
                assert!(
                    len <= rpc_wire::MAX_BODY,
                    "a body over the limit was accepted"
                );
                let _ = rpc_wire::Method::from_u32(method);
            }
            &b[rpc_wire::HEADER_LEN..]
        }
        None => b,
    };
    // Server side: the hot calls' borrowed decoders, and every message the cold calls decode.
    let _ = keys::decode_keyed(
        body,
        fields::put_start_request::ITEMS,
        &[fields::put_start_request::CONFIG],
        |field, bytes| {
            if field == fields::put_start_request::CONFIG {
                pb::ReplicateConfig::default()
                    .merge(bytes)
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        },
    );
    let _ = keys::decode_keyed(body, fields::PUT_REFS, &[], |_, _| Ok(()));
    let _ = keys::decode_strings(body, fields::KEYS);
    let _ = keys::decode_strings(body, fields::RELEASE);
    let _ = pb::MountSegmentRequest::decode(body);
    let _ = pb::HeartbeatRequest::decode(body);
    let _ = pb::BatchRemoveRequest::decode(body);
    let _ = pb::RemoveAllRequest::decode(body);
    let _ = pb::CreateReplicaTaskRequest::decode(body);
    let _ = pb::QueryTaskRequest::decode(body);
    let _ = pb::BatchReleaseLeasesRequest::decode(body);
    let _ = pb::BatchReplicaClearRequest::decode(body);
    // Client side: the answers, down to the domain types.
    let _ = replicas::decode(body);
    let _ = replicas::decode_put_start(body);
    let _ = mooncake_client::master::answers::lookup_from_frame(body);
    let _ = mooncake_client::master::answers::grants_from_frame(body);
}

// ---- local: the same-host socket's frames ----

fn local_seeds() -> Vec<Vec<u8>> {
    let mut hello = FrameWriter::new(LocalOp::Hello);
    hello
        .u8(mooncake_common::local::VERSION)
        .bytes(b"127.0.0.1:7000");
    let mut begin = FrameWriter::new(LocalOp::BeginWrite);
    begin.u32(2);
    for (i, key) in ["a", "key/2"].into_iter().enumerate() {
        begin.item(Item {
            offset: 4096 * i as u64,
            len: 4096,
            grant: 3,
            flags: 1,
            seal: Seal::new(1 << 50, [1; 16]),
            key,
        });
    }
    let mut end = FrameWriter::new(LocalOp::EndWrite);
    end.u32(2).u64(0).u64(4096).u8(1).u64(4096).u64(4096).u8(0);
    let mut reply = FrameWriter::new(LocalOp::Hello);
    reply.i32(0).u64(1 << 30);
    vec![hello.finish(), begin.finish(), end.finish(), reply.finish()]
}

fn local_run(b: &[u8]) {
    let Some(h) = b.first_chunk::<5>() else {
        return;
    };
    let Ok((len, op)) = frame_header(*h) else {
        return;
    };
    let body = &b[5..b.len().min(5 + len)];
    // As the owner reads each op (and the client the answers).
    let mut r = FrameReader::new(body);
    match op {
        LocalOp::Hello => {
            let _ = r.u8();
            let _ = std::str::from_utf8(r.rest());
            let mut r = FrameReader::new(body);
            let _ = (r.i32(), r.u64());
        }
        LocalOp::BeginWrite | LocalOp::BeginRead => {
            if let Ok(n) = r.count() {
                for _ in 0..n {
                    match r.item() {
                        Ok(item) => {
                            let _ = mooncake_common::ObjectKey::from_bytes(item.key);
                        }
                        Err(_) => break,
                    }
                }
            }
            let mut r = FrameReader::new(body);
            if let Ok(n) = r.count() {
                for _ in 0..n {
                    if r.i32().is_err() {
                        break;
                    }
                }
            }
        }
        LocalOp::EndWrite => {
            if let Ok(n) = r.count() {
                for _ in 0..n {
                    if r.u64().and(r.u64()).and(r.u8()).is_err() {
                        break;
                    }
                }
            }
        }
        LocalOp::EndRead => {
            if let Ok(n) = r.count() {
                for _ in 0..n {
                    if r.u64().and(r.u64()).is_err() {
                        break;
                    }
                }
            }
        }
    }
}

// ---- ssd: records read back from the SSD tier ----

fn ssd_seeds() -> Vec<Vec<u8>> {
    use mooncake_owner::ssd::record;
    let mut block = vec![0u8; 4096];
    record::Superblock {
        file_id: 77,
        capacity: 1 << 30,
    }
    .encode(&mut block);
    let mut rec = vec![0u8; 4096];
    let key = mooncake_common::ObjectKey::new("some/key").expect("valid");
    record::encode_header(&mut rec, 77, 12, 0xABCD, &key, &[7u8; 3000]);
    vec![block, rec]
}

fn ssd_run(b: &[u8]) {
    use mooncake_owner::ssd::record;
    // The tier reads whole aligned blocks.
    let mut block = vec![0u8; 4096];
    let n = b.len().min(block.len());
    block[..n].copy_from_slice(&b[..n]);
    let _ = record::Superblock::decode(&block);
    if let Some(key_len) = record::key_len_of(&block) {
        let _ = key_len;
        if let Some(h) = record::decode_header(&block, 77) {
            let _ = (h.record_len(), h.value_offset());
        }
    }
    let _ = record::decode_header(&b[..n], 77);
}

// ---- auth: the connection handshake, both sides ----

const FUZZ_SECRET: &[u8] = b"the fuzzer's secret, 32 bytes!!!";

fn auth_seeds() -> Vec<Vec<u8>> {
    let mut hello = auth::HELLO_MAGIC.to_vec();
    hello.extend_from_slice(&[9; 32]);
    hello.push(7);
    hello.extend_from_slice(b"cluster");
    hello.extend_from_slice(&[1; 32]);
    let mut challenge = 0i32.to_le_bytes().to_vec();
    challenge.extend_from_slice(&[2; 64]);
    challenge.extend_from_slice(&0i32.to_le_bytes());
    challenge.extend_from_slice(&[0, 0]);
    let mut refusal = (-1500i32).to_le_bytes().to_vec();
    refusal.extend_from_slice(&5u16.to_le_bytes());
    refusal.extend_from_slice(b"nope!");
    vec![hello, challenge, refusal]
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
}

fn auth_run(b: &[u8]) {
    use tokio::io::AsyncWriteExt;
    let keyring = Keyring::cluster(FUZZ_SECRET);
    let credential = Credential::new(auth::CLUSTER, FUZZ_SECRET).expect("valid");
    RUNTIME.with(|rt| {
        rt.block_on(async {
            // The server reading a peer that sends `b` and hangs up.
            let (mut c, mut s) = tokio::io::duplex(1 << 16);
            c.write_all(b).await.expect("the pipe holds it");
            drop(c);
            let _ = auth::admit(
                &mut s,
                true,
                Some(&keyring),
                &"fuzz",
                Duration::from_secs(1),
            )
            .await;
            // The client reading a server that answers `b`.
            let (mut c, mut s) = tokio::io::duplex(1 << 16);
            s.write_all(b).await.expect("the pipe holds it");
            drop(s);
            let _ = auth::authenticate(&mut c, &credential).await;
        })
    });
    // And a seal read off the wire, checked against a scope.
    let key = SealKey::from_secret(FUZZ_SECRET);
    if let Ok(seal) = Seal::from_bytes(&b[..b.len().min(auth::SEAL_LEN)]) {
        let scope = Scope {
            access: Access::Read,
            tenant: "",
            key: "k",
            segment: "127.0.0.1:1",
            offset: 0,
            length: b.len() as u64,
            put_id: 1,
        };
        let _ = key.check(&scope, &seal, 0);
    }
}
