"""The jobs the zarr strategy gives its I/O engines (raw POSIX/object store, and tensorstore).

A :class:`ChunkWrite` always covers a whole chunk, so no engine ever reads, modifies and writes
a chunk another rank also writes; a :class:`ChunkRead` copies one region of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from distckpt.strategies.zarr.meta import ArrayMeta, Shape

# The block CRC32Cs of a chunk file (relative path -> block size and CRC32Cs, or None):
# Manifest.block_crcs.
BlockLookup = Callable[[str], Optional[Tuple[int, List[int]]]]


@dataclass
class ChunkWrite:
    """Write chunk ``index`` of an array from ``data``, which has the chunk's shape cut at the
    array's edge."""

    meta: ArrayMeta
    index: Shape
    data: torch.Tensor
    owned: bool = False  # ``data`` is a private CPU copy (not a view of the caller's tensors)


@dataclass
class ChunkRead:
    """Copy the region ``[lo, hi)`` (in the chunk's own coordinates) of chunk ``index`` into ``dest``."""

    meta: ArrayMeta
    index: Shape
    lo: Shape
    hi: Shape
    dest: torch.Tensor


def padded(meta: ArrayMeta, data: torch.Tensor) -> torch.Tensor:
    """``data`` as one contiguous full chunk; a chunk at the array's edge is padded with the fill
    value (0)."""
    if tuple(data.shape) == meta.chunks:
        return data if data.is_contiguous() else data.contiguous()
    buf = torch.zeros(meta.chunks, dtype=data.dtype)
    buf[tuple(slice(0, s) for s in data.shape)] = data
    return buf
