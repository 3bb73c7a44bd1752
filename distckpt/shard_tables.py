"""Data-free shard descriptions: what each rank sends to rank 0 for the global integrity check
(:class:`ShardTable`), and the local re-check of each shard's own metadata (re-exported by
:mod:`distckpt.validation`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from distckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

# --------------------------------------------------------------------------- shard descriptions

# A shard's description: (key, is_object, dtype, global_shape, global_offset, local_shape, flat, main).
# ``local_shape`` has the full rank of the global tensor (prepended axes have size 1), so the shard
# is the box ``[global_offset, global_offset + local_shape)``; for a flattened range the box is the
# whole (un-flattened) chunk and ``flat`` is the ``(start, stop)`` slice of it, else None.
ShardDesc = Tuple[
    str,
    bool,
    Optional[str],
    Tuple[int, ...],
    Tuple[int, ...],
    Tuple[int, ...],
    Optional[Tuple[int, int]],
    bool,
]


@dataclass
class ShardTable:
    """One rank's shards, data-free and compact: what each rank sends for the global check.

    The properties that must agree across ranks are sent once per key, the boxes as one array:

    - ``entries``: one ``(key, is_object, dtype, global_shape, flattened, count)`` per distinct
      description on this rank, in the order first met (normally one per key);
    - ``rows``: int64 ``[n, 3 + 2 * ndim]``, the ``count`` rows of each entry in entry order:
      main (0/1), global offset, local shape, flat start, flat stop. ``ndim`` is the largest
      number of axes among this rank's keys; a key with fewer has its offset padded with 0 and
      its shape with 1 (``len(global_shape)`` says how many columns are real).

    Pickling it costs a few objects per key instead of a few per shard, and rank 0 validates
    every rank's rows with numpy (:func:`validate_global_integrity`). ``layout`` is a digest of
    ``entries``: ranks with the same entries (data-parallel replicas) are recognized by it
    without comparing the entries themselves.
    """

    rank: int
    entries: Tuple[Tuple[str, bool, Optional[str], Tuple[int, ...], bool, int], ...]
    rows: np.ndarray
    layout: bytes = b""

    @property
    def ndim(self) -> int:
        return (self.rows.shape[1] - 3) // 2

    @classmethod
    def build(cls, rank: int, shards: Iterable[ShardDesc]) -> ShardTable:
        groups: Dict[Tuple, List[Tuple]] = {}
        for key, is_object, dtype, global_shape, offset, local, flat, main in shards:
            props = (key, is_object, dtype, global_shape, flat is not None)
            group = groups.get(props)
            if group is None:
                group = groups[props] = []
            group.append((main, offset, local, flat))
        ndim = max((len(p[3]) for p in groups), default=0)
        rows: List[Tuple[int, ...]] = []
        for props, group in groups.items():
            pad = ndim - len(props[3])
            zeros, ones = (0,) * pad, (1,) * pad
            for main, offset, local, flat in group:
                rows.append((1 if main else 0, *offset, *zeros, *local, *ones, *(flat or (0, 0))))
        entries = tuple(props + (len(group),) for props, group in groups.items())
        return cls(
            rank,
            entries,
            np.array(rows, dtype=np.int64).reshape(len(rows), 3 + 2 * ndim),
            layout_digest(entries),
        )


def layout_digest(entries: Tuple) -> bytes:
    """A digest of a rank's per-key properties (plain tuples of str, int, bool, None, dtypes)."""
    return hashlib.blake2b(repr(entries).encode(), digest_size=16).digest()


def shard_desc(sh: ShardedBase) -> ShardDesc:
    if isinstance(sh, ShardedObject):
        ones = (1,) * len(sh.global_shape)
        return (
            sh.key,
            True,
            None,
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            ones,
            None,
            is_main_replica(sh.replica_id),
        )
    assert isinstance(sh, ShardedTensor)
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    flat = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
    return (
        sh.key,
        False,
        str(sh.dtype),
        tuple(sh.global_shape),
        tuple(sh.global_offset),
        full_local,
        flat,
        is_main_replica(sh.replica_id),
    )


def shard_table(shards: Iterable[ShardedBase], rank: int) -> ShardTable:
    """This rank's shard descriptions, as sent to rank 0 for the global check."""
    return ShardTable.build(rank, map(shard_desc, shards))


def validate_local_integrity(shards: Iterable[ShardedBase]) -> None:
    """Re-check each shard's own metadata (it may have been mutated since construction)."""
    for sh in shards:
        sh.validate_metadata_integrity()
