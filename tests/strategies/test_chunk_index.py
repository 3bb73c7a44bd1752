"""Finding the stored chunks a requested box meets: the answers of a scan, at the cost of what it meets.

A Mixture-of-Experts key holds ``layers x experts`` chunks, and a rank asks for its share one
expert at a time: a load that scanned the key per request would test ``requests x chunks``
pairs. These tests pin both halves: :class:`ChunkIndex` and the sidecar query return exactly
what a scan returns, and a load's planning and sidecar query test a number of chunks that grows
with the requests, not with the key's grid.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import CheckpointingException
from distckpt import dist as ddist
from distckpt.formats.index_read import IndexReader
from distckpt.strategies.chunk_index import ChunkIndex
from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy
from tests.support import layouts
from tests.support.harness import run_ranks


def _scan(offsets, sizes, off, size):
    """What a scan of every chunk finds: {chunk: (intersection offset, size)}."""
    out = {}
    for i, (o, s) in enumerate(zip(offsets, sizes)):
        lo = tuple(max(a, b) for a, b in zip(off, o))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(off, size, o, s))
        if all(h > lo_ for lo_, h in zip(lo, hi)):
            out[i] = (lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))
    return out


def _found(index, off, size):
    return {i: (lo, shape) for i, lo, shape in index.overlapping(off, size)}


def _grid(cuts):
    """The chunks of the rectilinear grid drawn by ``cuts`` (per axis, increasing cut points)."""
    cells = itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])
    offsets, sizes = [], []
    for cell in cells:
        offsets.append(tuple(a for a, _ in cell))
        sizes.append(tuple(b - a for a, b in cell))
    return offsets, sizes


_cuts = st.lists(st.integers(1, 6), min_size=1, max_size=5).map(
    lambda steps: list(itertools.accumulate([0] + steps))
)
_boxes = st.tuples(st.integers(-2, 30), st.integers(0, 12))


@settings(max_examples=200, deadline=None)
@given(st.lists(_cuts, min_size=1, max_size=3), st.data())
def test_a_grid_finds_exactly_what_a_scan_finds(cuts, data):
    offsets, sizes = _grid(cuts)
    index = ChunkIndex(offsets, sizes)
    for _ in range(5):
        box = [data.draw(_boxes) for _ in cuts]
        off, size = tuple(b[0] for b in box), tuple(b[1] for b in box)
        assert _found(index, off, size) == _scan(offsets, sizes, off, size)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_boxes, _boxes).filter(lambda b: b[0][0] >= 0 and b[1][0] >= 0), max_size=12),
    st.data(),
)
def test_any_other_layout_finds_exactly_what_a_scan_finds(chunks, data):
    # Chunks of any size and place, overlapping ones and empty ones included (damaged metadata).
    offsets = [(a[0], b[0]) for a, b in chunks]
    sizes = [(a[1], b[1]) for a, b in chunks]
    index = ChunkIndex(offsets, sizes)
    for _ in range(5):
        box = [data.draw(_boxes), data.draw(_boxes)]
        off, size = tuple(b[0] for b in box), tuple(b[1] for b in box)
        assert _found(index, off, size) == _scan(offsets, sizes, off, size)


def test_a_grid_query_tests_only_the_chunks_the_box_meets():
    offsets, sizes = _grid([list(range(0, 65)), list(range(0, 129, 2)), [0, 5, 16]])  # 64 x 64 x 2 chunks
    index = ChunkIndex(offsets, sizes)
    assert index.exact((7, 10, 5), (1, 2, 11)) is not None  # a chunk itself: found without a search
    assert index.examined == 0
    found = _found(index, (3, 7, 4), (2, 4, 3))  # meets 2 x 3 x 2 cells
    assert len(found) == 12 and index.examined == 12


def test_a_layout_that_is_no_grid_tests_the_chunks_near_the_box_not_all():
    # 1,000 chunks of two heights that do not line up into a grid (rows of 3 beside rows of 5).
    offsets, sizes = [], []
    for i in range(500):
        offsets += [(8 * i, 0), (8 * i + 3, 0)]
        sizes += [(3, 4), (5, 4)]
    offsets.append((0, 4))
    sizes.append((4000, 4))  # one long chunk beside them: no grid
    index = ChunkIndex(offsets, sizes)
    assert index.exact((8, 0), (3, 4)) is None  # no shortcut without a grid (claims may overlap)
    found = _found(index, (801, 0), (10, 4))
    assert found == _scan(offsets, sizes, (801, 0), (10, 4))
    assert index.examined < 40, index.examined


# --------------------------------------------------------------------------- a load's planning


LAYERS, EXPERTS = 16, 64  # 1,024 chunks per expert key, 512 requested per rank


def _save_experts(ckpt):
    sd, _ = layouts.build(
        "experts", ddist.get_rank(), ddist.get_world_size(), True, layers=LAYERS, count=EXPERTS
    )
    distckpt.save(sd, ckpt)


def _load_experts(ckpt, shift, etp, use_index):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, pieces = layouts.build(
        "experts", rank, world, False, layers=LAYERS, count=EXPERTS, shift=shift, etp=etp
    )
    strategy = TorchDistLoadShardedStrategy(use_index=use_index)
    out = distckpt.load(sd, ckpt, sharded_strategy=strategy)
    ok = all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())
    return ok, len(sd), strategy.chunks_examined, strategy.index_box_tests


@pytest.mark.parametrize(
    "shift, etp, use_index, per_request",
    [
        (0, 1, True, 1),  # the saved layout: each request is one stored chunk
        (1, 1, True, 1),  # expert parallelism re-assigned: every rank asks for the other's experts
        (0, 2, True, 1),  # expert-TP 2 on 2 ranks: each request is half a stored chunk
        (1, 1, False, 1),  # from .metadata (no sidecar): every chunk indexed, the same tests
    ],
)
def test_moe_load_tests_the_chunks_its_requests_meet_not_the_key_grid(
    tmp_path, shift, etp, use_index, per_request
):
    run_ranks(2, _save_experts, str(tmp_path))
    results = run_ranks(2, _load_experts, str(tmp_path), shift, etp, use_index)
    for ok, requests, examined, box_tests in results:
        assert ok
        # A scan would test every requested box against the key's 1,024 chunks: 512 x 1,024 per key.
        assert examined <= per_request * requests, (examined, requests)
        if use_index:
            # The sidecar walk: a bounded number of node entries and records per requested box
            # (the tree's fanout per level); a scan of the leaves would be 512 x 1,024 per key.
            assert 0 < box_tests <= 200 * requests, (box_tests, requests)


def test_moe_load_to_one_rank_finds_every_expert_separately(tmp_path):
    # What a conversion does: one process, no process group, every expert asked for on its own.
    run_ranks(2, _save_experts, str(tmp_path))
    sd, pieces = layouts.build("experts", 0, 1, False, layers=LAYERS, count=EXPERTS)
    strategy = TorchDistLoadShardedStrategy()
    out = distckpt.load(sd, tmp_path, sharded_strategy=strategy)
    assert all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())
    assert strategy.chunks_examined <= len(sd)
    assert strategy.index_box_tests <= 200 * len(sd)


def test_the_sidecar_query_returns_what_a_scan_of_metadata_returns(tmp_path):
    run_ranks(2, _save_experts, str(tmp_path))
    reader = IndexReader.open(tmp_path)
    key = "experts.fc1"
    boxes = [((layer, e, 0, 0), (1, 1, 4, 3)) for layer in range(0, LAYERS, 3) for e in range(1, EXPERTS, 5)]
    boxes.append(((2, 10, 1, 0), (3, 9, 2, 3)))  # a box across several chunks
    found = reader.query({key: boxes})[key]
    md = distckpt.load_tensors_metadata(tmp_path)[key]
    assert tuple(md.global_shape) == (LAYERS, EXPERTS, 4, 3)
    every = [((layer, e, 0, 0), (1, 1, 4, 3)) for layer in range(LAYERS) for e in range(EXPERTS)]
    offsets, sizes = [o for o, _ in every], [s for _, s in every]
    wanted = set()
    for off, size in boxes:
        wanted |= {(offsets[i], sizes[i]) for i in _scan(offsets, sizes, off, size)}
    assert sorted((r[0], r[1]) for r in found) == sorted(wanted)
    assert [r[0] for r in found] == sorted(r[0] for r in found)  # in offset order
    assert reader.box_tests < len(boxes) * 200


def test_overlapping_flattened_slices_are_refused_naming_the_metadata(tmp_path):
    from distckpt.strategies.torch_dist.stored import Stored, stored_key

    chunks = [
        Stored((0, 0), (1, 6), "__0_0.distcp", 0, 24),
        Stored((0, 4), (1, 6), "__0_0.distcp", 24, 24),  # claims elements 4 and 5 again
    ]
    key = stored_key("opt", torch.float32, (1, 12), chunks, (4, 3), "ckpt/.distckpt_index")
    with pytest.raises(
        CheckpointingException, match=r"ckpt/.distckpt_index: key 'opt'.*overlap at elements \[4, 6\)"
    ):
        key.flat_cell((0,))
