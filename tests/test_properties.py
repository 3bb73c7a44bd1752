"""Property-based tests: any valid layout saved under any world size loads bit-exactly under any
other; any layout with an overlap or a gap is refused on every rank.

Hypothesis draws, in the test process, a few global tensors (1-3 small dimensions, mixed dtypes)
and for each a shard grid -- regular, uneven (cells may be empty) or the flattened slices of a
regular grid (a distributed optimizer's view) -- spread over 1-4 ranks with random replicas. The
layout is a plain list of :class:`tests.support.layouts.Piece` per rank, sent to the rank functions. The
round trip draws the backend too (``torch_dist`` or ``zarr``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
from pathlib import Path
from typing import List, Tuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import check_is_distributed_checkpoint
from distckpt import dist as ddist
from tests.support import layouts
from tests.support.harness import expect_all_ranks_raise, run_ranks

BACKENDS = ("torch_dist", "zarr")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
KINDS = ("regular", "uneven", "flat")
Layout = List[List[layouts.Piece]]  # index = rank

PROPERTY_SETTINGS = settings(derandomize=True, deadline=None, database=None, print_blob=False)


# --------------------------------------------------------------------------- layout generation


@st.composite
def tensor_specs(draw) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    count = draw(st.integers(1, 2))
    specs = []
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        specs.append((f"t{i}", shape, draw(st.sampled_from(DTYPES))))
    return specs


def _regular_cuts(draw, n: int) -> List[Tuple[int, int]]:
    parts = draw(st.sampled_from([p for p in range(1, min(n, 3) + 1) if n % p == 0]))
    return [(i * (n // parts), n // parts) for i in range(parts)]


def _uneven_cuts(draw, n: int) -> List[Tuple[int, int]]:
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))  # repeats give empty cells
    bounds = [0] + cuts + [n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _cells(draw, key: str, shape, dtype, kind: str) -> List[dict]:
    """The pieces of one tensor that together cover it exactly once (before replication)."""
    cut = _uneven_cuts if kind == "uneven" else _regular_cuts
    per_axis = [cut(draw, n) for n in shape]
    cells = []
    for combo in itertools.product(*per_axis):
        offset = tuple(o for o, _ in combo)
        local = tuple(s for _, s in combo)
        base = dict(key=key, global_shape=shape, offset=offset, local_shape=local, dtype=dtype)
        if kind != "flat":
            cells.append(base)
            continue
        numel = math.prod(local)
        bounds = [0] + sorted(draw(st.lists(st.integers(0, numel), max_size=2))) + [numel]
        fragments = tuple(len(c) for c in per_axis)
        cells.extend(dict(base, flat=(a, b), fragments=fragments) for a, b in zip(bounds, bounds[1:]))
    return cells


@st.composite
def layout_for(draw, specs) -> Layout:
    """Every piece of every tensor gets one main replica on a random rank and replicas (ids 1..)
    on a random subset of the others."""
    world = draw(st.integers(1, 4))
    ranks: Layout = [[] for _ in range(world)]
    for key, shape, dtype in specs:
        kind = draw(st.sampled_from(KINDS))
        for index, cell in enumerate(_cells(draw, key, shape, dtype, kind)):
            main = draw(st.integers(0, world - 1))
            others = [r for r in range(world) if r != main]
            holders = [main] + draw(st.lists(st.sampled_from(others), unique=True)) if others else [main]
            for replica, rank in enumerate(holders):
                ranks[rank].append(layouts.Piece(name=f"{key}.{index}", replica=replica, **cell))
    return ranks


@st.composite
def save_and_load_layouts(draw) -> Tuple[str, Layout, Layout]:
    specs = draw(tensor_specs())
    return draw(st.sampled_from(BACKENDS)), draw(layout_for(specs)), draw(layout_for(specs))


def _nonempty(piece: layouts.Piece) -> bool:
    if piece.flat is not None:
        return piece.flat[1] > piece.flat[0]
    return math.prod(piece.local_shape) > 0


@st.composite
def broken_layouts(draw) -> Tuple[Layout, str]:
    """A valid layout with one main replica duplicated (overlap) or demoted (gap)."""
    layout = draw(layout_for(draw(tensor_specs())))
    mains = [
        (r, i)
        for r, pieces in enumerate(layout)
        for i, p in enumerate(pieces)
        if p.replica == 0 and _nonempty(p)
    ]
    rank, index = draw(st.sampled_from(mains))
    piece = layout[rank][index]
    problem = draw(st.sampled_from(["overlap", "gap"]))
    if problem == "overlap":
        other = draw(st.integers(0, len(layout) - 1))
        layout[other].append(dataclasses.replace(piece, name=piece.name + ".dup"))
    else:
        layout[rank][index] = dataclasses.replace(piece, replica=len(layout) + 1)
    return layout, problem


# --------------------------------------------------------------------------- rank functions


def _save(ckpt: str, layout: Layout, backend: str = "torch_dist") -> None:
    pieces = layout[ddist.get_rank()]
    distckpt.save({p.name: p.sharded(with_data=True) for p in pieces}, ckpt, sharded_strategy=(backend, 1))


def _load(ckpt: str, layout: Layout) -> List[str]:
    pieces = layout[ddist.get_rank()]
    loaded = distckpt.load({p.name: p.sharded(with_data=False) for p in pieces}, ckpt)
    return [p.name for p in pieces if not layouts.bitwise_equal(loaded[p.name], p.expected())]


# --------------------------------------------------------------------------- properties


@settings(PROPERTY_SETTINGS, max_examples=14)
@given(save_and_load_layouts())
def test_any_layout_reloads_bit_exactly_under_any_other(case):
    backend, save_layout, load_layout = case
    with tempfile.TemporaryDirectory(prefix="distckpt-prop-") as ckpt:
        run_ranks(len(save_layout), _save, ckpt, save_layout, backend)
        assert check_is_distributed_checkpoint(ckpt)
        assert run_ranks(len(load_layout), _load, ckpt, load_layout) == [[]] * len(load_layout)


@settings(PROPERTY_SETTINGS, max_examples=8)
@given(broken_layouts())
def test_layouts_with_an_overlap_or_a_gap_are_refused_on_every_rank(broken):
    layout, problem = broken
    match = r"overlap" if problem == "overlap" else r"not covered|not written by any main replica"
    with tempfile.TemporaryDirectory(prefix="distckpt-prop-") as ckpt:
        expect_all_ranks_raise(len(layout), _save, ckpt, layout, match=rf"validation failed .*({match})")
        assert not check_is_distributed_checkpoint(ckpt)
        assert not any(p.suffix == ".distcp" for p in Path(ckpt).iterdir())
