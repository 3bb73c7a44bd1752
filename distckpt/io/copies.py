"""Copies out of stored items: a :class:`CopyOp` says which elements of an item land where, and
:func:`copy_boxes` (from a tensor holding the item's elements) or :func:`copy_from_mapping` (from a
mapping of the file, touching only the pages the boxes cross) carries it out.

A load's plan (``strategies/torch_dist/loadplan.py``, the zarr and DCP readers) turns every
intersection of a requested box with a stored one (:mod:`distckpt.strategies.resharding`) into a
``CopyOp``; the readers of :mod:`distckpt.io` (:mod:`~distckpt.io.blockread`) and of each backend
execute them. Nothing here knows a strategy or a file format: a ``CopyOp`` is element offsets and
strides into the item's row-major elements.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import List, Tuple

import torch

from distckpt.core import CheckpointingException

__all__ = ["CopyOp", "Shape", "copy_boxes", "copy_from_mapping"]

Shape = Tuple[int, ...]


@dataclass
class CopyOp:
    """Copy elements of a stored item into ``dst`` (a view of shape ``size``): element ``i`` of
    the box is item element ``start + sum(i[d] * strides[d])`` (row-major item order)."""

    key: str
    start: int
    size: Shape
    strides: Shape
    dst: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def end(self) -> int:
        """One past the last item element the box touches."""
        if self.numel == 0:
            return self.start
        return self.start + sum((n - 1) * st for n, st in zip(self.size, self.strides)) + 1

    @property
    def is_range(self) -> bool:
        """True if the box is the plain element range ``[start, start + numel)``."""
        return self.end - self.start == self.numel


def copy_boxes(src: torch.Tensor, first: int, ops: List[CopyOp]) -> None:
    """Copy each op's box out of ``src``, the 1-D run of item elements starting at ``first``."""
    for op in ops:
        op.dst.copy_(src.as_strided(op.size, op.strides, src.storage_offset() + op.start - first))


def copy_from_mapping(
    fd: int, offset: int, count: int, dtype: torch.dtype, ops: List[CopyOp], first: int, what: str
) -> None:
    """Copy the ops' boxes out of ``count`` elements of the file at byte ``offset``, mapped
    rather than read: only the pages and cache lines the boxes touch are visited, so a box
    that takes every other run of a chunk does not pull the runs between them through memory."""
    nbytes = count * dtype.itemsize
    if os.fstat(fd).st_size < offset + nbytes:  # touching a page past EOF would be SIGBUS
        raise CheckpointingException(f"{what}: file is truncated (needs {offset + nbytes} bytes)")
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Private and writable only so torch accepts the buffer; nothing writes, so no page is copied.
    mapping = mmap.mmap(
        fd,
        nbytes + offset - aligned,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=aligned,
    )
    try:
        copy_boxes(torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset - aligned), first, ops)
    finally:
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
