"""`MooncakeDistributedStore` with Mooncake's Python API (vLLM and SGLang connectors call it).

Every method of the native client is inherited as is: writes return 0 or a negative code,
reads the number of bytes read or a negative code, `is_exist` 1 / 0 / negative, `get` b"" on a
miss. This module adds the encoder-cache tensor helpers (see `tensor.py` for the format).
"""

import ctypes
import logging

from . import tensor as _tensor
from ._native import BufferDescriptor, MemoryDescriptor, NativeStore, ReplicaDescriptor, ReplicateConfig

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ReplicaDescriptor", "MemoryDescriptor",
           "BufferDescriptor", "TensorFormatError"]

TensorFormatError = _tensor.TensorFormatError
_log = logging.getLogger("mooncake_rs")
_INVALID = -600
_PEEK = _tensor.header_size(_tensor.MAX_NDIM)


class MooncakeDistributedStore(NativeStore):
    """A client of the store. Call `setup(...)` before anything else and `close()` at the end."""

    def put_tensor(self, key, tensor, config=None):
        """Stores a NumPy array (or typed buffer) with its dtype and shape; 0 or a negative code."""
        header, data = _tensor.encode(tensor)
        return self.put_parts(key, header, data, config=config)

    def batch_put_tensor(self, keys, tensors, config=None):
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        return [self.put_tensor(k, t, config) for k, t in zip(keys, tensors)]

    def get_tensor(self, key):
        """The array stored under `key` (a writable copy), or None on a miss or a bad header."""
        data = self._get_bytearray(key)
        if data is None:
            return None
        try:
            code, shape, offset = _tensor.decode_header(memoryview(data)[:_PEEK], len(data))
        except TensorFormatError as e:
            _log.warning("get_tensor(%r): %s", key, e)
            return None
        return _tensor.to_array(data, offset, code, shape)

    def batch_get_tensor(self, keys):
        return [self.get_tensor(k) for k in keys]

    def put_tensor_from(self, key, buffer_ptr, size, config=None):
        """Stores `size` bytes of registered memory that already hold [header][data], as laid out
        by `tensor_header` (zero-copy); 0 or a negative code."""
        try:
            _tensor.decode_header(ctypes.string_at(buffer_ptr, min(size, _PEEK)), size)
        except TensorFormatError as e:
            _log.error("put_tensor_from(%r): %s", key, e)
            return _INVALID
        return self.put_from(key, buffer_ptr, size, config)

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the tensor into registered memory and returns an array over that memory (no
        copy), or None on a miss, a too-small buffer or a bad header."""
        n = self.get_into(key, buffer_ptr, size)
        if n < 0:
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
