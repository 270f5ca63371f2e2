"""The KV layout both sides agree on, and the bytes a prefill worker computes: a region per
worker holding `layers` x `blocks` blocks of `block_bytes`, layer-major. A block's bytes are a
function of (engine, tp rank, layer, block), so the decode side can check every byte it pulls."""

import ctypes
import hashlib


def block_bytes_of(engine_id, tp_rank, layer, block, size):
    tag = hashlib.sha256(f"{engine_id}/{tp_rank}/{layer}/{block}".encode()).digest()
    return (tag * (size // len(tag) + 1))[:size]


def offset(layer, block, blocks, size):
    return (layer * blocks + block) * size


class Region:
    """A KV region of this process, registered with `engine`."""

    def __init__(self, engine, layers, blocks, size):
        self.layers, self.blocks, self.size = layers, blocks, size
        self.nbytes = layers * blocks * size
        self.buf = ctypes.create_string_buffer(self.nbytes)
        self.base = ctypes.addressof(self.buf)
        rc = engine.register_memory(self.base, self.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory failed: {rc}")

    def fill(self, engine_id, tp_rank):
        for layer in range(self.layers):
            for block in range(self.blocks):
                data = block_bytes_of(engine_id, tp_rank, layer, block, self.size)
                ctypes.memmove(self.base + offset(layer, block, self.blocks, self.size), data, self.size)

    def block(self, layer, slot):
        start = offset(layer, slot, self.blocks, self.size)
        return self.buf.raw[start:start + self.size]
