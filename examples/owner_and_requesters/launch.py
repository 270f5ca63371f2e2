"""Owner and requester-only ranks: run under `scripts/mooncake_owner`, which starts this node's
owner and exports MOONCAKE_PREFERRED_SEGMENT. This launcher starts RANKS requester-only worker
processes (global_segment_size=0, as inference workers run); each puts its own keys, which land
on the node's owner, then reads every other rank's keys back and checks them byte for byte. At
the end the launcher reads the master's per-segment metrics: the node's owner holds all of it.

    scripts/mooncake_owner --master 127.0.0.1:50051 --host 127.0.0.1 --port 0 --segment-size 256MiB \
        -- python examples/owner_and_requesters/launch.py --master 127.0.0.1:50051 \
           --metrics http://127.0.0.1:9003/metrics
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.request

KEYS, SIZE = 32, 64 << 10


def value(key):
    """The bytes stored under `key`: derived from it, so any rank can check them."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (SIZE // len(seed) + 1))[:SIZE]


def worker(args):
    from mooncake_rs.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        sys.exit(f"rank {args.rank}: setup failed with {rc}")
    try:
        mine = [f"ranks/{args.rank}/{i}" for i in range(KEYS)]
        rc = store.put_batch(mine, [value(k) for k in mine])
        if rc != 0:
            sys.exit(f"rank {args.rank}: put_batch failed with {rc}")
        others = [f"ranks/{r}/{i}" for r in range(args.ranks) if r != args.rank for i in range(KEYS)]
        deadline = time.monotonic() + 30
        while not all(x == 1 for x in store.batch_is_exist(others)):
            if time.monotonic() > deadline:
                sys.exit(f"rank {args.rank}: the other ranks' keys did not appear within 30 s")
            time.sleep(0.05)
        got = store.get_batch(others)
        wrong = [k for k, v in zip(others, got) if v != value(k)]
        if wrong:
            sys.exit(f"rank {args.rank}: {len(wrong)} keys read back wrong, e.g. {wrong[0]}")
        print(f"rank {args.rank}: put {len(mine)}, read {len(others)} of the other ranks', all exact")
    finally:
        store.close()


def segment_bytes(metrics_url):
    """segment name -> allocated bytes, from the master's Prometheus metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^segment_allocated_bytes\{segment="([^"]+)"\} (\S+)$', text, re.M)}


def launch(args):
    local = os.environ.get("MOONCAKE_PREFERRED_SEGMENT")
    if not local:
        sys.exit("MOONCAKE_PREFERRED_SEGMENT is not set: run this under scripts/mooncake_owner")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--ranks", str(args.ranks),
                               "--master", args.master]) for r in range(args.ranks)]
    codes = [p.wait(timeout=120) for p in procs]
    if any(codes):
        sys.exit(f"workers exited with {codes}")
    used = segment_bytes(args.metrics)
    expected = args.ranks * KEYS * SIZE
    elsewhere = {s: b for s, b in used.items() if s != local and b}
    if used.get(local, 0) < expected or elsewhere:
        sys.exit(f"puts did not all land on this node's owner {local}: {used}")
    print(f"owner {local} holds all {args.ranks * KEYS} objects ({used[local]} bytes); other segments hold none")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metrics", help="the master's metrics URL (launcher)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        if not args.metrics:
            ap.error("--metrics is required")
        launch(args)


if __name__ == "__main__":
    main()
