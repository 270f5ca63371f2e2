"""Authentication through the Python surface: `setup()` proves the token named by
MOONCAKE_AUTH_TOKEN_FILE to a master and owners started with the same file, and is refused
without it or with another one."""

import os

import pytest

from conftest import start_master, start_owner
from mooncake_rs import MooncakeDistributedStore

SECRET = "pQ4mZ8vR1xT6yU3wK0sD9fG2hJ5lN7bC"


def token(tmp_path, name, secret):
    p = tmp_path / name
    p.write_text(secret + "\n")
    os.chmod(p, 0o600)
    return str(p)


@pytest.fixture
def guarded(tmp_path):
    path = token(tmp_path, "token", SECRET)
    m, rpc = start_master(["--auth_token_file", path])
    o, _ = start_owner(rpc, size="64MiB", extra=["--auth_token_file", path])
    try:
        yield rpc, path, token(tmp_path, "wrong", "another secret of 32 characters!")
    finally:
        o.stop()
        m.stop()


def setup(master, segment_size=0):
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "http://unused/metadata", segment_size, 16 << 20, "tcp", "", master)
    return s, rc


def test_setup_with_the_token_file_puts_and_gets(guarded, monkeypatch):
    rpc, path, _ = guarded
    monkeypatch.setenv("MOONCAKE_AUTH_TOKEN_FILE", path)
    # A store that contributes a segment too: its embedded owner proves the same token.
    for segment_size in (0, 32 << 20):
        s, rc = setup(rpc, segment_size)
        assert rc == 0
        value = os.urandom(100_000)
        key = f"py-auth/{segment_size}"
        assert s.put(key, value) == 0
        assert s.get(key) == value
        s.close()


def test_setup_without_or_with_another_token_is_refused(guarded, monkeypatch):
    rpc, _, wrong = guarded
    monkeypatch.delenv("MOONCAKE_AUTH_TOKEN_FILE", raising=False)
    s, rc = setup(rpc)
    assert rc == -1500, "UNAUTHENTICATED"
    monkeypatch.setenv("MOONCAKE_AUTH_TOKEN_FILE", wrong)
    s, rc = setup(rpc)
    assert rc == -1500
    monkeypatch.setenv("MOONCAKE_AUTH_TOKEN_FILE", "/nonexistent/token")
    s, rc = setup(rpc)
    assert rc == -600, "an unreadable token file is a configuration error"


def test_tenant_ids_are_namespaces(tmp_path):
    """setup(tenant_id=...) names the key namespace, on an open master as on a guarded one:
    the same key in two tenants is two objects, and one tenant's remove_all leaves the other's."""
    m, rpc = start_master([])
    o, _ = start_owner(rpc, size="64MiB")
    stores = []
    try:
        for tenant in ("team-a", "team-b", "default"):
            s = MooncakeDistributedStore()
            rc = s.setup("127.0.0.1", "http://unused/metadata", 0, 16 << 20, "tcp", "", rpc,
                         tenant_id=tenant)
            assert rc == 0, tenant
            stores.append(s)
        a, b, d = stores
        assert a.put("k", b"of team a") == 0
        assert b.put("k", b"of team b") == 0
        assert a.get("k") == b"of team a"
        assert b.get("k") == b"of team b"
        assert d.is_exist("k") == 0
        assert b.remove_all(True) == 1
        assert a.get("k") == b"of team a"
        assert b.is_exist("k") == 0
    finally:
        for s in stores:
            s.close()
        o.stop()
        m.stop()
