"""Resharding geometry shared by the backends: boxes, flattened ranges, the N-D reformulation.

A stored item (a chunk of a tensor) and a requested piece are boxes: an offset and a size per
axis. A load intersects each requested box with the stored ones (:func:`intersect`) and turns
every intersection into a :class:`~distckpt.io.copies.CopyOp`, a strided window of the item's
row-major elements copied into a view of the destination (:func:`~distckpt.io.copies.copy_boxes`,
or :func:`~distckpt.io.copies.copy_from_mapping` out of a file mapping): the copies are how bytes
move, so they live in :mod:`distckpt.io.copies` and are re-exported here, their old home. A
flattened slice of a tensor (a distributed-optimizer shard) is cut into boxes by
:func:`flat_range_boxes`.

Flattened slices are stored in the N-D reformulated shape ``grid + (prod(chunk),)``: one row of
a flat last axis per chunk of the regular grid; :func:`nd_reformulated` gives a piece's place in
it, and the original global shape is recorded under :data:`ORIG_SHAPE` (what Megatron-Core 0.15
reads from ``Metadata.mcore_data``). Used by the ``torch_dist``, ``torch_dcp`` and zarr backends.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

from distckpt.io.copies import CopyOp, Shape, copy_boxes, copy_from_mapping  # noqa: F401  (their old home)
from distckpt.mapping import ShardedTensor

# The key of a flattened tensor's original global shape in ``Metadata.mcore_data[key]``.
ORIG_SHAPE = "nd_reformulated_orig_global_shape"


def intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> Optional[Tuple[Shape, Shape]]:
    """The box where boxes ``a`` and ``b`` overlap, or None when they do not."""
    off, size = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def rel_slices(off: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> Tuple[slice, ...]:
    """Slices of box ``(off, size)`` in an array whose element 0 sits at ``origin``."""
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(off, size, origin))


def flat_range_boxes(shape: Shape, start: int, stop: int, pos: int = 0):
    """Split elements ``[start, stop)`` of a row-major ``shape`` into boxes.

    Yields ``(offset, size, position)``: every box is contiguous in row-major order, and
    ``position`` is where its first element sits in the flat range (``pos`` + elements before it).
    """
    if start >= stop:
        return
    if not shape:
        yield (), (), pos
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        for off, size, p in flat_range_boxes(shape[1:], c0, c1, pos):
            yield (r0,) + off, (1,) + size, p
        return
    if c0:
        for off, size, p in flat_range_boxes(shape[1:], c0, inner, pos):
            yield (r0,) + off, (1,) + size, p
        pos += inner - c0
        r0 += 1
    if r1 > r0:
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), pos
        pos += (r1 - r0) * inner
    if c1:
        for off, size, p in flat_range_boxes(shape[1:], 0, c1, pos):
            yield (r1,) + off, (1,) + size, p


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    """The row-major flat position of ``index`` in an array of ``shape``."""
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


def nd_reformulated(sh: ShardedTensor) -> Tuple[Shape, Shape, Shape, Optional[Shape]]:
    """Where a piece is stored: ``(stored global shape, offset, size, original shape)``.

    A regular piece is stored as it is (its global shape, its offset, its local shape with the
    prepended axes; original shape None). A flattened slice ``[start, stop)`` of chunk ``c`` of
    the regular grid is the box ``c + (start,)`` of size ``(1, ..., 1, stop - start)`` of the N-D
    reformulated tensor ``grid + (prod(local_shape),)``; its original shape is the global one.
    """
    if sh.flattened_range is None:
        size = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        return tuple(sh.global_shape), tuple(sh.global_offset), size, None
    grid = tuple(sh.max_allowed_chunks())
    start, stop = sh.flattened_range.start, sh.flattened_range.stop
    offset = tuple(sh.local_chunk_offset_in_global()) + (start,)
    size = (1,) * len(sh.global_shape) + (stop - start,)
    return grid + (math.prod(sh.local_shape),), offset, size, tuple(sh.global_shape)
