#!/usr/bin/env python3
"""A prefill worker: its own TransferEngine and KV region (filled as if the prefill had run),
registered with the bootstrap server, again every half second (a restarted server learns it
back). Decode workers pull blocks from the region; this process only serves. Runs until killed
or for --lifetime seconds."""

import argparse
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv import Region  # noqa: E402

from mooncake_rs.engine import TransferEngine  # noqa: E402


def register(bootstrap, body):
    req = urllib.request.Request(f"{bootstrap}/register", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bootstrap", required=True, help="http://host:port")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--tp-rank", type=int, required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-bytes", type=int, default=64 << 10)
    ap.add_argument("--lifetime", type=float, default=600)
    args = ap.parse_args()

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("prefill: TransferEngine.initialize failed")
    region = Region(engine, args.layers, args.blocks, args.block_bytes)
    region.fill(args.engine_id, args.tp_rank)
    body = {"engine_id": args.engine_id, "dp_rank": args.dp_rank, "tp_rank": args.tp_rank, "pp_rank": 0,
            "session": f"127.0.0.1:{engine.get_rpc_port()}", "kv_base": region.base, "layers": args.layers,
            "blocks": args.blocks, "block_bytes": args.block_bytes}
    announced = False
    end = time.monotonic() + args.lifetime
    while time.monotonic() < end:
        try:
            if register(args.bootstrap, body).get("status") == "ok" and not announced:
                print(f"prefill tp{args.tp_rank}: registered {body['session']}", flush=True)
                announced = True
        except OSError:
            pass  # the bootstrap server is down for now; keep trying
        time.sleep(0.5)


if __name__ == "__main__":
    main()
