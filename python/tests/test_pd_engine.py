"""Prefill/decode disaggregation over TransferEngine as `examples/pd_transfer_engine` runs it:
real processes on loopback (a bootstrap server, prefill and decode workers with an engine each),
the whole flow, and its failure cases: an engine that never registers, a prefill worker killed
mid-flow, and a bootstrap server restarted under registered workers."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from conftest import ROOT

PD = ROOT / "examples" / "pd_transfer_engine"
PY = sys.executable


class Procs:
    """Processes started by a test, all stopped (by pid) when it ends."""

    def __init__(self):
        self.procs = []

    def start(self, script, *args, **kw):
        p = subprocess.Popen([PY, str(PD / script), *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def bootstrap(procs, port=0):
    b = procs.start("bootstrap.py", "--port", port)
    line = b.stdout.readline()
    assert "bootstrap ready" in line, line
    return b, f"http://127.0.0.1:{line.split('port=')[1].strip()}"


def wait_line(p, needle, timeout=30):
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(seen)}")


def query(url):
    with urllib.request.urlopen(f"{url}/query", timeout=2) as r:
        return json.loads(r.read())


def test_the_whole_flow_two_tp_workers_each_side():
    out = subprocess.run([PY, str(PD / "run.py"), "--requests", "6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 decode workers pulled 6 requests each, every byte checked" in out.stdout
    assert out.stdout.count("ok, 16 blocks checked") == 12


def test_an_engine_that_never_registered_is_a_clear_error_after_a_bounded_wait():
    procs = Procs()
    try:
        _, url = bootstrap(procs)
        t = time.monotonic()
        d = procs.start("decode.py", "--bootstrap", url, "--engine-id", "ghost", "--tp-rank", 0, "--wait", 1)
        out, _ = d.communicate(timeout=30)
        assert d.returncode == 2, out
        assert "engine 'ghost' never registered" in out
        assert time.monotonic() - t < 10
    finally:
        procs.stop()


def test_a_prefill_worker_killed_mid_flow_fails_its_requests_quickly_and_the_rest_go_on():
    procs = Procs()
    env = dict(os.environ, MC_TRANSFER_TIMEOUT="5")
    try:
        _, url = bootstrap(procs)
        prefill = [procs.start("prefill.py", "--bootstrap", url, "--engine-id", "e", "--tp-rank", tp,
                               "--block-bytes", 256 << 10, env=env) for tp in (0, 1)]
        for p in prefill:
            wait_line(p, "registered")
        dec = [procs.start("decode.py", "--bootstrap", url, "--engine-id", "e", "--tp-rank", tp, "--requests", 30,
                           "--pause", 0.05, env=env) for tp in (0, 1)]
        wait_line(dec[1], "request 3 ok")
        prefill[1].send_signal(signal.SIGKILL)
        prefill[1].wait()
        out1, _ = dec[1].communicate(timeout=120)
        out0, _ = dec[0].communicate(timeout=120)
        assert dec[1].returncode == 1, out1
        fails = [line for line in out1.splitlines() if "failed (" in line]
        assert fails, out1
        for line in fails:
            took = float(line.split("after ")[1].split(" s")[0])
            assert took < 10, line  # about the 5 s deadline (a dead peer fails at once)
        assert "WRONG" not in out1
        assert dec[0].returncode == 0, out0
        assert "30 requests ok, 0 failed" in out0
    finally:
        procs.stop()


def test_registration_is_repeated_after_a_bootstrap_restart_and_is_idempotent():
    procs = Procs()
    try:
        boot, url = bootstrap(procs)
        port = int(url.rsplit(":", 1)[1])
        prefill = [procs.start("prefill.py", "--bootstrap", url, "--engine-id", "e", "--tp-rank", tp) for tp in (0, 1)]
        for p in prefill:
            wait_line(p, "registered")
        before = query(url)
        assert sorted(before["0"]["workers"]) == ["0", "1"]
        boot.send_signal(signal.SIGKILL)
        boot.wait()
        _, url2 = bootstrap(procs, port)
        assert url2 == url
        end = time.monotonic() + 10
        while time.monotonic() < end:
            after = query(url)
            if sorted(after.get("0", {}).get("workers", {})) == ["0", "1"]:
                break
            time.sleep(0.1)
        assert after == before, "the same registrations came back"
        # Registering the same worker again changes nothing; another engine for dp 0 is refused.
        w = after["0"]["workers"]["0"]["0"]
        body = {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, **w}
        for _ in range(2):
            req = urllib.request.Request(f"{url}/register", data=json.dumps(body).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                assert json.loads(r.read()) == {"status": "ok"}
        assert query(url) == before
        req = urllib.request.Request(f"{url}/register", data=json.dumps({**body, "engine_id": "other"}).encode(),
                                     method="POST")
        try:
            urllib.request.urlopen(req, timeout=2)
            raise AssertionError("another engine id was accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 400
        # A decode worker finds the engine through the restarted server and pulls from it.
        d = procs.start("decode.py", "--bootstrap", url, "--engine-id", "e", "--tp-rank", 1, "--requests", 2)
        out, _ = d.communicate(timeout=60)
        assert d.returncode == 0 and "2 requests ok, 0 failed" in out, out
    finally:
        procs.stop()
