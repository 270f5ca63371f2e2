#!/usr/bin/env python3
"""CPU time per GiB moved, from the cpu.jsonl files kvbench_cpu.py writes (one per run).

Per run only the kvbench main process counts (worker processes of the multi-process workload
overlap in time and would count the servers twice). Rounds are pooled: total CPU seconds over
total bytes, per store, op, value size and batch size.

    python3 scripts/cpu_report.py target/compare/<run>/*/cpu.jsonl
"""

import collections
import json
import sys

GiB = 1 << 30


def main(paths):
    pooled = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if not rows:
            continue
        calls = collections.Counter()
        for r in rows:
            calls[r["pid"]] += r["calls"]
        main_pid = calls.most_common(1)[0][0]
        for r in rows:
            if r["pid"] != main_pid or r["bytes"] == 0:
                continue
            t = pooled[(r["store"], r["op"], r["value_size"], r["batch"])]
            t[0] += r["client_cpu_s"]
            t[1] += r["server_cpu_s"]
            t[2] += r["bytes"]
    stores = sorted({k[0] for k in pooled})
    shapes = sorted({k[1:] for k in pooled}, key=lambda s: (s[1], s[2], s[0]))
    print("CPU seconds per GiB moved (client process + master + owner, inside the store's calls)\n")
    print("| op | value | batch | " + " | ".join(stores) + " |")
    print("|---|---|---|" + "---|" * len(stores))
    for op, size, batch in shapes:
        cells = []
        for s in stores:
            t = pooled.get((s, op, size, batch))
            if not t or not t[2]:
                cells.append("-")
                continue
            gib = t[2] / GiB
            cells.append(f"{(t[0] + t[1]) / gib:.2f} (client {t[0] / gib:.2f}, servers {t[1] / gib:.2f})")
        print(f"| {op} | {size >> 10} KiB | {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
