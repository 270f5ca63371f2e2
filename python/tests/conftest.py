"""Fixtures: a real master and owners (the project's binaries) on loopback, stopped by pid."""

import contextlib
import os
import pathlib
import queue
import subprocess
import threading
import types

import pytest

from mooncake_rs.store import MooncakeDistributedStore

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bin_path(name):
    d = os.environ.get("MOONCAKE_BIN_DIR")
    candidates = [pathlib.Path(d)] if d else [ROOT / "target" / "debug", ROOT / "target" / "release"]
    for c in candidates:
        if (c / name).exists():
            return str(c / name)
    pytest.fail(f"{name} not found in {candidates}: run `cargo build --bins` or set MOONCAKE_BIN_DIR")


def stop_process(pid, within=5.0):
    """SIGSTOPs `pid` and waits until every one of its threads is stopped. kill(2) returns once
    the stop is pending: the thread that takes it stops the others, so until it runs another
    thread can still answer a call."""
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within
    states = []
    while time.monotonic() < deadline:
        try:
            tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:
            pytest.fail(f"process {pid} exited instead of stopping")
        states = []
        for t in tasks:
            try:
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that exited
        # Stopped, or a thread exited and not yet reaped (it runs no more).
        if states and all(s in ("T", "t", "Z", "X") for s in states):
            return
        time.sleep(0.005)
    pytest.fail(f"process {pid} did not stop within {within} s (thread states {states})")


class Proc:
    """A child process whose stdout lines can be awaited; killed on stop()."""

    def __init__(self, args):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def wait_line(self, prefix, timeout=20):
        while True:
            line = self.lines.get(timeout=timeout)
            if line.startswith(prefix):
                return line

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def start_master(extra=()):
    m = Proc([bin_path("mooncake_master"), "--rpc_address", "127.0.0.1", "--rpc_port", "0", "--metrics_port", "0",
              *extra])
    line = m.wait_line("mooncake_master ready")
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return m, fields["rpc"]


def start_owner(master, size="128MiB", extra=()):
    o = Proc([bin_path("mooncake_ownerd"), "--master", master, "--host", "127.0.0.1", "--port", "0",
              "--segment-size", size, "--no-mlock", *extra])
    seg = o.wait_line("mooncake_ownerd ready").split("segment=")[1]
    return o, seg


@contextlib.contextmanager
def running_cluster(owners=2, size="128MiB", master_args=()):
    """A master (with `master_args`) and `owners` owners of `size`, stopped on exit."""
    procs = []
    try:
        m, rpc = start_master(master_args)
        procs.append(m)
        segments, owner_procs = [], []
        for _ in range(owners):
            o, seg = start_owner(rpc, size=size)
            procs.append(o)
            owner_procs.append(o)
            segments.append(seg)
        yield types.SimpleNamespace(master=rpc, segments=segments, owners=owner_procs)
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="session")
def cluster():
    """One master and two owners for the whole session."""
    with running_cluster() as c:
        yield c


def new_store(cluster, segment_size=0):
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "http://unused/metadata", segment_size, 16 << 20, "tcp", "", cluster.master)
    assert rc == 0, f"setup failed with {rc}"
    return s


@pytest.fixture
def store(cluster):
    s = new_store(cluster)
    yield s
    s.remove_all(True)
    s.close()
