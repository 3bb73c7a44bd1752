"""PyTorch's own readers on distckpt's ``torch_dist`` output: ``dcp.load`` into plain tensors (no
process group, ``no_dist=True``), ``dcp.load`` into DTensors on 2 gloo ranks, and
``format_utils.dcp_to_torch_save``. No distckpt reader is involved in any comparison.

The checkpoint holds every kind of key distckpt writes: chunks on axis 0 and 1, uneven and empty
pieces, several chunks per rank, a prepend_axis_num stack, flattened distributed-optimizer
slices (stored in the N-D reformulated shape, one of them empty), ShardedObjects, bf16, fp16,
fp8, int, bool and 0-d tensors. docs/formats.md ("DCP compatibility") lists what PyTorch sees.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import distckpt
from distckpt import dist
from tests.support import layouts
from tests.support.layouts import bitwise_equal, full_tensor, rank_object

WORLD = 2


def _pieces(rank: int):
    pieces = (
        layouts.tp_dp(rank, WORLD, tp=2)
        + layouts.uneven(rank, WORLD)
        + layouts.multi(rank, WORLD)
        + layouts.stacked(rank, WORLD, pp=2, per_layer=True)
        + layouts.grid(rank, WORLD, 1, 2)
        + layouts.fp8(rank, WORLD)
        + layouts.flat_optimizer(rank, WORLD, tp=1, empty=True)
    )
    # An empty regular piece: rank 1 holds 0 of the 5 elements of "gap".
    pieces.append(layouts.Piece("gap", "gap", (5,), (5 * rank,), (5 - 5 * rank,)))
    # The same optimizer keys with TP=2 (a 2x1 grid of flattened chunks), under other keys.
    pieces += [
        dataclasses.replace(p, key=f"tp2.{p.key}", name=f"tp2.{p.name}")
        for p in layouts.flat_optimizer(rank, WORLD, tp=2)
    ]
    return pieces


def _save(root: str) -> None:
    rank = dist.get_rank()
    sd = {p.name: p.sharded() for p in _pieces(rank)}
    sd["obj"] = rank_object(rank, WORLD)
    distckpt.save(sd, root)


def _globals():
    """key -> (global shape, dtype, flattened chunk grid or None), from the pieces of every rank."""
    out = {}
    for rank in range(WORLD):
        for p in _pieces(rank):
            grid = None if p.flat is None else tuple(p.fragments)
            out[p.key] = (tuple(p.global_shape), p.dtype, grid)
    return out


def _reformulated(full: torch.Tensor, grid) -> torch.Tensor:
    """What DCP sees of a flattened key: chunk (i, j, ...) of the grid, flattened, at [i, j, ...]."""
    chunk = [s // g for s, g in zip(full.shape, grid)]
    out = torch.empty(tuple(grid) + (math.prod(chunk),), dtype=full.dtype)
    for idx in torch.cartesian_prod(*[torch.arange(g) for g in grid]).reshape(-1, len(grid)).tolist():
        box = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk))
        out[tuple(idx)] = full[box].reshape(-1)
    return out


def _expected(key: str):
    shape, dtype, grid = _globals()[key]
    full = full_tensor(key, shape, dtype)
    return full if grid is None else _reformulated(full, grid)


OBJECTS = {rank_object(c, WORLD).unique_key: rank_object(c, WORLD).data for c in range(WORLD)}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    from tests.support.harness import run_ranks

    root = tmp_path_factory.mktemp("ours")
    run_ranks(WORLD, _save, str(root), timeout=120)
    return root


def _same_object(loaded, expected) -> bool:
    # ShardedObjects are byte items holding torch.save([data]) (Megatron-Core's layout).
    if not (isinstance(loaded, list) and len(loaded) == 1):
        return False
    a, b = loaded[0], expected
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(b[k]) else a[k] == b[k] for k in b
    )


def test_dcp_load_without_a_process_group_reads_every_key(ours):
    import torch.distributed.checkpoint as dcp

    keys = _globals()
    sd = {k: torch.zeros_like(_expected(k)) for k in keys}
    sd.update({k: None for k in OBJECTS})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(ours), no_dist=True)
    for k in keys:
        assert bitwise_equal(sd[k], _expected(k)), k
    for k, v in OBJECTS.items():
        assert _same_object(sd[k], v), k


def test_dcp_to_torch_save_reads_every_key(ours, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(ours, tmp_path / "all.pt")
    out = torch.load(tmp_path / "all.pt", weights_only=False)
    assert sorted(out) == sorted(list(_globals()) + list(OBJECTS))
    for k in _globals():
        assert bitwise_equal(out[k], _expected(k)), k
    for k, v in OBJECTS.items():
        assert _same_object(out[k], v), k


def _dcp_load_dtensors(root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    sd = {}
    for k in _globals():
        zeros = torch.zeros_like(_expected(k))
        # Shard on the first axis of at least WORLD elements; others replicated. fp8 has too few
        # kernels for DTensor's redistribution, so it is loaded as a plain tensor on each rank.
        if zeros.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            sd[k] = zeros
            continue
        axis = next((i for i, s in enumerate(zeros.shape) if s >= WORLD), None)
        sd[k] = distribute_tensor(zeros, mesh, [Shard(axis) if axis is not None else Replicate()])
    for k in OBJECTS:
        sd[k] = None
    dcp.load(sd, checkpoint_id=root)
    bad = []
    for k in _globals():
        got = sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]
        if not bitwise_equal(got, _expected(k)):
            bad.append(k)
    bad += [k for k, v in OBJECTS.items() if not _same_object(sd[k], v)]
    return bad


def test_dcp_load_into_dtensors_on_two_ranks(ours, run_ranks):
    assert run_ranks(WORLD, _dcp_load_dtensors, str(ours), timeout=120) == [[], []]
