#!/usr/bin/env python3
"""Point-to-point transfer benchmark, the same code against either TransferEngine:

    engine_bench.py --impl ours       # mooncake_rs.engine.TransferEngine
    engine_bench.py --impl mooncake   # mooncake.engine.TransferEngine (Mooncake's PyPI package)

A target process (this script with --role target) registers a buffer and waits; initiator
processes write and read batches into it. Workloads: batch sync write and read of 64 x 128 KiB
and of 16 x 4 MiB, single 4 KiB write latency, and two initiators at once (16 x 4 MiB writes);
with ours, also 16 x 4 MiB into and out of a managed buffer of the target's
(allocate_managed_buffer), which a same-host peer copies through a mapping.
Each measurement follows an unreported warm-up. Every byte is checked after each workload: the target region is read back and compared with
what was written. Prints one JSON line per workload (GiB/s medians over reps, latency p50/p99 in
microseconds). scripts/engine_compare runs both implementations interleaved.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
REGION = 64 * MIB


def engine_class(impl):
    if impl == "ours":
        from mooncake_rs.engine import TransferEngine
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


def start(impl):
    e = engine_class(impl)()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        sys.exit(f"initialize failed: {rc}")
    return e


def region(e, size, seed=None):
    buf = ctypes.create_string_buffer(size)
    if seed is not None:
        pattern = bytes((i * 131 + seed) % 251 for i in range(1 << 16))
        for off in range(0, size, len(pattern)):
            ctypes.memmove(ctypes.addressof(buf) + off, pattern, min(len(pattern), size - off))
    addr = ctypes.addressof(buf)
    if e.register_memory(addr, size) != 0:
        sys.exit("register_memory failed")
    return buf, addr


def target(args):
    e = start(args.impl)
    buf, addr = region(e, REGION)
    info = {"session": f"127.0.0.1:{e.get_rpc_port()}", "addr": addr}
    if args.impl == "ours":
        # Also a managed buffer, which ours keeps in a memory file that a same-host peer maps.
        managed = e.allocate_managed_buffer(REGION)
        if not managed:
            sys.exit("allocate_managed_buffer failed")
        info["managed"] = managed
    print(json.dumps(info), flush=True)
    sys.stdin.read()  # until the harness closes it
    del buf


def run_batches(e, peer, local, remote, count, size, op, reps):
    srcs = [local + i * size for i in range(count)]
    dsts = [remote + i * size for i in range(count)]
    call = e.batch_transfer_sync_write if op == "write" else e.batch_transfer_sync_read
    rates = []
    for rep in range(reps + 1):
        t = time.perf_counter()
        rc = call(peer, srcs, dsts, [size] * count)
        dt = time.perf_counter() - t
        if rc != 0:
            sys.exit(f"batch {op} failed: {rc}")
        if rep > 0:  # the first is a warm-up (connections, first touch of pages)
            rates.append(count * size / dt / (1 << 30))
    return statistics.median(rates)


def differing(back_addr, local_buf, nbytes):
    """Bytes of the region at back_addr that differ from local_buf's first nbytes."""
    got, want = ctypes.string_at(back_addr, nbytes), local_buf.raw[:nbytes]
    if got == want:
        return 0
    return sum(1 for a, b in zip(got, want) if a != b)


def check(e, peer, local_buf, back_addr, remote, nbytes):
    """Reads the target's bytes back and compares them with what was written."""
    back = (ctypes.c_char * nbytes).from_address(back_addr)
    ctypes.memset(back_addr, 0, nbytes)
    step = 4 * MIB
    n = (nbytes + step - 1) // step
    lens = [min(step, nbytes - i * step) for i in range(n)]
    if e.batch_transfer_sync_read(peer, [back_addr + i * step for i in range(n)],
                                  [remote + i * step for i in range(n)], lens) != 0:
        sys.exit("read-back failed")
    del back
    return differing(back_addr, local_buf, nbytes)


def initiator(args):
    e = start(args.impl)
    seed = args.seed
    src_buf, src = region(e, REGION, seed=seed)
    back_buf, back = region(e, REGION)
    peer, remote = args.peer, args.addr
    out = []
    for count, size in ((64, 128 << 10), (16, 4 * MIB)):
        if args.only_conc:
            break
        for op in ("write", "read"):
            # The write lands src in the target; the read brings the target's bytes back here.
            dst_local = src if op == "write" else back
            if op == "read":
                # The write's check left the target's bytes here: a read that moved nothing
                # must not pass.
                ctypes.memset(back, 0, count * size)
            gibs = run_batches(e, peer, dst_local, remote, count, size, op, args.reps)
            # A read's own bytes first (the check below reads back in 4 MiB pieces).
            wrong = differing(back, src_buf, count * size) if op == "read" else 0
            wrong += check(e, peer, src_buf, back, remote, count * size)
            out.append({"workload": f"batch {op} {count} x {size >> 10} KiB", "GiB/s": round(gibs, 3),
                        "wrong_bytes": wrong})
    if args.managed and not args.only_conc:
        # The target's managed buffer instead of memory it allocated itself.
        for op in ("write", "read"):
            dst_local = src if op == "write" else back
            if op == "read":
                ctypes.memset(back, 0, 16 * 4 * MIB)
            gibs = run_batches(e, peer, dst_local, args.managed, 16, 4 * MIB, op, args.reps)
            wrong = differing(back, src_buf, 16 * 4 * MIB) if op == "read" else 0
            wrong += check(e, peer, src_buf, back, args.managed, 16 * 4 * MIB)
            prep = "into" if op == "write" else "from"
            out.append({"workload": f"batch {op} 16 x 4096 KiB, {prep} the target's managed buffer",
                        "GiB/s": round(gibs, 3), "wrong_bytes": wrong})
    if not args.only_conc:
        lat = []
        for i in range(args.small_ops + 100):
            t = time.perf_counter()
            if e.transfer_sync_write(peer, src + (i % 64) * 4096, remote + (i % 64) * 4096, 4096) != 0:
                sys.exit("4 KiB write failed")
            if i >= 100:  # after a warm-up
                lat.append((time.perf_counter() - t) * 1e6)
        lat.sort()
        wrong = check(e, peer, src_buf, back, remote, 64 * 4096)
        out.append({"workload": "single 4 KiB write", "p50_us": round(lat[len(lat) // 2], 1),
                    "p99_us": round(lat[int(len(lat) * 0.99)], 1), "wrong_bytes": wrong})
    else:
        # One of two concurrent initiators: its own half of the target region.
        half = remote + (REGION // 2 if seed % 2 else 0)
        gibs = run_batches(e, peer, src, half, 8, 4 * MIB, "write", args.reps)
        wrong = check(e, peer, src_buf, back, half, 8 * 4 * MIB)
        out.append({"workload": "2 initiators, write 8 x 4 MiB each", "GiB/s": round(gibs, 3),
                    "wrong_bytes": wrong})
    for o in out:
        print(json.dumps({"impl": args.impl, **o}), flush=True)
    bad = [o["workload"] for o in out if o["wrong_bytes"]]
    if bad:
        sys.exit(f"wrong bytes in: {', '.join(bad)}")


def harness(args):
    me = [sys.executable, os.path.abspath(__file__), "--impl", args.impl]
    tgt = subprocess.Popen(me + ["--role", "target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(tgt.stdout.readline())
        base = me + ["--peer", info["session"], "--addr", str(info["addr"]), "--reps", str(args.reps),
                     "--small-ops", str(args.small_ops)]
        if "managed" in info:
            base += ["--managed", str(info["managed"])]
        subprocess.run(base + ["--role", "initiator", "--seed", "1"], check=True)
        both = [subprocess.Popen(base + ["--role", "initiator", "--only-conc", "--seed", str(s)]) for s in (2, 3)]
        for p in both:
            if p.wait() != 0:
                sys.exit("a concurrent initiator failed")
    finally:
        tgt.stdin.close()
        try:
            tgt.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tgt.kill()
            tgt.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["ours", "mooncake"], default="ours")
    ap.add_argument("--role", choices=["harness", "target", "initiator"], default="harness")
    ap.add_argument("--peer")
    ap.add_argument("--addr", type=int)
    ap.add_argument("--managed", type=int, help="address of the target's managed buffer (ours)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small-ops", type=int, default=2000)
    ap.add_argument("--only-conc", action="store_true")
    args = ap.parse_args()
    {"harness": harness, "target": target, "initiator": initiator}[args.role](args)


if __name__ == "__main__":
    main()
