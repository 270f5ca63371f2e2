"""scripts/soak for 30 s, as CI runs it: four requester processes against a master and two
owners with SSD tiers, auth on; no wrong byte, no lost object, no unexpected code."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_soak_30s(tmp_path):
    token = tmp_path / "token"
    token.write_text("soak-secret-0123456789abcdefghij\n")
    os.chmod(token, 0o600)
    env = dict(os.environ)
    env.setdefault("MOONCAKE_BIN_DIR", os.path.join(ROOT, "target", "debug"))
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--seconds", "30", "--workers", "4",
         "--token-file", str(token)],
        env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    print(r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-3000:]
    assert "wrong bytes: 0; lost objects: 0; unexpected codes: 0" in r.stdout
