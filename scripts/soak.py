"""scripts/soak: a master and two owners (small memory pools, SSD tiers behind them) under several
requester processes for a given time; every value checksummed and versioned.

Each requester owns a key space and keeps what it expects of it: puts of new keys, gets verified
byte for byte, upserts (a new version), removes, gets of keys it removed; batch puts and gets;
and attempts to overwrite keys another requester committed (which must be refused and change
nothing). The pools are far smaller than the data, so eviction spills to the SSD tiers all along.
Afterwards every committed key is read once more. Printed: operations and outcomes per kind,
wrong bytes, lost objects (committed, never removed, gone), unexpected codes, and the resident
memory of the master and the owners after warm-up and at the end.

  scripts/soak [--seconds 600] [--workers 4] [--token-file FILE]

Exits 1 on any wrong byte, lost object or unexpected code. Binaries come from MOONCAKE_BIN_DIR
(default target/release); the Python package must be importable (scripts/soak does both).
"""

import argparse
import collections
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib

MAGIC = 0x534F414B  # "SOAK"
HEADER = struct.Struct("<IIII")  # magic, version, length, crc32 of the payload
OK, EXISTS, NOT_FOUND, HAS_LEASE, NO_SPACE = 0, -705, -704, -706, -200


def value(key, version, size):
    rng = random.Random(f"{key}/{version}")
    payload = rng.randbytes(size - HEADER.size)
    return HEADER.pack(MAGIC, version, size, zlib.crc32(payload)) + payload


def check(got, version):
    """Whether `got` is a whole value of `version`."""
    if len(got) < HEADER.size:
        return False
    magic, v, size, crc = HEADER.unpack_from(got)
    return magic == MAGIC and v == version and size == len(got) and zlib.crc32(got[HEADER.size:]) == crc


def requester(idx, workers, master, seconds, keys, pinned, out, barrier):
    from mooncake_rs import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "http://unused/metadata", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        out.put({"worker": idx, "fatal": f"setup returned {rc}"})
        return
    rng = random.Random(idx)
    stats = collections.Counter()
    unexpected = collections.Counter()
    wrong, lost = [], []
    have = {}  # key -> version, for committed keys of this requester
    removed = set()
    versions = collections.Counter()

    def name(n):
        return f"w{idx}/k{n}"

    def size_of(key):
        return random.Random(key).choice([4096, 16384, 65536, 131072])

    def note(kind, rc, expected):
        stats[(kind, rc)] += 1
        if rc not in expected:
            unexpected[(kind, rc)] += 1

    def verify(kind, key, got):
        if got == b"":
            # Gone although committed and never removed: lost, unless the store says it is
            # there (a read that raced a spill is retried once).
            again = s.get(key)
            if again == b"":
                lost.append(key)
                stats[(kind, "lost")] += 1
                return
            got = again
        if check(got, have[key]):
            stats[(kind, "ok")] += 1
        else:
            head = HEADER.unpack_from(got) if len(got) >= HEADER.size else None
            wrong.append(f"{kind} {key}: expected version {have[key]}, got {len(got)} bytes, header {head}")
            stats[(kind, "wrong")] += 1

    # Keys the others try to overwrite: committed first, never removed.
    for n in range(pinned):
        key = f"w{idx}/pinned{n}"
        rc = s.put(key, value(key, 1, 8192))
        note("put-pinned", rc, {OK})
        if rc == OK:
            have[key] = 1
    # Nobody tries to overwrite a pinned key before its requester wrote it (a put of a key already
    # there answers 0, so the race would go unseen).
    barrier.wait(timeout=120)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        roll = rng.random()
        key = name(rng.randrange(keys))
        if roll < 0.30:
            if key in have:
                verify("get", key, s.get(key))
            else:
                got = s.get(key)
                stats[("get-absent", "empty" if got == b"" else "found")] += 1
                if got != b"":
                    wrong.append(key)
        elif roll < 0.55:
            if key in have:
                continue
            versions[key] += 1
            rc = s.put(key, value(key, versions[key], size_of(key)))
            note("put", rc, {OK, NO_SPACE})
            if rc == OK:
                have[key] = versions[key]
                removed.discard(key)
        elif roll < 0.63:
            if key not in have:
                continue
            versions[key] += 1
            rc = s.upsert(key, value(key, versions[key], size_of(key)))
            note("upsert", rc, {OK, NO_SPACE, HAS_LEASE})
            if rc == OK:
                have[key] = versions[key]
        elif roll < 0.73:
            if key not in have or key.startswith(f"w{idx}/pinned"):
                continue
            rc = s.remove(key, False)
            note("remove", rc, {OK, HAS_LEASE})
            if rc == OK:
                del have[key]
                removed.add(key)
                stats[("get-removed", "empty" if s.get(key) == b"" else "found")] += 1
        elif roll < 0.85:
            batch = [name(rng.randrange(keys)) for _ in range(16)]
            batch = [k for k in dict.fromkeys(batch) if k not in have]
            if not batch:
                continue
            for k in batch:
                versions[k] += 1
            rc = s.put_batch(batch, [value(k, versions[k], size_of(k)) for k in batch])
            note("put-batch", rc, {OK, NO_SPACE})
            # The batch answers one code: on a failure, which keys landed is read back.
            for k in batch:
                got = s.get(k) if rc != OK else None
                if rc == OK or (got and check(got, versions[k])):
                    have[k] = versions[k]
                    removed.discard(k)
                elif got:
                    wrong.append(k)
        elif roll < 0.95:
            batch = [k for k in dict.fromkeys(name(rng.randrange(keys)) for _ in range(16)) if k in have]
            if batch:
                for k, got in zip(batch, s.get_batch(batch)):
                    verify("get-batch", k, got)
        else:
            # Someone else's committed key: refused, and nothing changes (its owner verifies).
            other = rng.choice([w for w in range(workers) if w != idx] or [idx])
            target = f"w{other}/pinned{rng.randrange(pinned)}"
            rc = s.put(target, value(target, 999, 8192))
            # The binding answers a put of a key already there with 0, as Mooncake's does.
            note("overwrite-attempt", rc, {EXISTS, OK})
    # Every committed key, once more.
    for key in sorted(have):
        verify("final-get", key, s.get(key))
    moved = s.transfer_stats()
    s.close()
    out.put({"worker": idx, "stats": dict(stats), "unexpected": dict(unexpected),
             "wrong": wrong, "lost": lost, "committed": len(have), "moved": dict(moved)})


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def ssd_evictions(http):
    """Records the owners' SSD rings overwrote, from the master's metrics."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    except OSError:
        return "unknown"
    return int(sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("segment_ssd_evicted_records_total")))


def start(cmd, log, ready):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.startswith(ready):
            return p, line
        if p.poll() is not None:
            break
    p.kill()
    sys.exit(f"soak: {cmd[0]} did not start; see {log}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--keys", type=int, default=1500, help="keys per requester")
    ap.add_argument("--pinned", type=int, default=32, help="never-removed keys per requester")
    ap.add_argument("--pool", default="64MiB", help="memory of each owner")
    ap.add_argument("--ssd", default="2GiB",
                    help="SSD tier of each owner: it must hold what the run writes, since the ring "
                         "overwrites its oldest records (and the objects only they held) when full")
    ap.add_argument("--token-file", help="the cluster's secret: every role proves it")
    args = ap.parse_args()
    bins = os.environ.get("MOONCAKE_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "target", "release"))
    work = tempfile.mkdtemp(prefix="mooncake-soak-")
    procs = []
    try:
        auth = ["--auth_token_file", args.token_file] if args.token_file else []
        if args.token_file:
            os.environ["MOONCAKE_AUTH_TOKEN_FILE"] = args.token_file
        m, line = start([os.path.join(bins, "mooncake_master"), "--rpc_address", "127.0.0.1", "--rpc_port", "0",
                         "--metrics_port", "0", "--when_disk_behind", "keep", *auth],
                        os.path.join(work, "master.log"), "mooncake_master ready")
        procs.append(("master", m))
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        master, http = fields["rpc"], fields["http"]
        for i in range(2):
            o, _ = start([os.path.join(bins, "mooncake_ownerd"), "--master", master, "--host", "127.0.0.1",
                          "--port", "0", "--segment-size", args.pool, "--no-mlock",
                          "--ssd-path", os.path.join(work, f"ssd{i}"), "--ssd-size", args.ssd, *auth],
                         os.path.join(work, f"owner{i}.log"), "mooncake_ownerd ready")
            procs.append((f"owner{i}", o))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        barrier = ctx.Barrier(args.workers)
        workers = [ctx.Process(target=requester, args=(i, args.workers, master, args.seconds, args.keys,
                                                       args.pinned, out, barrier)) for i in range(args.workers)]
        for w in workers:
            w.start()
        # Resident memory: after warm-up (a third of the run), at two thirds and at the end.
        t0 = time.monotonic()
        samples = []
        while any(w.is_alive() for w in workers) and time.monotonic() - t0 < args.seconds + 300:
            time.sleep(0.5)
            if len(samples) < 2 and time.monotonic() - t0 >= args.seconds * (len(samples) + 1) / 3:
                samples.append({n: rss_kib(p.pid) for n, p in procs})
        samples.append({n: rss_kib(p.pid) for n, p in procs})
        ssd_evicted = ssd_evictions(http)
        results = [out.get(timeout=60) for _ in workers]
        for w in workers:
            w.join(timeout=30)
    finally:
        for _, p in procs:
            p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)

    fatal = [r for r in results if "fatal" in r]
    for r in fatal:
        print(f"worker {r['worker']}: {r['fatal']}")
    results = [r for r in results if "fatal" not in r]
    total = collections.Counter()
    unexpected = collections.Counter()
    for r in results:
        for k, n in r["stats"].items():
            total[k] += n
        for k, n in r["unexpected"].items():
            unexpected[k] += n
    wrong = sum(len(r["wrong"]) for r in results)
    lost = sum(len(r["lost"]) for r in results)
    print(f"## soak: {args.workers} requesters, {args.seconds:.0f} s, pools {args.pool} x 2, SSD {args.ssd} x 2"
          f"{', auth on' if args.token_file else ''}")
    print()
    print("| operation | outcome | count |")
    print("|---|---|---|")
    names = {0: "ok", -705: "OBJECT_ALREADY_EXISTS", -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE",
             -200: "NO_AVAILABLE_HANDLE"}
    for (op, outcome), n in sorted(total.items(), key=lambda x: (str(x[0][0]), str(x[0][1]))):
        print(f"| {op} | {names.get(outcome, outcome)} | {n} |")
    print()
    moved = collections.Counter()
    for r in results:
        moved.update(r["moved"])
    print(f"gets served from memory: {moved['memory_keys']} keys, {moved['memory_bytes'] >> 20} MiB; "
          f"from the SSD tiers: {moved['disk_keys']} keys, {moved['disk_bytes'] >> 20} MiB; "
          f"put: {moved['put_keys']} keys, {moved['put_bytes'] >> 20} MiB")
    print(f"committed keys at the end: {sum(r['committed'] for r in results)}; wrong bytes: {wrong}; "
          f"lost objects: {lost}; unexpected codes: {sum(unexpected.values())} {dict(unexpected) or ''}")
    print()
    print(f"records the SSD tiers' rings overwrote (dropping objects they held last): {ssd_evicted}")
    print()
    print("| process | RSS at 1/3 of the run (MiB) | at 2/3 | at the end |")
    print("|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v / 1024:.1f}"
    for n, _ in procs:
        print(f"| {n} | " + " | ".join(fmt(s.get(n)) for s in samples) + " |")
    for r in results:
        for w in r["wrong"] + [f"lost {k}" for k in r["lost"]]:
            print(f"worker {r['worker']}: {w}")
    bad = wrong or lost or unexpected or fatal or len(results) < args.workers
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
