"""Whether boxes tile a shape exactly once: the chunk coverage check of loads and ``verify``.

A tensor key's stored chunks must cover its global shape, and the chunks a load reads for a
requested piece must cover that piece, each element exactly once: a gap loads as whatever the
destination held (uninitialized memory for a tensor the load allocates), an overlap means the
metadata is damaged. Both are claims of untrusted metadata, so the check must stay cheap on
hostile inputs: one or a few boxes are compared directly, many go through a corner count in
time near-linear in their number (:func:`tiles`). Used by ``strategies/torch_dist/loadplan.py``
while it plans reads and by ``distckpt verify``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

# Boxes a load compares pairwise for overlaps; more go through the corner count.
_PAIRWISE = 8


def region_problem(
    origin: Sequence[int], shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]
) -> Optional[str]:
    """Why ``boxes`` (offset, size in the tensor's coordinates, each inside the region of
    ``shape`` elements at ``origin``) do not cover the region exactly once, or None if they do.
    A load calls it for every requested piece: the usual one box, or a few, cost microseconds."""
    got = 0
    inside = True
    for off, size in boxes:
        got += math.prod(size)
        for o, s, g, n in zip(off, size, origin, shape):
            if o < g or o + s > g + n:
                inside = False
    if got == math.prod(shape) and inside:
        if len(boxes) < 2:
            return None
        if len(boxes) <= _PAIRWISE and not any(
            _meet(boxes[i], boxes[j]) for i in range(len(boxes)) for j in range(i)
        ):
            return None
    rel = [(tuple(o - g for o, g in zip(off, origin)), tuple(size)) for off, size in boxes]
    return coverage_problem(shape, rel, origin)


def _meet(a: Tuple[Sequence[int], Sequence[int]], b: Tuple[Sequence[int], Sequence[int]]) -> bool:
    """Whether boxes ``a`` and ``b`` (offset, size) share an element."""
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        if ao + asz <= bo or bo + bsz <= ao:
            return False
    return True


def coverage_problem(
    shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]], origin: Sequence[int] = ()
) -> Optional[str]:
    """Why ``boxes`` (offset, size) do not tile ``shape`` exactly once, or None if they do.
    ``origin``: where ``shape`` begins in the coordinates the messages name chunks in (a
    region of a tensor; the boxes are given relative to it)."""

    def at(off: Sequence[int]) -> List[int]:
        return [o + g for o, g in zip(off, origin)] if origin else list(off)

    total = math.prod(shape)
    volume = 0
    for off, size in boxes:
        if len(off) != len(shape) or len(size) != len(shape):
            return f"chunk at {at(off)} has {len(off)} axes, the tensor {len(shape)}"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(off, size, shape)):
            return (
                f"chunk at {at(off)} of size {list(size)} lies outside the "
                f"{'region' if origin else 'global shape'} {list(shape)}"
            )
        volume += math.prod(size)
    nonempty = sorted((tuple(o), tuple(s)) for o, s in boxes if math.prod(s) > 0)
    if not shape:
        return (
            f"{len(nonempty)} chunks of a scalar"
            if len(nonempty) > 1
            else (f"chunks cover {volume} of {total} elements (missing data)" if volume < total else None)
        )
    tiled = True if total == 0 else tiles(shape, nonempty) if volume == total else False
    if tiled:
        return None
    if tiled is None:
        return f"{len(nonempty)} chunks in {len(shape)} axes are more than can be checked for overlaps"
    # They do not tile the shape: name two that overlap if a bounded search finds them.
    # Sweep along axis 0: only boxes whose axis-0 ranges intersect can overlap.
    active: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
    work = 0
    for off, size in nonempty:
        active = [b for b in active if b[0][0] + b[1][0] > off[0]]
        work += len(active)
        if work > _OVERLAP_SEARCH:
            break
        for o2, s2 in active:
            if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(off, size, o2, s2)):
                return f"chunks at {at(o2)} and {at(off)} overlap"
        active.append((off, size))
    if volume < total:
        return f"chunks cover {volume} of {total} elements (missing data)"
    return f"chunks hold {volume} elements for {total} but do not tile the shape: some overlap"


# Box comparisons spent looking for a pair of overlapping chunks to name (the check itself does
# not need them; a hostile layout could make the search quadratic).
_OVERLAP_SEARCH = 1 << 20
# Corner points the exact tiling check counts at most (boxes x 2^axes, about 24 bytes each per
# axis): 2M chunks of one key in 3 axes. More is reported as a layout it cannot check.
_MAX_CORNERS = 1 << 24


def tiles(shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[bool]:
    """Whether ``boxes`` (non-empty, inside ``shape``) cover every element of ``shape`` exactly
    once, in time linear in their number (times 2^axes); None if they have more corners than
    :data:`_MAX_CORNERS`.

    The indicator of a box ``[a, b)`` is the signed sum over its 2^d corners ``c`` of the
    orthant indicators ``[x >= c]``, the sign ``-1`` per coordinate taken from ``b``. These
    orthant functions are linearly independent, so the boxes' indicators add up to the shape's
    (each element covered exactly once) iff, at every corner point, the boxes' signs add up to
    the shape's own (+-1 at its corners, 0 elsewhere). Axes that every box spans whole are
    dropped first; they do not change the answer."""
    offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    ends = offs + np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    whole = np.array(shape, dtype=np.int64)
    keep = ~np.all((offs == 0) & (ends == whole), axis=0)
    offs, ends, whole = offs[:, keep], ends[:, keep], whole[keep]
    d = offs.shape[1]
    if d == 0:
        return len(boxes) == 1
    if len(boxes) << d > _MAX_CORNERS:
        return None
    corners, signs = [], []
    for mask in range(1 << d):
        upper = np.array([(mask >> i) & 1 for i in range(d)], dtype=bool)
        sign = -1 if bin(mask).count("1") % 2 else 1
        corners.append(np.where(upper, ends, offs))
        signs.append(np.full(len(offs), sign, dtype=np.int64))
        corners.append(np.where(upper, whole, 0)[None, :])  # the shape's corner, sign negated
        signs.append(np.array([-sign], dtype=np.int64))
    points = np.concatenate(corners)
    # One code per point: each axis ranked, the ranks combined (re-ranked before they overflow).
    code = np.zeros(len(points), dtype=np.int64)
    span = 1
    for axis in range(d):
        values, rank = np.unique(points[:, axis], return_inverse=True)
        if span * len(values) >= 1 << 62:
            span, code = _rerank(code)
        code = code * len(values) + rank.reshape(-1)
        span *= len(values)
    _, which = np.unique(code, return_inverse=True)
    return not np.any(np.bincount(which.reshape(-1), weights=np.concatenate(signs)))


def _rerank(code: np.ndarray) -> Tuple[int, np.ndarray]:
    values, rank = np.unique(code, return_inverse=True)
    return len(values), rank.reshape(-1).astype(np.int64)
