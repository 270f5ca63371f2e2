"""The store a side-by-side bench script talks to, through Mooncake's Python API: this project's
(`mooncake_rs`) or Mooncake's (its PyPI package), set up as a requester-only client over TCP."""

import sys


def open_store(which, master, metadata, asynchronous=False):
    """A set-up `MooncakeDistributedStore` (or its Async form) of `which` ("ours" or "mooncake");
    exits with the setup code when setup fails."""
    if which == "ours":
        from mooncake_rs import store as mod
    elif asynchronous:
        from mooncake import async_store as mod
    else:
        from mooncake import store as mod
    cls = mod.MooncakeDistributedStoreAsync if asynchronous else mod.MooncakeDistributedStore
    store = cls()
    rc = store.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", master)
    if rc != 0:
        sys.exit(f"{which}: setup failed with {rc}")
    return store
