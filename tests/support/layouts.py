"""Parallel layouts for tests: which piece of which global tensor each rank holds.

A layout is a function ``(rank, world, **params) -> List[Piece]``. The same description builds
the ShardedTensor to save (data = the piece of a deterministic global tensor), the empty
ShardedTensor to load into, and the expected value after loading, so a test can save under one
layout and load under any other.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from distckpt import ShardedObject, ShardedTensor


def full_tensor(key: str, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The deterministic global tensor behind ``key`` (the same in every process)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}{shape}{dtype}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


@dataclass(frozen=True)
class Piece:
    """One rank's piece of global tensor ``key``: the box at ``offset`` of shape
    ``(1,)*prepend + local_shape``, optionally only the flat range ``flat`` of it."""

    name: str  # key in the state dict
    key: str  # ShardedTensor key
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    dtype: torch.dtype = torch.float32
    prepend: int = 0
    replica: int = 0
    flat: Optional[Tuple[int, int]] = None
    fragments: Optional[Tuple[int, ...]] = None

    def expected(self) -> torch.Tensor:
        full = full_tensor(self.key, self.global_shape, self.dtype)
        index = tuple(
            self.offset[i]
            if i < self.prepend
            else slice(self.offset[i], self.offset[i] + self.local_shape[i - self.prepend])
            for i in range(len(self.global_shape))
        )
        local = full[index].contiguous()
        if self.flat is not None:
            local = local.flatten()[self.flat[0] : self.flat[1]].clone()
        return local

    def sharded(self, with_data: bool = True, **kwargs) -> ShardedTensor:
        data = self.expected() if with_data else torch.zeros_like(self.expected())
        flat = None if self.flat is None else slice(*self.flat)
        fragments = self.fragments
        if fragments is None:
            fragments = tuple(
                1
                if i < self.prepend
                else max(1, self.global_shape[i] // max(1, self.local_shape[i - self.prepend]))
                for i in range(len(self.global_shape))
            )
        return ShardedTensor(
            self.key,
            data,
            self.dtype,
            tuple(self.local_shape),
            tuple(self.global_shape),
            tuple(self.offset),
            fragments,
            self.replica,
            self.prepend,
            flattened_range=flat,
            **kwargs,
        )


def splits(n: int, parts: int) -> List[Tuple[int, int]]:
    """Cut ``range(n)`` into ``parts`` contiguous, possibly uneven, possibly empty pieces."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(parts)]


# --------------------------------------------------------------------------- layouts


def tp_dp(rank: int, world: int, tp: int) -> List[Piece]:
    """A small transformer-like model: TP splits on axis 0 and 1, DP replicas of everything."""
    tp_rank, dp_rank = rank % tp, rank // tp
    pieces = []
    for name, shape, axis, dtype in [
        ("col", (8, 6), 0, torch.float32),
        ("row", (6, 8), 1, torch.float32),
        ("emb", (16, 4), 0, torch.bfloat16),
        ("half", (4, 8), 1, torch.float16),
    ]:
        local = list(shape)
        local[axis] //= tp
        off = [0] * len(shape)
        off[axis] = tp_rank * local[axis]
        pieces.append(Piece(name, name, shape, tuple(off), tuple(local), dtype, replica=dp_rank))
    pieces.append(Piece("bias", "bias", (6,), (0,), (6,), replica=rank))
    pieces.append(Piece("count", "count", (5,), (0,), (5,), torch.int64, replica=rank))
    pieces.append(Piece("mask", "mask", (3, 3), (0, 0), (3, 3), torch.bool, replica=rank))
    pieces.append(Piece("steps", "steps", (), (), (), torch.int32, replica=rank))
    return pieces


def grid(rank: int, world: int, rows: int, cols: int) -> List[Piece]:
    """A [8, 12] tensor cut into a rows x cols grid; ranks beyond rows*cols hold replicas."""
    cell = rank % (rows * cols)
    r, c = divmod(cell, cols)
    (ro, rl), (co, cl) = splits(8, rows)[r], splits(12, cols)[c]
    return [Piece("grid", "grid", (8, 12), (ro, co), (rl, cl), replica=rank // (rows * cols))]


def uneven(rank: int, world: int, parts: Optional[int] = None) -> List[Piece]:
    """1-D tensors of 13 and 3 elements cut unevenly; with world > 3 some pieces are empty."""
    parts = parts or world
    out = []
    for key, n in [("uneven13", 13), ("uneven3", 3)]:
        off, length = splits(n, parts)[rank % parts]
        out.append(Piece(key, key, (n,), (off,), (length,), replica=rank // parts))
    return out


def multi(rank: int, world: int) -> List[Piece]:
    """Several shards of one key per rank: rank r holds row blocks r and r + world of a [16, 3]."""
    rows = 16 // (2 * world)
    return [
        Piece(f"multi.{i}", "multi", (16, 3), (rows * (rank + i * world), 0), (rows, 3)) for i in range(2)
    ]


def stacked(rank: int, world: int, pp: int, per_layer: bool) -> List[Piece]:
    """4 layers of [6, 4] stacked on a prepended axis, split over ``pp`` pipeline stages.

    ``per_layer``: one ShardedTensor per layer (prepend_axis_num=1, Megatron's layer stacking);
    else one ShardedTensor per stage covering its layers (no prepended axis).
    """
    stage = rank % pp
    layers = splits(4, pp)[stage]
    replica = rank // pp
    if per_layer:
        return [
            Piece(f"layers.{i}", "layers.w", (4, 6, 4), (i, 0, 0), (6, 4), prepend=1, replica=replica)
            for i in range(layers[0], layers[0] + layers[1])
        ]
    return [Piece("layers", "layers.w", (4, 6, 4), (layers[0], 0, 0), (layers[1], 6, 4), replica=replica)]


def flat_optimizer(rank: int, world: int, tp: int, empty: bool = False, flat: bool = True) -> List[Piece]:
    """Distributed-optimizer slices of ``exp_avg`` [8, 6] (fp32) and ``exp_avg_bf16`` [4, 10]:
    TP-split on axis 0, each TP chunk flattened and cut over DP = world // tp ranks at uneven
    points that cut rows; with ``empty`` one DP rank's slice is empty. ``flat=False`` gives the
    same keys as regular TP pieces (replicated over DP) to load flat checkpoints into."""
    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    pieces = []
    for key, shape, dtype in [("exp_avg", (8, 6), torch.float32), ("exp_avg_bf16", (4, 10), torch.bfloat16)]:
        rows = shape[0] // tp
        local = (rows, shape[1])
        offset = (tp_rank * rows, 0)
        if not flat:
            pieces.append(Piece(key, key, shape, offset, local, dtype, replica=dp_rank, fragments=(tp, 1)))
            continue
        numel = rows * shape[1]
        cuts = [0] + [min(numel, (i * numel) // dp + (3 if i % 2 else 0)) for i in range(1, dp)] + [numel]
        if empty and dp > 1:
            cuts[1] = 0
        cuts = sorted(cuts)
        start, stop = cuts[dp_rank], cuts[dp_rank + 1]
        pieces.append(Piece(key, key, shape, offset, local, dtype, flat=(start, stop), fragments=(tp, 1)))
    return pieces


def wide(rank: int, world: int, parts: Optional[int] = None) -> List[Piece]:
    """Wide tensors split on their last axis (row-parallel style), so a resharded piece is a
    column block of a stored chunk: long runs that are not contiguous on disk."""
    parts = parts or world
    out = []
    for key, shape, dtype in [
        ("wide_fp32", (16, 1024), torch.float32),
        ("wide_bf16", (8, 2048), torch.bfloat16),
    ]:
        off, length = splits(shape[1], parts)[rank % parts]
        out.append(Piece(key, key, shape, (0, off), (shape[0], length), dtype, replica=rank // parts))
    return out


def fp8(rank: int, world: int) -> List[Piece]:
    """Native float8 tensors split over ranks on axis 0."""
    out = []
    for key, dtype in [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
        off, length = splits(8, world)[rank]
        out.append(Piece(key, key, (8, 4), (off, 0), (length, 4), dtype))
    return out


def experts(
    rank: int,
    world: int,
    layers: int = 4,
    count: int = 8,
    ep: Optional[int] = None,
    etp: int = 1,
    shift: int = 0,
) -> List[Piece]:
    """Mixture-of-Experts weights as Megatron-Core's ``SequentialMLP`` describes them: one
    ShardedTensor per expert weight, a layer and an expert axis prepended, so ``experts.fc1`` is
    one key of ``layers x count`` chunks (``x etp`` with expert-TP, which splits axis 2). The
    experts are cut into ``ep`` groups (default: ``world // etp``); ranks beyond ``ep x etp`` hold
    replicas. ``shift``: this rank's expert group is ``shift`` groups further on (a load where
    every rank asks for another rank's experts)."""
    ep = ep or world // etp
    group = (rank // etp + shift) % ep
    part = rank % etp
    replica = rank // (ep * etp)
    local = count // ep
    out = []
    for key, shape in (("experts.fc1", (4, 3)), ("experts.fc2", (2, 6))):
        rows = shape[0] // etp
        for layer in range(layers):
            for e in range(group * local, (group + 1) * local):
                out.append(
                    Piece(
                        f"{key}.{layer}.{e}",
                        key,
                        (layers, count) + shape,
                        (layer, e, part * rows, 0),
                        (rows, shape[1]),
                        prepend=2,
                        replica=replica,
                    )
                )
    return out


LAYOUTS: Dict[str, Callable[..., List[Piece]]] = {
    "tp_dp": tp_dp,
    "grid": grid,
    "uneven": uneven,
    "multi": multi,
    "stacked": stacked,
    "flat_optimizer": flat_optimizer,
    "fp8": fp8,
    "wide": wide,
    "experts": experts,
}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe; works for float8 and bool)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def build(layout: str, rank: int, world: int, with_data: bool, **params) -> Tuple[dict, Dict[str, Piece]]:
    pieces = LAYOUTS[layout](rank, world, **params)
    return {p.name: p.sharded(with_data) for p in pieces}, {p.name: p for p in pieces}


def rank_object(rank: int, world: int, with_data: bool = True, replicas: int = 1) -> ShardedObject:
    """One object per rank group on a (1, world/replicas) grid."""
    cols = world // replicas
    col = rank % cols
    data = {"rank": col, "state": torch.arange(3) + 10 * col, "name": f"obj{col}"} if with_data else None
    return ShardedObject("rng_state", data, (1, cols), (0, col), replica_id=rank // cols)


def numel(shape) -> int:
    return math.prod(shape)
