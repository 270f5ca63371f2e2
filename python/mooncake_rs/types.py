"""Mooncake's enums and plain classes of `mooncake.store`, with its names and numeric values.

These carry data only; the store's methods take and return them.
"""

import enum


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class ObjectDataType(enum.IntEnum):
    """What an object holds (a hint for placement and metrics; `ReplicateConfig.data_type`)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class Descriptor:
    """Where an allocated buffer lies (Mooncake's `AllocatedBuffer::Descriptor`)."""

    def __init__(self, size=0, buffer_address=0, transport_endpoint=""):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self):
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class QueryTaskResponse:
    """A copy or move task's state, as `query_task` answers it."""

    def __init__(self, id=(0, 0), type=TaskType.REPLICA_COPY, status=TaskStatus.PENDING,
                 created_at_ms_epoch=0, last_updated_at_ms_epoch=0, assigned_client=(0, 0), message=""):
        self.id = tuple(id)
        self.type = TaskType(type)
        self.status = TaskStatus(status)
        self.created_at_ms_epoch = created_at_ms_epoch
        self.last_updated_at_ms_epoch = last_updated_at_ms_epoch
        self.assigned_client = tuple(assigned_client)
        self.message = message

    def __repr__(self):
        return (f"QueryTaskResponse(id={self.id}, type={int(self.type)}, status={int(self.status)}, "
                f"created_at={self.created_at_ms_epoch}, last_updated_at={self.last_updated_at_ms_epoch}, "
                f"assigned_client={self.assigned_client}, message={self.message!r})")


_KINDS = ("dp", "tp", "ep", "pp")


class ParallelAxis:
    """One axis of a tensor's parallel layout: kind "tp", "dp", "ep" or "pp", this rank of `size`,
    and the dimension a TP shard splits (`split_dim`), the expert (`expert_id`, EP) or the stage
    (`stage_id`, PP)."""

    def __init__(self, kind="tp", rank=0, size=1, split_dim=None, expert_id=None, stage_id=None):
        self.kind = kind
        self.rank = rank
        self.size = size
        self.split_dim = split_dim
        self.expert_id = expert_id
        self.stage_id = stage_id

    def __repr__(self):
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, stage_id={self.stage_id})")


class TensorParallelism:
    """A tensor's parallel layout: its axes (`ParallelAxis`)."""

    def __init__(self, axes=None):
        self.axes = list(axes or [])

    def __repr__(self):
        return f"TensorParallelism(axes={self.axes})"


class ReadTarget:
    """What a parallel read returns: the object "as_stored", this rank's "shard" of
    `parallelism`, or the "full" tensor reassembled."""

    _MODES = ("as_stored", "shard", "full")

    def __init__(self, mode="as_stored", parallelism=None):
        self.mode = mode
        self.parallelism = parallelism

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        m = str(value).lower()
        if m not in self._MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m

    def __repr__(self):
        return f"ReadTarget(mode={self.mode!r}, parallelism={self.parallelism})"


def check_axes(parallelism):
    """The axes of a TensorParallelism-like object, validated as Mooncake does; ValueError names
    what is wrong."""
    axes = list(getattr(parallelism, "axes", None) or [])
    if not axes:
        raise ValueError("a parallelism needs at least one axis")
    seen = set()
    for a in axes:
        kind = str(a.kind).lower()
        if kind not in _KINDS:
            raise ValueError(f"unknown parallel axis kind {a.kind!r}: expected one of {_KINDS}")
        if kind in seen:
            raise ValueError(f"axis kind {kind!r} appears twice")
        seen.add(kind)
        if not (isinstance(a.size, int) and a.size >= 1 and 0 <= a.rank < a.size):
            raise ValueError(f"{kind} axis: rank {a.rank} is not in [0, {a.size})")
        if kind == "tp" and a.split_dim is None:
            raise ValueError("a tp axis needs split_dim")
        if kind != "tp" and a.split_dim is not None:
            raise ValueError(f"a {kind} axis takes no split_dim")
        if kind == "ep" and a.expert_id is None:
            raise ValueError("an ep axis needs expert_id")
        if kind == "pp" and a.stage_id is None:
            raise ValueError("a pp axis needs stage_id")
    return sorted(axes, key=lambda a: _KINDS.index(str(a.kind).lower()))
