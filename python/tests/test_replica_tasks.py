"""Copy and move tasks, query_task and batch_replica_clear against a real master and three real
owners: the copies are made by the target owners reading from the source owner's data plane, and
every read afterwards is checked byte for byte."""

import os
import time
import types

import pytest

from conftest import new_store, running_cluster, start_master, start_owner
from mooncake_rs.store import TaskStatus, TaskType

LEASE_MS = 1000  # long enough that two calls in a row fall within one lease on a loaded machine


@pytest.fixture(scope="module")
def trio():
    """A master with a short read lease and three owners."""
    with running_cluster(3, "64MiB", ["--default_kv_lease_ttl", str(LEASE_MS)]) as c:
        yield c


@pytest.fixture
def s(trio):
    st = new_store(trio)
    yield st
    st.remove_all(True)
    st.close()


def put_on(st, key, value, segment):
    from mooncake_rs.store import ReplicateConfig
    c = ReplicateConfig()
    c.preferred_segments = [segment]
    assert st.put(key, value, c) == 0
    assert [r.segment for r in st.get_replica_desc(key)] == [segment]


def finished(st, task_id, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp, code = st.query_task(task_id)
        assert code == 0, code
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        time.sleep(0.05)
    pytest.fail(f"task {task_id} did not finish within {timeout}s")


def holders(st, key):
    return sorted(r.segment for r in st.get_replica_desc(key) if r.is_memory_replica())


def test_a_copy_adds_replicas_on_the_targets_with_the_same_bytes(s, trio):
    a, b, c = trio.segments
    value = os.urandom(3 << 20)
    put_on(s, "copy-me", value, a)
    task_id, code = s.create_copy_task("copy-me", [b, c])
    assert code == 0 and task_id != (0, 0)
    resp = finished(s, task_id)
    assert resp.status == TaskStatus.SUCCESS, resp.message
    assert resp.type == TaskType.REPLICA_COPY
    assert resp.id == tuple(task_id)
    assert sorted(resp.assigned_segments) == sorted([b, c])
    assert resp.created_at_ms_epoch <= resp.last_updated_at_ms_epoch
    assert abs(resp.created_at_ms_epoch / 1000 - time.time()) < 60
    assert holders(s, "copy-me") == sorted([a, b, c])
    # Each copy holds the same bytes: drop the others and read what is left.
    for keep in (b, c):
        time.sleep(LEASE_MS / 1000 + 0.1)
        others = [x for x in holders(s, "copy-me") if x != keep]
        time.sleep(LEASE_MS / 1000 + 0.1)
        for x in others:
            assert s.batch_replica_clear(["copy-me"], x) == ["copy-me"]
        assert holders(s, "copy-me") == [keep]
        assert s.get("copy-me") == value
        if keep == b:
            task_id, code = s.create_copy_task("copy-me", [c])
            assert code == 0
            assert finished(s, task_id).status == TaskStatus.SUCCESS


def test_a_move_leaves_one_replica_on_the_target(s, trio):
    a, b, _ = trio.segments
    value = os.urandom(1 << 20)
    put_on(s, "move-me", value, a)
    task_id, code = s.create_move_task("move-me", a, b)
    assert code == 0
    resp = finished(s, task_id)
    assert (resp.type, resp.status) == (TaskType.REPLICA_MOVE, TaskStatus.SUCCESS), resp.message
    assert holders(s, "move-me") == [b]
    assert s.get("move-me") == value


def test_bad_tasks_answer_mooncakes_codes(s, trio):
    a, b, _ = trio.segments
    put_on(s, "k", b"x" * 4096, a)
    assert s.create_copy_task("missing", [b]) == ((0, 0), -704)
    assert s.create_copy_task("k", ["127.0.0.1:1"]) == ((0, 0), -101)
    assert s.create_copy_task("k", []) == ((0, 0), -600)
    assert s.create_copy_task("k", ["not a segment"]) == ((0, 0), -600)
    assert s.create_move_task("k", b, a) == ((0, 0), -600)  # nothing on b to move
    assert s.create_move_task("k", a, a) == ((0, 0), -600)
    assert s.create_copy_task("k", [b] * 2) == ((0, 0), -600)
    put_on(s, "filler", bytes(8 << 20), a)
    big = os.urandom(60 << 20)
    put_on(s, "big", big, b)
    assert s.create_copy_task("big", [a])[1] == -200  # no room on a
    assert s.query_task((0, 123456789)) == (None, -704)
    assert s.query_task((1, 1)) == (None, -704)
    assert s.query_task("nonsense") == (None, -600)


def test_replica_clear_leaves_leased_objects_and_answers_the_keys_cleared(s, trio):
    a, b, _ = trio.segments
    from mooncake_rs.store import ReplicateConfig
    c = ReplicateConfig()
    c.replica_num = 2
    c.preferred_segments = [a, b]
    for key in ("c1", "c2"):
        assert s.put(key, key.encode() * 1000, c) == 0
    assert s.is_exist("c1") == 1  # held until this client's next call ends
    assert s.batch_replica_clear(["c1", "c2", "nope"], a) == ["c2"]
    assert holders(s, "c2") == [b]
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert s.batch_replica_clear(["c1", "c2"]) == ["c1", "c2"]
    assert s.is_exist("c1") == 0 and s.is_exist("c2") == 0
    assert s.batch_replica_clear(["c1"], "127.0.0.1:1") == []


def test_a_disk_only_object_is_copied_from_its_owners_ssd(tmp_path):
    """An owner with an SSD tier offloads at once (eager offload); once its memory replica is
    cleared the object lives on disk only, with a DiskDescriptor, and a copy task brings it back
    to another owner's memory from that disk."""
    procs = []
    try:
        m, rpc = start_master(["--default_kv_lease_ttl", str(LEASE_MS), "--eager_offload"])
        procs.append(m)
        o, a = start_owner(rpc, size="32MiB", extra=["--ssd-path", str(tmp_path / "ssd"), "--ssd-size", "64MiB"])
        procs.append(o)
        o, b = start_owner(rpc, size="32MiB")
        procs.append(o)
        st = new_store(types.SimpleNamespace(master=rpc))
        try:
            value = os.urandom(2 << 20)
            put_on(st, "cold", value, a)
            deadline = time.monotonic() + 15
            while not any(r.is_disk_replica() for r in st.get_replica_desc("cold")):
                assert time.monotonic() < deadline, "the eager offload did not land"
                time.sleep(0.05)
            time.sleep(LEASE_MS / 1000 + 0.1)
            assert st.batch_replica_clear(["cold"], a) == ["cold"]
            [disk] = st.get_replica_desc("cold")
            assert disk.is_disk_replica() and not disk.is_memory_replica()
            d = disk.get_disk_descriptor()
            assert d.object_size == len(value) and d.file_path
            assert disk.get_memory_descriptor() is None
            task_id, code = st.create_copy_task("cold", [b])
            assert code == 0
            assert finished(st, task_id).status == TaskStatus.SUCCESS
            assert holders(st, "cold") == [b]
            assert st.get("cold") == value
        finally:
            st.close()
    finally:
        for p in reversed(procs):
            p.stop()
