"""Which tensor-, pipeline- and data-parallel group each rank is in, and the collectives.

Ranks are ordered the Megatron-Core way: tensor parallel varies fastest, then data parallel,
then pipeline parallel (``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``), so the ranks of a
tensor-parallel group are neighbours.

The collectives that the layers call inside ``forward`` are autograd functions, so that the
backward pass runs the matching collective (all-reduce <-> identity, all-gather <-> split).
Every collective is skipped for a group of one rank, and the whole module works without any
process group when the layout has a single rank.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor-, pipeline- and data-parallel sizes."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Read ``"TP2xPP2xDP2"`` (any case, any order, parts optional) or ``"2,2,2"``."""
        text = text.strip()
        if re.fullmatch(r"\d+,\d+,\d+", text):
            tp, pp, dp = (int(v) for v in text.split(","))
            return cls(tp, pp, dp)
        parts = re.findall(r"(tp|pp|dp)(\d+)", text.lower())
        rest = re.sub(r"(tp|pp|dp)\d+|[x*,\s]", "", text.lower())
        if not parts or rest:
            raise ValueError(f"cannot read a layout from {text!r}; write e.g. TP2xPP2xDP2 or 2,2,2")
        return cls(**{name: int(value) for name, value in parts})

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, pp_rank, dp_rank)`` of global ``rank``."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, p, d) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, p, d) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, p, d) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]


# Groups of a layout, created once per default process group: every rank must create every
# group, in the same order, and caching them keeps repeated runs in one process (a test's rank
# pool) cheap. The key holds the default group itself, so a re-initialized world starts afresh.
_GROUPS: dict[tuple[object | None, Layout], tuple[object | None, object | None, object | None]] = {}


def _my_group(groups: list[list[int]], rank: int):
    mine = None
    for ranks in groups:
        if len(ranks) == 1:
            continue  # a group of one needs no process group; every rank skips the same ones
        group = tdist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in a :class:`Layout` and its process groups (None for a group of one)."""

    layout: Layout
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object | None
    pp_group: object | None
    dp_group: object | None

    @classmethod
    def initialize(cls, layout: Layout) -> ParallelState:
        """Build the state of this rank; every rank of the default process group must call it.

        Without a process group the layout must have a single rank.

        Raises:
            ValueError: the layout's rank count differs from the world size.
        """
        initialized = tdist.is_available() and tdist.is_initialized()
        world = tdist.get_world_size() if initialized else 1
        rank = tdist.get_rank() if initialized else 0
        if layout.world_size != world:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the world has {world}")
        key = (tdist.group.WORLD if initialized else None, layout)
        if key not in _GROUPS:
            if world == 1:
                _GROUPS[key] = (None, None, None)
            else:
                _GROUPS[key] = (
                    _my_group(layout.tp_groups(), rank),
                    _my_group(layout.pp_groups(), rank),
                    _my_group(layout.dp_groups(), rank),
                )
        tp_group, pp_group, dp_group = _GROUPS[key]
        tp_rank, pp_rank, dp_rank = layout.coords(rank)
        return cls(layout, rank, tp_rank, pp_rank, dp_rank, tp_group, pp_group, dp_group)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_neighbour(self, step: int) -> int:
        """Global rank of the pipeline stage ``step`` stages away (same TP and DP rank)."""
        return self.layout.rank_of(self.tp_rank, self.pp_rank + step, self.dp_rank)


# --------------------------------------------------------------------------- collectives


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` in place over ``group`` (nothing to do for a group of one)."""
    if group is not None:
        tdist.all_reduce(t, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    """Concatenate every group member's ``t`` along ``dim``, in group-rank order."""
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    tdist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _CopyToTP(torch.autograd.Function):
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Leave a row-parallel region: all-reduce the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dimension forward; keep this rank's part of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        ctx.local, ctx.rank = x.shape[-1], rank
        return all_gather_cat(x, group, size, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.local, ctx.local).contiguous(), None, None, None


def copy_to_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _CopyToTP.apply(x, ps.tp_group)


def reduce_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _ReduceFromTP.apply(x, ps.tp_group)


def gather_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _GatherFromTP.apply(x, ps.tp_group, ps.tp, ps.tp_rank)


# --------------------------------------------------------------------------- pipeline p2p


def send_to_stage(t: torch.Tensor, ps: ParallelState, step: int) -> None:
    """Send ``t`` to the stage ``step`` (+1: next, -1: previous) away."""
    tdist.send(t.detach().contiguous(), dst=ps.stage_neighbour(step))


def recv_from_stage(shape: Sequence[int], ps: ParallelState, step: int) -> torch.Tensor:
    """Receive a float32 tensor of ``shape`` from the stage ``step`` away."""
    t = torch.empty(tuple(shape), dtype=torch.float32)
    tdist.recv(t, src=ps.stage_neighbour(step))
    return t
