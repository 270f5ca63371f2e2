"""MooncakeDistributedStore against a real master and owners: every method, Mooncake's return
codes, zero-copy pointers checked against registrations, scatter/gather, and setup failures."""

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mooncake_rs.store import MooncakeDistributedStore, ReplicateConfig

INVALID, NOT_FOUND, HAS_LEASE = -600, -704, -706


def registered(store, nbytes, fill=None):
    """A NumPy byte buffer registered with the store."""
    a = np.zeros(nbytes, dtype=np.uint8) if fill is None else np.frombuffer(bytearray(fill), dtype=np.uint8).copy()
    assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    return a


def test_setup_forms_and_their_errors(cluster):
    s = MooncakeDistributedStore()
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "0",
           "local_buffer_size": str(16 << 20), "protocol": "tcp", "rdma_devices": "", "master_server_addr": cluster.master}
    assert s.setup(cfg) == 0
    assert s.setup(cfg) == INVALID, "a second setup without close is refused"
    assert s.close() == 0
    assert s.setup(local_hostname="127.0.0.1", metadata_server="", global_segment_size=0, local_buffer_size=0,
                   protocol="tcp", rdma_devices="", master_server_addr=cluster.master, tenant_id="default") == 0
    s.close()
    with pytest.raises(ValueError, match="unknown config key 'colour'"):
        s.setup({**cfg, "colour": "blue"})
    with pytest.raises(TypeError, match="missing required argument 'local_hostname'"):
        s.setup()
    # Mooncake's defaults for the last five arguments (protocol "tcp" among them).
    assert s.setup("127.0.0.1", "", 0, master_server_addr=cluster.master) == 0
    s.close()
    with pytest.raises(ValueError, match="invalid size"):
        s.setup("127.0.0.1", "", "lots", 0, "tcp", "", cluster.master)
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "", [], 0, "tcp", "", cluster.master)
    assert s.setup("127.0.0.1", "", 0, 0, "rdma", "", cluster.master) == INVALID
    assert s.setup("127.0.0.1", "", 0, 0, "carrier-pigeon", "", cluster.master) == INVALID


@pytest.mark.parametrize("master", ["127.0.0.1:1", "10.255.255.1:50051"])
def test_setup_against_an_unreachable_master_fails_within_seconds(master):
    s = MooncakeDistributedStore()
    t = time.monotonic()
    rc = s.setup("127.0.0.1", "", 0, 0, "tcp", "", master)
    assert rc < 0
    assert time.monotonic() - t < 8


def test_a_store_that_is_not_set_up_answers_codes_not_crashes():
    s = MooncakeDistributedStore()
    buf = np.zeros(8, dtype=np.uint8)
    assert s.put("k", b"v") == INVALID
    assert s.get("k") == b""
    assert s.is_exist("k") == INVALID
    assert s.batch_is_exist(["a", "b"]) == [INVALID, INVALID]
    assert s.get_size("k") == INVALID
    assert s.remove("k") == INVALID
    assert s.batch_remove(["k"]) == [INVALID]
    assert s.remove_all() == INVALID
    assert s.get_into("k", buf.ctypes.data, 8) == INVALID
    assert s.batch_get_into(["k"], [buf.ctypes.data], [8]) == [INVALID]
    assert s.register_buffer(buf.ctypes.data, 8) == INVALID, "GPU memory is recognised from setup() on"
    assert s.batch_get_replica_desc(["k"]) == {}
    assert s.get_hostname() == ""
    assert s.health_check() == 1
    assert s.get_tensor("k") is None
    assert s.close() == 0


def test_put_get_and_mooncake_conventions(store):
    assert store.put("hello", b"Hello, store!") == 0
    assert store.put("hello", b"something else") == 0, "an existing key is a success no-op"
    assert store.get("hello") == b"Hello, store!"
    assert store.get("missing") == b""
    assert store.put("ba", bytearray(b"from a bytearray")) == 0
    assert store.put("mv", memoryview(b"xxfrom a viewxx")[2:-2]) == 0
    assert store.get("ba") == b"from a bytearray" and store.get("mv") == b"from a view"
    assert store.is_exist("hello") == 1
    assert store.is_exist("missing") == 0
    assert store.batch_is_exist(["hello", "missing", "ba"]) == [1, 0, 1]
    assert store.get_size("hello") == 13
    assert store.get_size("missing") == NOT_FOUND
    assert store.put("", b"x") == INVALID
    assert store.put("empty", b"") == INVALID
    assert store.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("parts") == b"abcdef"
    assert store.put_batch(["pb1", "pb2"], [b"one", b"two"]) == 0
    assert store.get_batch(["pb1", "missing", "pb2"]) == [b"one", b"", b"two"]
    big = os.urandom(5 << 20)
    before = store.transfer_stats()
    assert store.put("big", big) == 0
    assert store.get("big") == big
    after = store.transfer_stats()
    assert after["memory_keys"] - before["memory_keys"] == 1
    assert after["memory_bytes"] - before["memory_bytes"] == 5 << 20
    assert after["disk_keys"] == before["disk_keys"] == 0
    moved = (after["local_bytes"] + after["tcp_bytes"]) - (before["local_bytes"] + before["tcp_bytes"])
    assert moved == 2 * (5 << 20), "the put and the get"


def test_zero_copy_put_from_and_get_into(store):
    src = registered(store, 1 << 20, os.urandom(1 << 20))
    dst = registered(store, 1 << 20)
    p, q = src.ctypes.data, dst.ctypes.data
    assert store.put_from("zc", p, 4096) == 0
    assert store.get_into("zc", q, 8192) == 4096
    assert bytes(dst[:4096]) == bytes(src[:4096])
    assert store.get_into("zc", q, 100) == INVALID, "buffer smaller than the object"
    assert store.get_into("missing", q, 100) == NOT_FOUND

    keys = [f"zc/{i}" for i in range(16)]
    rc = store.batch_put_from(keys, [p + i * 65536 for i in range(16)], [65536] * 16)
    assert rc == [0] * 16
    dst[:] = 0
    spare = registered(store, 10)
    got = store.batch_get_into(keys + ["missing"], [q + i * 65536 for i in range(16)] + [spare.ctypes.data], [65536] * 16 + [10])
    assert got == [65536] * 16 + [NOT_FOUND]
    assert np.array_equal(src, dst)
    assert store.batch_put_from(["a", "b"], [p], [1, 2]) == [INVALID, INVALID], "mismatched lengths"


def test_pointers_outside_registered_memory_are_refused(store):
    reg = registered(store, 4096, os.urandom(4096))
    other = np.zeros(4096, dtype=np.uint8)
    p = reg.ctypes.data
    assert store.put_from("ok", p, 4096) == 0
    assert store.put_from("never", other.ctypes.data, 100) == INVALID
    assert store.put_from("past-end", p + 4000, 200) == INVALID
    assert store.get_into("ok", other.ctypes.data, 4096) == INVALID
    assert store.get_into("ok", 0, 4096) == INVALID
    assert store.get_into("ok", 8, 4096) == INVALID
    assert store.is_exist("never") == 0 and store.is_exist("past-end") == 0
    # Two destinations of one batch may not overlap.
    assert store.batch_get_into(["ok", "ok"], [p, p + 100], [4096, 100]) == [4096, INVALID]
    # They may touch; one overlapping any earlier destination of the batch is refused.
    assert store.put_from("ten", p + 2000, 10) == 0
    got = store.batch_get_into(["ten"] * 5, [p, p + 10, p + 5, p + 30, p + 20], [10] * 5)
    assert got == [10, 10, INVALID, 10, 10]
    assert store.unregister_buffer(p) == 0
    assert store.unregister_buffer(p) == INVALID
    assert store.get_into("ok", p, 4096) == INVALID, "unregistered memory is refused"
    assert store.register_buffer(0, 10) == INVALID
    assert store.register_buffer(p, 0) == INVALID
    # Only memory this process maps readable and writable counts as host memory: anything else
    # (a stray address, reserved address space as device memory's, a read-only mapping) would
    # crash the process when a transfer touched it.
    assert store.register_buffer(4096, 4096) == INVALID
    import mmap
    ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
    ro_array = np.frombuffer(ro, dtype=np.uint8)
    assert store.register_buffer(ro_array.ctypes.data, 8192) == INVALID
    del ro_array
    ro.close()


def test_objects_scattered_over_several_buffers(store):
    k_src = registered(store, 3000, os.urandom(3000))
    v_src = registered(store, 5000, os.urandom(5000))
    rc = store.batch_put_from_multi_buffers(["kv", "kv2"], [[k_src.ctypes.data, v_src.ctypes.data], [v_src.ctypes.data]],
                                            [[3000, 5000], [5000]])
    assert rc == [0, 0]
    assert store.get("kv") == bytes(k_src) + bytes(v_src)
    a, b = registered(store, 1000), registered(store, 7000)
    got = store.batch_get_into_multi_buffers(["kv"], [[a.ctypes.data, b.ctypes.data]], [[1000, 7000]])
    assert got == [8000]
    assert bytes(a) + bytes(b) == bytes(k_src) + bytes(v_src)
    small = store.batch_get_into_multi_buffers(["kv"], [[a.ctypes.data, b.ctypes.data]], [[1000, 6999]])
    assert small == [INVALID]
    # A key refused for an unregistered buffer leaves the next key's buffers where they are:
    # kv2 lands in its own buffer, and kv's registered one is left alone.
    loose = np.zeros(3000, dtype=np.uint8)
    c = registered(store, 5000)
    a[:] = 7
    got = store.batch_get_into_multi_buffers(["kv", "kv2"], [[loose.ctypes.data, a.ctypes.data], [c.ctypes.data]],
                                             [[3000, 1000], [5000]])
    assert got == [INVALID, 5000]
    assert bytes(c) == bytes(v_src)
    assert bytes(a) == b"\x07" * 1000


def test_remove_and_leases(store):
    store.put("r", b"data")
    assert store.get("r") == b"data"
    # A check holds the object for this client's next read (until its next call ends).
    assert store.is_exist("r") == 1
    assert store.remove("r") == HAS_LEASE
    assert store.remove("r", True) == 0
    assert store.remove("r") == NOT_FOUND
    for i in range(3):
        store.put(f"ra/{i}", b"x")
    assert store.batch_remove(["ra/0", "ra/1", "missing"]) == [0, 0, NOT_FOUND]
    assert store.remove_all() >= 1
    assert store.is_exist("ra/2") == 0


def test_replica_config_and_descriptors(store, cluster):
    c = ReplicateConfig()
    assert (c.replica_num, c.preferred_segment, c.preferred_segments, c.with_soft_pin, c.with_hard_pin) == (1, "", [], False, False)
    c.replica_num = 2
    assert "replica_num=2" in repr(c)
    assert store.put("two", b"replicated", c) == 0
    desc = store.batch_get_replica_desc(["two", "missing"])
    assert list(desc) == ["two"], "misses are left out"
    reps = desc["two"]
    assert sorted(r.segment for r in reps) == sorted(cluster.segments)
    for r in reps:
        assert r.is_memory_replica() and not r.is_disk_replica()
        md = r.get_memory_descriptor().buffer_descriptor
        assert md.size == 10 and md.transport_endpoint == r.segment
    pref = ReplicateConfig(preferred_segment=cluster.segments[1])
    for i in range(4):
        assert store.put(f"pref/{i}", b"p", pref) == 0
        assert [r.segment for r in store.get_replica_desc(f"pref/{i}")] == [cluster.segments[1]]
    assert store.get_replica_desc("missing") == []
    pinned = ReplicateConfig(with_hard_pin=True, with_soft_pin=True)
    assert store.put("pinned", b"p", config=pinned) == 0


def test_wrong_argument_types_raise_python_errors(store):
    with pytest.raises(TypeError):
        store.put(123, b"x")
    with pytest.raises(TypeError, match="bytes-like"):
        store.put("k", 123)
    with pytest.raises(TypeError):
        store.batch_get_into(["a"], ["not a pointer"], [1])
    with pytest.raises(TypeError):
        store.put("k", b"x", config="not a config")
    # Not a tensor: Mooncake's code, not an exception.
    assert store.put_tensor("t", [1, 2, 3]) == -600


def test_an_embedded_owner_contributes_memory_and_serves_others(cluster, store):
    emb = MooncakeDistributedStore()
    assert emb.setup("127.0.0.1", "", 64 << 20, 0, "tcp", "", cluster.master) == 0
    host = emb.get_hostname()
    assert host.startswith("127.0.0.1:") and host not in cluster.segments
    assert emb.put("emb", b"held in the embedded owner") == 0
    assert [r.segment for r in emb.get_replica_desc("emb")] == [host], "puts prefer the local segment"
    assert store.get("emb") == b"held in the embedded owner"
    emb.remove("emb", True)
    assert emb.close() == 0
    assert store.is_exist("emb") == 0


def test_a_store_dropped_without_close_lets_other_threads_run_while_it_closes():
    """Closing a dropped store waits for the network (its embedded owner unmounts, here from a
    stopped master, until the unmount's deadline): other Python threads run meanwhile."""
    import signal
    import threading

    from conftest import start_master, stop_process

    m, rpc = start_master()
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 16 << 20, 0, "tcp", "", rpc) == 0
        ticks, stop = [], threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        ticker = threading.Thread(target=tick)
        ticker.start()
        stop_process(m.p.pid)
        try:
            start = time.monotonic()
            del s
            took = time.monotonic() - start
        finally:
            os.kill(m.p.pid, signal.SIGCONT)
            stop.set()
            ticker.join()
        assert took > 0.5, f"the close did not wait for the stopped master ({took:.2f}s)"
        during = [t for t in ticks if start < t < start + took]
        assert len(during) > took / 0.01 / 4, f"{len(during)} ticks in {took:.2f}s: the GIL was held"
    finally:
        m.stop()


def test_close_waits_for_a_copy_into_the_stores_own_memory(store, cluster):
    """get_into_ranges copies into the caller's registered memory, here a block of the store's
    own pool (alloc_from_mem_pool), which close() frees. Closing while another thread copies
    into it waits for the copy, made natively with the registry pinned: every range is copied
    whole or refused, and nothing faults. Before, the copy was a ctypes.memmove, which released
    the GIL with nothing pinned, so close() could unmap the block under it (SIGSEGV; the window
    is narrow, and this test did not hit it on a 2-core machine)."""
    child = textwrap.dedent(f"""
        import os, threading
        from mooncake_rs.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 16 << 20, "tcp", "", {cluster.master!r}) == 0
        key = f"close-race/{{os.getpid()}}"
        size = 48 << 20
        assert s.put(key, b"x" * size) == 0
        block = s.alloc_from_mem_pool(size)
        assert block
        copying = threading.Event()

        def copy():
            while True:
                got = s.get_into_ranges([block], [[key] * 4], [[0] * 4], [[0] * 4], [[size] * 4])[0]
                # Each range copied whole, or refused once the store closed (-600).
                assert all(n in (size, -600) for n in got), got
                if -600 in got:
                    ended.append(got)
                    return
                copying.set()

        ended = []

        t = threading.Thread(target=copy)
        t.start()
        assert copying.wait(30)
        s.close()
        t.join(30)
        assert ended, "the copying thread failed"
        print("closed")
    """)
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0 and out.stdout.strip() == "closed", (out.returncode, out.stderr[-2000:])
    # (The `store` fixture removes the children's 48 MiB objects from the shared cluster.)


def test_two_processes_share_objects_through_one_owner(store, cluster):
    payload = os.urandom(300_000)
    assert store.put("shared/from-parent", payload) == 0
    child = textwrap.dedent(f"""
        import sys
        from mooncake_rs.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 0, "tcp", "", {cluster.master!r}) == 0
        data = s.get("shared/from-parent")
        sys.stdout.write(data.hex()[:64] + " " + str(len(data)) + "\\n")
        assert s.put("shared/from-child", data[::-1]) == 0
        s.close()
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    head, n = out.stdout.split()
    assert head == payload.hex()[:64] and int(n) == len(payload)
    assert store.get("shared/from-child") == payload[::-1]


def test_no_deadlock_between_a_transfer_an_unregister_and_a_registry_check():
    """A transfer holds the registry while the GIL is released; an unregister waits for it; a
    third thread then needs the registry too. That thread must wait without holding the GIL, or
    the transfer, which takes the GIL back before it lets the registry go, never ends. Run in a
    child process so that a deadlock fails the test instead of hanging it."""
    import signal

    from conftest import running_cluster, stop_process

    with running_cluster(owners=1, size="64MiB") as c:
        child = textwrap.dedent(f"""
            import sys, threading, time
            import numpy as np
            from mooncake_rs.store import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", "", 0, 0, "tcp", "", {c.master!r}) == 0
            size = 4 << 20
            src = np.full(size, 3, dtype=np.uint8)
            dst = np.zeros(size, dtype=np.uint8)
            other = np.zeros(4096, dtype=np.uint8)
            for a in (src, dst, other):
                assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
            assert s.put_from("held", src.ctypes.data, size) == 0
            print("ready", flush=True)
            time.sleep(0.5)  # the owner is stopped meanwhile: the read below waits for it
            got = []
            reader = threading.Thread(target=lambda: got.append(s.get_into("held", dst.ctypes.data, size)))
            reader.start()
            time.sleep(0.3)
            unregister = threading.Thread(target=lambda: s.unregister_buffer(other.ctypes.data))
            unregister.start()
            time.sleep(0.3)
            assert s._is_registered(dst.ctypes.data, size)
            reader.join()
            unregister.join()
            assert got == [size] and (dst == 3).all(), got
            s.close()
            print("done", flush=True)
        """)
        owner_pid = c.owners[0].p.pid
        p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            stop_process(owner_pid)
            time.sleep(1.5)
            os.kill(owner_pid, signal.SIGCONT)
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail("deadlocked: the registry check held the GIL while the transfer waited for it")
        finally:
            os.kill(owner_pid, signal.SIGCONT)
        assert p.returncode == 0 and "done" in out, err


def test_a_call_is_not_held_up_by_another_threads_transfer_to_a_stopped_owner(monkeypatch):
    """Calls from several threads on the default store (the calling thread drives the I/O): one
    thread's large transfer to an owner that stopped answering does not hold up another thread's
    call (here a lookup the master answers) until that transfer's deadline. Before, every call
    ran on one runtime, which the transfer held in its transfer threads."""
    import signal
    import threading

    from conftest import new_store, running_cluster, stop_process

    monkeypatch.setenv("MOONCAKE_SHM", "0")
    with running_cluster(owners=1, size="256MiB") as c:
        s = new_store(c)
        try:
            n, size = 4, 16 << 20
            buf = np.full(n * size, 7, dtype=np.uint8)
            assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            ptrs = [buf.ctypes.data + i * size for i in range(n)]
            assert s.batch_put_from([f"big/{i}" for i in range(n)], ptrs, [size] * n) == [0] * n
            assert s.put("present", b"x") == 0
            owner = c.owners[0].p.pid
            stop_process(owner)
            try:
                stuck = {}
                t = threading.Thread(target=lambda: stuck.setdefault(
                    "codes", s.batch_put_from([f"late/{i}" for i in range(n)], ptrs, [size] * n)))
                t.start()
                time.sleep(0.5)
                start = time.monotonic()
                assert s.is_exist("present") == 1
                took = time.monotonic() - start
            finally:
                os.kill(owner, signal.SIGCONT)
            t.join(timeout=60)
            assert "codes" in stuck
            assert took < 6, f"the lookup waited {took:.1f} s for the other thread's transfer"
        finally:
            s.close()
