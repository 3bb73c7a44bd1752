"""Mixture-of-Experts state dicts: how save and load grow with the number of experts' tensors.

    python -m bench.moe [--ranks 2] [--tensors 1000,3000,6000,12000,20000] [--layout sequential]
                        [--ep 2] [--etp 1] [--dense tp|replicated] [--reps 3] [--megatron-max 6000]

Megatron-Core describes a MoE layer's experts in one of two layouts, and this benchmark builds
both the way its modules do (sharded offsets, replica ids, keys), without Megatron:

- ``sequential`` (``SequentialMLP``, and ``TEGroupedMLP`` which keeps its sharded keys): every
  expert weight is one ``ShardedTensor`` of a key shared by all layers and experts, with a layer
  and an expert axis prepended (``prepend_axis_num=2``): ``experts.linear_fc1.weight`` has the
  global shape ``(layers, experts, ffn, hidden)`` and ``layers x experts`` chunks, spread over the
  expert-parallel ranks (with expert-TP, ``etp`` pieces each);
- ``grouped`` (the legacy ``GroupedMLP``): a layer's local experts are one stacked tensor, so a
  rank holds one chunk per layer of ``(layers, experts, ffn, hidden)``.

Beside them the dense part of each layer: attention weights split over the ranks as TP
(``--dense tp``) or replicated (``--dense replicated``), layer norms and the router replicated, all
with the layer axis prepended as Megatron's ``TransformerBlock`` does. ``--tensors`` sets the
tensors per rank (the layer count follows; 64 experts, ``--ep`` of them groups over the ranks).

For each size it times, between barriers on every rank (median of ``--reps``): the save, the
blocking part of an async save, a load in the same layout, a load where every rank asks for the
experts another rank saved (expert parallelism re-assigned: ``EP shifted``), and, in this process
without a process group after the ranks are gone, a load of the whole checkpoint into one rank
with every expert requested separately (what a conversion does: ``to 1 rank``). With
megatron-core installed (the ``megatron`` extra) and up to ``--megatron-max`` tensors per rank,
megatron-core's own save and load of the same state dict (its ``ShardedTensor`` class, its default
``torch_dist`` strategies) run in the same ranks. The table prints each time and its time per
tensor (µs), so growth is visible as a rising µs/tensor; then the raw write and read of the same
bytes (``os.write``/``os.read``, the physical limit).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import barrier_time, raw_read, raw_write, spawn_ranks

EXPERTS = 64
HIDDEN, FFN = 16, 32  # small weights: what is measured is the cost per tensor, not bytes
DENSE_PER_LAYER = 5  # qkv, proj, two layer norms, router (TP-split or replicated alike)


# --------------------------------------------------------------------------- the state dicts


def layers_for(tensors: int, world: int, ep: int, layout: str, dense: str) -> int:
    """The layer count giving about ``tensors`` tensors per rank."""
    per_layer = DENSE_PER_LAYER + (2 * EXPERTS // ep if layout == "sequential" else 2)
    return max(1, round(tensors / per_layer))


def moe_state(
    rank: int,
    world: int,
    layers: int,
    *,
    layout: str = "sequential",
    ep: int = 2,
    etp: int = 1,
    dense: str = "tp",
    with_data: bool = True,
    ep_shift: int = 0,
    cls=None,
) -> dict:
    """One rank's sharded state dict of a MoE GPT whose expert-parallel rank is shifted by
    ``ep_shift`` (a load where every rank asks for another rank's experts). ``cls``: the
    ``ShardedTensor`` class (distckpt's, or megatron-core's for its own save and load)."""
    if cls is None:
        from distckpt import ShardedTensor as cls
    if world % (ep * etp):
        raise SystemExit(f"--ep {ep} x --etp {etp} must divide the world size {world}")
    g = torch.Generator().manual_seed(1000 + rank)
    local_experts = EXPERTS // ep
    ep_rank = (rank // etp + ep_shift) % ep
    etp_rank = rank % etp
    edp_rank = rank // (ep * etp)
    tp = world if dense == "tp" else 1
    tp_rank = rank if dense == "tp" else 0
    L, h, f = layers, HIDDEN, FFN

    def make(*shape):
        if not with_data:
            return torch.empty(shape, dtype=torch.bfloat16)
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    sd = {}
    dense_replica = (0, 0, 0) if dense == "tp" else (0, 0, rank)
    for layer in range(L):
        lay = (0, layer, L)
        pre = f"decoder.layers.{layer}"
        sd[f"{pre}.qkv"] = cls.from_rank_offsets(
            "decoder.layers.self_attention.linear_qkv.weight",
            make(3 * h // tp, h),
            lay,
            (1, tp_rank, tp),
            replica_id=dense_replica,
            prepend_axis_num=1,
        )
        sd[f"{pre}.proj"] = cls.from_rank_offsets(
            "decoder.layers.self_attention.linear_proj.weight",
            make(h, h // tp),
            lay,
            (2, tp_rank, tp),
            replica_id=dense_replica,
            prepend_axis_num=1,
        )
        for name in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
            sd[f"{pre}.{name}"] = cls.from_rank_offsets(
                f"decoder.layers.{name}", make(h), lay, replica_id=(0, 0, rank), prepend_axis_num=1
            )
        sd[f"{pre}.router"] = cls.from_rank_offsets(
            "decoder.layers.mlp.router.weight",
            make(EXPERTS, h),
            lay,
            replica_id=(0, 0, rank),
            prepend_axis_num=1,
        )
        first = ep_rank * local_experts
        if layout == "grouped":
            sd[f"{pre}.w1"] = cls.from_rank_offsets(
                "decoder.layers.mlp.experts.weight1",
                make(local_experts, f // etp, h),
                lay,
                (1, ep_rank, ep),
                (2, etp_rank, etp),
                replica_id=(0, 0, edp_rank),
                prepend_axis_num=1,
            )
            sd[f"{pre}.w2"] = cls.from_rank_offsets(
                "decoder.layers.mlp.experts.weight2",
                make(local_experts, h, f // etp),
                lay,
                (1, ep_rank, ep),
                (3, etp_rank, etp),
                replica_id=(0, 0, edp_rank),
                prepend_axis_num=1,
            )
            continue
        for e in range(first, first + local_experts):
            expert = (1, e, EXPERTS)
            sd[f"{pre}.e{e}.fc1"] = cls.from_rank_offsets(
                "decoder.layers.mlp.experts.linear_fc1.weight",
                make(f // etp, h),
                lay,
                expert,
                (2, etp_rank, etp),
                replica_id=(0, 0, edp_rank),
                prepend_axis_num=2,
            )
            sd[f"{pre}.e{e}.fc2"] = cls.from_rank_offsets(
                "decoder.layers.mlp.experts.linear_fc2.weight",
                make(h, f // etp),
                lay,
                expert,
                (3, etp_rank, etp),
                replica_id=(0, 0, edp_rank),
                prepend_axis_num=2,
            )
    return sd


def one_rank_request(layers: int, layout: str) -> dict:
    """Everything, asked for by one rank expert by expert (EP=1, TP=1): a conversion's request."""
    return moe_state(0, 1, layers, layout=layout, ep=1, etp=1, dense="tp", with_data=False)


def _zeros(sd: dict) -> dict:
    from dataclasses import replace

    return {k: replace(sh, data=torch.zeros_like(sh.data)) for k, sh in sd.items()}


# --------------------------------------------------------------------------- megatron-core


def _megatron():
    """megatron-core's ``dist_checkpointing`` and ``ShardedTensor``, runnable on a CPU (its save
    calls ``torch.cuda.synchronize`` and ``torch.cuda.current_device`` for 1-element collective
    tensors: both answered for the CPU); None when it is not installed."""
    try:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
    except ImportError:
        return None
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    return dist_checkpointing, ShardedTensor


# --------------------------------------------------------------------------- one size, all ranks


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as tdist

    import distckpt
    from distckpt.mapping import is_main_replica
    from distckpt.strategies.async_utils import AsyncCallsQueue

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    layers = args.layers
    opts = dict(layout=args.layout, ep=args.ep, etp=args.etp, dense=args.dense)
    sd = moe_state(rank, world, layers, **opts)
    shifted = moe_state(rank, world, layers, with_data=False, ep_shift=1, **opts)
    root = Path(args.dir)
    times: dict = {}

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    mine = [sh.data for sh in sd.values() if is_main_replica(sh.replica_id)]
    megatron = _megatron() if len(sd) <= args.megatron_max else None
    prof = cProfile.Profile() if args.profile and rank == 0 else None

    def timed(name, fn, *a, **k):
        if prof is not None and name == args.profile:
            prof.enable()
        seconds = barrier_time(fn, *a, **k)[0]
        if prof is not None:
            prof.disable()
        record(name, seconds)

    for rep in range(-1, args.reps):
        if rep == 0:
            times.clear()
        ckpt = root / "ckpt"
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
        tdist.barrier()
        timed("save", distckpt.save, sd, ckpt)
        timed("load", distckpt.load, _zeros(sd), ckpt)
        timed("load, EP shifted", distckpt.load, _zeros(shifted), ckpt)
        actx = root / "ckpt_async"
        if rank == 0:
            shutil.rmtree(actx, ignore_errors=True)
        calls = AsyncCallsQueue()
        tdist.barrier()
        if prof is not None and args.profile == "async":
            prof.enable()
        t0 = time.perf_counter()
        request = distckpt.save(sd, actx, async_sharded_save=True)
        blocking = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        calls.schedule_async_request(request)
        calls.maybe_finalize_async_calls(blocking=True)
        calls.close()
        out = [None] * world
        tdist.all_gather_object(out, blocking)
        record("async save, blocking", max(out))
        raw = root / f"raw_{rank}.bin"
        record("raw write", barrier_time(raw_write, raw, mine)[0])
        record("raw read", barrier_time(raw_read, raw, [torch.zeros_like(t) for t in mine])[0])
        raw.unlink()
        if megatron is not None:
            mcore, mcls = megatron
            msd = moe_state(rank, world, layers, cls=mcls, **opts)
            mckpt = root / "ckpt_mcore"
            if rank == 0:
                shutil.rmtree(mckpt, ignore_errors=True)
                mckpt.mkdir(parents=True)
            tdist.barrier()
            record("megatron-core save", barrier_time(mcore.save, msd, str(mckpt))[0])
            req = moe_state(rank, world, layers, cls=mcls, with_data=False, **opts)
            for sh in req.values():
                sh.data = torch.zeros(sh.local_shape, dtype=sh.dtype)
            record("megatron-core load", barrier_time(mcore.load, req, str(mckpt))[0])
    if rank == 0:
        out = {k: statistics.median(v) for k, v in times.items()}
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            out["profile"] = text.getvalue()
        queue.put(out)
    tdist.barrier()
    tdist.destroy_process_group()


def _one_rank_load(args) -> float:
    """Seconds to load the whole checkpoint in this process, expert by expert (no process group)."""
    import distckpt

    req = _zeros(one_rank_request(args.layers, args.layout))
    t0 = time.perf_counter()
    distckpt.load(req, Path(args.dir) / "ckpt")
    return time.perf_counter() - t0, len(req)


def measure(args, tensors: int) -> dict:
    args.layers = layers_for(tensors, args.ranks, args.ep, args.layout, args.dense)
    per_rank = len(
        moe_state(
            0,
            args.ranks,
            args.layers,
            with_data=False,
            layout=args.layout,
            ep=args.ep,
            etp=args.etp,
            dense=args.dense,
        )
    )
    result = spawn_ranks(_rank_main, args.ranks, args)
    one = [_one_rank_load(args) for _ in range(max(1, args.reps))]
    result["load to 1 rank"] = statistics.median(t for t, _ in one)
    result["tensors per rank"] = per_rank
    result["tensors (1 rank)"] = one[0][1]
    result["layers"] = args.layers
    shutil.rmtree(args.dir, ignore_errors=True)
    return result


COLUMNS = [
    "save",
    "async save, blocking",
    "load",
    "load, EP shifted",
    "load to 1 rank",
    "megatron-core save",
    "megatron-core load",
]


def report(rows: list) -> str:
    head = (
        "| tensors/rank | layers | "
        + " | ".join(COLUMNS)
        + " | load ÷ save | megatron load ÷ load | raw write / read |"
    )
    lines = [head, "|" + "---:|" * (len(COLUMNS) + 5)]
    for r in rows:
        n = r["tensors per rank"]
        cells = []
        for c in COLUMNS:
            if c not in r:
                cells.append("—")
                continue
            count = r["tensors (1 rank)"] if c == "load to 1 rank" else n
            cells.append(f"{r[c]:.3f} s ({1e6 * r[c] / count:.0f} µs)")
        ratio = f"{r['load'] / r['save']:.2f}"
        mratio = f"{r['megatron-core load'] / r['load']:.1f}×" if "megatron-core load" in r else "—"
        raw = f"{1e3 * r['raw write']:.1f} / {1e3 * r['raw read']:.1f} ms"
        lines.append(f"| {n} | {r['layers']} | " + " | ".join(cells) + f" | {ratio} | {mratio} | {raw} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--tensors", default="1000,3000,6000,12000,20000", help="tensors per rank, comma-separated"
    )
    parser.add_argument("--layout", choices=["sequential", "grouped"], default="sequential")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    parser.add_argument("--dense", choices=["tp", "replicated"], default="tp")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--megatron-max", type=int, default=6500, help="megatron-core runs up to this many tensors per rank"
    )
    parser.add_argument("--dir", default="/dev/shm/distckpt-moe")
    parser.add_argument(
        "--profile",
        choices=["save", "async", "load", "load, EP shifted"],
        help="print a cProfile of rank 0's calls of this step (cumulative order)",
    )
    args = parser.parse_args()
    if args.ep is None:
        args.ep = args.ranks // args.etp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in (int(x) for x in args.tensors.split(",")):
        rows.append(measure(args, n))
        print(rows[-1].pop("profile", ""), end="")
        print(report(rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\n{args.ranks} ranks, layout {args.layout}, EP {args.ep}, expert-TP {args.etp}, "
        f"dense {args.dense}, {EXPERTS} experts, median of {args.reps}:"
    )
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
