"""The ground of the sharded state dict data model: the type aliases, the replica rule and the
interface every sharded leaf implements (:mod:`distckpt.mapping` re-exports the public names)."""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import Any, Dict, Tuple, Union

from distckpt.core import CheckpointingException

ReplicaId = Union[int, Tuple[int, ...]]
ShardedStateDict = Dict[str, Any]
StateDict = Dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Whether ``replica_id`` denotes the replica that writes the data (all-zero id)."""
    if isinstance(replica_id, (tuple, list)):
        return all(r == 0 for r in replica_id)
    # Also accepts numpy/torch integer scalars, which are not `int` instances.
    return replica_id == 0


def to_int(value: Any, what: str, owner: str) -> int:
    """``value`` as a plain int (numpy and torch integer scalars too); bool, float and anything
    else raise a CheckpointingException naming ``owner`` and ``what``."""
    if type(value) is int:  # the common case, first and cheapest
        return value
    # bool and float are rejected on purpose: a shape of 2.0, NaN or True is a caller bug.
    if not isinstance(value, (bool, float)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise CheckpointingException(
        f"{owner}: {what} must be an integer, got {value!r} ({type(value).__name__})"
    )


def to_int_tuple(values: Any, what: str, owner: str) -> Tuple[int, ...]:
    """``values`` as a tuple of plain ints (see :func:`to_int`)."""
    if type(values) is tuple and all(type(v) is int for v in values):
        return values  # already normalised (every validation after the first)
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        items = tuple(values)
    except TypeError:
        raise CheckpointingException(
            f"{owner}: {what} must be a sequence of integers, got {values!r}"
        ) from None
    return tuple(to_int(v, f"every entry of {what} {items}", owner) for v in items)


class ShardedBase(ABC):
    """Common interface of the leaves that carry sharded (per-rank) data.

    Attributes:
        key: global name of the sharded entity; equal on all ranks holding a part of it.
        data: the local part (tensor, object, ...), or None when only metadata is held.
        replica_id: which replica of the same piece this is; only main replicas are saved.
    """

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """Return a copy holding the same metadata and ``data=None``."""
