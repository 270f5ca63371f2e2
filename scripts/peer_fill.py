"""Fills a running Mooncake Store (the peer, from its PyPI package) with N objects of SIZE bytes
under keys like scale/1024/123456, then reads a sample back and checks it byte for byte. Used by
scripts/master_memory to load Mooncake's master the same way mooncake_bench loads ours.

    python peer_fill.py --master 127.0.0.1:50151 --metadata http://127.0.0.1:8180/metadata --keys N
"""

import argparse
import sys

import numpy as np
from mooncake.store import MooncakeDistributedStore


def payload(index: int, size: int) -> np.ndarray:
    """The bytes of object `index`: a pattern that differs per key and per offset."""
    return ((np.arange(size, dtype=np.uint32) * 131 + (index * 7919) % 251) % 251).astype(np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--verify", type=int, default=4096, help="objects read back and checked")
    a = ap.parse_args()

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", a.metadata, 0, 512 << 20, "tcp", "", a.master)
    if rc != 0:
        print(f"peer_fill: setup failed with {rc}", file=sys.stderr)
        return 2
    buf = np.zeros(a.batch * a.size, dtype=np.uint8)
    ptr = buf.ctypes.data
    if store.register_buffer(ptr, buf.nbytes) != 0:
        print("peer_fill: register_buffer failed", file=sys.stderr)
        return 2
    prefix = f"scale/{a.size}/"
    failed = 0
    for start in range(0, a.keys, a.batch):
        idx = range(start, min(start + a.batch, a.keys))
        for j, i in enumerate(idx):
            buf[j * a.size:(j + 1) * a.size] = payload(i, a.size)
        keys = [f"{prefix}{i:06d}" for i in idx]
        ptrs = [ptr + j * a.size for j in range(len(keys))]
        codes = store.batch_put_from(keys, ptrs, [a.size] * len(keys))
        failed += sum(1 for c in codes if c != 0)
    wrong = 0
    step = max(1, a.keys // max(1, a.verify))
    sample = list(range(0, a.keys, step))[: a.verify]
    for start in range(0, len(sample), a.batch):
        idx = sample[start:start + a.batch]
        keys = [f"{prefix}{i:06d}" for i in idx]
        ptrs = [ptr + j * a.size for j in range(len(keys))]
        got = store.batch_get_into(keys, ptrs, [a.size] * len(keys))
        for j, i in enumerate(idx):
            ok = got[j] == a.size and np.array_equal(buf[j * a.size:(j + 1) * a.size], payload(i, a.size))
            wrong += 0 if ok else 1
    print(f"peer_fill: {a.keys} puts, {failed} failed; {len(sample)} read back, {wrong} wrong")
    store.close()
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
