"""``distckpt demo``: ranks save a small TP x DP model and reload it under other layouts, bit for bit.

What runs (``main(world_size, out_dir)``):

1. ``world_size`` gloo ranks are spawned on this machine (``distckpt.examples.launch``).
2. Under the save layout (TP2 x DP, so layer norms have TP and DP replicas) they build the
   example GPT (``distckpt.examples``) with its distributed optimizer, train two steps and save
   model, optimizer (flat DP slices of Adam's state), one RNG state per rank as a ShardedObject
   and common state (iteration, config).
3. The saved pieces are gathered and assembled into whole tensors by plain indexing -- the
   reference, which uses none of distckpt's reading or resharding.
4. Under two other layouts the same ranks build a fresh model and optimizer, restore them from
   the checkpoint, and compare every parameter and optimizer slice they now hold (replicas
   included) with the reference, bit for bit, and each rank's RNG state with the saved one.
5. A table shows layouts, keys, bytes, seconds and the verdict; the return code is 0 when
   everything matched and 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from distckpt import dist
from distckpt.dict_utils import nested_values
from distckpt.examples.launch import launch
from distckpt.examples.model import GPTConfig
from distckpt.examples.parallel import Layout
from distckpt.examples.training import (
    TrainConfig,
    batch,
    build,
    checkpoint_sharded_state_dict,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from distckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, apply_factories, is_main_replica

SEED = 1234
TRAIN_STEPS = 2


@dataclass
class PhaseReport:
    """One rank's account of one save or load."""

    action: str  # "save" or "load"
    layout: str
    seconds: float  # between barriers: the slowest rank's time
    keys: list[str]  # sharded keys involved (tensors and objects)
    nbytes: int  # save: checkpoint size on disk; load: bytes this rank loaded
    mismatches: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- layouts


def choose_layouts(world_size: int, global_batch_size: int | None = None):
    """``[save layout, load layout, ...]`` for ``world_size`` ranks.

    Saves under TP2 x DP(world/2) when it can (replicas over TP and DP), else TP1 x DP(world);
    loads under up to two other layouts, preferring a TP change (TP4), then pure DP, then PP.
    """
    cfg = GPTConfig()
    batch = global_batch_size or 2 * world_size

    def valid(tp: int, pp: int):
        if world_size % (tp * pp):
            return None
        dp = world_size // (tp * pp)
        try:
            cfg.check_layout(tp, pp)
        except ValueError:
            return None
        return Layout(tp, pp, dp) if batch % dp == 0 else None

    saves = [layout for layout in (valid(2, 1), valid(1, 1)) if layout is not None]
    if not saves:
        raise ValueError(f"the demo model cannot be laid out over {world_size} ranks")
    save = saves[0]
    loads: list[Layout] = []
    for tp, pp in ((4, 1), (1, 1), (2, 2), (1, 2), (2, 1), (4, 2)):
        layout = valid(tp, pp)
        if layout is not None and layout != save and layout not in loads and len(loads) < 2:
            loads.append(layout)
    return [save] + (loads or [save])


# --------------------------------------------------------------------------- reference


Piece = tuple[str, tuple[int, ...], tuple, tuple[int, int] | None, torch.Tensor]


def main_replica_pieces(sharded_leaves) -> list[Piece]:
    """``(key, global shape, global index, flat range, data)`` of every main-replica tensor."""
    pieces = []
    for leaf in sharded_leaves:
        if isinstance(leaf, ShardedTensor) and is_main_replica(leaf.replica_id):
            fr = leaf.flattened_range
            pieces.append(
                (
                    leaf.key,
                    tuple(leaf.global_shape),
                    leaf.global_slice(),
                    None if fr is None else (fr.start, fr.stop),
                    leaf.data.detach().clone(),
                )
            )
    return pieces


def _region(full: torch.Tensor, index: tuple, flat: tuple[int, int] | None) -> torch.Tensor:
    """Copy of the elements at ``index`` (then flat range ``flat``) of ``full``."""
    region = full[index]
    return region.reshape(-1)[flat[0] : flat[1]].clone() if flat is not None else region.clone()


def _assign(full: torch.Tensor, index: tuple, flat: tuple[int, int] | None, value: torch.Tensor) -> None:
    if flat is None:
        full[index] = value
        return
    region = full[index].clone()
    region.reshape(-1)[flat[0] : flat[1]] = value
    full[index] = region


def assemble_reference(pieces: Sequence[Piece]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Whole tensors from main-replica pieces, and the keys not covered exactly once."""
    full: dict[str, torch.Tensor] = {}
    count: dict[str, torch.Tensor] = {}
    for key, shape, index, flat, data in pieces:
        if key not in full:
            full[key] = torch.zeros(shape, dtype=data.dtype)
            count[key] = torch.zeros(shape, dtype=torch.int32)
        _assign(full[key], index, flat, data)
        _assign(count[key], index, flat, _region(count[key], index, flat) + 1)
    badly_covered = sorted(k for k, c in count.items() if not bool((c == 1).all()))
    return full, badly_covered


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: equal bits, not merely equal values (NaN, -0.0)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def compare_with_reference(sharded_leaves, reference: dict[str, torch.Tensor]) -> list[str]:
    """Describe every ShardedTensor whose data differs (bits, dtype or shape) from the reference."""
    wrong = []
    for leaf in sharded_leaves:
        if not isinstance(leaf, ShardedTensor):
            continue
        full = reference.get(leaf.key)
        if full is None:
            wrong.append(f"{leaf.key}: not in the saved checkpoint")
            continue
        fr = leaf.flattened_range
        want = _region(full, leaf.global_slice(), None if fr is None else (fr.start, fr.stop))
        got = leaf.data
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            wrong.append(
                f"{leaf.key} at {leaf.global_offset}" + ("" if fr is None else f" [{fr.start}:{fr.stop}]")
            )
    return wrong


# --------------------------------------------------------------------------- ranks


def _rng_object(rank: int, world: int, state: torch.Tensor | None):
    return ShardedObject("rng_state", state, (world,), (rank,))


def _applied_leaves(state) -> list:
    """The sharded leaves of ``state`` once its factories are built (in place)."""
    apply_factories(state)
    return [leaf for leaf in nested_values(state) if isinstance(leaf, ShardedBase)]


def _timed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and its time between barriers (the slowest rank's time)."""
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    dist.barrier()
    return out, time.perf_counter() - start


def _rank_main(ckpt_dir: str, layouts: list) -> list[PhaseReport]:
    rank, world = dist.get_rank(), dist.get_world_size()
    train_cfg = TrainConfig(global_batch_size=2 * world, distributed_optimizer=True)
    reports = []

    # Save: train a little under the first layout so that weights and Adam state are not trivial.
    torch.manual_seed(SEED + rank)
    save_layout = layouts[0]
    ps, model, optimizer = build(save_layout, train_cfg)
    for iteration in range(TRAIN_STEPS):
        train_step(model, optimizer, ps, batch(model.cfg, iteration, train_cfg.global_batch_size))
    saved_rng = torch.get_rng_state()
    rng = {"rng_state": _rng_object(rank, world, saved_rng)}
    leaves = _applied_leaves(checkpoint_sharded_state_dict(model, optimizer, TRAIN_STEPS))
    gathered = dist.all_gather_object(main_replica_pieces(leaves))
    reference, badly_covered = assemble_reference([p for pieces in gathered for p in pieces])
    _, seconds = _timed(save_checkpoint, ckpt_dir, model, optimizer, TRAIN_STEPS, extra=rng)
    size = sum(f.stat().st_size for f in Path(ckpt_dir).iterdir() if f.is_file())
    reports.append(
        PhaseReport(
            "save",
            str(save_layout),
            seconds,
            sorted(reference) + ["rng_state"],
            size,
            [f"{k}: saved pieces overlap or leave holes" for k in badly_covered],
        )
    )

    for layout in layouts[1:]:
        ps, model, optimizer = build(layout, train_cfg)
        request = {"rng_state": _rng_object(rank, world, None)}
        state, seconds = _timed(load_checkpoint, ckpt_dir, model, optimizer, extra=request)
        # What the ranks now hold -- parameters and optimizer slices, every replica -- against
        # the reference, by each piece's own position in the global tensors.
        leaves = _applied_leaves(checkpoint_sharded_state_dict(model, optimizer, state["iteration"]))
        wrong = compare_with_reference(leaves, reference)
        if not torch.equal(state["rng_state"], saved_rng):
            wrong.append(f"rng_state of rank {rank}")
        if state["iteration"] != TRAIN_STEPS:
            wrong.append(f"iteration {state['iteration']} != {TRAIN_STEPS}")
        nbytes = sum(
            leaf.data.numel() * leaf.data.element_size() for leaf in leaves if isinstance(leaf, ShardedTensor)
        )
        keys = sorted({leaf.key for leaf in leaves} | {"rng_state"})
        reports.append(PhaseReport("load", str(layout), seconds, keys, nbytes, wrong))
    return reports


# --------------------------------------------------------------------------- driver


def _summarise(per_rank: list[list[PhaseReport]]) -> list[PhaseReport]:
    """One report per phase: the slowest time, the keys of all ranks, bytes summed over ranks."""
    rows = []
    for phase in zip(*per_rank):
        first = phase[0]
        nbytes = first.nbytes if first.action == "save" else sum(r.nbytes for r in phase)
        mismatches = [f"rank {rank}: {m}" for rank, r in enumerate(phase) for m in r.mismatches]
        rows.append(
            PhaseReport(
                first.action,
                first.layout,
                max(r.seconds for r in phase),
                sorted(set().union(*(r.keys for r in phase))),
                nbytes,
                mismatches,
            )
        )
    return rows


def _print_table(rows: list[PhaseReport], world_size: int, ckpt_dir: Path, total_s: float) -> None:
    console = Console()
    table = Table(title=f"distckpt demo: {world_size} gloo rank(s), GPT + distributed Adam")
    for name, justify in (
        ("step", "left"),
        ("layout", "left"),
        ("keys", "right"),
        ("bytes", "right"),
        ("seconds", "right"),
        ("verdict", "left"),
    ):
        table.add_column(name, justify=justify)
    for row in rows:
        if row.mismatches:
            verdict = f"[red]MISMATCH ({len(row.mismatches)})[/red]"
        else:
            verdict = "[green]written[/green]" if row.action == "save" else "[green]bit-exact[/green]"
        table.add_row(
            row.action, row.layout, str(len(row.keys)), f"{row.nbytes:,}", f"{row.seconds:.2f}", verdict
        )
    console.print(table)
    for row in rows:
        for line in row.mismatches[:10]:
            console.print(f"[red]{row.action} {row.layout}: {line}[/red]")
    console.print(f"checkpoint: {ckpt_dir}   total: {total_s:.1f} s")


def main(world_size: int = 4, out_dir: str | os.PathLike | None = None) -> int:
    """Run the demo on ``world_size`` ranks; 0 if every reload was bit-exact, else 1.

    The checkpoint goes to ``out_dir/ckpt`` (kept), or to a temporary directory (removed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    layouts = choose_layouts(world_size)
    base = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="distckpt-demo-"))
    ckpt_dir = base / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        per_rank = launch(
            world_size, _rank_main, str(ckpt_dir), layouts, timeout=max(120.0, 10.0 * world_size)
        )
        rows = _summarise(per_rank)
        _print_table(
            rows,
            world_size,
            ckpt_dir if out_dir is not None else Path("(temporary, removed)"),
            time.perf_counter() - start,
        )
    finally:
        if out_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 1 if any(row.mismatches for row in rows) else 0


__all__ = ["main", "choose_layouts", "assemble_reference", "compare_with_reference", "main_replica_pieces"]
