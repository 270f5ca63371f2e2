"""A store set up before `os.fork()` (multiprocessing's fork start method, DataLoader workers):
the child does not use the parent's session, whose I/O threads did not survive the fork and
whose sockets the parent still uses. Its calls answer "not set up" at once (before: they waited
for ever on a runtime with no threads, or read the parent's answers over the shared sockets),
it can set up a session of its own, and the parent's session is untouched."""

import os
import signal
import warnings

import pytest

from mooncake_rs.store import MooncakeDistributedStore, MooncakeDistributedStoreAsync

INVALID = -600


def in_child(body):
    """Runs `body()` in a forked child within 20 s; its repr'd result, or the child's status."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python warns that forking a process with threads may deadlock the child: that is
        # what this test checks does not happen in the store.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            signal.alarm(20)
            os.write(w, repr(body()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with status {status:#x}"
    return eval(out)


@pytest.mark.parametrize("cls", [MooncakeDistributedStore, MooncakeDistributedStoreAsync])
def test_a_forked_child_sets_up_its_own_session_and_leaves_the_parents_alone(cluster, cls):
    args = ("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master)
    s = cls()
    assert s.setup(*args) == 0
    try:
        assert s.put("fork/k", b"the parent's") == 0

        def child():
            inherited = (s.is_exist("fork/k"), s.get("fork/k"), s.put("fork/child", b"x"))
            again = s.setup(*args)
            got = s.get("fork/k") if again == 0 else None
            stored = s.put("fork/child", b"the child's") if again == 0 else None
            s.close()
            return inherited, again, got, stored

        inherited, again, got, stored = in_child(child)
        assert inherited == (INVALID, b"", INVALID), "the child used the parent's session"
        assert (again, got, stored) == (0, b"the parent's", 0)
        # The parent's session works as before, and sees what the child stored with its own.
        assert s.is_exist("fork/k") == 1
        assert s.get("fork/k") == b"the parent's"
        assert s.get("fork/child") == b"the child's"
    finally:
        s.remove_all(True)
        s.close()


def test_a_forked_child_does_not_use_the_parents_transfer_engine(monkeypatch):
    """The same for a TransferEngine initialized before fork(): the child's calls fail at once
    (-1) instead of hanging on runtimes whose threads did not survive the fork, its copy is never
    stopped (that would withdraw the parent's registration), and it may initialize its own."""
    from mooncake_rs.engine import TransferEngine

    monkeypatch.setenv("MOONCAKE_SHM", "0")
    parent = TransferEngine()
    assert parent.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port = parent.get_rpc_port()
    assert port > 0

    def child():
        inherited = (parent.get_rpc_port(), parent.transfer_sync_write("127.0.0.1:1", 1, 1, 1))
        again = parent.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        return inherited, again, parent.get_rpc_port() not in (-1, port)

    inherited, again, own_port = in_child(child)
    assert inherited == (-1, -1), "the child used the parent's engine"
    assert again == 0 and own_port
    assert parent.get_rpc_port() == port, "the parent's engine is untouched"
