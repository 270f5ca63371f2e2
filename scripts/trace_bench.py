"""One store's prefix-cache trace replay through Mooncake's Python API, for scripts/trace_compare
(the same steps as `mooncake_bench --trace`): per request, `batch_is_exist` over its blocks,
`batch_get_into` of the longest cached prefix (into a poisoned buffer, every byte checked against
the block's pattern), then `batch_put_from` of the blocks that were missing, from registered
memory. Prints one JSON line: requests/s, the block hit ratio, p50/p99 of lookup+get (the store's
two calls; the harness's poisoning and checks are outside) and of put, and the errors. Exits
non-zero when a block read back wrong or a lookup failed.

    python trace_bench.py --store ours|mooncake --master HOST:PORT [--metadata URL] \
        --trace FILE [--block-size 65536] [--tag NAME]
"""

import argparse
import json
import sys
import time

import numpy as np

import bench_stores


def block_bytes(block_id, size):
    """The block's content: its id repeated, so a wrong or stale read shows (made per use:
    keeping them would take the working set's size in memory)."""
    unit = f"<{block_id:014x}>".encode()
    return (unit * (size // len(unit) + 1))[:size]


def load(path):
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def open_store(args):
    return bench_stores.open_store(args.store, args.master, args.metadata, asynchronous=False)


def pct(values, p):
    if not values:
        return 0.0
    values = sorted(values)
    return values[round((len(values) - 1) * p)] * 1e6


def main(args):
    requests = load(args.trace)
    size = args.block_size
    longest = max(len(r) for r in requests)
    store = open_store(args)
    src = np.zeros(longest * size, dtype=np.uint8)
    dst = np.zeros(longest * size, dtype=np.uint8)
    for a in (src, dst):
        if store.register_buffer(a.ctypes.data, a.nbytes) != 0:
            sys.exit("register_buffer failed")
    lookups, puts = [], []
    hits = blocks = verified = wrong = failed_gets = failed_puts = lookup_errors = 0
    prefix = f"trace/{args.tag or args.store}"
    started = time.perf_counter()
    try:
        for req in requests:
            keys = [f"{prefix}/{b}" for b in req]
            blocks += len(req)
            t = time.perf_counter()
            codes = store.batch_is_exist(keys)
            took = time.perf_counter() - t
            # An error is counted, and the block taken as missing (it is computed again).
            lookup_errors += sum(1 for c in codes if c < 0)
            found = [c == 1 for c in codes]
            cached = next((i for i, f in enumerate(found) if not f), len(found))
            usable = cached
            if cached:
                # Poisoned first (untimed): a get that reports success without writing every
                # byte cannot pass on what an earlier request left in the buffer.
                dst[:cached * size] = 0xA5
                t = time.perf_counter()
                got = store.batch_get_into(keys[:cached], [dst.ctypes.data + i * size for i in range(cached)],
                                           [size] * cached)
                took += time.perf_counter() - t
                usable = next((i for i, n in enumerate(got) if n != size), cached)
                # Checked outside the timed span: the harness's work is not the store's.
                for i, n in enumerate(got):
                    if n == size:
                        if dst[i * size:(i + 1) * size].tobytes() == block_bytes(req[i], size):
                            verified += 1
                        else:
                            wrong += 1
                    else:
                        failed_gets += 1
            lookups.append(took)
            hits += usable
            missing = [i for i in range(usable, len(req)) if i < cached or not found[i]]
            if not missing:
                continue
            for slot, i in enumerate(missing):
                src[slot * size:(slot + 1) * size] = np.frombuffer(block_bytes(req[i], size), dtype=np.uint8)
            t = time.perf_counter()
            codes = store.batch_put_from([keys[i] for i in missing],
                                         [src.ctypes.data + slot * size for slot in range(len(missing))],
                                         [size] * len(missing))
            puts.append(time.perf_counter() - t)
            failed_puts += sum(1 for c in codes if c not in (0, -705))
        seconds = time.perf_counter() - started
    finally:
        store.close()
    print(json.dumps({
        "store": args.tag or args.store, "requests": len(requests), "blocks": blocks, "seconds": seconds,
        "requests_per_s": len(requests) / seconds,
        # The store's own time: the timed calls alone, not the harness's making and checking of
        # every block's bytes between them (the same for every store).
        "store_requests_per_s": len(requests) / max(sum(lookups) + sum(puts), 1e-9),
        "hit_ratio": hits / max(blocks, 1),
        "lookup_get_p50_us": pct(lookups, 0.5), "lookup_get_p99_us": pct(lookups, 0.99),
        "put_p50_us": pct(puts, 0.5), "put_p99_us": pct(puts, 0.99),
        "verified": verified, "wrong_bytes": wrong, "failed_gets": failed_gets, "failed_puts": failed_puts,
        "lookup_errors": lookup_errors,
    }), flush=True)
    if wrong or lookup_errors:
        sys.exit(f"{args.store}: {wrong} blocks read back wrong, {lookup_errors} lookups failed")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", choices=["ours", "mooncake"], required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--block-size", type=int, default=64 << 10)
    ap.add_argument("--tag", default="")
    main(ap.parse_args())
