"""Device (GPU) memory given to the pointer calls: recognised at register_buffer, moved through
host staging with the device's own copies, never read as host memory. Run here with device-like
host memory whose addresses fault if dereferenced (the same path a CUDA GPU takes)."""

import os

import numpy as np

INVALID = -600


def test_device_buffers_move_through_staging_and_are_never_read_directly(store):
    dev = store._attach_host_backed_device()
    n, size = 6, 3 << 20  # 18 MiB: more than one staging slice
    data = [os.urandom(size) for _ in range(n)]
    src = [dev.alloc(size) for _ in range(n)]
    for p, d in zip(src, data):
        dev.write(p, d)
        assert store.register_buffer(p, size) == 0
    keys = [f"gpu/{i}" for i in range(n)]
    assert store.batch_put_from(keys, src, [size] * n) == [0] * n
    assert store.get(keys[2]) == data[2], "any client reads what the device wrote"

    dst = [dev.alloc(size) for _ in range(n)]
    for p in dst:
        assert store.register_buffer(p, size) == 0
    assert store.batch_get_into(keys, dst, [size] * n) == [size] * n
    assert all(dev.read(p, size) == d for p, d in zip(dst, data))

    # Host and device buffers in one batch; single-key forms.
    host = np.zeros(size, dtype=np.uint8)
    assert store.register_buffer(host.ctypes.data, host.nbytes) == 0
    assert store.batch_get_into([keys[0], keys[1]], [host.ctypes.data, dst[5]], [size, size]) == [size, size]
    assert bytes(host) == data[0] and dev.read(dst[5], size) == data[1]
    assert store.put_from("gpu/one", src[3], 1000) == 0
    assert store.get_into("gpu/one", dst[0], size) == 1000
    assert dev.read(dst[0], 1000) == data[3][:1000]

    # A layer's K and V apart in device memory: one object, read back into two device buffers.
    assert store.batch_put_from_multi_buffers(["gpu/kv"], [[src[0], src[1]]], [[100, 200]]) == [0]
    assert store.get("gpu/kv") == data[0][:100] + data[1][:200]
    assert store.batch_get_into_multi_buffers(["gpu/kv"], [[dst[1], dst[2]]], [[100, 200]]) == [300]
    assert dev.read(dst[1], 100) == data[0][:100] and dev.read(dst[2], 200) == data[1][:200]

    # A tensor read into device memory lands there, but is not viewed as a host array (that
    # would read device addresses): None, not a crash.
    assert store.put_tensor("gpu/tensor", np.arange(64, dtype=np.float32)) == 0
    assert store.get_tensor_into("gpu/tensor", dst[3], size) is None
    assert store.batch_get_tensor_into(["gpu/tensor"], [dst[4]], [size]) == [None]
    raw = store.get("gpu/tensor")
    assert dev.read(dst[3], len(raw)) == raw and dev.read(dst[4], len(raw)) == raw

    # Device memory that was never registered, and device memory mixed with host memory in one
    # key, are refused, never touched.
    stray = dev.alloc(4096)
    assert store.put_from("gpu/stray", stray, 4096) == INVALID
    # A range that runs past the end of a device allocation is refused at registration: taken
    # for host memory, it would be dereferenced.
    assert store.register_buffer(stray, 4096 + 4096) == INVALID
    assert store.register_buffer(stray + 4096 - 16, 64) == INVALID
    mixed = [[src[0], host.ctypes.data]]
    assert store.batch_put_from_multi_buffers(["gpu/mixed"], mixed, [[10, 10]]) == [INVALID]
    assert store.batch_get_into_multi_buffers(["gpu/kv"], mixed, [[100, 200]]) == [INVALID]
    # Device destinations of one batch that overlap are refused, as host ones are (the later
    # key overwrote the earlier one's bytes); sources may overlap.
    assert store.batch_get_into([keys[0], keys[1]], [dst[0], dst[0] + 100], [size, size]) == [size, INVALID]
    assert dev.read(dst[0], size) == data[0]
    assert store.batch_get_into_multi_buffers(["gpu/kv"], [[dst[1], dst[1] + 50]], [[100, 200]]) == [INVALID]
    assert store.batch_put_from(["gpu/o1", "gpu/o2"], [src[0], src[0] + 10], [100, 100]) == [0, 0]
    for p in src + dst:
        assert store.unregister_buffer(p) == 0
    assert store.put_from("gpu/after", src[0], 10) == INVALID, "unregistered"


def test_async_pointer_calls_stage_device_memory_too(cluster):
    import asyncio

    from mooncake_rs.store import MooncakeDistributedStoreAsync

    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        dev = s._attach_host_backed_device()
        size = 1 << 20
        data = [os.urandom(size) for _ in range(4)]
        src, dst = [dev.alloc(size) for _ in data], [dev.alloc(size) for _ in data]
        for p, d in zip(src, data):
            dev.write(p, d)
        for p in src + dst:
            assert s.register_buffer(p, size) == 0
        keys = [f"agpu/{i}" for i in range(4)]
        host = np.zeros(size, dtype=np.uint8)
        assert s.register_buffer(host.ctypes.data, size) == 0

        async def main():
            assert await s.async_batch_put_from(keys, src, [size] * 4) == [0] * 4
            got = await s.async_batch_get_into(keys + [keys[0]], dst + [host.ctypes.data], [size] * 5)
            assert got == [size] * 5
            assert await s.async_get_into(keys[3], dst[0], size) == size

        asyncio.run(main())
        assert [dev.read(p, size) for p in dst[1:]] == data[1:] and dev.read(dst[0], size) == data[3]
        assert bytes(host) == data[0]
    finally:
        s.remove_all(True)
        s.close()
