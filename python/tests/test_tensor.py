"""Encoder-cache tensors: dtypes and shapes round-trip exactly, through bytes and zero-copy."""

import array

import numpy as np
import pytest

from mooncake_rs import tensor as T
from mooncake_rs.store import MooncakeDistributedStore

DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool"]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 1, 2)]


def sample(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_shapes_round_trip_exactly(store, dtype):
    for i, shape in enumerate(SHAPES):
        a = sample(dtype, shape, i)
        key = f"t/{dtype}/{i}"
        assert store.put_tensor(key, a) == 0
        b = store.get_tensor(key)
        assert b.dtype == a.dtype and b.shape == a.shape
        assert a.tobytes() == b.tobytes()
        assert b.flags.writeable


def test_non_contiguous_arrays_and_plain_buffers(store):
    a = np.arange(24, dtype=np.int32).reshape(4, 6).T  # a transposed view
    assert store.put_tensor("t/transposed", a) == 0
    assert np.array_equal(store.get_tensor("t/transposed"), a)
    d = array.array("d", [1.5, -2.25, 3.0])  # buffer protocol with a format, no numpy
    assert store.put_tensor("t/array", d) == 0
    got = store.get_tensor("t/array")
    assert got.dtype == np.float64 and got.tolist() == [1.5, -2.25, 3.0]
    assert store.put_tensor("t/big", np.ones((256, 1024), dtype=np.float32)) == 0
    assert store.get_tensor("t/big").sum() == 256 * 1024


def test_batch_tensor_helpers_and_misses(store):
    ts = [np.full((3,), i, dtype=np.int16) for i in range(4)]
    keys = [f"bt/{i}" for i in range(4)]
    assert store.batch_put_tensor(keys, ts) == [0] * 4
    got = store.batch_get_tensor(keys + ["missing"])
    assert got[-1] is None
    for a, b in zip(ts, got):
        assert np.array_equal(a, b)
    store.put("not-a-tensor", b"just some bytes of no tensor")
    assert store.get_tensor("not-a-tensor") is None


def test_zero_copy_tensor_from_and_into_registered_buffers(store):
    a = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    header = MooncakeDistributedStore.tensor_header(a)
    total = len(header) + a.nbytes
    src = np.zeros(total, dtype=np.uint8)
    src[:len(header)] = np.frombuffer(header, dtype=np.uint8)
    src[len(header):] = a.view(np.uint8).reshape(-1)
    dst = np.zeros(total + 100, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.put_tensor_from("tz", src.ctypes.data, total) == 0
    view = store.get_tensor_into("tz", dst.ctypes.data, dst.nbytes)
    assert np.array_equal(view, a)
    assert view.ctypes.data == dst.ctypes.data + len(header), "the array is a view of the registered buffer"
    assert store.get_tensor_into("tz", dst.ctypes.data, 10) is None, "too small"
    src[0] ^= 0xFF  # break the magic
    assert store.put_tensor_from("tz-bad", src.ctypes.data, total) == -600


def test_tensor_from_calls_refuse_memory_that_is_not_registered(store):
    """A pointer outside registered memory is -600 before a byte is read: unregistered memory is
    not stored, and a bogus address is not a crash."""
    a = np.arange(64, dtype=np.float32)
    blob = MooncakeDistributedStore.tensor_header(a) + a.tobytes()
    src = np.frombuffer(bytearray(blob), dtype=np.uint8)  # never registered
    assert store.put_tensor_from("unreg", src.ctypes.data, len(blob)) == -600
    assert store.batch_put_tensor_from(["unreg"], [src.ctypes.data], [len(blob)]) == [-600]
    assert store.put_tensor_with_tp_from("unreg", src.ctypes.data, len(blob), tp_size=2) == -600
    assert store.put_tensor_from("bogus", 0x1000, 64) == -600
    assert store.put_tensor_with_tp_from("bogus", 0x1000, 64, tp_size=2) == -600
    assert store.is_exist("unreg") == 0 and store.is_exist("unreg_tp_0") == 0


def test_header_format_is_validated():
    h = T.encode_header(0, (2, 3), 24)
    assert len(h) % 64 == 0
    assert T.decode_header(h, len(h) + 24) == (0, (2, 3), len(h))
    with pytest.raises(T.TensorFormatError):
        T.decode_header(h, len(h) + 23)
    with pytest.raises(T.TensorFormatError):
        T.decode_header(b"\0" * 64, 128)
    with pytest.raises(ValueError):
        T.encode_header(0, (1,) * 33, 4)


def test_bfloat16_and_float8_round_trip(store):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for i, name in enumerate(["bfloat16", "float8_e4m3fn", "float8_e5m2"]):
        a = np.linspace(-4, 4, 24, dtype=np.float32).reshape(2, 3, 4).astype(getattr(ml_dtypes, name))
        assert store.put_tensor(f"t/ml/{name}", a) == 0
        b = store.get_tensor(f"t/ml/{name}")
        assert b.dtype == a.dtype and b.shape == a.shape and a.tobytes() == b.tobytes(), name


def test_dlpack_tensors_are_accepted(store):
    class DLPackOnly:
        """A tensor known only through DLPack (as cupy and jax arrays are)."""

        def __init__(self, a):
            self._a, self.dtype, self.shape = a, a.dtype, a.shape

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    a = np.arange(20, dtype=np.int32).reshape(4, 5)
    assert store.put_tensor("t/dl", DLPackOnly(a)) == 0
    assert np.array_equal(store.get_tensor("t/dl"), a)


def test_torch_tensors_round_trip_as_torch_tensors(store):
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        t = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
        assert store.put_tensor(f"t/torch/{dtype}", t) == 0
        back = store.get_tensor(f"t/torch/{dtype}")
        assert isinstance(back, torch.Tensor) and back.dtype == dtype and torch.equal(back, t)
