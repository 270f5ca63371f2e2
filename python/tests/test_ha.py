"""setup() with an etcd:// master address: the store follows the elected master of a real etcd
and a real pair of HA masters, and a get after the leader is killed returns the same bytes."""

import os
import shutil
import socket
import tempfile
import time

import pytest

from conftest import Proc, bin_path, start_owner
from mooncake_rs.store import MooncakeDistributedStore


_next_port = [os.getpid() * 97 % 12000]


def free_port():
    """A free port below the kernel's ephemeral range (see the Rust tests' free_port): one handed
    out now and bound later is not taken meanwhile as some connect()'s local port."""
    for _ in range(12000):
        port = 20000 + _next_port[0] % 12000
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000..32000")


@pytest.fixture
def etcd():
    exe = shutil.which("etcd")
    if exe is None:
        pytest.fail("etcd not found: install Debian's etcd-server (.ci/run does)")
    data = tempfile.mkdtemp(prefix="mooncake-py-etcd-")
    client, peer = free_port(), free_port()
    curl, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    p = Proc([exe, "--name", "t", "--data-dir", data, "--listen-client-urls", curl, "--advertise-client-urls", curl,
              "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl, "--initial-cluster", f"t={purl}",
              "--log-level", "error"])
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", client), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline, "etcd did not start"
            time.sleep(0.05)
    try:
        yield f"127.0.0.1:{client}"
    finally:
        p.stop()
        shutil.rmtree(data, ignore_errors=True)


def ha_master(endpoint):
    port = free_port()
    return Proc([bin_path("mooncake_master"), "--enable_ha", "--etcd_endpoints", endpoint, "--cluster_id", "py-ha",
                 "--ha_lease_ttl", "2", "--rpc_address", "127.0.0.1", "--rpc_port", str(port),
                 "--metrics_port", "0"])


def test_setup_follows_the_elected_master_through_a_failover(etcd, monkeypatch):
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", "py-ha")
    procs = []
    store = MooncakeDistributedStore()
    try:
        a = ha_master(etcd)
        procs.append(a)
        a.wait_line("mooncake_master ready")
        b = ha_master(etcd)
        procs.append(b)
        b.wait_line("mooncake_master standby")
        url = f"etcd://{etcd}"
        o, _ = start_owner(url, extra=("--heartbeat-interval", "200ms"))
        procs.append(o)
        assert store.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", url) == 0
        value = os.urandom(100_000)
        assert store.put("ha/key", value) == 0
        assert store.get("ha/key") == value
        a.p.kill()
        a.p.wait()
        # The get waits through the election and the catalog rebuild.
        assert store.get("ha/key") == value
        b.wait_line("mooncake_master ready", timeout=5)
        assert store.put("ha/after", b"x" * 1000) == 0
        assert store.get("ha/after") == b"x" * 1000
    finally:
        store.close()
        for p in reversed(procs):
            p.stop()
