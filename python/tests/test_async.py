"""MooncakeDistributedStoreAsync from asyncio against a real master and owners: the native async
data calls (many in flight at once, bytes checked), the executor fallback for the others, and
the errors of a misuse."""

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from mooncake_rs.store import BufferHandle, MooncakeDistributedStore, MooncakeDistributedStoreAsync

INVALID, NOT_FOUND = -600, -704


@pytest.fixture
def astore(cluster):
    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    yield s
    s.remove_all(True)
    s.close()


def test_async_put_get_exists_and_remove(astore):
    async def main():
        assert await astore.async_put("a/1", b"hello") == 0
        assert await astore.async_put_batch(["a/2", "a/3"], [b"x" * 5000, bytearray(b"yy")]) == 0
        assert await astore.async_get("a/2") == b"x" * 5000
        assert await astore.async_get("a/missing") == b""
        assert await astore.async_get_batch(["a/3", "a/missing", "a/1"]) == [b"yy", b"", b"hello"]
        assert await astore.async_is_exist("a/1") == 1
        assert await astore.async_batch_is_exist(["a/1", "a/nope"]) == [1, 0]
        h = await astore.async_get_buffer("a/2")
        assert isinstance(h, BufferHandle) and bytes(memoryview(h)) == b"x" * 5000
        got = await astore.async_batch_get_buffer(["a/1", "a/missing"])
        assert bytes(got[0]) == b"hello" and got[1] is None
        assert await astore.async_remove("a/1", True) == 0
        assert await astore.async_remove("a/1") == NOT_FOUND
        assert await astore.async_batch_remove(["a/2", "a/3", "a/1"], True) == [0, 0, NOT_FOUND]
        assert await astore.async_put_batch(["a/4"], [b"1", b"2"]) == INVALID, "mismatched lengths"

    asyncio.run(main())


def test_many_async_zero_copy_batches_in_flight_at_once(astore):
    n, batch, size = 8, 16, 64 << 10
    src = np.frombuffer(os.urandom(n * batch * size), dtype=np.uint8).copy()
    dst = np.zeros_like(src)
    extra = np.zeros(3 * size, dtype=np.uint8)
    for a in (src, dst, extra):
        assert astore.register_buffer(a.ctypes.data, a.nbytes) == 0
    keys = [[f"z/{c}/{i}" for i in range(batch)] for c in range(n)]
    at = lambda a, c, i: a.ctypes.data + (c * batch + i) * size  # noqa: E731
    half = size // 2

    async def main():
        puts = [astore.async_batch_put_from(keys[c], [at(src, c, i) for i in range(batch)], [size] * batch)
                for c in range(n)]
        assert await asyncio.gather(*puts) == [[0] * batch] * n
        gets = [astore.async_batch_get_into(keys[c], [at(dst, c, i) for i in range(batch)], [size] * batch)
                for c in range(n)]
        assert await asyncio.gather(*gets) == [[size] * batch] * n
        # K and V apart: the object of z/0/1 lands in two buffers (its halves swapped here).
        e = extra.ctypes.data
        got = await astore.async_batch_get_into_multi_buffers([keys[0][1]], [[e + half, e]], [[half, half]])
        assert got == [size]
        assert await astore.async_put_from("z/one", at(src, 3, 3), size) == 0
        assert await astore.async_get_into("z/one", e + size, size) == size
        # Memory that was never registered is refused, per key.
        outside = np.zeros(size, dtype=np.uint8)
        assert await astore.async_batch_get_into(["z/one"], [outside.ctypes.data], [size]) == [INVALID]
        assert await astore.async_batch_put_from(["z/two"], [outside.ctypes.data], [size]) == [INVALID]

    asyncio.run(main())
    assert np.array_equal(dst, src)
    one = src[size:2 * size]  # the object of z/0/1
    assert np.array_equal(extra[half:size], one[:half]) and np.array_equal(extra[:half], one[half:])
    start = (3 * batch + 3) * size
    assert np.array_equal(extra[size:2 * size], src[start:start + size])
    for a in (src, dst, extra):
        assert astore.unregister_buffer(a.ctypes.data) == 0


def test_other_methods_run_in_the_executor(astore):
    async def main():
        t = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert await astore.async_put_tensor("at/t", t) == 0
        assert np.array_equal(await astore.async_get_tensor("at/t"), t)
        assert await astore.async_get_size("at/t") > t.nbytes
        with pytest.raises(AttributeError):
            await astore.async_no_such_method()

    asyncio.run(main())
    with pytest.raises(AttributeError):
        astore.not_async_either  # noqa: B018


def test_async_misuse_answers_clearly(cluster):
    async def main():
        never = MooncakeDistributedStoreAsync()
        assert await never.async_put("k", b"v") == INVALID, "not set up"
        assert await never.async_batch_get_into(["k"], [1], [1]) == [INVALID]
        sync = MooncakeDistributedStore()
        assert sync.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
        try:
            with pytest.raises(RuntimeError, match="I/O threads"):
                await sync.async_put("k", b"v")
        finally:
            sync.close()

    asyncio.run(main())


def test_async_calls_are_coroutines_as_in_mooncakes_wrapper(astore):
    """Scheduled with create_task, run by asyncio.run, or handed to a loop on another thread."""
    import inspect
    import threading

    assert inspect.iscoroutinefunction(MooncakeDistributedStoreAsync.async_put)
    assert asyncio.run(astore.async_put("coro/1", b"one")) == 0

    async def main():
        task = asyncio.create_task(astore.async_get("coro/1"))
        assert await task == b"one"
        async with asyncio.TaskGroup() as tg:
            put = tg.create_task(astore.async_put_batch(["coro/2", "coro/3"], [b"two", b"three"]))
        assert put.result() == 0

    asyncio.run(main())
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    try:
        done = asyncio.run_coroutine_threadsafe(astore.async_get_batch(["coro/2", "coro/3"]), loop)
        assert done.result(timeout=20) == [b"two", b"three"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def test_an_async_call_that_panics_resolves_with_an_error(astore):
    async def main():
        with pytest.raises(RuntimeError, match="failed inside"):
            await asyncio.wait_for(astore._async_call_that_panics(), 20)
        assert await astore.async_put("after/panic", b"still serving") == 0

    asyncio.run(main())


def test_close_with_calls_in_flight_waits_for_them_and_hands_back_their_leases(cluster):
    """close() while async calls are in flight waits for them (their deadlines allow it), so
    every one completes; the read leases they took go back before the session ends, so
    another client removes the key at once instead of meeting -706 until the lease's TTL."""
    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    value = os.urandom(1 << 20)

    async def main():
        assert await s.async_put("closing/k", value) == 0
        calls = [asyncio.create_task(s.async_get("closing/k")) for _ in range(16)]
        await asyncio.sleep(0)  # each task reaches its native call
        s.close()
        done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
        assert done == [value] * 16, [d if isinstance(d, Exception) else len(d) for d in done]

    asyncio.run(main())
    other = MooncakeDistributedStore()
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    try:
        assert other.remove("closing/k") == 0
    finally:
        other.close()


def test_a_store_freed_with_a_call_in_flight_keeps_its_pool_memory_mapped_until_the_call_ends(cluster):
    """The native awaitable does not hold the store: freed without close() while the call
    writes into its pool memory, the store's attributes (the pool's blocks) go first. The
    blocks stay mapped until the call is over."""
    import gc

    from mooncake_rs._native import NativeStore

    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    value = os.urandom(8 << 20)
    assert s.put("freed/k", value) == 0
    p = s.alloc_from_mem_pool(len(value))

    async def main():
        nonlocal s
        native = NativeStore.async_get_into(s, "freed/k", p, len(value))
        del s
        gc.collect()
        return await asyncio.wait_for(native, 20)

    assert asyncio.run(main()) == len(value)
    checker = MooncakeDistributedStore()
    assert checker.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master) == 0
    assert checker.remove("freed/k", True) == 0
    checker.close()


def test_a_cancelled_async_put_stops_and_stores_nothing(monkeypatch):
    """A caller that cancels an async put (here asyncio.wait_for's timeout, its owner stopped
    mid-write) may reuse its buffer at once: the put stops and is revoked instead of going on
    when the owner comes back and storing whatever the buffer holds then."""
    import signal

    from conftest import running_cluster, stop_process

    monkeypatch.setenv("MOONCAKE_SHM", "0")
    with running_cluster(owners=1, size="256MiB") as c:
        s = MooncakeDistributedStoreAsync()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", c.master) == 0
        try:
            owner = c.owners[0].p.pid
            value = os.urandom(32 << 20)

            async def main():
                stop_process(owner)
                try:
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(s.async_put("cancelled/k", value), 0.5)
                finally:
                    os.kill(owner, signal.SIGCONT)

            asyncio.run(main())
            assert s.is_exist("cancelled/k") == 0
            # The cancelled put's revoke lands in the background: until then a put of the key is
            # told it exists (0) and stores nothing.
            deadline = time.monotonic() + 10
            while True:
                assert s.put("cancelled/k", b"new") == 0
                if s.get("cancelled/k") == b"new" or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert s.get("cancelled/k") == b"new"
        finally:
            s.close()


def test_an_async_zero_copy_call_does_not_hold_the_event_loop_while_memory_is_registered(monkeypatch):
    """register_buffer waits for the transfers in flight (they pin the registry), and pins asked
    for meanwhile queue behind it. An async zero-copy call awaited then waits for the pin in its
    task, and the event loop runs on. Before, it waited on the loop's thread, so the loop stood
    still until the transfer in flight ended (here, until a stopped owner resumed, 3 s)."""
    import ctypes
    import threading
    import time

    from conftest import running_cluster, stop_process

    monkeypatch.setenv("MOONCAKE_SHM", "0")
    n = 64 << 10
    with running_cluster(owners=1) as c:
        s = MooncakeDistributedStoreAsync()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", c.master) == 0
        owner = c.owners[0].p.pid
        try:
            value = os.urandom(n)
            assert s.put("pin/k", value) == 0
            bufs = [ctypes.create_string_buffer(n) for _ in range(3)]
            ptrs = [ctypes.addressof(b) for b in bufs]
            assert s.register_buffer(ptrs[0], n) == 0 and s.register_buffer(ptrs[2], n) == 0
            stop_process(owner)
            # A read from the stopped owner, the registry pinned; then a registration waiting
            # for it.
            stuck = threading.Thread(target=lambda: s.batch_get_into(["pin/k"], [ptrs[0]], [n]))
            stuck.start()
            time.sleep(0.5)
            registering = threading.Thread(target=lambda: s.register_buffer(ptrs[1], n))
            registering.start()
            time.sleep(0.5)
            assert stuck.is_alive() and registering.is_alive(), "nothing holds the registry"
            resume = threading.Timer(3, lambda: os.kill(owner, signal.SIGCONT))
            resume.start()

            async def main():
                wakes = []

                async def ticker():
                    for _ in range(50):
                        wakes.append(time.monotonic())
                        await asyncio.sleep(0.05)

                ticking = asyncio.create_task(ticker())
                await asyncio.sleep(0.1)
                got = await s.async_batch_get_into(["pin/k"], [ptrs[2]], [n])
                await ticking
                return got, max(b - a for a, b in zip(wakes, wakes[1:]))

            got, gap = asyncio.run(main())
            resume.join()
            stuck.join(30)
            registering.join(30)
            assert gap < 1, f"the event loop stood still for {gap:.2f} s"
            assert got == [n] and bufs[2].raw == value
        finally:
            os.kill(owner, signal.SIGCONT)
            s.close()
