"""One store's async batch throughput, for scripts/async_compare: CALLS concurrent
`async_batch_put_from` calls (a batch of keys each) from registered memory, then CALLS concurrent
`async_batch_get_into` calls into other registered memory, every byte checked, the keys removed;
REPS times. Prints one JSON line per phase and rep.

    python async_bench.py --store ours|mooncake --master HOST:PORT [--metadata URL] --size 1MiB \
        [--tag NAME]   # the "store" field of the JSON lines (default: --store)
"""

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

import bench_stores

ROUND_BYTES = 128 << 20  # per phase: CALLS x keys x size


def parse_size(s):
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20}
    for u, m in units.items():
        if s.upper().endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


def open_store(args):
    return bench_stores.open_store(args.store, args.master, args.metadata, asynchronous=True)


async def phase(calls):
    started = time.perf_counter()
    results = await asyncio.gather(*calls)
    return time.perf_counter() - started, results


async def main(args):
    size = parse_size(args.size)
    per_call = max(1, ROUND_BYTES // (args.calls * size))
    total = args.calls * per_call
    store = open_store(args)
    src = np.frombuffer(os.urandom(total * size), dtype=np.uint8).copy()
    dst = np.empty_like(src)
    for a in (src, dst):
        if store.register_buffer(a.ctypes.data, a.nbytes) != 0:
            sys.exit("register_buffer failed")
    try:
        # A first round, not reported: connections, mappings and first touches, as a worker
        # pays once at start.
        for rep in range(-args.warmup, args.reps):
            keys = [f"async/{args.store}/{os.getpid()}/{rep}/{i}" for i in range(total)]
            chunks = [range(c * per_call, (c + 1) * per_call) for c in range(args.calls)]
            put_s, codes = await phase([
                store.async_batch_put_from([keys[i] for i in ch], [src.ctypes.data + i * size for i in ch],
                                           [size] * len(ch)) for ch in chunks])
            dst[:] = 0
            get_s, got = await phase([
                store.async_batch_get_into([keys[i] for i in ch], [dst.ctypes.data + i * size for i in ch],
                                           [size] * len(ch)) for ch in chunks])
            put_errors = sum(1 for r in codes for c in r if c != 0)
            get_errors = sum(1 for r in got for n in r if n != size)
            if not np.array_equal(src, dst):
                sys.exit(f"{args.store}: bytes read back differ from those written")
            store.batch_remove(keys, True)
            if rep < 0:
                continue
            for op, secs, errors in (("put", put_s, put_errors), ("get", get_s, get_errors)):
                print(json.dumps({"store": args.tag or args.store, "op": op, "size": size, "calls": args.calls,
                                  "keys_per_call": per_call, "gib_s": total * size / secs / (1 << 30),
                                  "errors": errors, "rep": rep}), flush=True)
    finally:
        store.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", choices=["ours", "mooncake"], required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--size", default="1MiB")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tag", default="")
    asyncio.run(main(ap.parse_args()))
