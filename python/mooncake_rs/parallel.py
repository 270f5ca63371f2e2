"""Tensors stored in parallel layouts (Mooncake's `*_with_parallelism*` calls): a writer stores
its shard of a tensor under a key that names the layout, plus a small manifest of the whole
tensor, and a reader asks for the object as stored, for its own shard, or for the full tensor
put back together.

Keys, as Mooncake names them:
  - writer partition (rank r of n writers, split along d): `key__writer_<r>of<n>_sd<d>`, with
    the manifest at `key__writer_manifest`;
  - a layout with one TP axis: `key_tp_<rank>` (the `*_with_tp` name), manifest
    `key__parallelism_manifest`;
  - any other layout: `key__<axis>__<axis>...`, each axis `<kind>_<rank>of<size>[_sd<d>][_eid<e>]
    [_sid<s>]` in the order DP, TP, EP, PP, manifest `key__parallelism_manifest` when it has a
    TP axis.
The manifest: magic 0x574D414E, version 1, dtype code, ndim, split dim, shard count (six
little-endian 32-bit words and 8 reserved bytes), then the full shape as 64-bit words.
"""

import struct

from . import tensor as _tensor
from .types import check_axes

MAGIC, VERSION = 0x574D414E, 1
_HEAD = struct.Struct("<IIIIiI8x")


class LayoutError(ValueError):
    """A layout, partition or read target that cannot apply (the call answers -600 or None)."""


def manifest(code, shape, split_dim, shards):
    return _HEAD.pack(MAGIC, VERSION, code, len(shape), split_dim, shards) + struct.pack(f"<{len(shape)}Q", *shape)


def read_manifest(raw):
    """(dtype code, full shape, split dim, shard count), or None if `raw` is not a manifest."""
    if raw is None or len(raw) < _HEAD.size:
        return None
    magic, version, code, ndim, split_dim, shards = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or len(raw) != _HEAD.size + 8 * ndim:
        return None
    return code, struct.unpack_from(f"<{ndim}Q", raw, _HEAD.size), split_dim, shards


def writer_key(key, rank, size, split_dim):
    return f"{key}__writer_{rank}of{size}_sd{split_dim}"


def axis_suffix(a):
    s = f"{str(a.kind).lower()}_{a.rank}of{a.size}"
    if a.split_dim is not None:
        s += f"_sd{a.split_dim}"
    if a.expert_id is not None:
        s += f"_eid{a.expert_id}"
    if a.stage_id is not None:
        s += f"_sid{a.stage_id}"
    return s


def tp_axis(axes):
    return next((a for a in axes if str(a.kind).lower() == "tp"), None)


def layout_key(key, axes, tp_rank=None):
    """The key of one shard of layout `axes` (with the TP axis at `tp_rank` if given)."""
    tp = tp_axis(axes)
    if tp is not None and len(axes) == 1:
        return f"{key}_tp_{tp.rank if tp_rank is None else tp_rank}"
    parts = []
    for a in axes:
        if a is tp and tp_rank is not None:
            a = _with_rank(a, tp_rank)
        parts.append(axis_suffix(a))
    return key + "__" + "__".join(parts)


def _with_rank(a, rank):
    from .types import ParallelAxis

    return ParallelAxis(a.kind, rank, a.size, a.split_dim, a.expert_id, a.stage_id)


def check_partition(p, ndim):
    for f in ("rank", "size", "split_dim"):
        if not isinstance(getattr(p, f, None), int):
            raise LayoutError(f"a writer partition needs an integer {f}")
    if p.size <= 0 or not 0 <= p.rank < p.size or not 0 <= p.split_dim < ndim:
        raise LayoutError(f"writer partition rank {p.rank} of {p.size} along dim {p.split_dim} does not fit "
                          f"a {ndim}-d tensor")


def narrow(np, arr, dim, rank, size):
    """Shard `rank` of `size` equal shards of `arr` along `dim` (C-contiguous)."""
    n = arr.shape[dim]
    if n % size:
        raise LayoutError(f"dimension {dim} of size {n} does not split into {size} equal shards")
    step = n // size
    index = [slice(None)] * arr.ndim
    index[dim] = slice(rank * step, (rank + 1) * step)
    return np.ascontiguousarray(arr[tuple(index)])


def as_numpy(tensor):
    """A NumPy view of a tensor for slicing (torch through DLPack; NumPy as is)."""
    np = _tensor._numpy(required=True)
    if isinstance(tensor, np.ndarray):
        return tensor
    if hasattr(tensor, "cpu") and hasattr(tensor, "numpy"):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def plan_write(key, tensor, parallelism, writer_partition):
    """[(key, tensor)] to store for one write, the manifest (key, bytes) last when there is one."""
    if parallelism is not None and writer_partition is not None:
        raise LayoutError("give parallelism or writer_partition, not both")
    if parallelism is None and writer_partition is None:
        return [(key, tensor)]
    np = _tensor._numpy(required=True)
    arr = as_numpy(tensor)
    code = _tensor.describe(arr)[0]
    if writer_partition is not None:
        p = writer_partition
        check_partition(p, arr.ndim)
        shard = narrow(np, arr, p.split_dim, p.rank, p.size)
        return [(writer_key(key, p.rank, p.size, p.split_dim), shard),
                (f"{key}__writer_manifest", manifest(code, arr.shape, p.split_dim, p.size))]
    try:
        axes = check_axes(parallelism)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    tp = tp_axis(axes)
    if tp is None:
        return [(layout_key(key, axes), arr)]
    if not 0 <= tp.split_dim < max(arr.ndim, 1):
        raise LayoutError(f"split_dim {tp.split_dim} is out of range for a {arr.ndim}-d tensor")
    if len(axes) == 1:
        # The tensor is this rank's shard already; the whole one is size times as long.
        full = list(arr.shape)
        full[tp.split_dim] *= tp.size
        shard = arr
    else:
        full = list(arr.shape)
        shard = narrow(np, arr, tp.split_dim, tp.rank, tp.size)
    return [(layout_key(key, axes), shard),
            (f"{key}__parallelism_manifest", manifest(code, full, tp.split_dim, tp.size))]


def resolve_read(store, key, target):
    """The tensor a read of `key` with `target` answers, or None."""
    if target is None:
        return store.get_tensor(key)
    mode = str(getattr(target, "mode", "as_stored")).lower()
    parallelism = getattr(target, "parallelism", None)
    if mode not in ("as_stored", "shard", "full"):
        raise LayoutError(f"unknown read mode {mode!r}")
    if parallelism is None:
        if mode == "full":
            whole = _gather_writers(store, key)
            return whole if whole is not None else store.get_tensor(key)
        if mode == "shard":
            raise LayoutError("a shard read needs the target's parallelism")
        return store.get_tensor(key)
    try:
        axes = check_axes(parallelism)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    tp = tp_axis(axes)
    if mode == "full":
        if tp is None:
            raise LayoutError("a full read of a parallel layout needs its TP axis")
        shards = store.batch_get_tensor([layout_key(key, axes, r) for r in range(tp.size)])
        if any(s is None for s in shards):
            return _gather_writers(store, key)
        return _like(_concat([as_numpy(s) for s in shards], tp.split_dim), shards[0])
    # A shard (or as stored: the same object).
    got = store.get_tensor(layout_key(key, axes))
    if got is not None or tp is None:
        return got
    # Written by writer partitions matching this TP layout, or whole: take this rank's part.
    m = read_manifest(store.get(f"{key}__writer_manifest") or None)
    if m is not None and m[2] == tp.split_dim and m[3] == tp.size:
        return store.get_tensor(writer_key(key, tp.rank, tp.size, tp.split_dim))
    whole = store.get_tensor(key)
    if whole is None:
        return None
    np = _tensor._numpy(required=True)
    return _like(narrow(np, as_numpy(whole), tp.split_dim, tp.rank, tp.size), whole)


def _gather_writers(store, key):
    m = read_manifest(store.get(f"{key}__writer_manifest") or None)
    if m is None:
        return None
    _, shape, split_dim, n = m
    shards = store.batch_get_tensor([writer_key(key, r, n, split_dim) for r in range(n)])
    if any(s is None for s in shards):
        return None
    whole = _concat([as_numpy(s) for s in shards], split_dim)
    return _like(whole, shards[0]) if tuple(whole.shape) == tuple(shape) else None


def _concat(parts, dim):
    np = _tensor._numpy(required=True)
    return np.ascontiguousarray(np.concatenate(parts, axis=dim))


def _like(arr, sample):
    """`arr` as the same kind of tensor as `sample` (torch where the store reads torch)."""
    if hasattr(sample, "cpu") and hasattr(sample, "numpy"):
        import torch

        return torch.from_numpy(arr)
    return arr
