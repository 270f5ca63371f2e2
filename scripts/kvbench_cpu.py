"""kvbench adapter wrapper that measures CPU time per byte moved, for any store.

    KVB_CPU_INNER=mooncake KVB_CPU_OUT=cpu.jsonl KVB_OURS_PIDS=<master>,<owner> \
    PYTHONPATH=scripts:../shared/peer python ../shared/peer/kvbench.py run \
        --adapter kvbench_cpu:CpuAdapter --adapter-args '<the inner adapter's JSON>' ...

Every batch put and get of the inner adapter (`KVB_CPU_INNER`: `mooncake` or `module:Class`) is
timed in CPU seconds: this client process (all its threads) plus the store's server processes
(`KVB_OURS_PIDS`: master and owner), from /proc, within the call. Totals per (op, value size,
batch size) and the bytes moved successfully are appended to `KVB_CPU_OUT` as JSON lines when
the process exits. CPU the client spends outside the store's calls (kvbench generating and
checking data) is not counted.
"""

import atexit
import json
import os
import time

import kvbench

_HZ = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _HZ  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuAdapter(kvbench.Adapter):
    def __init__(self, **kw):
        self.inner = kvbench.make_adapter(os.environ.get("KVB_CPU_INNER", "mooncake"), json.dumps(kw))
        self.name = getattr(self.inner, "name", "inner")
        pids = os.environ.get("KVB_OURS_PIDS", "")
        self.servers = [int(p) for p in pids.split(",") if p.strip()]
        self.out = os.environ.get("KVB_CPU_OUT")
        self.tag = os.environ.get("KVB_CPU_TAG", self.name)
        self.totals = {}  # (op, value size, batch) -> [client_s, servers_s, bytes, calls]
        atexit.register(self._dump)

    def _servers_s(self):
        return sum(_proc_cpu_s(p) for p in self.servers)

    def _timed(self, op, f, keys, ptrs, sizes, ok):
        # Reading /proc costs this process CPU too: keep those reads outside the client window.
        s0 = self._servers_s()
        c0 = time.process_time()
        rc = f(keys, ptrs, sizes)
        c1 = time.process_time()
        s1 = self._servers_s()
        moved = sum(sz for sz, r in zip(sizes, rc) if ok(r, sz))
        t = self.totals.setdefault((op, max(sizes) if sizes else 0, len(keys)), [0.0, 0.0, 0, 0])
        t[0] += c1 - c0
        t[1] += s1 - s0
        t[2] += moved
        t[3] += 1
        return rc

    def batch_put_from(self, keys, ptrs, sizes):
        return self._timed("put", self.inner.batch_put_from, keys, ptrs, sizes, lambda r, _: r == 0)

    def batch_get_into(self, keys, ptrs, sizes):
        return self._timed("get", self.inner.batch_get_into, keys, ptrs, sizes, lambda r, sz: r == sz)

    def _dump(self):
        if not self.out or not self.totals:
            return
        with open(self.out, "a") as f:
            for (op, size, batch), (client, servers, moved, calls) in sorted(self.totals.items()):
                f.write(json.dumps({"store": self.tag, "pid": os.getpid(), "op": op, "value_size": size,
                                    "batch": batch, "calls": calls, "bytes": moved,
                                    "client_cpu_s": round(client, 4), "server_cpu_s": round(servers, 4)}) + "\n")

    # Everything else goes straight to the inner adapter.
    def setup(self):
        return self.inner.setup()

    def register_buffer(self, ptr, size):
        return self.inner.register_buffer(ptr, size)

    def is_exist(self, key):
        return self.inner.is_exist(key)

    def batch_is_exist(self, keys):
        return self.inner.batch_is_exist(keys)

    def remove(self, key):
        return self.inner.remove(key)

    def batch_remove(self, keys):
        return self.inner.batch_remove(keys)

    def put(self, key, value):
        return self.inner.put(key, value)

    def get(self, key):
        return self.inner.get(key)

    def close(self):
        return self.inner.close()

    def describe(self):
        return self.inner.describe()
