"""Encoder cache (EPD disaggregation): an encoder process turns each request's images into encoder
outputs (tensors) and saves them under a hash of the image's content, asynchronously, many saves
in flight at once; it reports a request done only after every save of it finished, and reports a
request whose save failed as failed (never silently lost). A prefill process then loads the
outputs of the done requests by content hash and checks them.

    python examples/encoder_cache/run.py --master 127.0.0.1:50051
"""

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys

import numpy as np

REQUESTS, IMAGES = 6, 4
TOKENS, HIDDEN = 64, 256


def image(request, i):
    """An input image's bytes (request 3's second image repeats request 0's: a cache hit)."""
    if (request, i) == (3, 1):
        request, i = 0, 0
    return np.random.default_rng(request * 100 + i).integers(0, 256, 32 * 32 * 3, dtype=np.uint8).tobytes()


def encode(img):
    """The "encoder": a deterministic tensor of the image (float16, as engines keep them)."""
    seed = int.from_bytes(hashlib.sha256(img).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal((TOKENS, HIDDEN)).astype(np.float16)


def key_of(img):
    return "mm/" + hashlib.sha256(img).hexdigest()


async def encoder(args):
    from mooncake_rs.store import MooncakeDistributedStoreAsync

    store = MooncakeDistributedStoreAsync()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        sys.exit(f"encoder: setup failed with {rc}")
    try:
        inflight = {}  # key -> its save: two requests with the same image share one

        def save_once(key, img):
            if key not in inflight:
                inflight[key] = asyncio.ensure_future(store.async_put_tensor(key, encode(img)))
            return inflight[key]

        async def save(request):
            images = [image(request, i) for i in range(IMAGES)]
            keys = [key_of(img) for img in images]
            if request == args.fail_request:
                keys[2] = ""  # an invalid key: this save fails, and the request must say so
            exists = await store.async_batch_is_exist(keys)
            todo = [(k, img) for k, img, e in zip(keys, images, exists) if e != 1]
            codes = await asyncio.gather(*(save_once(k, img) for k, img in todo))
            failed = [k for (k, _), c in zip(todo, codes) if c != 0]
            return {"request": request, "keys": keys, "saved": len(todo) - len(failed),
                    "cached": len(keys) - len(todo), "failed": len(failed)}

        # Every request's saves are in flight together; each request is done when its own are.
        results = await asyncio.gather(*(save(r) for r in range(REQUESTS)))
    finally:
        store.close()
    for r in results:
        state = "FAILED" if r["failed"] else "done"
        print(f"encoder: request {r['request']} {state}: {r['saved']} saved, {r['cached']} already cached, "
              f"{r['failed']} failed", file=sys.stderr)
    print(json.dumps(results))


def prefill(args, results):
    from mooncake_rs.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.master) != 0:
        sys.exit("prefill: setup failed")
    loaded = 0
    try:
        for r in results:
            if r["failed"]:
                continue
            outputs = store.batch_get_tensor(r["keys"])
            for i, t in enumerate(outputs):
                expected = encode(image(r["request"], i))
                if t is None or t.dtype != expected.dtype or not np.array_equal(t, expected):
                    sys.exit(f"prefill: request {r['request']} image {i}: encoder output missing or wrong")
                loaded += 1
        store.remove_by_regex("^mm/", True)
    finally:
        store.close()
    return loaded


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master", required=True)
    ap.add_argument("--fail-request", type=int, default=5, help="the request whose save is made to fail")
    ap.add_argument("--role", choices=["encoder"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "encoder":
        return asyncio.run(encoder(args))
    out = subprocess.run([sys.executable, __file__, "--role", "encoder", "--master", args.master,
                          "--fail-request", str(args.fail_request)], stdout=subprocess.PIPE, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"encoder exited with {out.returncode}")
    results = json.loads(out.stdout.strip().splitlines()[-1])
    failed = [r["request"] for r in results if r["failed"]]
    if failed != ([args.fail_request] if 0 <= args.fail_request < REQUESTS else []):
        sys.exit(f"the failed save was not reported as such: {failed}")
    loaded = prefill(args, results)
    print(f"encoder cache: {len(results) - len(failed)} requests done, {len(failed)} reported failed; "
          f"prefill loaded {loaded} encoder outputs, all exact")


if __name__ == "__main__":
    main()
