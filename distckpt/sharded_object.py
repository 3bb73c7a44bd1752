"""Sharded leaves that are not tensors: :class:`ShardedObject` (one piece of a grid of picklable
objects) and :class:`LocalNonpersistentObject` (re-exported by :mod:`distckpt.mapping`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from distckpt.core import CheckpointingException
from distckpt.sharded_base import ReplicaId, ShardedBase, to_int_tuple

_SHARD_SEP = "/shard_"


def _parse_dotted_ints(text: str) -> Optional[Tuple[int, ...]]:
    if text == "":
        return ()
    parts = text.split(".")
    if not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


@dataclass
class ShardedObject(ShardedBase):
    """One rank's piece of a grid of picklable objects (e.g. per-rank RNG states).

    The grid has shape ``global_shape``; this piece sits at index ``global_offset`` of it.
    Each piece is stored under its own :attr:`unique_key`.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that the offset is a valid index into a grid of ``global_shape``.

        Raises:
            CheckpointingException: naming the key and the offending values.
        """
        me = f"ShardedObject {self.key!r}"
        # Normalised here because the fields stay mutable after construction.
        shape = self.global_shape = to_int_tuple(self.global_shape, "global_shape", me)
        offset = self.global_offset = to_int_tuple(self.global_offset, "global_offset", me)
        if len(shape) != len(offset):
            raise CheckpointingException(
                f"{me}: global_shape {shape} and global_offset {offset} have different lengths"
            )
        if any(not 0 <= o < s for o, s in zip(offset, shape)):
            raise CheckpointingException(
                f"{me}: global_offset {offset} is outside the grid of global_shape {shape}"
            )

    @property
    def unique_key(self) -> str:
        """Name of this piece: ``{key}/shard_{offset}_{shape}`` with dot-separated numbers."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}{_SHARD_SEP}{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Rebuild a data-less ShardedObject from its :attr:`unique_key`.

        Raises:
            CheckpointingException: ``unique_key`` is not of the form ``{key}/shard_{o}_{s}``.
        """
        key, sep, shard = unique_key.rpartition(_SHARD_SEP)
        parts = shard.split("_")
        parsed = [_parse_dotted_ints(p) for p in parts] if len(parts) == 2 else [None]
        if not sep or any(p is None for p in parsed):
            raise CheckpointingException(
                f"Malformed ShardedObject unique key {unique_key!r}: expected "
                f"'<key>/shard_<offset>_<shape>' with dot-separated integers"
            )
        offset, shape = parsed
        return cls(key, None, shape, offset, replica_id)

    def without_data(self) -> ShardedObject:
        """Return a copy with the same metadata and ``data=None``."""
        return replace(self, data=None)

    def __str__(self) -> str:
        return f"ShardedObject(unique_key={self.unique_key!r}, replica_id={self.replica_id})"


class LocalNonpersistentObject:
    """A value that is never saved; loading puts the wrapped object back in its place."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """Return the wrapped object."""
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonpersistentObject({self.obj!r})"
