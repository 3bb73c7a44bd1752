"""The sweep of ``python -m bench.throughput --sweep``: fixed and marginal cost per state-dict shape.

For every shape (hidden size, TP degree, share of flattened optimizer state) and every size per
rank, one gloo run per rank measures, each a median of ``--reps`` after ``--warmup``:
raw write (os.write + fsync) and raw read (preadv) of the same per-rank bytes, torch_dist save,
load (same layout) and resharded load (every rank takes two interleaved pieces of a 2x finer TP
split). Per shape it then fits ``seconds = fixed + marginal * GiB`` over the sizes (least
squares) and reports the fixed cost (s at zero bytes) and the marginal cost (s/GiB) of each,
with the marginal cost's ratio to raw I/O's (save / raw write, loads / raw read).

The raw file and the checkpoint of a repetition exist side by side and are written and read
in turns (even repetitions raw first, odd ones the checkpoint first; use an even ``--reps``):
on tmpfs the file written second tends to get pages that read faster, so a fixed order would
hand the same side that edge in every repetition.

Every save and load also reports its phases (``distckpt.last_timings``); ``phase_table()`` prints, per
cell, each rank's median time before the first byte, in the bytes' phase (writing or reading,
also as a ratio to raw I/O) and after it: where a cell's time beyond raw I/O goes.

    python -m bench.throughput --sweep --sizes-mib 64,256,1024 --shapes h1024-tp2-opt80,h4096-tp1-opt0

(from the repository root; the options are bench.throughput's, which hands them to :func:`run`.)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from bench.common import barrier_time, drop, pyplot, raw_read, raw_write, spawn_ranks

DEFAULT_SHAPES = "h1024-tp2-opt80,h2048-tp2-opt80,h4096-tp2-opt0,h1024-tp1-opt0,h1024-tp2-opt0"

# A size is skipped for a shape whose smallest state (one layer) is further than this from it.
SIZE_TOLERANCE = 0.3


def parse_shape(text: str) -> Dict[str, int]:
    """``h<hidden>-tp<degree>-opt<percent>``: opt80 = two fp32 flattened states per bf16 weight
    (80% of the bytes), opt0 = weights only."""
    parts = dict(
        (
            p[:1] if p[0] == "h" else p[:2] if p.startswith("tp") else p[:3],
            int(p[1:] if p[0] == "h" else p[2:] if p.startswith("tp") else p[3:]),
        )
        for p in text.split("-")
    )
    if set(parts) != {"h", "tp", "opt"} or parts["opt"] not in (0, 80):
        raise ValueError(f"shape {text!r}: expected h<hidden>-tp<degree>-opt<0|80>")
    return parts


def layers_for(size_mib: float, hidden: int, tp: int, opt: int) -> int:
    """Layers whose per-rank bytes are about ``size_mib`` (12 h^2 weight elements per layer)."""
    per_elem = 10 if opt else 2
    per_layer = 12 * hidden * hidden * per_elem / tp
    return max(1, round(size_mib * 2**20 / per_layer))


def layer_mib(shape: Dict[str, int]) -> float:
    """MiB per rank of one layer of ``shape``."""
    return 12 * shape["h"] ** 2 * (10 if shape["opt"] else 2) / shape["tp"] / 2**20


def sweep_state(
    rank: int,
    world: int,
    hidden: int,
    layers: int,
    tp: int,
    opt: int,
    pieces: int = 1,
    with_data: bool = True,
) -> dict:
    """TP over ``tp`` parts (times ``pieces`` for a resharded request), DP over world // tp."""
    from distckpt import ShardedTensor

    g = torch.Generator().manual_seed(7 + rank)
    parts = tp * pieces
    tp_rank, dp_rank = rank % tp, rank // tp
    mine = [tp_rank + k * tp for k in range(pieces)]
    sd = {}

    def make(shape, dtype):
        if not with_data:
            return torch.zeros(shape, dtype=dtype)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)

    h = hidden
    for layer in range(layers):
        for name, shape, axis in [
            ("qkv", (3 * h, h), 0),
            ("proj", (h, h), 1),
            ("fc1", (4 * h, h), 0),
            ("fc2", (h, 4 * h), 1),
        ]:
            key = f"layers.{layer}.{name}"
            local = list(shape)
            local[axis] //= parts
            for p in mine:
                sd[f"{key}#{p}"] = ShardedTensor.from_rank_offsets(
                    key, make(tuple(local), torch.bfloat16), (axis, p, parts), replica_id=dp_rank
                )
                if not opt:
                    continue
                numel = local[0] * local[1]
                dp = world // tp
                lo, hi = numel * dp_rank // dp, numel * (dp_rank + 1) // dp
                if pieces > 1:
                    lo, hi = 0, numel
                for state in ("exp_avg", "exp_avg_sq"):
                    okey = f"optimizer.{state}.{key}"
                    sd[f"{okey}#{p}"] = ShardedTensor.from_rank_offsets_flat(
                        okey,
                        make((hi - lo,), torch.float32),
                        tuple(local),
                        (axis, p, parts),
                        flattened_range=slice(lo, hi),
                        replica_id=0 if pieces == 1 else dp_rank,
                    )
    return sd


def cells(shapes: List[str], sizes_mib: List[float]):
    """``(shape text, shape, size, layers)`` for every shape and size of a sweep, leaving out a
    size that one layer of the shape already overshoots by more than ``SIZE_TOLERANCE``."""
    for shape_text in shapes:
        shape = parse_shape(shape_text)
        for size in sizes_mib:
            layers = layers_for(size, shape["h"], shape["tp"], shape["opt"])
            if abs(layer_mib(shape) * layers - size) <= SIZE_TOLERANCE * size:
                yield shape_text, shape, size, layers


def rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun (the variable came too late)
    import torch.distributed as tdist

    import distckpt
    from distckpt.mapping import is_main_replica
    from distckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(args.dir)
    rows = []
    if rank == 0:
        drop(root / "ckpt")  # a run that was stopped may have left one; each repetition drops its own
    tdist.barrier()
    for shape_text, shape, size, layers in cells(args.shapes, args.sizes_mib):
        sd = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"])
        tensors = [sh.data for sh in sd.values() if is_main_replica(sh.replica_id)]
        mine = sum(t.numel() * t.element_size() for t in tensors)
        # What a load reads on this rank: every tensor it holds, replicas too (with DP > 1
        # every rank loads the whole model though only the main replicas were written).
        wanted = [sh.data for sh in sd.values()]
        times: Dict[str, List[float]] = {}
        phases: Dict[str, Dict[str, List[float]]] = {}

        def note(op, phases=phases):  # this rank's phases of the call just timed
            t = distckpt.last_timings("load" if op != "save" else "save")
            for name, sec in t.phases.items():
                phases.setdefault(op, {}).setdefault(name, []).append(sec)

        for rep in range(-args.warmup, args.reps):
            if rep == 0:
                times.clear()
                phases.clear()
            raw, ckpt = root / f"raw_{rank}.bin", root / "ckpt"
            # Raw file and checkpoint take turns at going first (see the module docstring).
            order = (
                ("raw write", "save", "raw read", "load")
                if rep % 2 == 0
                else ("save", "raw write", "load", "raw read")
            )
            for step in order:
                if step == "raw write":
                    times.setdefault(step, []).append(barrier_time(raw_write, raw, tensors)[0])
                    if len(wanted) != len(tensors):
                        raw_write(raw, wanted)
                elif step == "save":
                    strategy = TorchDistSaveShardedStrategy(thread_count=args.threads)
                    times.setdefault(step, []).append(
                        barrier_time(distckpt.save, sd, ckpt, sharded_strategy=strategy)[0]
                    )
                    note(step)
                elif step == "raw read":
                    bufs = [torch.zeros_like(t) for t in wanted]
                    times.setdefault(step, []).append(barrier_time(raw_read, raw, bufs)[0])
                    bufs = None
                else:
                    req = sweep_state(
                        rank, world, shape["h"], layers, shape["tp"], shape["opt"], with_data=False
                    )
                    times.setdefault("load", []).append(barrier_time(distckpt.load, req, ckpt)[0])
                    note("load")
                    # Freed before the next request is built: at 2 GiB per rank, two requests
                    # alive at once (4 GiB per rank beside the state and the checkpoint) left the
                    # VM short of memory, and the kernel's reclaim then slowed every phase.
                    req = None
                    req = sweep_state(
                        rank, world, shape["h"], layers, shape["tp"], shape["opt"], pieces=2, with_data=False
                    )
                    times.setdefault("load resharded", []).append(barrier_time(distckpt.load, req, ckpt)[0])
                    note("load resharded")
                    req = None
            tdist.barrier()
            raw.unlink()
            if rank == 0:
                drop(ckpt)
            tdist.barrier()
        out = [None] * world
        tdist.all_gather_object(out, mine)
        read = [None] * world
        tdist.all_gather_object(read, sum(t.numel() * t.element_size() for t in wanted))
        by_rank = [None] * world
        tdist.all_gather_object(
            by_rank, {op: {k: statistics.median(v) for k, v in ph.items()} for op, ph in phases.items()}
        )
        rows.append(
            {
                "shape": shape_text,
                "size_mib": size,
                "layers": layers,
                "gib_per_rank": max(out) / 2**30,
                "gib_read_per_rank": max(read) / 2**30,
                "seconds": {k: statistics.median(v) for k, v in times.items()},
                "phases": by_rank,
            }
        )
        sd = tensors = wanted = None
    if rank == 0:
        queue.put(rows)
    tdist.barrier()
    tdist.destroy_process_group()


LIMIT = {"save": "raw write", "load": "raw read", "load resharded": "raw read"}


def fit(rows: List[dict]) -> str:
    """Per shape and operation: fixed cost (s) and marginal cost (s/GiB) from a least-squares line."""
    lines = [
        "| shape | op | fixed s | marginal s/GiB | marginal ÷ raw I/O's marginal |",
        "|---|---|---:|---:|---:|",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        fits = {}
        for op in ("raw write", "raw read", "save", "load", "load resharded"):
            written = op in ("raw write", "save")
            x = np.array(
                [
                    r["gib_per_rank"] if written else r.get("gib_read_per_rank", r["gib_per_rank"])
                    for r in mine
                ]
            )
            y = np.array([r["seconds"][op] for r in mine])
            slope, icpt = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (y[0] / x[0], 0.0)
            fits[op] = (icpt, slope)
        for op in ("raw write", "raw read", "save", "load", "load resharded"):
            icpt, slope = fits[op]
            ratio = f"{slope / fits[LIMIT[op]][1]:.2f}" if op in LIMIT else ""
            lines.append(f"| {shape} | {op} | {icpt:.3f} | {slope:.3f} | {ratio} |")
    return "\n".join(lines)


GOALS = {"save": 0.85, "load": 0.9, "resharded": 1.2}


def ratios(row: dict) -> Dict[str, float]:
    """The issue's three ratios: save and load as a fraction of raw speed (higher is better),
    resharded load time over same-layout load time (lower is better)."""
    s = row["seconds"]
    return {
        "save": s["raw write"] / s["save"],
        "load": s["raw read"] / s["load"],
        "resharded": s["load resharded"] / s["load"],
    }


def table(rows: List[dict]) -> str:
    lines = [
        "| shape | MiB/rank | layers | raw write s | raw read s | save s | load s | resharded s "
        "| save ÷ raw speed (≥ 0.85) | load ÷ raw speed (≥ 0.9) | resharded ÷ load time (≤ 1.2) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, q = r["seconds"], ratios(r)
        mark = {k: "" if (q[k] >= g if k != "resharded" else q[k] <= g) else " ✗" for k, g in GOALS.items()}
        lines.append(
            f"| {r['shape']} | {r['size_mib']:g} | {r['layers']} | {s['raw write']:.3f} | "
            f"{s['raw read']:.3f} | "
            f"{s['save']:.3f} | {s['load']:.3f} | {s['load resharded']:.3f} | "
            f"{q['save']:.2f}{mark['save']} | "
            f"{q['load']:.2f}{mark['load']} | {q['resharded']:.2f}{mark['resharded']} |"
        )
    return "\n".join(lines)


BYTES_PHASE = {"save": "writing", "load": "reading", "load resharded": "reading"}


def split(phases: Dict[str, float], op: str) -> tuple:
    """(before the bytes' phase, the bytes' phase, after it) in seconds, from one rank's phases."""
    names = list(phases)
    mid = BYTES_PHASE[op]
    if mid not in phases:
        return (sum(phases.values()), 0.0, 0.0)
    i = names.index(mid)
    return (sum(phases[n] for n in names[:i]), phases[mid], sum(phases[n] for n in names[i + 1 :]))


def phase_table(rows: List[dict], min_mib: float = 0) -> str:
    """Per cell and operation: each rank's median ms before the first byte, in the bytes' phase
    (and its ratio to raw I/O of the same bytes on that rank's run) and after the last."""
    lines = [
        (
            "| shape | MiB/rank | op | before ms (rank 0 / 1) | bytes' phase ms | bytes' phase ÷ raw I/O "
            "| after ms |"
        ),
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["size_mib"] < min_mib or not r.get("phases"):
            continue
        for op in ("save", "load", "load resharded"):
            per_rank = [split(p.get(op, {}), op) for p in r["phases"]]
            raw = r["seconds"][LIMIT[op]]
            col = [" / ".join(f"{x[i] * 1e3:.1f}" for x in per_rank) for i in range(3)]
            ratio = " / ".join(f"{x[1] / raw:.2f}" for x in per_rank)
            lines.append(
                f"| {r['shape']} | {r['size_mib']:g} | {op} | {col[0]} | {col[1]} | {ratio} | {col[2]} |"
            )
    return "\n".join(lines)


def chart(rows: List[dict], path: Path) -> bool:
    """Seconds against GiB per rank, one panel per operation, one line per shape (and raw I/O)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (op, limit) in zip(
        axes, [("save", "raw write"), ("load", "raw read"), ("load resharded", "raw read")]
    ):
        for shape in dict.fromkeys(r["shape"] for r in rows):
            mine = [r for r in rows if r["shape"] == shape]
            x = [
                r["gib_per_rank"] if op == "save" else r.get("gib_read_per_rank", r["gib_per_rank"])
                for r in mine
            ]
            (line,) = ax.plot(x, [r["seconds"][op] for r in mine], marker="o", label=shape)
            ax.plot(x, [r["seconds"][limit] for r in mine], ls=":", color=line.get_color())
        ax.set_title(f"{op} (dotted: {limit})")
        ax.set_xlabel("GiB per rank")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def run(args) -> int:
    """The sweep of ``python -m bench.throughput --sweep``: every cell on ``args.ranks`` gloo
    ranks, then the table, the fit, the phases and the chart (``sweep.json``, ``sweep.png`` in
    ``args.out``)."""
    args.sizes_mib = [float(x) for x in args.sizes_mib.split(",") if x]
    args.shapes = [x for x in (args.shapes or DEFAULT_SHAPES).split(",") if x]
    for shape in args.shapes:
        parse_shape(shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    rows = spawn_ranks(rank_main, args.ranks, args, lambda: shutil.rmtree(args.dir, ignore_errors=True))
    (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))
    print()
    print(fit(rows))
    print()
    print(
        "Where the time goes (medians per rank; the bytes' phase is writing for a save, reading for a load):"
    )
    print(phase_table(rows))
    drew = chart(rows, out / "sweep.png")
    print(
        f"\nwrote {out / 'sweep.json'}"
        + (f" and {out / 'sweep.png'}" if drew else " (no matplotlib: no chart)")
    )
    return 0
