"""Prefill to decode through the store (P/D disaggregation): a prefill process writes a request's
KV cache layer by layer, K and V from separate registered buffers (one object per block, put from
two buffers without joining them); a decode process polls `batch_is_exist` for each layer and,
as soon as a layer is complete, loads it into its own registered K and V buffers and checks
every byte. The two run at once, so decode overlaps prefill.

    python examples/prefill_decode/run.py --master 127.0.0.1:50051          # both roles
    python examples/prefill_decode/run.py --master ... --role prefill       # one role
"""

import argparse
import hashlib
import subprocess
import sys
import time

import numpy as np

LAYERS, BLOCKS, BLOCK_BYTES = 8, 16, 32 << 10  # per block: K and V of BLOCK_BYTES each


def block(request, layer, b, which):
    """The bytes of one block's K or V: derived from its position, so decode can check them."""
    seed = int.from_bytes(hashlib.sha256(f"{request}/{layer}/{b}/{which}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def keys_of(request, layer):
    return [f"{request}/layer{layer}/block{b}" for b in range(BLOCKS)]


def connect(master):
    from mooncake_rs.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        sys.exit(f"setup failed with {rc}")
    return store


def buffers(store):
    """This process's K and V caches: one block per slot, registered for zero-copy transfers."""
    k = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    v = np.zeros_like(k)
    for a in (k, v):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    return k, v


def prefill(args):
    store = connect(args.master)
    k, v = buffers(store)
    for layer in range(LAYERS):
        for b in range(BLOCKS):  # "compute" the layer's KV
            k[b], v[b] = block(args.request, layer, b, "k"), block(args.request, layer, b, "v")
        keys = keys_of(args.request, layer)
        ptrs = [[k[b].ctypes.data, v[b].ctypes.data] for b in range(BLOCKS)]
        codes = store.batch_put_from_multi_buffers(keys, ptrs, [[BLOCK_BYTES, BLOCK_BYTES]] * BLOCKS)
        if any(codes):
            sys.exit(f"prefill: layer {layer} put failed: {codes}")
    print(f"prefill: {LAYERS} layers x {BLOCKS} blocks of K and V written")
    store.close()


def decode(args):
    store = connect(args.master)
    k, v = buffers(store)
    deadline = time.monotonic() + args.timeout
    for layer in range(LAYERS):
        keys = keys_of(args.request, layer)
        while not all(x == 1 for x in store.batch_is_exist(keys)):
            if time.monotonic() > deadline:
                sys.exit(f"decode: layer {layer} did not arrive within {args.timeout} s")
            time.sleep(0.01)
        ptrs = [[k[b].ctypes.data, v[b].ctypes.data] for b in range(BLOCKS)]
        got = store.batch_get_into_multi_buffers(keys, ptrs, [[BLOCK_BYTES, BLOCK_BYTES]] * BLOCKS)
        if got != [2 * BLOCK_BYTES] * BLOCKS:
            sys.exit(f"decode: layer {layer} read failed: {got}")
        for b in range(BLOCKS):
            if not (np.array_equal(k[b], block(args.request, layer, b, "k"))
                    and np.array_equal(v[b], block(args.request, layer, b, "v"))):
                sys.exit(f"decode: layer {layer} block {b} holds wrong bytes")
    print(f"decode: {LAYERS} layers loaded as they arrived, every byte checked")
    store.remove_by_regex(f"^{args.request}/", True)
    store.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master", required=True)
    ap.add_argument("--role", choices=["prefill", "decode"])
    ap.add_argument("--request", default="req-0001")
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    if args.role == "prefill":
        return prefill(args)
    if args.role == "decode":
        return decode(args)
    common = ["--master", args.master, "--request", args.request, "--timeout", str(args.timeout)]
    dec = subprocess.Popen([sys.executable, __file__, "--role", "decode", *common])
    pre = subprocess.Popen([sys.executable, __file__, "--role", "prefill", *common])
    codes = (pre.wait(timeout=args.timeout + 30), dec.wait(timeout=args.timeout + 30))
    if any(codes):
        sys.exit(f"prefill and decode exited with {codes}")


if __name__ == "__main__":
    main()
