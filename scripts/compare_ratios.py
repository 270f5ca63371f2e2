#!/usr/bin/env python3
"""compare_ratios.py - the medians of scripts/compare's workload-a rounds, per store, and each
store's ratio to Mooncake's, from kvbench.py's results.jsonl files (one per store and round).

    compare_ratios.py results1.jsonl [results2.jsonl ...]

Per (store, value size, keys per batch): each round's median GiB/s over its measured reps (those
with no failed call), then the median over rounds. A ratio above 1 is faster than Mooncake. The
spread column gives each round's median, so run-to-run noise shows. Reps with failed calls or
wrong bytes are counted, not hidden; wrong bytes are named on a line of their own.
"""
import json
import statistics as S
import sys
from collections import defaultdict


def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def main(paths):
    # (store, value, batch) -> [(round medians put, get)], and failure counts.
    rounds = defaultdict(lambda: {"put": [], "get": []})
    fails = defaultdict(int)
    bad = defaultdict(int)
    for path in paths:
        per = defaultdict(lambda: {"put": [], "get": []})
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("type") != "rep" or r.get("warmup") or r.get("workload") != "a":
                continue
            cell = (r["store"], r["value_size"], r["batch"])
            fails[cell] += r.get("put_fail", 0) + r.get("get_fail", 0)
            bad[cell] += r.get("integrity_errors", 0) or 0
            if r.get("put_fail", 0) == 0 and r.get("put_gib_s"):
                per[cell]["put"].append(r["put_gib_s"])
            if r.get("get_fail", 0) == 0 and r.get("get_gib_s"):
                per[cell]["get"].append(r["get_gib_s"])
        for cell, v in per.items():
            for op in ("put", "get"):
                if v[op]:
                    rounds[cell][op].append(S.median(v[op]))
    if not rounds:
        print("(no workload-a results)")
        return 0
    med = lambda xs: S.median(xs) if xs else None
    stores = sorted({s for s, _, _ in rounds}, key=lambda s: (s == "mooncake", s))
    cells = sorted({(v, b) for _, v, b in rounds})
    print("### (a) batch put / get: medians over rounds, and ratios to Mooncake\n")
    print("| store | value | keys/batch | put GiB/s | put x Mooncake | get GiB/s | get x Mooncake "
          "| each round's put-get medians | failed calls | wrong bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for store in stores:
        for v, b in cells:
            mine = rounds.get((store, v, b))
            if not mine:
                continue
            peer = rounds.get(("mooncake", v, b), {"put": [], "get": []})
            cols = []
            for op in ("put", "get"):
                m, p = med(mine[op]), med(peer[op])
                cols.append("n/a" if m is None else f"{m:.3f}")
                cols.append("-" if store == "mooncake" or m is None or not p else f"{m / p:.2f}x")
            spread = " / ".join(f"{p:.2f}-{g:.2f}" for p, g in zip(mine["put"], mine["get"]))
            print(f"| {store} | {fmt_size(v)} | {b} | {' | '.join(cols)} | {spread} | "
                  f"{fails[(store, v, b)]} | {bad[(store, v, b)]} |")
    print()
    wrong = {cell: n for cell, n in bad.items() if n}
    if wrong:
        print("WRONG BYTES: " + ", ".join(f"{s} {fmt_size(v)} x{b}: {n}" for (s, v, b), n in wrong.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
