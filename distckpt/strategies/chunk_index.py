"""Finding the stored chunks a box meets, in time that grows with what it meets, not the key's grid.

A load asks, for every requested piece, which stored chunks of its key overlap it. Scanning
every chunk of the key per piece costs ``pieces x chunks``: for a Mixture-of-Experts model whose
expert weights are one key of ``layers x experts`` chunks (Megatron-Core's ``SequentialMLP``
prepends a layer and an expert axis), a rank asking for its share makes
``(layers x experts)^2 / EP`` comparisons -- 90 million per expert weight at DeepSeek-V3's size.

:class:`ChunkIndex` answers the same question in ``O(log n + k)`` per box (``k`` the chunks it
meets), built once per key in ``O(n log n)``:

- **a grid** (the common case: any TP/EP/PP split, prepended axes, uneven splits included): the
  chunks are cells of a rectilinear grid -- along each axis, every chunk starts at one of the
  axis's boundaries and ends at the next one. A box's cells are found by bisecting each axis's
  boundaries; the cells map to chunks through a dictionary.
- **anything else** (chunks of several sizes that do not line up, e.g. a checkpoint assembled by
  surgery or damaged metadata): along the axis that separates the chunks best, the chunks are
  grouped by their extent (powers of two) and each group sorted by start; a box takes, from each
  group, the chunks whose start lies within the group's longest extent before its own range (two
  bisections per group), then tests those.

The index never decides what is *correct*: a box the chunks do not cover exactly once is still
caught by the coverage check of the caller (:func:`distckpt.strategies.tiling.region_problem`).
``examined`` counts the chunks each query tested, so tests can pin that a request touches only
what it overlaps.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from distckpt.strategies.resharding import Shape, intersect

__all__ = ["ChunkIndex"]

# A grid query visits every cell of the box's cell range; where the chunks are sparse (a partial
# index holding only what a load asked for), a box may span many empty cells. Past this many
# cells per chunk present, the query takes the sorted path instead.
_SPARSE_CELLS = 4


class ChunkIndex:
    """The stored chunks of one key (``offsets[i]``, ``sizes[i]``), indexed for box queries.

    ``overlapping(off, size)`` yields ``(i, lo, shape)`` for each chunk ``i`` whose box meets the
    box ``(off, size)``, with the intersection; ``exact(off, size)`` is the chunk that is exactly
    that box, or None. Zero-size chunks meet nothing.
    """

    def __init__(self, offsets: Sequence[Shape], sizes: Sequence[Shape]):
        self.offsets = offsets
        self.sizes = sizes
        self.examined = 0  # chunks tested by queries (for complexity tests)
        self.ndim = len(offsets[0]) if len(offsets) else 0
        self._grid = self._build_grid()
        # A grid's chunks by their box (a request in the saved layout: one lookup).
        self._exact: Dict[Tuple[Shape, Shape], int] = (
            {(o, s): i for i, (o, s) in enumerate(zip(offsets, sizes))} if self._grid is not None else {}
        )
        self._sorted: Optional[Tuple[int, List[Tuple[int, List[int], List[int]]]]] = None

    # ------------------------------------------------------------------ building

    def _build_grid(self) -> Optional[Tuple[List[List[int]], Dict[Shape, int]]]:
        """Per axis the sorted boundaries, and each cell's chunk; None unless every chunk is
        one cell of the grid those boundaries draw (and no two chunks are the same cell)."""
        if not self.ndim:
            return None
        bounds: List[List[int]] = []
        for axis in range(self.ndim):
            edges = set()
            for o, s in zip(self.offsets, self.sizes):
                if s[axis] <= 0:
                    return None
                edges.add(o[axis])
                edges.add(o[axis] + s[axis])
            bounds.append(sorted(edges))
        where = [{b: j for j, b in enumerate(axis)} for axis in bounds]
        cells: Dict[Shape, int] = {}
        for i, (o, s) in enumerate(zip(self.offsets, self.sizes)):
            cell = []
            for axis in range(self.ndim):
                j = where[axis][o[axis]]
                if bounds[axis][j + 1] != o[axis] + s[axis]:
                    return None  # spans several cells along this axis
                cell.append(j)
            if cells.setdefault(tuple(cell), i) != i:
                return None  # two chunks on one cell: overlapping claims, left to the scan path
        return bounds, cells

    def _build_sorted(self) -> Tuple[int, List[Tuple[int, List[int], List[int]]]]:
        """The axis with the most distinct starts, and the chunks grouped by their extent along
        it (powers of two), each group sorted by start: ``(longest extent, starts, chunk ids)``.
        A long chunk thus widens the search of its own group only."""
        axis = max(range(self.ndim), key=lambda a: len({o[a] for o in self.offsets}))
        groups: Dict[int, List[int]] = {}
        for i, s in enumerate(self.sizes):
            groups.setdefault(s[axis].bit_length(), []).append(i)
        classes = []
        for ids in groups.values():
            ids.sort(key=lambda i: self.offsets[i][axis])
            longest = max(self.sizes[i][axis] for i in ids)
            classes.append((longest, [self.offsets[i][axis] for i in ids], ids))
        return axis, classes

    # ------------------------------------------------------------------ queries

    def exact(self, off: Shape, size: Shape) -> Optional[int]:
        """The chunk whose box is exactly ``(off, size)`` and the only one meeting it, or None.
        Only a grid answers: its cells are disjoint, so no other chunk can claim part of the box
        (elsewhere a box must go through :meth:`overlapping`, which finds such claims)."""
        return self._exact.get((off, size))

    def overlapping(self, off: Shape, size: Shape) -> Iterator[Tuple[int, Shape, Shape]]:
        """Each chunk meeting the box ``(off, size)``: ``(chunk id, intersection offset,
        intersection size)``."""
        if any(s <= 0 for s in size):
            return
        candidates = self._grid_candidates(off, size) if self._grid is not None else None
        if candidates is None:
            candidates = self._sorted_candidates(off, size)
        for i in candidates:
            self.examined += 1
            inter = intersect(off, size, self.offsets[i], self.sizes[i])
            if inter is not None:
                yield i, inter[0], inter[1]

    def _grid_candidates(self, off: Shape, size: Shape) -> Optional[List[int]]:
        bounds, cells = self._grid
        ranges = []
        count = 1
        for axis, (a, n) in enumerate(zip(off, size)):
            edges = bounds[axis]
            first = max(0, bisect.bisect_right(edges, a) - 1)
            end = min(len(edges) - 1, bisect.bisect_left(edges, a + n))
            if end <= first:
                return []
            ranges.append(range(first, end))
            count *= end - first
        if count == 1:
            i = cells.get(tuple(r.start for r in ranges))
            return [] if i is None else [i]
        if count > _SPARSE_CELLS * len(cells) + 64:
            return None
        return [i for i in map(cells.get, itertools.product(*ranges)) if i is not None]

    def _sorted_candidates(self, off: Shape, size: Shape) -> List[int]:
        if not self.ndim:
            return list(range(len(self.offsets)))
        if self._sorted is None:
            self._sorted = self._build_sorted()
        axis, classes = self._sorted
        lo, hi = off[axis], off[axis] + size[axis]
        out: List[int] = []
        for longest, starts, ids in classes:
            out += ids[bisect.bisect_right(starts, lo - longest) : bisect.bisect_left(starts, hi)]
        return out
