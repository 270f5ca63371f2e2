"""Encoder-cache tensors as stored objects: a small self-describing header, then the raw bytes.

Header (little endian, padded with zeros to a multiple of 64 bytes so the data stays aligned)::

    0   u32  magic 0x5452434D (b"MCRT")
    4   u16  version (1)
    6   u16  header_size (bytes before the data)
    8   u16  dtype code (the table below; Mooncake's numbering)
    10  u16  ndim (0..32)
    12  u32  reserved (0)
    16  u64  data_bytes
    24  u64  shape[ndim]
"""

import os
import struct

MAGIC = 0x5452434D
VERSION = 1
MAX_NDIM = 32
_FIXED = struct.Struct("<IHHHHIQ")
ALIGN = 64

# code: (numpy dtype name, itemsize, memoryview format characters)
DTYPES = {
    0: ("float32", 4, "f"),
    1: ("float64", 8, "d"),
    2: ("int8", 1, "b"),
    3: ("uint8", 1, "B"),
    4: ("int16", 2, "h"),
    5: ("uint16", 2, "H"),
    6: ("int32", 4, "i"),
    7: ("uint32", 4, "I"),
    8: ("int64", 8, "ql"),
    9: ("uint64", 8, "QL"),
    10: ("bool", 1, "?"),
    11: ("float16", 2, "e"),
    12: ("bfloat16", 2, ""),
    13: ("float8_e4m3fn", 1, ""),
    14: ("float8_e5m2", 1, ""),
}
_BY_NAME = {name: code for code, (name, _, _) in DTYPES.items()}
_BY_FORMAT = {f: code for code, (_, _, fmts) in DTYPES.items() for f in fmts}


class TensorFormatError(ValueError):
    """A stored object is not a tensor written by this module, or is damaged."""


def header_size(ndim):
    return -(-(_FIXED.size + 8 * ndim) // ALIGN) * ALIGN


def encode_header(code, shape, data_bytes):
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensors have at most {MAX_NDIM} dimensions, got {len(shape)}")
    size = header_size(len(shape))
    raw = _FIXED.pack(MAGIC, VERSION, size, code, len(shape), 0, data_bytes)
    raw += struct.pack(f"<{len(shape)}Q", *shape)
    return raw + bytes(size - len(raw))


def decode_header(buf, total_len):
    """(dtype code, shape, header_size) of the object whose first bytes are `buf`."""
    if len(buf) < _FIXED.size:
        raise TensorFormatError(f"object of {total_len} bytes is too short for a tensor header")
    magic, version, size, code, ndim, _, data_bytes = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise TensorFormatError("not a tensor: bad magic")
    if version != VERSION:
        raise TensorFormatError(f"tensor header version {version} is not supported (this build reads {VERSION})")
    if code not in DTYPES or ndim > MAX_NDIM or size != header_size(ndim) or len(buf) < _FIXED.size + 8 * ndim:
        raise TensorFormatError("damaged tensor header")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    count = 1
    for d in shape:
        count *= d
    if data_bytes != total_len - size or count * DTYPES[code][1] != data_bytes:
        raise TensorFormatError(
            f"tensor header says {data_bytes} data bytes for shape {shape}, the object holds {total_len - size}")
    return code, tuple(shape), size


def describe(tensor):
    """(dtype code, shape, C-contiguous byte view) of a tensor: a NumPy array, an object with
    DLPack (torch, cupy, ...; device tensors are copied to the host first), or a typed buffer."""
    np = _numpy(required=False)
    if np is not None and isinstance(tensor, np.ndarray):
        return _describe_array(np, tensor)
    if hasattr(tensor, "__dlpack__") and hasattr(tensor, "dtype") and np is not None:
        return _describe_dlpack(np, tensor)
    try:
        mv = memoryview(tensor)
    except TypeError:
        raise TypeError(f"expected a tensor (NumPy, DLPack) or an object with the buffer protocol, "
                        f"got {type(tensor).__name__}") from None
    fmt = mv.format.lstrip("@=<")
    code = _BY_FORMAT.get(fmt)
    if code is None:
        raise TypeError(f"buffer format {mv.format!r} is not a supported tensor dtype")
    if not mv.c_contiguous:
        raise TypeError("the buffer must be C-contiguous")
    return code, tuple(mv.shape), mv.cast("B")


def _describe_array(np, tensor):
    code = _BY_NAME.get(tensor.dtype.name)
    if code is None:
        raise TypeError(f"dtype {tensor.dtype} is not supported for tensors")
    if tensor.dtype.byteorder == ">":
        raise TypeError("big-endian arrays are not supported; convert with astype('<...')")
    # ascontiguousarray would turn a 0-d array into a 1-d one: keep the caller's shape.
    arr = tensor if tensor.flags.c_contiguous else np.ascontiguousarray(tensor)
    return code, tuple(tensor.shape), memoryview(arr.reshape(-1).view(np.uint8))


def _describe_dlpack(np, tensor):
    """A DLPack tensor's bytes on the host: torch through a byte view (which also carries dtypes
    NumPy lacks, bfloat16 and float8), others through NumPy's DLPack import."""
    name = str(tensor.dtype).rsplit(".", 1)[-1]
    code = _BY_NAME.get(name)
    if code is None:
        raise TypeError(f"dtype {tensor.dtype} is not supported for tensors")
    shape = tuple(tensor.shape)
    if hasattr(tensor, "cpu") and hasattr(tensor, "view"):  # torch
        import torch

        host = tensor.detach().cpu().contiguous()
        raw = np.from_dlpack(host.reshape(-1).view(torch.uint8))
        return code, shape, memoryview(raw)
    if hasattr(tensor, "get") and not hasattr(tensor, "__array_interface__"):  # cupy: device to host
        tensor = tensor.get()
    arr = np.from_dlpack(tensor)
    return code, shape, _describe_array(np, arr)[2]


def encode(tensor):
    """(header bytes, data view) for storing `tensor`."""
    code, shape, data = describe(tensor)
    return encode_header(code, shape, data.nbytes), data


def to_array(buffer, offset, code, shape):
    """The tensor of dtype `code` and `shape` over `buffer` from `offset` (no copy): a torch
    tensor where torch is installed (as Mooncake returns), else a NumPy array;
    MOONCAKE_TENSOR_LIB=numpy or =torch chooses."""
    lib = os.environ.get("MOONCAKE_TENSOR_LIB", "").lower()
    if lib != "numpy":
        torch = _torch(required=lib == "torch")
        if torch is not None:
            return _to_torch(torch, buffer, offset, code, shape)
    np = _numpy(required=True)
    name = DTYPES[code][0]
    try:
        dtype = np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes  # bfloat16 and float8 live there

            dtype = np.dtype(getattr(ml_dtypes, name))
        except (ImportError, AttributeError):
            raise TypeError(f"reading a {name} tensor needs the ml_dtypes package") from None
    count = 1
    for d in shape:
        count *= d
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)


def _to_torch(torch, buffer, offset, code, shape):
    dtype = getattr(torch, DTYPES[code][0])
    count = 1
    for d in shape:
        count *= d
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)


def _torch(required):
    try:
        import torch
    except ImportError:
        if required:
            raise ImportError("MOONCAKE_TENSOR_LIB=torch, but torch is not installed") from None
        return None
    return torch


def _numpy(required):
    try:
        import numpy
    except ImportError:
        if required:
            raise ImportError("tensor reads return NumPy arrays: pip install numpy") from None
        return None
    return numpy
