"""`TransferEngine` with the API of Mooncake's point-to-point engine (vLLM's MooncakeConnector
and SGLang's disaggregation backend call it). Switch by changing one import::

    from mooncake_rs.engine import TransferEngine   # was: from mooncake.engine import TransferEngine

Calls return 0 or a negative code (Mooncake's: -1 a failed transfer or bad argument, -3 an
address not registered, -4 a region still in use, -7 overlapping regions), async batches an id.
Peers are named by session name ``host:rpc_port``. Unlike Mooncake's engine, every request is
checked on its target against the regions the target registered, and local buffers must lie in
regions this engine registered; ``write_bytes_to_buffer`` / ``read_bytes_from_buffer`` stay
inside registered memory too. Transfers go over TCP (several connections, pipelined) under the
deadline ``MC_TRANSFER_TIMEOUT`` (seconds, 30 by default).
"""

import enum

from ._native import TransferEngine as _NativeEngine

__all__ = ["TransferEngine", "TransferOpcode", "Read", "Write"]


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferEngine(_NativeEngine):
    TransferOpcode = TransferOpcode
