"""The flows users deploy, as `examples/` runs them, against real master and owner processes:
owner and requester-only ranks under scripts/mooncake_owner, prefill to decode through the
store, and an encoder cache with asynchronous saves."""

import os
import subprocess
import sys

from conftest import ROOT, Proc, bin_path, start_owner

EXAMPLES = ROOT / "examples"


def run(args, env=None, timeout=180):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, f"{args} exited with {out.returncode}:\n{out.stdout}\n{out.stderr[-4000:]}"
    return out.stdout


def test_owner_and_requester_only_ranks_under_the_wrapper():
    # A master of its own, with another owner beside the node's: the ranks' puts must still
    # all land on the node's owner.
    m = Proc([bin_path("mooncake_master"), "--rpc_address", "127.0.0.1", "--rpc_port", "0", "--metrics_port", "0"])
    other = None
    try:
        fields = dict(w.split("=", 1) for w in m.wait_line("mooncake_master ready").split() if "=" in w)
        rpc, http = fields["rpc"], fields["http"]
        other, _ = start_owner(rpc, "64MiB")
        env = dict(os.environ, MOONCAKE_OWNERD=bin_path("mooncake_ownerd"))
        env.pop("MOONCAKE_PREFERRED_SEGMENT", None)
        out = run([str(ROOT / "scripts" / "mooncake_owner"), "--master", rpc, "--host", "127.0.0.1", "--port", "0",
                   "--segment-size", "64MiB", "--no-mlock", "--",
                   sys.executable, str(EXAMPLES / "owner_and_requesters" / "launch.py"),
                   "--master", rpc, "--metrics", f"http://{http}/metrics"], env=env)
        assert "rank 0: put 32, read 32 of the other ranks', all exact" in out
        assert "rank 1: put 32" in out
        assert "holds all 64 objects" in out and "other segments hold none" in out
    finally:
        if other:
            other.stop()
        m.stop()


def test_prefill_to_decode_layer_by_layer(cluster):
    out = run([sys.executable, str(EXAMPLES / "prefill_decode" / "run.py"), "--master", cluster.master,
               "--request", "example-pd"])
    assert "prefill: 8 layers x 16 blocks of K and V written" in out
    assert "decode: 8 layers loaded as they arrived, every byte checked" in out


def test_encoder_cache_with_asynchronous_saves(cluster):
    out = run([sys.executable, str(EXAMPLES / "encoder_cache" / "run.py"), "--master", cluster.master])
    assert "5 requests done, 1 reported failed; prefill loaded 20 encoder outputs, all exact" in out
