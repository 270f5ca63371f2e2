"""mooncake_rs.engine.TransferEngine: Mooncake's calls and codes between two engines on
loopback, every byte checked, and the refusals Mooncake's engine lacks."""

import ctypes
import os

import pytest

from mooncake_rs.engine import TransferEngine, TransferOpcode
from conftest import stop_process
from test_ha import etcd  # noqa: F401  (the real-etcd fixture)


def buf(n, seed=0):
    """A buffer of exactly n bytes (a pattern when seeded, zeros otherwise) and its address."""
    b = ctypes.create_string_buffer(n)
    if seed:
        ctypes.memmove(b, bytes((i * 31 + seed) % 256 for i in range(n)), n)
    return b, ctypes.addressof(b)


@pytest.fixture(params=["tcp", "same-host"])
def pair(request, monkeypatch):
    """Two engines; the first reaches the second over TCP (MOONCAKE_SHM=0) or the same-host path."""
    monkeypatch.setenv("MOONCAKE_SHM", "0" if request.param == "tcp" else "1")
    a = TransferEngine()
    assert a.initialize("127.0.0.1:5555", "P2PHANDSHAKE", "tcp", "") == 0
    monkeypatch.setenv("MOONCAKE_SHM", "1")
    b = TransferEngine()
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    a.path = request.param
    yield a, b
    del a, b


def test_the_path_is_the_one_asked_for(pair):
    a, b = pair
    n = 256 << 10  # small batches take TCP even on one host (a grant costs a round trip)
    src, src_p = buf(n, seed=1)
    dst, dst_p = buf(n)
    assert a.register_memory(src_p, n) == 0 and b.register_memory(dst_p, n) == 0
    assert a.transfer_sync_write(session(b), src_p, dst_p, n) == 0
    assert dst.raw == src.raw
    want = {"tcp": {"same_host": 0, "same_host_mapped": 0, "tcp": 1},
            "same-host": {"same_host": 1, "same_host_mapped": 0, "tcp": 0}}[a.path]
    assert a.get_stats() == want


@pytest.fixture
def plain_pair():
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1:5555", "P2PHANDSHAKE", "tcp", "") == 0
    yield a, b
    del a, b


def session(e):
    return f"127.0.0.1:{e.get_rpc_port()}"


def test_sync_and_batch_transfers_both_ways(pair):
    a, b = pair
    assert a.get_rpc_port() != 5555 and a.get_session_id() == session(a)
    src, src_p = buf(1 << 20, seed=5)
    dst, dst_p = buf(1 << 20)
    assert a.register_memory(src_p, len(src)) == 0
    assert b.register_memory(dst_p, len(dst)) == 0
    assert a.transfer_sync_write(session(b), src_p, dst_p, 4096) == 0
    assert dst.raw[:4096] == src.raw[:4096]
    # 16 blocks of 64 KiB, scattered.
    blk = 64 << 10
    order = [(i * 5) % 16 for i in range(16)]
    assert a.batch_transfer_sync_write(session(b), [src_p + i * blk for i in range(16)],
                                       [dst_p + o * blk for o in order], [blk] * 16) == 0
    for i, o in enumerate(order):
        assert dst.raw[o * blk:(o + 1) * blk] == src.raw[i * blk:(i + 1) * blk]
    back, back_p = buf(1 << 20)
    assert a.register_memory(back_p, len(back)) == 0
    assert a.batch_transfer_sync_read(session(b), [back_p + i * blk for i in range(16)],
                                      [dst_p + o * blk for o in order], [blk] * 16) == 0
    assert back.raw == src.raw
    assert a.transfer_sync(session(b), back_p, dst_p, 8, TransferOpcode.Read) == 0
    assert a.batch_transfer_sync(session(b), [src_p], [dst_p], [8], TransferEngine.TransferOpcode.Write) == 0


def test_async_batches_and_status(pair):
    a, b = pair
    src, src_p = buf(256 << 10, seed=9)
    dst, dst_p = buf(256 << 10)
    assert a.batch_register_memory([src_p], [len(src)]) == 0
    assert b.batch_register_memory([dst_p], [len(dst)]) == 0
    ids = [a.batch_transfer_async_write(session(b), [src_p + i * 4096], [dst_p + i * 4096], [4096])
           for i in range(32)]
    assert all(i > 0 for i in ids) and len(set(ids)) == 32
    assert a.get_batch_transfer_status(ids) == 0
    assert dst.raw[:32 * 4096] == src.raw[:32 * 4096]
    assert a.get_batch_transfer_status(ids[:1]) == -1, "an id is spent once taken"
    rid = a.batch_transfer_async_read(session(b), [src_p], [dst_p + 8192], [4096])
    assert a.get_batch_transfer_status([rid]) == 0
    wid = a.transfer_submit_write(session(b), src_p, dst_p, 16)
    while (st := a.transfer_check_status(wid)) == 0:
        pass
    assert st == 1
    # A batch to unregistered memory fails when its status is taken.
    bad = a.batch_transfer_async_write(session(b), [src_p], [dst_p + (1 << 30)], [16])
    assert bad > 0 and a.get_batch_transfer_status([bad]) == -1
    assert a.batch_transfer_async_write(session(b), [src_p], [dst_p], [1, 2]) == 0, "mismatched lists"


def test_codes_for_bad_ranges_and_registrations(pair):
    a, b = pair
    src, src_p = buf(8192, seed=3)
    dst, dst_p = buf(4096)
    assert a.register_memory(src_p, 8192) == 0
    assert a.register_memory(src_p + 100, 10) == -7, "overlapping"
    assert a.register_memory(0, 10) == -1
    assert b.register_memory(dst_p, 4096) == 0
    # The target refuses what it did not register; nothing lands.
    assert a.transfer_sync_write(session(b), src_p, dst_p + 4000, 200) == -1
    assert a.transfer_sync_read(session(b), src_p, src_p, 16) == -1, "the peer never registered it"
    assert dst.raw == bytes(4096)
    # A local buffer outside registered memory is refused before anything moves.
    stray, stray_p = buf(64)
    assert a.transfer_sync_read(session(b), stray_p, dst_p, 64) == -1
    assert a.transfer_sync_write("127.0.0.1:1", src_p, dst_p, 16) == -1, "nothing there"
    assert a.unregister_memory(stray_p) == -3
    assert a.unregister_memory(src_p) == 0 and a.unregister_memory(src_p) == -3
    assert a.transfer_sync(session(b), src_p, dst_p, 16, 7) == -1, "unknown opcode"
    with pytest.raises(ValueError):
        a.read_bytes_from_buffer(stray_p, 8)
    assert a.write_bytes_to_buffer(stray_p, b"x", 1) == -3


def test_managed_buffers_first_address_and_probe(plain_pair):
    a, b = plain_pair
    m = b.allocate_managed_buffer(1 << 20)
    assert m and m % 4096 == 0
    assert b.write_bytes_to_buffer(m, b"prefill", 7) == 0
    assert a.get_first_buffer_address(session(b)) == m
    assert a.send_probe(session(b)) == 0
    local = a.allocate_managed_buffer(4096)
    assert a.transfer_sync_read(session(b), local, m, 7) == 0
    assert a.read_bytes_from_buffer(local, 7) == b"prefill"
    assert a.free_managed_buffer(local, 4096) == 0
    # Unregistered, then partly registered again: not freed under that region (-4, in use).
    assert b.unregister_memory(m) == 0 and b.register_memory(m + 4096, 4096) == 0
    assert b.free_managed_buffer(m, 1 << 20) == -4
    assert b.write_bytes_to_buffer(m + 4096, b"kv", 2) == 0
    assert b.unregister_memory(m + 4096) == 0
    assert b.free_managed_buffer(m, 1 << 20) == 0
    assert a.get_first_buffer_address(session(b)) == 0
    assert a.get_notifies() == []


TARGET = """
import sys
from mooncake_rs.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
n = int(sys.argv[1])
m = e.allocate_managed_buffer(n)
assert m and e.write_bytes_to_buffer(m, bytes((i * 7 + 1) % 251 for i in range(n)), n) == 0
print(f"127.0.0.1:{e.get_rpc_port()} {m}", flush=True)
sys.stdin.readline()  # the test wrote: check what landed
want = bytes((i * 13 + 5) % 251 for i in range(n))
print("ok" if e.read_bytes_from_buffer(m, n) == want else "wrong", flush=True)
sys.stdin.readline()
assert e.free_managed_buffer(m, n) == 0
"""


def memory_files(pid="self"):
    """The inodes of the managed buffers' memory files mapped in a process."""
    with open(f"/proc/{pid}/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:mooncake-managed" in line}


def start_target(n):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", TARGET, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    peer, m = p.stdout.readline().split()
    return p, peer, int(m)


def stop_target(p):
    if p.poll() is None:
        p.kill()
    p.wait()


@pytest.mark.parametrize("shm", ["1", "0"])
def test_another_processs_managed_buffer_is_copied_through_a_mapping(shm, monkeypatch):
    """A managed buffer lives in a memory file: a peer on the same host maps it and copies with
    memcpy (counted as same_host_mapped), and lets the mapping go once the target has exited;
    with MOONCAKE_SHM=0 the same calls go over TCP."""
    n = 4 << 20
    target, peer, m = start_target(n)
    second = None
    try:
        monkeypatch.setenv("MOONCAKE_SHM", shm)
        a = TransferEngine()
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        back, back_p = buf(n)
        src = ctypes.create_string_buffer(bytes((i * 13 + 5) % 251 for i in range(n)), n)
        src_p = ctypes.addressof(src)
        assert a.register_memory(back_p, n) == 0 and a.register_memory(src_p, n) == 0
        half = n // 2
        assert a.batch_transfer_sync_read(peer, [back_p, back_p + half], [m, m + half],
                                          [half, half]) == 0
        assert back.raw == bytes((i * 7 + 1) % 251 for i in range(n))
        assert a.transfer_sync_write(peer, src_p, m, n) == 0
        target.stdin.write("check\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "ok"
        mapped = 2 if shm == "1" else 0
        assert a.get_stats() == {"same_host": mapped, "same_host_mapped": mapped, "tcp": 2 - mapped}
        (theirs,) = memory_files(target.pid)
        assert (theirs in memory_files()) == (shm == "1"), "mapped only on the same-host path"
        target.stdin.write("done\n")
        target.stdin.close()
        assert target.wait(timeout=30) == 0
        # The target is gone: the caller's next grant (to another process) lets its file go.
        second, peer2, m2 = start_target(n)
        ctypes.memset(back_p, 0, n)
        assert a.transfer_sync_read(peer2, back_p, m2, 256 << 10) == 0
        assert back.raw[:256 << 10] == bytes((i * 7 + 1) % 251 for i in range(256 << 10))
        assert theirs not in memory_files()
    finally:
        stop_target(target)
        if second:
            stop_target(second)


def test_a_sync_call_is_not_held_up_by_another_threads_call_to_a_silent_peer(monkeypatch):
    """Sync calls from several threads (a connector's thread pool): one waiting on a peer that
    stopped answering does not hold up another's call to a healthy peer. Before, every sync call
    ran on one runtime, which the first call's blocking socket held: the second waited out the
    first one's deadline."""
    import signal
    import threading
    import time

    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    monkeypatch.setenv("MOONCAKE_SHM", "0")
    n = 4096
    target, peer, m = start_target(n)
    try:
        a, b = TransferEngine(), TransferEngine()
        for e in (a, b):
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src, src_p = buf(n, seed=3)
        dst, dst_p = buf(n)
        assert a.register_memory(src_p, n) == 0 and b.register_memory(dst_p, n) == 0
        # Met once: the next small call to it waits on a blocking socket.
        assert a.transfer_sync_write(peer, src_p, m, n) == 0
        stop_process(target.pid)
        stuck = {}
        t = threading.Thread(
            target=lambda: stuck.setdefault("rc", a.transfer_sync_write(peer, src_p, m, n)))
        t.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert a.transfer_sync_write(session(b), src_p, dst_p, n) == 0
        took = time.monotonic() - start
        assert dst.raw == src.raw
        t.join(timeout=30)
        assert stuck["rc"] == -1, "the silent peer's call fails at its deadline"
        assert took < 4, f"the healthy call waited {took:.1f} s"
    finally:
        os.kill(target.pid, signal.SIGCONT)
        stop_target(target)


def test_initialize_refuses_what_it_cannot_do():
    e = TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1, "before initialize"
    assert e.initialize("127.0.0.1", "http://127.0.0.1:8080/metadata", "tcp", "") == -1
    assert e.initialize("127.0.0.1", "etcd://not-an-endpoint", "tcp", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "twice"
    assert e.get_rpc_port() > 0


def test_etcd_metadata_names_peers_by_their_hostname(etcd, monkeypatch):
    """With an etcd metadata server, engines are named by the local_hostname they started with
    (etcd maps it to their session), as Mooncake's engine with etcd metadata."""
    monkeypatch.setenv("MOONCAKE_SHM", "0")
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1:7001", f"etcd://{etcd}", "tcp", "") == 0
    assert b.initialize("127.0.0.1:7002", etcd, "tcp", "") == 0, "a bare HOST:PORT is etcd too"
    src, src_p = buf(64 << 10, seed=4)
    dst, dst_p = buf(64 << 10)
    assert a.register_memory(src_p, len(src)) == 0 and b.register_memory(dst_p, len(dst)) == 0
    assert a.transfer_sync_write("127.0.0.1:7002", src_p, dst_p, len(src)) == 0
    assert dst.raw == src.raw
    assert a.get_first_buffer_address("127.0.0.1:7002") == dst_p
    assert a.transfer_sync_write("127.0.0.1:7999", src_p, dst_p, 16) == -1, "no engine by that name"
    # A stopped engine's entry goes with it; a new engine under the same name is found.
    del b
    assert a.transfer_sync_write("127.0.0.1:7002", src_p, dst_p, 16) == -1
    c = TransferEngine()
    assert c.initialize("127.0.0.1:7002", f"etcd://{etcd}", "tcp", "") == 0
    again, again_p = buf(64 << 10)
    assert c.register_memory(again_p, len(again)) == 0
    # The first call after the restart names the old process's incarnation: the new one refuses
    # it and nothing moves (the caller's addresses were the old process's), small or large.
    big, big_p = buf(1 << 20, seed=5)
    assert a.register_memory(big_p, len(big)) == 0
    room, room_p = buf(1 << 20)
    assert c.register_memory(room_p, len(room)) == 0
    assert a.transfer_sync_write("127.0.0.1:7002", src_p, again_p, len(src)) == -1
    assert again.raw == bytes(len(again))
    # The same call again still fails: its addresses were learnt from the old process, and
    # may well be where the new one keeps other buffers.
    assert a.transfer_sync_write("127.0.0.1:7002", src_p, again_p, len(src)) == -1
    assert again.raw == bytes(len(again))
    # Its buffers looked up again, it is met again: served, on the small and the batch path.
    assert a.get_first_buffer_address("127.0.0.1:7002") == again_p
    assert a.transfer_sync_write("127.0.0.1:7002", src_p, again_p, len(src)) == 0
    assert again.raw == src.raw
    assert a.batch_transfer_sync_write("127.0.0.1:7002", [big_p], [room_p], [len(big)]) == 0
    assert room.raw == big.raw
    # A batch is refused likewise after a restart, and moves nothing. With no call in between,
    # the name still leads to the old session: the call finds the new one within itself, and
    # that one refuses it (one failed call per restart, not two).
    del c
    d = TransferEngine()
    assert d.initialize("127.0.0.1:7002", f"etcd://{etcd}", "tcp", "") == 0
    fresh, fresh_p = buf(1 << 20)
    assert d.register_memory(fresh_p, len(fresh)) == 0
    assert a.batch_transfer_sync_write("127.0.0.1:7002", [big_p], [fresh_p], [len(big)]) == -1
    assert fresh.raw == bytes(len(fresh))
    assert a.batch_transfer_sync_write("127.0.0.1:7002", [big_p], [fresh_p], [len(big)]) == -1
    assert fresh.raw == bytes(len(fresh)), "a retry with the old addresses moved bytes"
    assert a.get_first_buffer_address("127.0.0.1:7002") == fresh_p
    assert a.batch_transfer_sync_write("127.0.0.1:7002", [big_p], [fresh_p], [len(big)]) == 0
    assert fresh.raw == big.raw


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_restarted_peer_refuses_calls_meant_for_its_predecessor(etcd, monkeypatch, shm):
    """A new engine under a name the caller met before refuses the first call (its incarnation
    is not the one met), over TCP and over the same-host path, and nothing moves; so are the
    calls after it (their addresses were the old process's: a probe does not change that), until
    the caller looks the peer's buffers up again, which meets it afresh."""
    monkeypatch.setenv("MOONCAKE_SHM", shm)
    port = 7101 + 10 * int(shm)
    me, peer = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize(me, f"etcd://{etcd}", "tcp", "") == 0
    assert b.initialize(peer, f"etcd://{etcd}", "tcp", "") == 0
    n = 1 << 20
    src, src_p = buf(n, seed=6)
    back, back_p = buf(n)
    dst, dst_p = buf(n)
    assert a.register_memory(src_p, n) == 0 and a.register_memory(back_p, n) == 0
    assert b.register_memory(dst_p, n) == 0
    assert a.batch_transfer_sync_write(peer, [src_p], [dst_p], [n]) == 0
    assert dst.raw == src.raw
    del b
    # While no process is behind the name, calls fail (and the caller looks the name up again).
    assert a.batch_transfer_sync_write(peer, [src_p], [dst_p], [n]) == -1
    c = TransferEngine()
    assert c.initialize(peer, f"etcd://{etcd}", "tcp", "") == 0
    fresh, fresh_p = buf(n)
    assert c.register_memory(fresh_p, n) == 0
    assert a.batch_transfer_sync_write(peer, [src_p], [fresh_p], [n]) == -1
    assert fresh.raw == bytes(n), "nothing moved"
    for _ in range(2):
        assert a.batch_transfer_sync_write(peer, [src_p], [fresh_p], [n]) == -1
        assert a.transfer_sync_write(peer, src_p, fresh_p, 4096) == -1
        assert a.send_probe(peer) == 0
    assert fresh.raw == bytes(n), "a retry with the old addresses moved bytes"
    assert a.get_first_buffer_address(peer) == fresh_p
    before = a.get_stats()
    assert a.batch_transfer_sync_write(peer, [src_p], [fresh_p], [n]) == 0
    assert a.batch_transfer_sync_read(peer, [back_p], [fresh_p], [n]) == 0
    assert fresh.raw == src.raw and back.raw == src.raw
    after = a.get_stats()
    path = "same_host" if shm == "1" else "tcp"
    assert after[path] - before[path] == 2, (before, after)


def test_calls_in_flight_when_a_peer_restarts_never_reach_its_successor(etcd, monkeypatch):
    """Many calls made while a name still meant the old engine, all in flight when its
    successor is up: each names the incarnation it met, so every one is refused, however the
    refusals of the others interleave with them, and nothing moves."""
    monkeypatch.setenv("MOONCAKE_SHM", "0")
    me, peer = "127.0.0.1:7131", "127.0.0.1:7132"
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize(me, f"etcd://{etcd}", "tcp", "") == 0
    assert b.initialize(peer, f"etcd://{etcd}", "tcp", "") == 0
    n = 64 << 10
    src, src_p = buf(n, seed=9)
    dst, dst_p = buf(n)
    assert a.register_memory(src_p, n) == 0 and b.register_memory(dst_p, n) == 0
    assert a.batch_transfer_sync_write(peer, [src_p], [dst_p], [n]) == 0
    del b
    c = TransferEngine()
    assert c.initialize(peer, f"etcd://{etcd}", "tcp", "") == 0
    # The successor's buffer at the address the caller knew (allocations often come back at
    # the same place): a call that reached it would land.
    fresh, fresh_p = buf(n)
    assert c.register_memory(fresh_p, n) == 0
    ids = [a.batch_transfer_async_write(peer, [src_p], [fresh_p], [n]) for _ in range(32)]
    assert all(ids)
    assert all(a.get_batch_transfer_status([i]) == -1 for i in ids)
    assert fresh.raw == bytes(n), "a call made for the old engine wrote into its successor"


def test_device_memory_is_staged_never_read_as_host_memory(monkeypatch):
    """GPU memory follows the store's handling: recognised at registration, moved through host
    staging with the device's own copies (a host-backed device here, whose addresses fault if
    read directly), and never sent process to process."""
    monkeypatch.setenv("MOONCAKE_SHM", "1")
    a, b = TransferEngine(), TransferEngine()
    dev_a, dev_b = a._attach_host_backed_device(), b._attach_host_backed_device()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    n = 512 << 10
    da, db = dev_a.alloc(n), dev_b.alloc(n)
    data = bytes((i * 7) % 256 for i in range(n))
    dev_a.write(da, data)
    assert a.register_memory(da, n) == 0 and b.register_memory(db, n) == 0
    assert a.transfer_sync_write(session(b), da, db, n) == 0
    assert dev_b.read(db, n) == data
    host, host_p = buf(n)
    assert a.register_memory(host_p, n) == 0
    assert a.transfer_sync_read(session(b), host_p, db, n) == 0
    assert host.raw == data
    assert a.get_stats() == {"same_host": 0, "same_host_mapped": 0, "tcp": 2}
    assert b.write_bytes_to_buffer(db, b"kv", 2) == 0 and b.read_bytes_from_buffer(db, 2) == b"kv"
