"""`MooncakeDistributedStore` with Mooncake's Python API (vLLM and SGLang connectors call it).

Every method of the native client is inherited as is: writes return 0 or a negative code,
reads the number of bytes read or a negative code, `is_exist` 1 / 0 / negative, `get` b"" on a
miss. This module adds the encoder-cache tensor helpers (see `tensor.py` for the format).
"""

import asyncio
import ctypes
import functools
import logging
import mmap
import os

from . import parallel as _parallel
from . import tensor as _tensor
from ._native import (BufferDescriptor, DiskDescriptor, MemoryDescriptor, NativeStore, ReplicaDescriptor,
                      ReplicateConfig)
from .types import (Descriptor, ObjectDataType, ParallelAxis, QueryTaskResponse, ReadTarget,
                    ReplicaStatus, TaskStatus, TaskType, TensorParallelism)

__all__ = ["MooncakeDistributedStore", "MooncakeHostMemAllocator", "bind_to_numa_node", "MooncakeDistributedStoreAsync", "ReplicateConfig", "ReplicaDescriptor", "MemoryDescriptor",
           "BufferDescriptor", "BufferHandle", "TensorFormatError", "Descriptor", "DiskDescriptor",
           "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget", "ReplicaStatus", "TaskStatus",
           "TaskType", "TensorParallelism"]

TensorFormatError = _tensor.TensorFormatError
_log = logging.getLogger("mooncake_rs")
_INVALID = -600
_NOT_FOUND = -704
_PEEK = _tensor.header_size(_tensor.MAX_NDIM)


def bind_to_numa_node(node):
    """Runs the calling process on the CPUs of NUMA node `node` (memory follows first touch
    there). Never raises: logs a warning when the machine has no such node."""
    try:
        with open(f"/sys/devices/system/node/node{int(node)}/cpulist") as f:
            cpus = set()
            for part in f.read().strip().split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as e:
        _log.warning("bind_to_numa_node(%r): %s", node, e)


def _get_pyclient_from_wrapper(wrapper):
    """Mooncake's way to share its C++ client with EngramStore; there is none here. None."""
    return None


class MooncakeHostMemAllocator:
    """Shared host memory for buffers (Mooncake's allocator of its shared-memory helper):
    `alloc(size)` gives the address of `size` page-aligned bytes, `free(ptr)` gives them back
    (0, or -600 for an address it did not give)."""

    def __init__(self):
        self._blocks = {}

    def alloc(self, size, /):
        if size <= 0:
            return 0
        block = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(block))
        self._blocks[ptr] = block
        return ptr

    def free(self, ptr, /):
        block = self._blocks.pop(ptr, None)
        if block is None:
            return _INVALID
        block.close()
        return 0


class BufferHandle(bytearray):
    """An object's bytes as `get_buffer` returns them: read straight into this buffer, which
    supports the buffer protocol (`memoryview(h)`, `np.frombuffer(h, ...)`: no copy), `len(h)`,
    and Mooncake's `ptr()` and `size()`."""

    def ptr(self):
        """The address of the first byte (valid while the handle lives; 0 when empty)."""
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self):
        return len(self)


def _tp_key(key, rank, size):
    return key if size <= 1 else f"{key}_tp_{rank}"


def _tp_shards(tensor, tp_size, split_dim):
    """The tp_size shards of `tensor` along `split_dim` (torch's chunk or numpy's array_split),
    each C-contiguous; ValueError when it does not split into exactly tp_size pieces."""
    if hasattr(tensor, "chunk"):
        shards = list(tensor.chunk(tp_size, split_dim))
        shards = [s.contiguous() for s in shards]
    else:
        np = _tensor._numpy(required=True)
        arr = np.asarray(tensor)
        if not 0 <= split_dim < max(arr.ndim, 1):
            raise ValueError(f"split_dim {split_dim} is out of range for a {arr.ndim}-d tensor")
        shards = [np.ascontiguousarray(s) for s in np.array_split(arr, tp_size, axis=split_dim)]
    if len(shards) != tp_size or any(s.shape[split_dim] == 0 for s in shards):
        raise ValueError(f"a dimension of {tensor.shape[split_dim]} does not split into {tp_size} shards")
    return shards


class MooncakeDistributedStore(NativeStore):
    """A client of the store. Call `setup(...)` before anything else and `close()` at the end."""

    # -- zero-copy reads into buffers the store allocates --------------------------------------

    def get_buffer(self, key, /):
        """The object's bytes in a `BufferHandle` (read straight into it), or None on a miss."""
        return self._get_buffers([key], BufferHandle)[0]

    def batch_get_buffer(self, keys, /):
        """One `BufferHandle` or None per key, from one lookup for the batch."""
        return self._get_buffers(list(keys), BufferHandle)

    # -- replica tasks ------------------------------------------------------------------------

    def query_task(self, task_id):
        """A copy or move task's state: (QueryTaskResponse, 0), or (None, negative code). `task_id`
        is the (hi, lo) pair `create_copy_task` / `create_move_task` answered (or its lo alone).
        `assigned_client` is (0, 0) here: the copies are done by the targets' owners, named in
        `assigned_segments`."""
        try:
            hi, lo = task_id if isinstance(task_id, (tuple, list)) else (0, task_id)
            hi, lo = int(hi), int(lo)
        except (TypeError, ValueError):
            return None, _INVALID
        if hi != 0 or lo <= 0:
            return None, _NOT_FOUND
        code, state = self._query_task(lo)
        if state is None:
            return None, code
        kind, status, created, updated, assigned, detail = state
        response = QueryTaskResponse(id=(0, lo), type=kind, status=status, created_at_ms_epoch=created,
                                     last_updated_at_ms_epoch=updated, message=detail)
        response.assigned_segments = list(assigned)
        return response, 0

    # -- tensors ----------------------------------------------------------------------------

    def put_tensor(self, key, tensor, config=None):
        """Stores a tensor (numpy array, or any typed buffer) with its dtype and shape; 0 or a
        negative code."""
        return self._store_tensor(self.put_parts, key, tensor, config)

    def upsert_tensor(self, key, tensor, config=None):
        """`put_tensor`, replacing the value if the key exists."""
        return self._store_tensor(self.upsert_parts, key, tensor, config)

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self.upsert_tensor(key, tensor, config if config is not None else ReplicateConfig())

    def batch_upsert_tensor(self, keys, tensors_list, config=None):
        if len(keys) != len(tensors_list) or not keys:
            return [_INVALID] * len(keys)
        return [self.upsert_tensor(k, t, config) for k, t in zip(keys, tensors_list)]

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self.batch_upsert_tensor(keys, tensors_list, config if config is not None else ReplicateConfig())

    def _store_tensor(self, put_parts, key, tensor, config):
        try:
            header, data = _tensor.encode(tensor)
        except (TypeError, ValueError) as e:
            _log.error("put_tensor(%r): %s", key, e)
            return _INVALID
        return put_parts(key, header, data, config=config)

    def pub_tensor(self, key, tensor, config=None):
        """`put_tensor` with replication settings."""
        return self.put_tensor(key, tensor, config if config is not None else ReplicateConfig())

    def batch_put_tensor(self, keys, tensors_list, config=None):
        if len(keys) != len(tensors_list) or not keys:
            _log.error("batch_put_tensor: %d keys but %d tensors", len(keys), len(tensors_list))
            return [_INVALID] * len(keys)
        return [self.put_tensor(k, t, config) for k, t in zip(keys, tensors_list)]

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self.batch_put_tensor(keys, tensors_list, config if config is not None else ReplicateConfig())

    def get_tensor(self, key):
        """The tensor stored under `key` (owning its bytes: a torch tensor where torch is
        installed, else a NumPy array), or None on a miss or a bad header."""
        return self._tensor_of(key, self.get_buffer(key))

    def batch_get_tensor(self, keys):
        return [self._tensor_of(k, b) for k, b in zip(keys, self.batch_get_buffer(keys))]

    def _tensor_of(self, key, data):
        if data is None:
            return None
        try:
            code, shape, offset = _tensor.decode_header(memoryview(data)[:_PEEK], len(data))
        except TensorFormatError as e:
            _log.warning("get_tensor(%r): %s", key, e)
            return None
        return _tensor.to_array(data, offset, code, shape)

    def put_tensor_from(self, key, buffer_ptr, size, config=None):
        """Stores `size` bytes of registered memory that already hold [header][data], as laid out
        by `tensor_header` (zero-copy); 0 or a negative code."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size], config)[0]

    def upsert_tensor_from(self, key, buffer_ptr, size, config=None):
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes, config=None):
        """`put_tensor_from` for several keys in one batch; any bad entry makes every result -600,
        as in Mooncake."""
        return self._tensors_from(self.batch_put_from, keys, buffer_ptrs, sizes, config)

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._tensors_from(self.batch_upsert_from, keys, buffer_ptrs, sizes, config)

    def _tensors_from(self, batch_put_from, keys, buffer_ptrs, sizes, config):
        if not keys:
            return []
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID] * len(keys)
        for k, p, n in zip(keys, buffer_ptrs, sizes):
            # Checked before a byte is read here: a pointer outside registered memory is -600,
            # as in the native calls, not a crash.
            if n < 0 or not self._is_registered(p, n):
                _log.error("put_tensor_from(%r): %d bytes at %#x are not in a registered buffer", k, n, p)
                return [_INVALID] * len(keys)
            try:
                _tensor.decode_header(ctypes.string_at(p, min(n, _PEEK)), n)
            except (TensorFormatError, ValueError, OSError) as e:
                _log.error("put_tensor_from(%r): %s", k, e)
                return [_INVALID] * len(keys)
        return batch_put_from(keys, buffer_ptrs, sizes, config)

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the tensor into registered memory and returns an array over that memory (no
        copy), or None on a miss, a too-small buffer or a bad header."""
        return self._tensor_at(key, buffer_ptr, self.get_into(key, buffer_ptr, size))

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """Arrays over the caller's registered buffers, or None per failed key; [-600] * n when
        the lists' lengths differ (Mooncake's convention)."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [self._tensor_at(k, p, n) for k, p, n in zip(keys, buffer_ptrs, got)]

    def _tensor_at(self, key, buffer_ptr, n):
        if n < 0:
            return None
        # Only host memory can be viewed as an array here: device memory (a GPU's) would fault.
        if not self._is_registered(buffer_ptr, n):
            _log.error("get_tensor_into(%r): the %d bytes at %#x are not registered host memory; "
                       "read device memory with get_into and view it with the device's library", key, n, buffer_ptr)
            return None
        try:
            code, shape, offset = _tensor.decode_header(ctypes.string_at(buffer_ptr, min(n, _PEEK)), n)
        except TensorFormatError as e:
            _log.warning("get_tensor_into(%r): %s", key, e)
            return None
        return _tensor.to_array((ctypes.c_char * n).from_address(buffer_ptr), offset, code, shape)

    @staticmethod
    def tensor_header(tensor):
        """The header `put_tensor_from` expects in front of `tensor`'s bytes."""
        header, _ = _tensor.encode(tensor)
        return header

    # -- tensor-parallel shards: key_tp_<rank>, every rank's shard written at once -----------

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Splits `tensor` into `tp_size` shards along `split_dim` and stores each under
        `key_tp_<rank>` (all ranks; `tp_rank` is not used, as in Mooncake); the first failure's
        code, or 0."""
        return self.pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0):
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1,
                                 split_dim=0):
        if len(base_keys) != len(tensors_list) or not base_keys:
            return [_INVALID] * len(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list, config)
        out = []
        for key, tensor in zip(base_keys, tensors_list):
            try:
                shards = _tp_shards(tensor, tp_size, split_dim)
            except (TypeError, ValueError, IndexError) as e:
                _log.error("put_tensor_with_tp(%r): %s", key, e)
                out.append(_INVALID)
                continue
            codes = self.batch_put_tensor([_tp_key(key, r, tp_size) for r in range(tp_size)], shards, config)
            out.append(next((c for c in codes if c != 0), 0))
        return out

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """The registered buffer holds a whole tensor ([header][data]); its shards are stored as
        `put_tensor_with_tp` does."""
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        tensor = self._tensor_in(key, buffer_ptr, size)
        if tensor is None:
            return _INVALID
        return self.put_tensor_with_tp(key, tensor, tp_rank, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        if not len(base_keys) == len(buffer_ptrs) == len(sizes) or not base_keys:
            return [_INVALID] * len(base_keys)
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
                for k, p, n in zip(base_keys, buffer_ptrs, sizes)]

    def _tensor_in(self, key, buffer_ptr, size):
        """The tensor laid out in caller memory as [header][data] (a view), or None (logged)."""
        if size < 0 or not self._is_registered(buffer_ptr, size):
            _log.error("%r: %d bytes at %#x are not in a registered buffer", key, size, buffer_ptr)
            return None
        try:
            code, shape, offset = _tensor.decode_header(ctypes.string_at(buffer_ptr, min(size, _PEEK)), size)
        except (TensorFormatError, ValueError, OSError) as e:
            _log.error("%r: %s", key, e)
            return None
        return _tensor.to_array((ctypes.c_char * size).from_address(buffer_ptr), offset, code, shape)

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """This rank's shard (`key_tp_<tp_rank>`), or the whole tensor when tp_size <= 1."""
        return self.get_tensor(_tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        return self.batch_get_tensor([_tp_key(k, tp_rank, tp_size) for k in base_keys])

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor_into(_tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1):
        return self.batch_get_tensor_into([_tp_key(k, tp_rank, tp_size) for k in base_keys], buffer_ptrs, sizes)

    # -- parallel layouts (see parallel.py) ------------------------------------------------------

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        """Stores `tensor` in a parallel layout: this writer's partition, or this rank's shard of
        a TensorParallelism (plus the manifest of the whole); with neither, as put_tensor does.
        0 or a negative code (-600 for a layout that does not apply)."""
        return self._write_parallel(False, key, tensor, parallelism, config, writer_partition)

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        return self._write_parallel(True, key, tensor, parallelism, config, writer_partition)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None,
                                         writer_partition=None):
        """As put_tensor_with_parallelism, the tensor laid out [header][data] in registered memory."""
        return self._write_parallel_from(False, key, buffer_ptr, size, parallelism, config, writer_partition)

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None,
                                            writer_partition=None):
        return self._write_parallel_from(True, key, buffer_ptr, size, parallelism, config, writer_partition)

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None,
                                          writer_partitions=None):
        return self._batch_parallel(False, keys, tensors_list, parallelisms, config, writer_partitions)

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None,
                                             writer_partitions=None):
        return self._batch_parallel(True, keys, tensors_list, parallelisms, config, writer_partitions)

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None,
                                               writer_partitions=None):
        return self._batch_parallel_from(False, keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None,
                                                  writer_partitions=None):
        return self._batch_parallel_from(True, keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions)

    def get_tensor_with_parallelism(self, key, target=None):
        """The object as stored, this rank's shard, or the full tensor put back together
        (`ReadTarget` mode "as_stored", "shard" or "full"); None when it cannot be had."""
        try:
            return _parallel.resolve_read(self, key, target)
        except (_parallel.LayoutError, TypeError, ValueError) as e:
            _log.error("get_tensor_with_parallelism(%r): %s", key, e)
            return None

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        if targets is None:
            return self.batch_get_tensor(keys)
        if len(targets) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """As get_tensor_with_parallelism, the tensor laid out [header][data] in registered memory
        and returned as a view of it; None when it cannot be had or does not fit."""
        if target is None or (getattr(target, "parallelism", None) is None
                              and str(getattr(target, "mode", "")).lower() == "as_stored"):
            return self.get_tensor_into(key, buffer_ptr, size)
        tensor = self.get_tensor_with_parallelism(key, target)
        if tensor is None:
            return None
        header, data = _tensor.encode(tensor)
        n = len(header) + data.nbytes
        # Copied natively, the registry pinned: close() waits for the copy before it frees
        # the store's pool blocks (a ctypes.memmove released the GIL and did not).
        if (n > size or self._copy_into(buffer_ptr, header, 0, len(header)) != 0
                or self._copy_into(buffer_ptr + len(header), data, 0, data.nbytes) != 0):
            _log.error("get_tensor_with_parallelism_into(%r): needs %d bytes of registered memory", key, n)
            return None
        return self._tensor_at(key, buffer_ptr, n)

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        if not len(keys) == len(buffer_ptrs) == len(sizes) or (targets is not None and len(targets) != len(keys)):
            return [None] * len(keys)
        targets = targets if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for k, p, n, t in zip(keys, buffer_ptrs, sizes, targets)]

    def _write_parallel(self, upsert, key, tensor, parallelism, config, writer_partition):
        try:
            plan = _parallel.plan_write(key, tensor, parallelism, writer_partition)
        except (_parallel.LayoutError, TypeError, ValueError) as e:
            _log.error("put_tensor_with_parallelism(%r): %s", key, e)
            return _INVALID
        for k, v in plan:
            if isinstance(v, bytes):  # the manifest: every writer stores the same one
                rc = (self.upsert if upsert else self.put)(k, v, config=config)
            else:
                rc = (self.upsert_tensor if upsert else self.put_tensor)(k, v, config)
            if rc != 0:
                return rc
        return 0

    def _write_parallel_from(self, upsert, key, buffer_ptr, size, parallelism, config, writer_partition):
        if parallelism is None and writer_partition is None:
            put_from = self.upsert_tensor_from if upsert else self.put_tensor_from
            return put_from(key, buffer_ptr, size, config)
        tensor = self._tensor_in(key, buffer_ptr, size)
        if tensor is None:
            return _INVALID
        return self._write_parallel(upsert, key, tensor, parallelism, config, writer_partition)

    def _batch_parallel(self, upsert, keys, tensors_list, parallelisms, config, writer_partitions):
        n = len(keys)
        layouts = self._layouts(n, parallelisms, writer_partitions)
        if layouts is None or len(tensors_list) != n:
            return [_INVALID] * n
        return [self._write_parallel(upsert, k, t, p, config, w) for k, t, (p, w) in zip(keys, tensors_list, layouts)]

    def _batch_parallel_from(self, upsert, keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions):
        n = len(keys)
        layouts = self._layouts(n, parallelisms, writer_partitions)
        if layouts is None or not len(buffer_ptrs) == len(sizes) == n:
            return [_INVALID] * n
        return [self._write_parallel_from(upsert, k, b, s, p, config, w)
                for k, b, s, (p, w) in zip(keys, buffer_ptrs, sizes, layouts)]

    @staticmethod
    def _layouts(n, parallelisms, writer_partitions):
        """(parallelism, writer partition) per key; None when both lists are given or one has
        the wrong length."""
        if parallelisms is not None and writer_partitions is not None:
            return None
        for given in (parallelisms, writer_partitions):
            if given is not None and len(given) != n:
                return None
        return [(parallelisms[i] if parallelisms is not None else None,
                 writer_partitions[i] if writer_partitions is not None else None) for i in range(n)]

    # -- other zero-copy forms -----------------------------------------------------------------

    def put_from_with_metadata(self, key, buffer_ptr, metadata_buffer_ptr, size, metadata_size, config=None):
        """Stores [metadata][data] from two registered buffers as one object, without joining
        them first; 0 or a negative code."""
        return self.batch_put_from_multi_buffers([key], [[metadata_buffer_ptr, buffer_ptr]],
                                                 [[metadata_size, size]], config)[0]

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """Partial reads: for buffer i and its j-th range, `all_sizes[i][j]` bytes of object
        `all_keys[i][j]` from offset `all_src_offsets[i][j]` into registered memory at
        `buffer_ptrs[i] + all_dst_offsets[i][j]`. Answers bytes read (or a negative code) per
        range, nested as the arguments are."""
        shapes = [len(k) for k in all_keys]
        if not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes)
                and all(len(x[i]) == n for x in (all_dst_offsets, all_src_offsets, all_sizes)
                        for i, n in enumerate(shapes))):
            _log.error("get_into_ranges: the lists' shapes differ")
            return [[_INVALID] * n for n in shapes]
        keys = list(dict.fromkeys(k for ks in all_keys for k in ks))
        found = dict(zip(keys, self._get_buffers_coded(keys, BufferHandle)))
        out = []
        for base, ks, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
            row = []
            for k, dst, src, n in zip(ks, dsts, srcs, sizes):
                h, code = found[k]
                if h is None:
                    row.append(code)
                elif src < 0 or dst < 0 or n < 0 or src + n > len(h):
                    row.append(_INVALID)
                else:
                    # Copied natively, the registry pinned: close() waits for the copy before it
                    # frees the store's pool blocks.
                    row.append(n if self._copy_into(base + dst, h, src, n) == 0 else _INVALID)
            out.append(row)
        return out

    def alloc_from_mem_pool(self, size, /):
        """`size` bytes of page-aligned host memory, registered for zero-copy transfers; its
        address, or 0 when the store is not set up or the size is not positive. Freed at close."""
        if size <= 0:
            return 0
        # Private: a child of a fork() gets its own copy, never the parent's bytes to write into.
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(block))
        if self.register_buffer(ptr, size) != 0:
            block.close()
            return 0
        self.__dict__.setdefault("_pool_blocks", []).append(block)
        # A store freed without close() clears its attributes before its native part goes:
        # the native side keeps the block mapped until no call in flight can write into it.
        self._keep_alive(block)
        return ptr

    def close(self):
        """Ends the session and frees `alloc_from_mem_pool` memory. Calls in flight are waited
        for (within their deadlines): with async calls in flight, call it off the event loop
        (`await loop.run_in_executor(None, store.close)`), which their cancellation needs."""
        blocks = self.__dict__.pop("_pool_blocks", [])
        for block in blocks:
            self.unregister_buffer(ctypes.addressof(ctypes.c_char.from_buffer(block)))
        rc = super().close()
        for block in blocks:
            block.close()
        return rc

    # -- what has no meaning here: the call exists and answers a clear code --------------------

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's dummy client proxies through a local real client process; here every
        client talks to the master and owners itself. Use setup() with global_segment_size=0
        (requester-only) and MOONCAKE_PREFERRED_SEGMENT for the node-local owner. Answers -600."""
        _log.error("setup_dummy: no dummy clients in this store; call setup(..., global_segment_size=0, ...) "
                   "with the master's address instead")
        return _INVALID

    def init_all(self, protocol, device_name, mount_segment_size, /):
        """Mooncake's older transfer-engine initialisation; setup() does all of it here. Answers
        0 after setup (nothing left to do), -600 before."""
        if not self.get_hostname():
            _log.error("init_all: call setup() first; it initialises everything")
            return _INVALID
        return 0

    def _get_pyclient_capsule(self):
        """Mooncake hands its C++ client to EngramStore through this capsule; this store has no
        C++ client to share. Always None."""
        return None

    def mount_segment(self, path, size, offset=0, protocol="tcp", location=""):
        """Mounting a file as a segment: not supported (owners' pools are anonymous shared
        memory). Answers ret -1. Use allocate_and_mount_segment for memory."""
        _log.error("mount_segment(%r): file-backed segments are not supported; use allocate_and_mount_segment", path)
        return {"ret": -1, "segment_ids": []}

    def unmount_segment(self, segment_ids):
        """The counterpart of mount_segment: -1 (no file-backed segments exist here); segments
        from allocate_and_mount_segment go with unmount_and_free_segment."""
        _log.error("unmount_segment: no file-backed segments exist here; use unmount_and_free_segment")
        return -1

    # -- safetensors files ----------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key, file_name=None):
        """Writes the tensor stored under `key` to a safetensors file (`file_name`, default the
        key) under the name `key`; 0, -704 (FILE_NOT_FOUND: no such object) or -600."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return _NOT_FOUND
        try:
            from safetensors.numpy import save_file

            save_file({key: tensor}, file_name or key)
        except Exception as e:  # noqa: BLE001 - any failure is this call's -600, logged
            _log.error("save_tensor_to_safetensor(%r): %s", key, e)
            return _INVALID
        return 0

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Reads the tensor named `key` (or the file's first) from a safetensors file, stores it
        under `key` (or the file name) and returns it; None on any failure (logged)."""
        if file_name is None:
            _log.error("load_tensor_from_safetensor: file_name is required")
            return None
        try:
            from safetensors.numpy import load_file

            tensors = load_file(file_name)
        except Exception as e:  # noqa: BLE001
            _log.error("load_tensor_from_safetensor(%r): %s", file_name, e)
            return None
        if not tensors:
            return None
        if key in tensors:
            tensor = tensors[key]
        else:
            if key is not None:
                _log.warning("load_tensor_from_safetensor: %r is not in %s; taking its first tensor", key, file_name)
            tensor = next(iter(tensors.values()))
        if self.put_tensor(key if key is not None else file_name, tensor) != 0:
            return None
        return tensor

    # -- statistics ---------------------------------------------------------------------------

    def get_client_stats(self):
        """This client's reads by tier and writes (counts and bytes), Mooncake's keys; {} before
        setup."""
        t = self.transfer_stats()
        if not t:
            return {}
        return {
            "get_from_memory_count": t["memory_keys"], "get_from_memory_bytes": t["memory_bytes"],
            "get_from_disk_count": t["disk_keys"], "get_from_disk_bytes": t["disk_bytes"],
            "put_to_memory_count": t["put_keys"], "put_to_memory_bytes": t["put_bytes"],
            # Puts always land in memory here; the SSD tier takes objects from there.
            "put_to_disk_count": 0, "put_to_disk_bytes": 0,
        }

    def calc_cache_stats(self):
        """Hit rates of this client's gets: of the lookups made, how many were found and in which
        tier; {} before setup."""
        t = self.transfer_stats()
        if not t:
            return {}
        mem, ssd, total = t["memory_keys"], t["disk_keys"], t["get_keys"]
        rate = lambda n, d: float(n) / d if d else 0.0  # noqa: E731
        return {
            "memory_hits": float(mem), "ssd_hits": float(ssd),
            "memory_total": float(total), "ssd_total": float(total - mem),
            "memory_hit_rate": rate(mem, total), "ssd_hit_rate": rate(ssd, total - mem),
            "overall_hit_rate": rate(mem + ssd, total), "valid_get_rate": rate(mem + ssd, total),
        }


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """`MooncakeDistributedStore` with an awaitable `async_<name>` for every method, for asyncio.

    The data calls (put, get, their batch, buffer and zero-copy forms, existence, removal) are
    native: each runs as a task of the store's own I/O runtime, with no thread per call, so many
    calls in flight overlap their transfers. Every other `async_<name>` runs the blocking method
    in the event loop's default executor, as Mooncake's wrapper does for all of them. The store
    starts I/O threads for this (MOONCAKE_IO_THREADS, default 2).
    """

    def __init__(self):
        super().__init__()
        self._set_io_threads(2)

    async def async_get_buffer(self, key):
        return (await self._async_get_buffers([key], BufferHandle))[0]

    async def async_batch_get_buffer(self, keys):
        return await self._async_get_buffers(list(keys), BufferHandle)

    def __getattr__(self, name):
        if not name.startswith("async_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        sync_name = name[len("async_"):]
        if not callable(getattr(self, sync_name, None)):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        # Made once, on the class: kept on the instance, it would hold the instance in a cycle
        # (freed only by the cyclic collector, on whatever thread that runs).
        async def method(self, *args, **kwargs):
            loop = asyncio.get_running_loop()
            call = functools.partial(getattr(self, sync_name), *args, **kwargs)
            return await loop.run_in_executor(None, call)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"`{sync_name}` run in the event loop's default executor."
        setattr(type(self), name, method)
        return getattr(self, name)

    def _make_async_wrapper(self, sync_method):
        """An awaitable form of `sync_method`, run in the event loop's default executor
        (Mooncake's helper; `async_<name>` use their own, made once per class)."""

        @functools.wraps(sync_method)
        async def wrapper(*args, **kwargs):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(sync_method, *args, **kwargs))

        return wrapper


def _coroutine_of(native):
    """A native async call as a coroutine function, as Mooncake's wrapper has them: one can
    `create_task` it or hand it to another thread's loop, and the call starts when awaited."""

    @functools.wraps(native)
    async def call(self, *args, **kwargs):
        return await native(self, *args, **kwargs)

    return call


for _name in dir(NativeStore):
    if _name.startswith("async_") and _name not in vars(MooncakeDistributedStoreAsync):
        setattr(MooncakeDistributedStoreAsync, _name, _coroutine_of(getattr(NativeStore, _name)))
