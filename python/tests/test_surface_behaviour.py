"""What the rest of Mooncake's surface does here, against a real master and owners: zero-copy
buffer handles, ReplicateConfig's current fields, the enums, tensor publishing, tensor-parallel
shards, and the client's statistics."""

import ctypes
import os

import numpy as np
import pytest

from mooncake_rs import tensor as T
from mooncake_rs.store import (BufferHandle, MooncakeDistributedStore, ObjectDataType, ReplicaStatus,
                               ReplicateConfig, TaskStatus, TaskType)

INVALID, NOT_FOUND = -600, -704


def registered(store, nbytes):
    a = np.zeros(nbytes, dtype=np.uint8)
    assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    return a


def test_buffer_handles_are_read_into_directly_and_export_their_bytes_without_a_copy(store):
    payloads = {f"buf/{i}": os.urandom(1000 + 4096 * i) for i in range(4)}
    for k, v in payloads.items():
        assert store.put(k, v) == 0
    h = store.get_buffer("buf/2")
    assert isinstance(h, BufferHandle) and h.size() == len(h) == len(payloads["buf/2"])
    view = memoryview(h)
    assert view.obj is h, "the memoryview is over the handle itself"
    assert bytes(view) == payloads["buf/2"]
    assert h.ptr() == np.frombuffer(h, dtype=np.uint8).ctypes.data
    assert store.get_buffer("buf/missing") is None
    keys = ["buf/0", "buf/missing", "buf/3", ""]
    got = store.batch_get_buffer(keys)
    assert bytes(got[0]) == payloads["buf/0"] and got[1] is None and bytes(got[2]) == payloads["buf/3"]
    assert got[3] is None, "an invalid key is a miss"
    assert store.batch_get_buffer([]) == []


def test_replicate_config_has_mooncakes_current_fields(store, cluster):
    c = ReplicateConfig()
    assert (c.replica_num, c.with_soft_pin, c.with_hard_pin, c.preferred_segments, c.preferred_segment,
            c.prefer_alloc_in_same_node, c.nof_replica_num, c.preferred_nof_segments, c.data_type,
            c.group_ids) == (1, False, False, [], "", False, 0, [], 0, None)
    c.data_type = ObjectDataType.KVCACHE
    c.prefer_alloc_in_same_node = True
    c.preferred_segments = [cluster.segments[1]]
    assert "data_type=1" in str(c)
    assert store.put("cfg/kv", b"v", config=c) == 0
    [desc] = store.get_replica_desc("cfg/kv")
    assert desc.segment == cluster.segments[1] and desc.status == ReplicaStatus.COMPLETE
    assert desc.get_disk_descriptor() is None and desc.get_memory_descriptor() is not None
    # What this store does not have is refused with a code, not ignored.
    for bad in (ReplicateConfig(nof_replica_num=1), ReplicateConfig(preferred_nof_segments=["nvme"]),
                ReplicateConfig(data_type=10)):
        assert store.put("cfg/bad", b"v", config=bad) == INVALID, bad
    assert store.is_exist("cfg/bad") == 0
    assert store.put("cfg/empty-groups", b"v", config=ReplicateConfig(group_ids=[])) == 0
    # Group ids are a placement hint (SGLang sets one per key on every put when it finds the
    # field): ignored, with a warning, and the put stores.
    assert store.put("cfg/groups", b"v", config=ReplicateConfig(group_ids=["g"])) == 0
    assert store.get("cfg/groups") == b"v"
    # A name that is no segment (a bare host, as Mooncake's etcd mode names segments) places as
    # if absent: it falls back, as a preferred segment that is gone or full does.
    assert store.put("cfg/bare-host", b"v", config=ReplicateConfig(preferred_segment="10.0.0.1")) == 0
    assert store.get("cfg/bare-host") == b"v"


def test_enums_have_mooncakes_values():
    assert [int(x) for x in ReplicaStatus] == [0, 1, 2, 3, 4, 5]
    assert (TaskType.REPLICA_COPY, TaskType.REPLICA_MOVE) == (0, 1)
    assert (TaskStatus.PENDING, TaskStatus.PROCESSING, TaskStatus.FAILED, TaskStatus.SUCCESS) == (0, 1, 2, 3)
    assert ObjectDataType.UNKNOWN == 0 and ObjectDataType.KVCACHE == 1 and ObjectDataType.GENERAL == 9


def test_tensors_published_in_batches_and_read_into_registered_memory(store, cluster):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.arange(10, dtype=np.int64)
    cfg = ReplicateConfig(replica_num=2)
    assert store.pub_tensor("pt/a", a, cfg) == 0
    assert len(store.get_replica_desc("pt/a")) == 2
    assert store.batch_pub_tensor(["pt/b", "pt/c"], [b, a], cfg) == [0, 0]
    assert store.batch_put_tensor(["x"], []) == [INVALID]
    out = store.batch_get_tensor(["pt/a", "pt/missing", "pt/b"])
    assert np.array_equal(out[0], a) and out[1] is None and np.array_equal(out[2], b)

    dst = registered(store, 3 * 4096)
    ptrs = [dst.ctypes.data + i * 4096 for i in range(3)]
    got = store.batch_get_tensor_into(["pt/a", "pt/missing", "pt/b"], ptrs, [4096] * 3)
    assert np.array_equal(got[0], a) and got[1] is None and np.array_equal(got[2], b)
    assert got[0].ctypes.data == ptrs[0] + T.header_size(2), "a view over the caller's memory"
    assert store.batch_get_tensor_into(["pt/a"], ptrs, [4096]) == [INVALID], "mismatched lengths"

    # [header][data] laid out by the caller, stored without a copy.
    src = registered(store, 2 * 4096)
    for i, t in enumerate((a, b)):
        blob = MooncakeDistributedStore.tensor_header(t) + t.tobytes()
        ctypes.memmove(src.ctypes.data + i * 4096, blob, len(blob))
    sizes = [len(MooncakeDistributedStore.tensor_header(t)) + t.nbytes for t in (a, b)]
    src_ptrs = [src.ctypes.data, src.ctypes.data + 4096]
    assert store.batch_put_tensor_from(["pf/a", "pf/b"], src_ptrs, sizes) == [0, 0]
    assert np.array_equal(store.get_tensor("pf/b"), b)
    assert store.batch_put_tensor_from(["pf/x", "pf/y"], src_ptrs, [sizes[0], 3]) == [INVALID, INVALID]
    assert store.batch_put_tensor_from([], [], []) == []


def test_tensor_parallel_shards_are_stored_per_rank_and_read_per_rank(store):
    w = np.arange(4 * 6, dtype=np.float16).reshape(4, 6)
    assert store.put_tensor_with_tp("tp/w", w, tp_rank=1, tp_size=2, split_dim=1) == 0
    assert store.is_exist("tp/w") == 0 and store.is_exist("tp/w_tp_0") == 1 and store.is_exist("tp/w_tp_1") == 1
    for rank in range(2):
        shard = store.get_tensor_with_tp("tp/w", tp_rank=rank, tp_size=2, split_dim=1)
        assert np.array_equal(shard, w[:, rank * 3:(rank + 1) * 3])
    assert store.put_tensor_with_tp("tp/plain", w, tp_size=1) == 0
    assert np.array_equal(store.get_tensor_with_tp("tp/plain"), w)
    assert store.put_tensor_with_tp("tp/bad", w, tp_size=8, split_dim=1) == INVALID, "6 columns, 8 ranks"
    assert store.put_tensor_with_tp("tp/bad", w, tp_size=2, split_dim=5) == INVALID

    v = np.arange(8, dtype=np.int32)
    assert store.batch_pub_tensor_with_tp(["tp/v", "tp/w2"], [v, w], ReplicateConfig(), tp_size=2,
                                          split_dim=0) == [0, 0]
    got = store.batch_get_tensor_with_tp(["tp/v", "tp/w2"], tp_rank=1, tp_size=2)
    assert np.array_equal(got[0], v[4:]) and np.array_equal(got[1], w[2:])

    dst = registered(store, 4096)
    shard = store.get_tensor_with_tp_into("tp/v", dst.ctypes.data, 4096, tp_rank=0, tp_size=2)
    assert np.array_equal(shard, v[:4])
    [shard] = store.batch_get_tensor_with_tp_into(["tp/v"], [dst.ctypes.data], [4096], tp_rank=1, tp_size=2)
    assert np.array_equal(shard, v[4:])

    # A whole tensor in registered memory, split on the way in.
    src = registered(store, 4096)
    blob = MooncakeDistributedStore.tensor_header(w) + w.tobytes()
    ctypes.memmove(src.ctypes.data, blob, len(blob))
    assert store.put_tensor_with_tp_from("tp/f", src.ctypes.data, len(blob), tp_size=2, split_dim=0) == 0
    assert np.array_equal(store.get_tensor_with_tp("tp/f", tp_rank=1, tp_size=2), w[2:])
    assert store.batch_put_tensor_with_tp_from(["tp/g"], [src.ctypes.data], [len(blob)], tp_size=2,
                                               split_dim=1) == [0]
    assert np.array_equal(store.get_tensor_with_tp("tp/g", tp_rank=0, tp_size=2), w[:, :3])


def test_client_stats_count_this_clients_reads_and_writes(cluster):
    from conftest import new_store

    s = new_store(cluster)
    try:
        assert s.put("st/a", b"x" * 1000) == 0
        assert s.put("st/b", b"y" * 24) == 0
        assert s.put("st/a", b"again") == 0, "already there: not counted"
        assert len(s.get("st/a")) == 1000 and s.get("st/missing") == b""
        stats = s.get_client_stats()
        assert stats["put_to_memory_count"] == 2 and stats["put_to_memory_bytes"] == 1024
        assert stats["get_from_memory_count"] == 1 and stats["get_from_memory_bytes"] == 1000
        assert stats["get_from_disk_count"] == 0 and stats["put_to_disk_count"] == 0
        cache = s.calc_cache_stats()
        assert cache["memory_total"] == 2.0 and cache["memory_hits"] == 1.0
        assert cache["memory_hit_rate"] == pytest.approx(0.5) and cache["overall_hit_rate"] == pytest.approx(0.5)
    finally:
        s.remove_all(True)
        s.close()
    fresh = MooncakeDistributedStore()
    assert fresh.get_client_stats() == {} and fresh.calc_cache_stats() == {}


def test_upsert_replaces_values_in_every_form(store):
    assert store.put("u/a", b"1" * 1000) == 0
    assert store.put("u/a", b"2" * 10) == 0, "a plain put keeps the first value (Mooncake's 0)"
    assert store.get("u/a") == b"1" * 1000
    assert store.upsert("u/a", b"3" * 900) == 0, "smaller: the same memory"
    assert store.get("u/a") == b"3" * 900
    assert store.upsert("u/a", b"4" * 5000) == 0, "larger: new memory"
    assert store.get("u/a") == b"4" * 5000
    assert store.upsert("u/new", b"n") == 0 and store.get("u/new") == b"n"
    assert store.upsert_parts("u/a", b"ab", memoryview(b"cd")) == 0 and store.get("u/a") == b"abcd"
    assert store.upsert_batch(["u/a", "u/b"], [b"x", b"y"]) == 0
    assert store.get_batch(["u/a", "u/b"]) == [b"x", b"y"]
    assert store.upsert_batch(["u/a"], [b"1", b"2"]) == INVALID

    src = registered(store, 8192)
    src[:] = np.frombuffer(os.urandom(8192), dtype=np.uint8)
    p = src.ctypes.data
    assert store.upsert_from("u/a", p, 4096) == 0 and store.get("u/a") == bytes(src[:4096])
    assert store.batch_upsert_from(["u/a", "u/c"], [p + 4096, p], [4096, 100]) == [0, 0]
    assert store.get("u/a") == bytes(src[4096:]) and store.get("u/c") == bytes(src[:100])

    t1, t2 = np.arange(6, dtype=np.int16), np.ones((2, 2), dtype=np.float64)
    assert store.put_tensor("u/t", t1) == 0
    assert store.upsert_tensor("u/t", t2) == 0 and np.array_equal(store.get_tensor("u/t"), t2)
    assert store.upsert_pub_tensor("u/t", t1, ReplicateConfig(replica_num=2)) == 0
    assert np.array_equal(store.get_tensor("u/t"), t1) and len(store.get_replica_desc("u/t")) == 2
    assert store.batch_upsert_tensor(["u/t", "u/t2"], [t2, t1]) == [0, 0]
    assert store.batch_upsert_pub_tensor(["u/t2"], [t2], ReplicateConfig()) == [0]
    assert np.array_equal(store.get_tensor("u/t"), t2) and np.array_equal(store.get_tensor("u/t2"), t2)
    blob = MooncakeDistributedStore.tensor_header(t1) + t1.tobytes()
    ctypes.memmove(p, blob, len(blob))
    assert store.upsert_tensor_from("u/t", p, len(blob)) == 0 and np.array_equal(store.get_tensor("u/t"), t1)
    assert store.batch_upsert_tensor_from(["u/t2"], [p], [len(blob)]) == [0]
    assert np.array_equal(store.get_tensor("u/t2"), t1)


def test_readers_never_see_a_half_written_upsert(store, cluster):
    """A writer keeps replacing one key with whole values of one byte each while another client
    reads it: every read is one whole value or a miss, never a mix."""
    import threading

    from conftest import new_store

    size = 256 << 10
    values = [bytes([v]) * size for v in range(1, 5)]
    assert store.put("u/race", values[0]) == 0
    reader = new_store(cluster)
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seen.append(reader.get("u/race"))

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(200):
            assert store.upsert("u/race", values[i % len(values)]) == 0
    finally:
        stop.set()
        t.join()
        reader.close()
    whole = [v for v in seen if v]
    assert whole, "the reader read something"
    assert all(v in values for v in whole), "a read mixed two values"


def test_remove_by_regex_removes_matching_keys_that_are_not_in_use(store):
    for k in ("rx/layer0/a", "rx/layer0/b", "rx/layer1/a", "other/layer0"):
        assert store.put(k, b"v") == 0
    assert store.is_exist("rx/layer1/a") == 1, "held until this client's next call ends"
    assert store.remove_by_regex(r"layer0") == 3
    assert store.batch_is_exist(["rx/layer0/a", "rx/layer0/b", "other/layer0", "rx/layer1/a"]) == [0, 0, 0, 1]
    assert store.remove_by_regex(r"^rx/") == 0, "the leased one stays without force"
    assert store.remove_by_regex(r"^rx/", True) == 1
    assert store.remove_by_regex(r"nothing matches") == 0
    # ECMAScript features Mooncake's std::regex has: look-around and back-references.
    for k in ("ab/ab", "ab/cd", "xy/keep", "xy/drop"):
        assert store.put(k, b"v") == 0
    assert store.remove_by_regex(r"^(\w+)/\1$") == 1
    assert store.remove_by_regex(r"^xy/(?!keep)") == 1
    assert store.batch_is_exist(["ab/ab", "ab/cd", "xy/keep", "xy/drop"]) == [0, 1, 1, 0]
    assert store.remove_by_regex(r"(unclosed") == INVALID
    assert MooncakeDistributedStore().remove_by_regex("x") == INVALID, "not set up"


def test_partial_reads_metadata_puts_and_pool_memory(store, tmp_path):
    from mooncake_rs.store import MooncakeHostMemAllocator, bind_to_numa_node

    a, b = os.urandom(10000), os.urandom(300)
    assert store.put("pr/a", a) == 0 and store.put("pr/b", b) == 0
    dst = registered(store, 2 * 4096)
    base = dst.ctypes.data
    got = store.get_into_ranges([base, base + 4096], [["pr/a", "pr/b"], ["pr/a", "pr/missing"]],
                                [[0, 100], [0, 0]], [[5000, 0], [9990, 0]], [[100, 300], [10, 5]])
    assert got == [[100, 300], [10, NOT_FOUND]]
    assert bytes(dst[:100]) == a[5000:5100] and bytes(dst[100:400]) == b and bytes(dst[4096:4106]) == a[9990:]
    assert store.get_into_ranges([base], [["pr/a"]], [[0]], [[9999]], [[2]]) == [[INVALID]], "past the object"
    outside = np.zeros(16, dtype=np.uint8)
    assert store.get_into_ranges([outside.ctypes.data], [["pr/a"]], [[0]], [[0]], [[16]]) == [[INVALID]]
    assert store.get_into_ranges([base], [["pr/a"]], [[0, 1]], [[0]], [[1]]) == [[INVALID]], "shapes differ"
    assert store.get_into_ranges([base], [["pr/a", ""]], [[0, 8]], [[0, 0]], [[8, 8]]) == [[8, INVALID]], \
        "a bad key is named as such, not as a miss"

    # [metadata][data] from two buffers as one object, in pool memory the store allocated.
    meta, data = store.alloc_from_mem_pool(64), store.alloc_from_mem_pool(4096)
    assert meta and data and store.alloc_from_mem_pool(0) == 0
    ctypes.memmove(meta, b"M" * 64, 64)
    ctypes.memmove(data, b"D" * 4096, 4096)
    assert store.put_from_with_metadata("pr/meta", data, meta, 4096, 64) == 0
    assert store.get("pr/meta") == b"M" * 64 + b"D" * 4096

    alloc = MooncakeHostMemAllocator()
    p = alloc.alloc(1 << 20)
    ctypes.memmove(p, b"x" * 10, 10)
    assert ctypes.string_at(p, 10) == b"x" * 10
    assert alloc.free(p) == 0 and alloc.free(p) == INVALID and alloc.alloc(0) == 0
    before = os.sched_getaffinity(0)
    bind_to_numa_node(0)
    assert os.sched_getaffinity(0), "node 0's CPUs (or unchanged where there is no NUMA info)"
    bind_to_numa_node(999)  # logs, never raises
    os.sched_setaffinity(0, before)


def test_calls_without_meaning_here_answer_clearly(store, tmp_path):
    from mooncake_rs import store as module

    assert store.setup_dummy(1 << 20, 1 << 20, "127.0.0.1:50052") == INVALID
    assert store.init_all("tcp", "", 16 << 20) == 0, "after setup there is nothing left to do"
    assert MooncakeDistributedStore().init_all("tcp", "", 1) == INVALID
    assert store._get_pyclient_capsule() is None and module._get_pyclient_from_wrapper(store) is None
    assert store.mount_segment(str(tmp_path / "f"), 1 << 20) == {"ret": -1, "segment_ids": []}
    assert store.unmount_segment(["x"]) == -1

    t = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_tensor("st/t", t) == 0
    f = str(tmp_path / "t.safetensors")
    assert store.save_tensor_to_safetensor("st/t", f) == 0
    assert store.save_tensor_to_safetensor("st/missing", f) == NOT_FOUND
    loaded = store.load_tensor_from_safetensor("st/t2", f)
    assert np.array_equal(loaded, t), "first tensor of the file, stored under the new key"
    assert np.array_equal(store.get_tensor("st/t2"), t)
    assert store.load_tensor_from_safetensor("st/t3", str(tmp_path / "none")) is None


def test_memory_mounted_after_setup_serves_as_a_segment(cluster):
    from conftest import new_store

    s = new_store(cluster)
    try:
        got = s.allocate_and_mount_segment(32 << 20)
        assert got["ret"] == 0 and got["allocated_size"] == 32 << 20
        [seg] = got["segment_ids"]
        assert s.put("mnt/a", b"x" * 5000, config=ReplicateConfig(preferred_segments=[seg])) == 0
        [desc] = s.get_replica_desc("mnt/a")
        assert desc.segment == seg
        other = new_store(cluster)
        assert other.get("mnt/a") == b"x" * 5000, "served to other clients"
        other.close()
        assert s.allocate_and_mount_segment(1 << 20, protocol="rdma")["ret"] == INVALID
        assert s.unmount_and_free_segment([seg, "127.0.0.1:1"]) == INVALID, "one unknown name"
        assert s.unmount_and_free_segment([seg]) == INVALID, "already gone"
        assert s.get("mnt/a") == b"", "its objects went with it"
    finally:
        s.remove_all(True)
        s.close()
    assert MooncakeDistributedStore().allocate_and_mount_segment(1 << 20)["ret"] == INVALID


def test_the_remaining_names_behave_as_upstream_documents(store, cluster):
    from mooncake_rs.store import (Descriptor, MemoryDescriptor, MooncakeDistributedStoreAsync,
                                   QueryTaskResponse, ReplicaDescriptor)
    # pub_tensor_with_tp / batch_put_tensor_with_tp: shards per rank, read back per rank.
    w = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    assert store.pub_tensor_with_tp("rest/w", w, ReplicateConfig(), tp_size=3, split_dim=1) == 0
    for rank in range(3):
        got = store.get_tensor_with_tp("rest/w", tp_rank=rank, tp_size=3, split_dim=1)
        assert np.array_equal(got, w[:, rank * 2:(rank + 1) * 2])
    assert store.batch_put_tensor_with_tp(["rest/a", "rest/b"], [w, w * 2], tp_size=2, split_dim=0) == [0, 0]
    got = store.batch_get_tensor_with_tp(["rest/a", "rest/b"], tp_rank=1, tp_size=2)
    assert np.array_equal(got[0], w[2:]) and np.array_equal(got[1], w[2:] * 2)

    # Replica descriptors, with their memory descriptor; the disk descriptor of a memory replica.
    [rep] = store.get_replica_desc("rest/a_tp_0")
    assert isinstance(rep, ReplicaDescriptor) and rep.segment in cluster.segments
    assert isinstance(rep.get_memory_descriptor(), MemoryDescriptor)
    assert rep.get_disk_descriptor() is None, "a memory replica has no disk descriptor"

    # Reprs name what they show.
    c = ReplicateConfig(replica_num=2)
    assert "replica_num=2" in str(c)
    d = Descriptor(size=8, buffer_address=4096, transport_endpoint="127.0.0.1:1")
    assert "size=8" in repr(d) and "127.0.0.1:1" in repr(d)

    # A real task's QueryTaskResponse.
    task_id, code = store.create_copy_task("rest/a_tp_0", [s for s in cluster.segments if s != rep.segment])
    assert code == 0
    resp, code = store.query_task(task_id)
    assert code == 0 and isinstance(resp, QueryTaskResponse)
    assert f"id={resp.id}" in repr(resp) and "type=0" in repr(resp)

    # BufferHandle's length is the object's.
    h = store.get_buffer("rest/a_tp_1")
    assert isinstance(h, BufferHandle) and len(h) == h.size() > 0

    # The async store: any sync name behind async_, run off the event loop.
    import asyncio

    a = MooncakeDistributedStoreAsync()
    assert a.setup("127.0.0.1", "http://unused/metadata", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        wrapped = a._make_async_wrapper(a.is_exist)
        assert asyncio.run(wrapped("rest/a_tp_0")) == 1
        assert asyncio.run(a.__getattr__("async_get_hostname")()) == a.get_hostname()
        with pytest.raises(AttributeError):
            a.__getattr__("not_a_method")
    finally:
        a.close()
