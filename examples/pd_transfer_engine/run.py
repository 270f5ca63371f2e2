#!/usr/bin/env python3
"""Prefill/decode disaggregation with TransferEngine, end to end on loopback: a bootstrap
server, a prefill engine of 2 tensor-parallel workers and a decode engine of 2, each worker a
process with its own engine and KV region. Decode workers find the prefill workers through the
bootstrap server and pull each request's blocks of every layer, checking every byte. Every
process started here is stopped before it returns."""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    py = sys.executable
    procs = []
    try:
        boot = subprocess.Popen([py, os.path.join(HERE, "bootstrap.py")], stdout=subprocess.PIPE, text=True)
        procs.append(boot)
        port = boot.stdout.readline().split("port=")[1].strip()
        url = f"http://127.0.0.1:{port}"
        for tp in range(args.tp):
            procs.append(subprocess.Popen([py, os.path.join(HERE, "prefill.py"), "--bootstrap", url,
                                           "--engine-id", "prefill-0", "--tp-rank", str(tp)]))
        decodes = [subprocess.Popen([py, os.path.join(HERE, "decode.py"), "--bootstrap", url, "--engine-id",
                                     "prefill-0", "--tp-rank", str(tp), "--requests", str(args.requests)])
                   for tp in range(args.tp)]
        codes = [d.wait(timeout=120) for d in decodes]
        if any(codes):
            sys.exit(f"decode workers exited with {codes}")
        print(f"prefill/decode: {args.tp} decode workers pulled {args.requests} requests each, every byte checked")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
