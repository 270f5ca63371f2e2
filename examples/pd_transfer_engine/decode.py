#!/usr/bin/env python3
"""A decode worker: its own TransferEngine and KV region; it looks the prefill engine up at the
bootstrap server (waiting at most --wait seconds for it to register), then for each request
pulls the request's blocks of every layer from the prefill worker of the same tp rank into its
own slots in one batch, and checks every byte. A request whose transfer fails is reported and
the next goes on. Prints one line per request and a summary; exit code 0 when all succeeded,
1 when some failed, 2 when the engine never registered."""

import argparse
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv import Region, block_bytes_of, offset  # noqa: E402

from mooncake_rs.engine import TransferEngine  # noqa: E402


def find_worker(bootstrap, engine_id, tp_rank, wait):
    """The prefill worker of `engine_id` with this tp rank, once registered; None after `wait`."""
    end = time.monotonic() + wait
    while True:
        try:
            with urllib.request.urlopen(f"{bootstrap}/query", timeout=2) as r:
                for dp in json.loads(r.read()).values():
                    if dp["engine_id"] == engine_id:
                        w = dp["workers"].get(str(tp_rank), {}).get("0")
                        if w:
                            return w
        except OSError:
            pass
        if time.monotonic() >= end:
            return None
        time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--tp-rank", type=int, required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks-per-request", type=int, default=4)
    ap.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the engine to register")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    args = ap.parse_args()

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("decode: TransferEngine.initialize failed")
    t0 = time.monotonic()
    w = find_worker(args.bootstrap, args.engine_id, args.tp_rank, args.wait)
    if w is None:
        print(f"decode tp{args.tp_rank}: engine {args.engine_id!r} never registered at {args.bootstrap} "
              f"within {args.wait:.0f} s", flush=True)
        sys.exit(2)
    layers, blocks, size = w["layers"], w["blocks"], w["block_bytes"]
    region = Region(engine, layers, blocks, size)
    print(f"decode tp{args.tp_rank}: found {w['session']} after {time.monotonic() - t0:.2f} s", flush=True)
    ok = failed = 0
    for r in range(args.requests):
        want = [(r * args.blocks_per_request + i) % blocks for i in range(args.blocks_per_request)]
        slots = list(range(len(want)))  # this worker's free slots for the request
        local, remote = [], []
        for layer in range(layers):
            for b, s in zip(want, slots):
                local.append(region.base + offset(layer, s, blocks, size))
                remote.append(w["kv_base"] + offset(layer, b, blocks, size))
        t = time.monotonic()
        rc = engine.batch_transfer_sync_read(w["session"], local, remote, [size] * len(local))
        took = time.monotonic() - t
        if rc != 0:
            failed += 1
            print(f"decode tp{args.tp_rank}: request {r} failed ({rc}) after {took:.2f} s", flush=True)
        else:
            bad = [(layer, b) for layer in range(layers) for b, s in zip(want, slots)
                   if region.block(layer, s) != block_bytes_of(args.engine_id, args.tp_rank, layer, b, size)]
            if bad:
                failed += 1
                print(f"decode tp{args.tp_rank}: request {r} WRONG BYTES in {bad[:4]}", flush=True)
            else:
                ok += 1
                print(f"decode tp{args.tp_rank}: request {r} ok, {len(local)} blocks checked", flush=True)
        time.sleep(args.pause)
    print(f"decode tp{args.tp_rank}: {ok} requests ok, {failed} failed", flush=True)
    sys.exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    main()
