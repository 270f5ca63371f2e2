//! The framed master RPC's borrowed codecs on a 64-key batch, both directions of the two hot
//! calls: the request a client encodes and the master decodes, and the answer the master encodes
//! and the client decodes. `cargo bench -p mooncake-bench --bench framed_codec`.

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

use mooncake_proto::framed::{keys, replicas};

const BATCH: usize = 64;

fn batch_keys() -> Vec<String> {
    (0..BATCH)
        .map(|i| format!("scale/1024/{:06}", 123_456 + i))
        .collect()
}

fn replica(i: usize) -> replicas::ReplicaRef<'static> {
    replicas::ReplicaRef {
        segment: "127.0.0.1:40001",
        offset: (i as u64) << 20,
        size: 1 << 20,
        tier: 0,
        put_id: 0,
        seal: &[],
    }
}

fn get_replicas(c: &mut Criterion) {
    let owned = batch_keys();
    let ks: Vec<&str> = owned.iter().map(String::as_str).collect();
    c.bench_function("get_replicas/request encode+decode x64", |b| {
        b.iter(|| {
            let mut buf = Vec::with_capacity(keys::strings_len(1, &ks));
            keys::encode_strings(1, black_box(&ks), &mut buf);
            black_box(keys::decode_strings(&buf, 1).unwrap().len())
        })
    });
    c.bench_function("get_replicas/answer encode x64", |b| {
        b.iter(|| {
            let mut enc = replicas::Encoder::with_capacity(BATCH * 48);
            for i in 0..BATCH {
                enc.result(0, 1 << 20, std::iter::once(replica(black_box(i))));
            }
            black_box(enc.finish(10_000, 42))
        })
    });
    let mut enc = replicas::Encoder::with_capacity(BATCH * 48);
    for i in 0..BATCH {
        enc.result(0, 1 << 20, std::iter::once(replica(i)));
    }
    let answer = enc.finish(10_000, 42);
    c.bench_function("get_replicas/answer decode x64", |b| {
        b.iter(|| black_box(replicas::decode(black_box(&answer)).unwrap().results.len()))
    });
}

fn put_start(c: &mut Criterion) {
    let owned = batch_keys();
    let items: Vec<(&str, u64)> = owned.iter().map(|k| (k.as_str(), 1 << 20)).collect();
    c.bench_function("put_start/request encode+decode x64", |b| {
        b.iter(|| {
            let mut buf = Vec::with_capacity(keys::keyed_len(1, &items));
            keys::encode_keyed(1, black_box(&items), &mut buf);
            black_box(
                keys::decode_keyed(&buf, 1, &[], |_, _| Ok(()))
                    .unwrap()
                    .len(),
            )
        })
    });
    let encode = || {
        let mut enc = replicas::Encoder::with_capacity(BATCH * 48);
        for i in 0..BATCH {
            enc.put_start_result(0, "", i as u64 + 1, std::iter::once(replica(i)));
        }
        enc.finish(0, 0)
    };
    c.bench_function("put_start/answer encode x64", |b| {
        b.iter(|| black_box(encode()))
    });
    let answer = encode();
    c.bench_function("put_start/answer decode x64", |b| {
        b.iter(|| {
            black_box(
                replicas::decode_put_start(black_box(&answer))
                    .unwrap()
                    .0
                    .len(),
            )
        })
    });
}

criterion_group!(benches, get_replicas, put_start);
criterion_main!(benches);
