"""Tensors in parallel layouts (the *_with_parallelism* calls) against a real master and owners:
writer partitions put back together, TP shards with and without other axes, reads as stored, by
shard and in full, the _into/_from and upsert forms, and layouts that cannot apply."""

import ctypes

import numpy as np

from mooncake_rs.store import MooncakeDistributedStore, ParallelAxis, ReadTarget, TensorParallelism

INVALID = -600


class Partition:
    """A writer partition (Mooncake takes any object with rank, size and split_dim)."""

    def __init__(self, rank, size, split_dim):
        self.rank, self.size, self.split_dim = rank, size, split_dim


def tp(rank, size, split_dim, *others):
    return TensorParallelism([ParallelAxis("tp", rank, size, split_dim), *others])


def registered(store, nbytes):
    a = np.zeros(nbytes, dtype=np.uint8)
    assert store.register_buffer(a.ctypes.data, a.nbytes) == 0
    return a


def test_writer_partitions_are_read_back_whole_or_by_shard(store):
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    for r in range(4):  # four writers, each storing only its quarter of the rows
        assert store.put_tensor_with_parallelism("par/w", w, writer_partition=Partition(r, 4, 0)) == 0
    assert store.is_exist("par/w__writer_2of4_sd0") == 1 and store.is_exist("par/w") == 0
    whole = store.get_tensor_with_parallelism("par/w", ReadTarget("full"))
    assert np.array_equal(whole, w)
    # A TP reader of the same split finds its shard among the writers'.
    shard = store.get_tensor_with_parallelism("par/w", ReadTarget("shard", tp(1, 4, 0)))
    assert np.array_equal(shard, w[2:4])
    assert store.put_tensor_with_parallelism("par/w", w, writer_partition=Partition(0, 5, 0)) == INVALID, \
        "8 rows do not split 5 ways"
    assert store.put_tensor_with_parallelism("par/x", w, tp(0, 2, 1), writer_partition=Partition(0, 2, 0)) == INVALID


def test_tp_shards_with_and_without_other_axes(store):
    full = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
    # TP alone: each rank holds its shard already (the _with_tp names), the manifest the whole.
    for r in range(2):
        assert store.put_tensor_with_parallelism("par/t", full[:, r * 4:(r + 1) * 4], tp(r, 2, 1)) == 0
    assert store.is_exist("par/t_tp_1") == 1 and store.is_exist("par/t__parallelism_manifest") == 1
    assert np.array_equal(store.get_tensor_with_parallelism("par/t", ReadTarget("full", tp(0, 2, 1))), full)
    assert np.array_equal(store.get_tensor_with_parallelism("par/t", ReadTarget("shard", tp(1, 2, 1))), full[:, 4:])
    assert np.array_equal(store.get_tensor_with_tp("par/t", tp_rank=1, tp_size=2), full[:, 4:])
    # TP with DP: the full tensor narrowed to this rank's shard, under a key naming both axes.
    dp = ParallelAxis("dp", 1, 2)
    for r in range(2):
        assert store.put_tensor_with_parallelism("par/d", full, tp(r, 2, 0, dp)) == 0
    assert store.is_exist("par/d__dp_1of2__tp_0of2_sd0") == 1
    assert np.array_equal(store.get_tensor_with_parallelism("par/d", ReadTarget("shard", tp(1, 2, 0, dp))), full[2:])
    assert np.array_equal(store.get_tensor_with_parallelism("par/d", ReadTarget("full", tp(0, 2, 0, dp))), full)
    # No TP axis: stored as is under its layout's key.
    pp = TensorParallelism([ParallelAxis("pp", 0, 4, stage_id=2)])
    assert store.put_tensor_with_parallelism("par/p", full, pp) == 0
    assert store.is_exist("par/p__pp_0of4_sid2") == 1
    assert np.array_equal(store.get_tensor_with_parallelism("par/p", ReadTarget("as_stored", pp)), full)
    # Layouts that cannot apply.
    assert store.put_tensor_with_parallelism("par/bad", full, TensorParallelism([ParallelAxis("tp", 0, 2)])) == INVALID
    assert store.put_tensor_with_parallelism("par/bad", full, tp(2, 2, 0)) == INVALID
    assert store.get_tensor_with_parallelism("par/p", ReadTarget("full", pp)) is None, "full needs a TP axis"
    assert store.get_tensor_with_parallelism("par/t", ReadTarget("shard")) is None
    # A whole tensor read by TP shard.
    assert store.put_tensor("par/whole", full) == 0
    assert np.array_equal(store.get_tensor_with_parallelism("par/whole", ReadTarget("shard", tp(1, 4, 0))), full[1:2])
    assert np.array_equal(store.get_tensor_with_parallelism("par/whole"), full)


def test_batch_into_from_and_upsert_forms(store):
    a = np.arange(12, dtype=np.float64).reshape(4, 3)
    b = np.ones((2, 6), dtype=np.int16)
    assert store.batch_put_tensor_with_parallelism(["pb/a", "pb/b"], [a, b],
                                                   parallelisms=[tp(0, 2, 0), tp(1, 2, 1)]) == [0, 0]
    assert store.batch_put_tensor_with_parallelism(["pb/c"], [a]) == [0], "no layout: a plain put"
    assert store.batch_put_tensor_with_parallelism(["x"], [a], [tp(0, 2, 0)], writer_partitions=[None]) == [INVALID]
    got = store.batch_get_tensor_with_parallelism(["pb/a", "pb/b"], [ReadTarget("shard", tp(0, 2, 0)),
                                                                     ReadTarget("shard", tp(1, 2, 1))])
    assert np.array_equal(got[0], a) and np.array_equal(got[1], b)
    assert store.batch_get_tensor_with_parallelism(["pb/a"], [None, None]) == [None]

    # From and into registered memory.
    src = registered(store, 4096)
    blob = MooncakeDistributedStore.tensor_header(a) + a.tobytes()
    ctypes.memmove(src.ctypes.data, blob, len(blob))
    assert store.put_tensor_with_parallelism_from("pf/a", src.ctypes.data, len(blob),
                                                  writer_partition=Partition(1, 2, 0)) == 0
    assert store.batch_put_tensor_with_parallelism_from(["pf/a"], [src.ctypes.data], [len(blob)],
                                                        writer_partitions=[Partition(0, 2, 0)]) == [0]
    dst = registered(store, 4096)
    view = store.get_tensor_with_parallelism_into("pf/a", dst.ctypes.data, 4096, ReadTarget("shard", tp(1, 2, 0)))
    assert np.array_equal(view, a[2:]) and view.ctypes.data > dst.ctypes.data - 1
    [view] = store.batch_get_tensor_with_parallelism_into(["pf/a"], [dst.ctypes.data], [4096],
                                                          [ReadTarget("shard", tp(0, 2, 0))])
    assert np.array_equal(view, a[:2])
    assert store.get_tensor_with_parallelism_into("pf/a", dst.ctypes.data, 8, ReadTarget("shard", tp(1, 2, 0))) is None

    # Upserts replace shards in place of the old ones.
    a2 = a * 10
    assert store.upsert_tensor_with_parallelism("pb/a", a2, tp(0, 2, 0)) == 0
    assert np.array_equal(store.get_tensor_with_parallelism("pb/a", ReadTarget("shard", tp(0, 2, 0))), a2)
    assert store.batch_upsert_tensor_with_parallelism(["pb/a"], [a], [tp(0, 2, 0)]) == [0]
    assert store.upsert_tensor_with_parallelism_from("pf/a", src.ctypes.data, len(blob),
                                                     writer_partition=Partition(1, 2, 0)) == 0
    assert store.batch_upsert_tensor_with_parallelism_from(["pf/a"], [src.ctypes.data], [len(blob)],
                                                           writer_partitions=[Partition(0, 2, 0)]) == [0]
    assert np.array_equal(store.get_tensor_with_parallelism("pf/a", ReadTarget("full")), a)
