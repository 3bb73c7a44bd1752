"""The global integrity check, on one rank over every rank's :class:`ShardTable`.

For every key, all ranks agree on global shape and dtype, and the main replicas (replica_id == 0)
cover every element of the global tensor exactly once. Flattened ranges must tile each chunk of
the regular grid exactly once. ShardedObjects must fill their grid exactly once. Its verdict is
broadcast, so every rank raises the same error (re-exported by :mod:`distckpt.validation`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Dict, Iterable, List, Sequence, Set, Tuple

import numpy as np

from distckpt.core import CheckpointingException
from distckpt.shard_tables import ShardTable

# --------------------------------------------------------------------------- global integrity


# Keys of at most this many rows are checked once per pattern (hashing their rows costs less than
# the per-key overhead of checking them); larger ones are checked vectorized, each on its own.
_PATTERN_ROWS = 1024


def validate_global_integrity(tables: Sequence[ShardTable]) -> None:
    """Check that the gathered shards of all ranks describe a consistent, complete checkpoint.

    ``tables`` are every rank's :class:`ShardTable` in rank order. Ranks with the same layout
    (data-parallel replicas) are stacked into one array; each key's rows are cut from those and
    checked vectorized. A failing check is re-run on the key's rows in rank order, so the error
    names the same first offender whatever the grouping.

    Raises:
        CheckpointingException: naming the key, the ranks involved and the problem.
    """
    if not tables:
        return
    ndim = max(t.ndim for t in tables)
    props: List[Tuple] = []  # global entry id -> (key, is_object, dtype, shape, flat)
    ids: Dict[Tuple, int] = {}
    # A layout -> (rows per rank, (entry id, first row, end row) of each entry, its ranks' tables).
    groups: Dict[object, Tuple[int, List[Tuple[int, int, int]], List[ShardTable]]] = {}
    for t in tables:
        group = groups.get(t.layout)
        if group is None:
            entry_spans, start = [], 0
            for e in t.entries:
                gid = ids.get(e[:5])
                if gid is None:
                    gid = ids[e[:5]] = len(props)
                    props.append(e[:5])
                entry_spans.append((gid, start, start + e[5]))
                start += e[5]
            group = groups[t.layout or object()] = (start, entry_spans, [])
        if group[0] != len(t.rows):
            raise CheckpointingException(
                f"rank {t.rank}: malformed shard table ({len(t.rows)} rows for {group[0]} shards)"
            )
        group[2].append(t)
    # Each entry's rows: one array per entry, filled group by group (one copy of every row).
    total = [0] * len(props)
    for _, entry_spans, members in groups.values():
        for gid, lo, hi in entry_spans:
            total[gid] += len(members) * (hi - lo)
    width = 3 + 2 * ndim
    parts = [np.empty((n, width), np.int64) for n in total]
    part_ranks = [np.empty(n, np.int64) for n in total]
    filled = [0] * len(props)
    for _, entry_spans, members in groups.values():
        stacked = np.stack([t.rows for t in members])  # [ranks, rows, columns]
        own = members[0].ndim
        if own < ndim:
            r, n, pad = stacked.shape[0], stacked.shape[1], ndim - own
            stacked = np.concatenate(
                [
                    stacked[:, :, : 1 + own],
                    np.zeros((r, n, pad), np.int64),
                    stacked[:, :, 1 + own : 1 + 2 * own],
                    np.ones((r, n, pad), np.int64),
                    stacked[:, :, 1 + 2 * own :],
                ],
                axis=2,
            )
        ranks = np.array([t.rank for t in members], dtype=np.int64)
        repeats: Dict[int, np.ndarray] = {}
        for gid, lo, hi in entry_spans:
            a, b = filled[gid], filled[gid] + len(members) * (hi - lo)
            parts[gid][a:b].reshape(len(members), hi - lo, width)[...] = stacked[:, lo:hi]
            rep = repeats.get(hi - lo)
            if rep is None:
                rep = repeats[hi - lo] = np.repeat(ranks, hi - lo)
            part_ranks[gid][a:b] = rep
            filled[gid] = b
        del stacked
    by_key: Dict[str, List[int]] = {}
    for gid, p in enumerate(props):
        by_key.setdefault(p[0], []).append(gid)
    # The layers of a model repeat a few sharding patterns: a key whose rows and properties (all
    # but its name) equal those of a key that passed, passes too (the ranks that hold the rows
    # only name offenders in the errors).
    passed: Set[bytes] = set()
    heads: Dict[Tuple, bytes] = {}
    for key, gids in by_key.items():
        if len(gids) > 1:
            _diagnose_disagreement(key, [(props[g], sorted(set(part_ranks[g].tolist()))) for g in gids])
        g = gids[0]
        part, part_rank = parts[g], part_ranks[g]
        parts[g] = part_ranks[g] = None
        pattern = None
        if len(part) <= _PATTERN_ROWS:
            shape_key = (props[g][1:], part.shape)
            head = heads.get(shape_key)
            if head is None:
                head = heads[shape_key] = repr(shape_key).encode()
            digest = hashlib.blake2b(head, digest_size=16)
            digest.update(part)
            pattern = digest.digest()
            if pattern in passed:
                continue
        try:
            _check_rows(key, props[g], ndim, part, part_rank)
        except CheckpointingException:
            if (np.diff(part_rank) >= 0).all():
                raise
            order = np.argsort(part_rank, kind="stable")
            _check_rows(key, props[g], ndim, part[order], part_rank[order])
            raise
        if pattern is not None:
            passed.add(pattern)


def _check_rows(key: str, props: Tuple, ndim: int, part: np.ndarray, part_rank: np.ndarray) -> None:
    _, is_object, _, global_shape, flat = props
    main = part[:, 0] != 0
    if not main.all():
        part, part_rank = part[main], part_rank[main]
    n = len(global_shape)
    offs = part[:, 1 : 1 + n]
    sizes = part[:, 1 + ndim : 1 + ndim + n]
    if is_object:
        _check_object_grid(key, global_shape, offs, part_rank)
    elif flat:
        _check_flat_tiling(key, global_shape, offs, sizes, part[:, 1 + 2 * ndim :], part_rank)
    else:
        check_exact_cover(key, global_shape, offs, sizes, part_rank)


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(set(ranks)))


def _diagnose_disagreement(key: str, entries: List[Tuple[Tuple, List[int]]]) -> None:
    """``entries``: ``((key, is_object, dtype, global_shape, flattened), ranks)`` in the order
    first met; raises on the first property the ranks disagree on."""

    def ranks_by(i: int) -> Dict:
        out: Dict = {}
        for p, rs in entries:
            out.setdefault(p[i], []).extend(rs)
        return out

    kinds = ranks_by(1)
    if len(kinds) > 1:
        raise CheckpointingException(
            f"key {key!r} is a ShardedTensor on rank(s) {_ranks(kinds.get(False, []))} and a ShardedObject "
            f"on rank(s) {_ranks(kinds.get(True, []))}"
        )
    shapes = ranks_by(3)
    if len(shapes) > 1:
        desc = "; ".join(f"{list(shape)} on rank(s) {_ranks(rs)}" for shape, rs in shapes.items())
        raise CheckpointingException(f"key {key!r}: ranks disagree on the global shape: {desc}")
    dtypes = ranks_by(2)
    if len(dtypes) > 1:
        desc = "; ".join(f"{d} on rank(s) {_ranks(rs)}" for d, rs in dtypes.items())
        raise CheckpointingException(f"key {key!r}: ranks disagree on the dtype: {desc}")
    flat = ranks_by(4)
    raise CheckpointingException(
        f"key {key!r}: flattened on rank(s) {_ranks(flat.get(True, []))} but not on the others"
    )


def _check_object_grid(key: str, global_shape: Tuple[int, ...], offs: np.ndarray, ranks: np.ndarray) -> None:
    expected = math.prod(global_shape)
    if len(global_shape):
        inside = ((offs >= 0) & (offs < np.array(global_shape, dtype=np.int64))).all(axis=1)
        if not inside.all():
            i = int(np.argmin(inside))
            raise CheckpointingException(
                f"ShardedObject {key!r}: offset {offs[i].tolist()} of rank {int(ranks[i])} is outside the "
                f"grid of global shape {list(global_shape)}"
            )
        cells = np.ravel_multi_index(offs.T, global_shape)
    else:
        cells = np.zeros(len(offs), dtype=np.int64)
    _, first, inverse = np.unique(cells, return_index=True, return_inverse=True)
    dup = np.flatnonzero(first[inverse.reshape(-1)] != np.arange(len(cells)))
    if len(dup):
        i = int(dup[0])
        j = int(first[inverse.reshape(-1)[i]])
        raise CheckpointingException(
            f"ShardedObject {key!r}: offset {offs[i].tolist()} is written by more than one "
            f"main replica (ranks {int(ranks[j])} and {int(ranks[i])})"
        )
    if len(first) != expected:
        present = np.zeros(expected, dtype=bool)
        present[cells] = True
        missing = np.unravel_index(int(np.argmin(present)), global_shape) if global_shape else ()
        raise CheckpointingException(
            f"ShardedObject {key!r}: {expected - len(first)} of {expected} shards have no main "
            f"replica (e.g. offset {[int(m) for m in missing]}); "
            f"set replica_id=0 on exactly one rank per shard"
        )


def _sorted_by_chunk(offs: np.ndarray, sizes: np.ndarray, start: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The order of the flattened slices by (chunk, start) and each one's chunk number in it
    (chunks numbered in the order of their boxes)."""
    n = len(offs)
    if offs.shape[1] and (sizes == sizes[0]).all() and (sizes[0] > 0).all() and not (offs % sizes[0]).any():
        # A regular grid (what a distributed optimizer makes): the cell index is the chunk.
        cells = offs // sizes[0]
        cid = np.ravel_multi_index(cells.T, tuple(int(c) + 1 for c in cells.max(axis=0)))
        span = int(start.max()) + 1
        if int(start.min()) >= 0 and int(cid.max()) < (2**62) // span:
            order = np.argsort(cid * span + start, kind="stable")
        else:
            order = np.lexsort((start, cid))
        cid = cid[order]
    else:
        _, cid = np.unique(np.concatenate([offs, sizes], axis=1), axis=0, return_inverse=True)
        cid = cid.reshape(-1)
        order = np.lexsort((start, cid))
        cid = cid[order]
    first = np.ones(n, dtype=bool)
    first[1:] = cid[1:] != cid[:-1]
    return order, np.cumsum(first) - 1


def _check_flat_tiling(
    key: str,
    global_shape: Tuple[int, ...],
    offs: np.ndarray,
    sizes: np.ndarray,
    flat: np.ndarray,
    ranks: np.ndarray,
) -> None:
    """Flattened slices of each chunk must tile ``[0, numel)`` exactly once; the chunks (boxes
    of a regular grid) must then cover the tensor exactly once. Vectorized over all slices."""
    if not len(offs):
        check_exact_cover(key, global_shape, offs, sizes, ranks)
        return
    order, chunk = _sorted_by_chunk(offs, sizes, flat[:, 0])
    starts = np.flatnonzero(np.concatenate([[True], chunk[1:] != chunk[:-1]]))
    owner = np.minimum.reduceat(order, starts)  # each chunk's first shard, in the ranks' order
    numel = np.prod(sizes[owner], axis=1) if sizes.shape[1] else np.ones(len(owner), np.int64)
    keep = flat[order, 1] > flat[order, 0]
    idx, cid = order[keep], chunk[keep]
    start, stop = flat[idx, 0], flat[idx, 1]
    first = np.ones(len(cid), dtype=bool)
    first[1:] = cid[1:] != cid[:-1]
    last = np.ones(len(cid), dtype=bool)
    last[:-1] = cid[1:] != cid[:-1]
    expected_start = np.where(first, 0, np.concatenate([[0], stop[:-1]]))
    bad = np.flatnonzero(start != expected_start)
    if len(bad):
        i = bad[0]
        where = offs[idx[i]].tolist()
        if start[i] < expected_start[i]:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flattened ranges overlap in the chunk at offset "
                f"{where}: [{start[i]}, {stop[i]}) on rank {ranks[idx[i]]} starts before {expected_start[i]}"
            )
        raise CheckpointingException(
            f"ShardedTensor {key!r}: flattened range [{expected_start[i]}, {start[i]}) "
            f"of the chunk at offset "
            f"{where} is not written by any main replica"
        )
    ends = np.zeros(len(owner), dtype=np.int64)
    ends[cid[last]] = stop[last]
    short = np.flatnonzero(ends != numel)
    if len(short):
        c = short[0]
        raise CheckpointingException(
            f"ShardedTensor {key!r}: flattened range [{ends[c]}, {numel[c]}) of the chunk at offset "
            f"{offs[owner[c]].tolist()} is not written by any main replica"
        )
    check_exact_cover(key, global_shape, offs[owner], sizes[owner], ranks[owner])


def _small_exact_cover(global_shape: Sequence[int], offs: List[List[int]], sizes: List[List[int]]) -> bool:
    """True if a handful of boxes certainly cover ``global_shape`` exactly once: each inside
    the tensor, pairwise disjoint, volumes adding up. False means "check the long way" (which
    also describes the problem)."""
    total = 0
    for off, size in zip(offs, sizes):
        if any(o < 0 or o + s > g for o, s, g in zip(off, size, global_shape)):
            return False
        total += math.prod(size)
    boxes = list(zip(offs, sizes))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(ao < bo + bs and bo < ao + az for ao, az, bo, bs in zip(a_off, a_size, b_off, b_size)):
                return False
    return total == math.prod(global_shape)


# Above this many cells of the compressed grid the cover check falls back to volume + sweep.
_MAX_GRID_CELLS = 50_000_000


def check_exact_cover(
    key: str, global_shape: Sequence[int], offs: np.ndarray, sizes: np.ndarray, ranks: np.ndarray
) -> None:
    """Check that the boxes ``[offs[i], offs[i] + sizes[i])`` (written by ``ranks[i]``) cover
    ``global_shape`` exactly once.

    A regular grid is checked by counting the boxes per grid cell; anything else by coordinate
    compression: the cut points of all boxes along each axis split the tensor into a grid of
    cells, each of which is either fully inside or fully outside any box.
    """
    ndim = len(global_shape)
    if math.prod(global_shape) == 0:
        return
    if ndim == 0:
        if len(offs) != 1:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: a scalar needs exactly one main replica, got {len(offs)} "
                f"(ranks {sorted(ranks.tolist())})"
            )
        return
    nonempty = (sizes > 0).all(axis=1)
    if not nonempty.all():
        offs, sizes, ranks = offs[nonempty], sizes[nonempty], ranks[nonempty]
    if len(offs) <= 4 and _small_exact_cover(global_shape, offs.tolist(), sizes.tolist()):
        return  # a few boxes (most keys of most models): plain Python, no more numpy
    gshape = np.array(global_shape, dtype=np.int64)
    if (
        len(offs)
        and (sizes == sizes[0]).all()
        and not (offs % sizes[0]).any()
        and not (gshape % sizes[0]).any()
        and (offs >= 0).all()
        and (offs + sizes <= gshape).all()
    ):
        # Regular grid (the common case): exact cover <=> every grid cell held exactly once.
        cells = offs // sizes[0]
        grid_shape = gshape // sizes[0]
        flat = np.ravel_multi_index(cells.T, grid_shape)
        counts = np.bincount(flat, minlength=int(np.prod(grid_shape)))
        if counts.max() <= 1 and counts.min() == 1:
            return
    cuts = [
        np.unique(np.concatenate([[0, global_shape[a]], offs[:, a], offs[:, a] + sizes[:, a]]))
        for a in range(ndim)
    ]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > _MAX_GRID_CELLS:
        _check_cover_by_volume(key, global_shape, offs.tolist(), sizes.tolist(), ranks.tolist())
        return
    lo = np.stack([np.searchsorted(cuts[a], offs[:, a]) for a in range(ndim)], axis=1)
    hi = np.stack([np.searchsorted(cuts[a], offs[:, a] + sizes[:, a]) for a in range(ndim)], axis=1)
    counts = np.zeros(grid, dtype=np.int32)
    cell_slices = []
    for b in range(len(offs)):
        sl = tuple(slice(int(lo[b, a]), int(hi[b, a])) for a in range(ndim))
        cell_slices.append(sl)
        counts[sl] += 1
    if (counts > 1).any():
        cell = tuple(int(i) for i in np.argwhere(counts > 1)[0])
        owners = [
            int(r)
            for r, sl in zip(ranks, cell_slices)
            if all(s.start <= c < s.stop for s, c in zip(sl, cell))
        ]
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main replicas overlap at global region {_region(cuts, cell)} "
            f"(written by ranks {owners}); give all but one of them replica_id != 0"
        )
    if (counts == 0).any():
        cell = tuple(int(i) for i in np.argwhere(counts == 0)[0])
        raise CheckpointingException(
            f"ShardedTensor {key!r}: global region {_region(cuts, cell)} of shape "
            f"{list(global_shape)} is not covered by any main replica"
        )


def _region(cuts: List[np.ndarray], cell: Tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{int(c[i])}:{int(c[i + 1])}" for c, i in zip(cuts, cell)) + "]"


def _check_cover_by_volume(key, global_shape, offs, sizes, ranks) -> None:
    boxes = list(zip(offs, sizes, ranks))
    total = sum(math.prod(size) for _, size, _ in boxes)
    expected = math.prod(global_shape)
    order = sorted(boxes, key=lambda b: b[0][0])
    active: List[Tuple] = []
    for b in order:
        active = [a for a in active if a[0][0] + a[1][0] > b[0][0]]
        for a in active:
            if all(
                a[0][i] < b[0][i] + b[1][i] and b[0][i] < a[0][i] + a[1][i] for i in range(len(global_shape))
            ):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: main replicas of ranks {a[2]} and {b[2]} overlap "
                    f"(offsets {list(a[0])} and {list(b[0])})"
                )
        active.append(b)
    if total != expected:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main replicas cover {total} of {expected} elements"
        )
