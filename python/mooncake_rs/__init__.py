"""mooncake-rs: Python client of the mooncake-rs KV object store.

Switch from Mooncake by changing one import::

    from mooncake_rs.store import MooncakeDistributedStore, ReplicateConfig
"""

from . import store
from ._native import __version__
from .store import MooncakeDistributedStore, MooncakeDistributedStoreAsync, ReplicateConfig

__all__ = ["MooncakeDistributedStore", "MooncakeDistributedStoreAsync", "ReplicateConfig", "store", "__version__"]
