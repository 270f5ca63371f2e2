"""scripts/trace_gen.py makes valid, reproducible traces of each shape: JSON lines with integer
hash_ids, the same output for the same seed, and prefix structure (a later turn of a conversation
starts with every block of its earlier turn)."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "trace_gen.py"


def generate(*args):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("shape", ["chat", "rag", "agent", "flat"])
def test_each_shape_is_valid_reproducible_and_prefix_structured(shape):
    reqs = generate("--shape", shape, "--requests", "300", "--seed", "7")
    assert len(reqs) == 300
    assert reqs == generate("--shape", shape, "--requests", "300", "--seed", "7")
    assert reqs != generate("--shape", shape, "--requests", "300", "--seed", "8")
    ids = [r["hash_ids"] for r in reqs]
    assert all(r and all(isinstance(b, int) and b > 0 for b in r) for r in ids)
    assert all(r["input_length"] == 512 * len(r["hash_ids"]) for r in reqs)
    # Some request extends an earlier one exactly (a conversation's next turn).
    extends = sum(1 for i, r in enumerate(ids) for p in ids[max(0, i - 50):i]
                  if len(p) < len(r) and r[:len(p)] == p)
    assert extends > 0


def test_bad_arguments_are_refused():
    bad = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "positive" in bad.stderr
