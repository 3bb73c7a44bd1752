"""The fixed cost of a save and a load: a 200-tensor state dict of small tensors.

    python -m bench.fixed_cost [--ranks 1|2] [--tensors 200] [--reps 20] [--profile save|load]

Each rank holds ``--tensors`` TP-split fp32 tensors of 1 KiB per rank (so bytes are negligible
and what is left is the fixed cost: planning, validation, metadata, collectives, commit) and a
few common values. The checkpoint goes to tmpfs (``--dir``). Prints the median and the best
save and load time (ms) over ``--reps`` runs after one warm-up, measured on rank 0 between
barriers. ``--profile save`` (or ``load``) runs cProfile on rank 0 over the repetitions and
prints the functions with the most own time. ``--phases`` also prints each rank's median time in
each phase of the save and the load (``distckpt.last_timings``): on several ranks, where the
work ends and the waiting for the other ranks begins.
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
import torch.multiprocessing as mp

from bench.common import free_port


def state(rank: int, world: int, tensors: int, with_data: bool = True) -> dict:
    from distckpt import ShardedTensor

    sd = {"common": {"step": 7, "lr": 1e-4}}
    for i in range(tensors):
        t = torch.full((256,), float(i)) if with_data else torch.empty(256)
        sd[f"layer{i}.weight"] = ShardedTensor.from_rank_offsets(f"layer{i}.weight", t, (0, rank, world))
    return sd


def _run(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as tdist

    import distckpt

    if world > 1:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def barrier():
        if world > 1:
            tdist.barrier()

    times = {"save": [], "load": []}
    phases = {"save": {}, "load": {}}

    def note(op):
        for name, sec in distckpt.last_timings(op).phases.items():
            phases[op].setdefault(name, []).append(sec)

    prof = cProfile.Profile() if (args.profile and rank == 0) else None
    for rep in range(args.reps + 1):
        ckpt = Path(args.dir) / f"c{rep}"
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
            ckpt.mkdir(parents=True)
        barrier()
        sd = state(rank, world, args.tensors)
        if prof is not None and args.profile == "save" and rep:
            prof.enable()
        t0 = time.perf_counter()
        distckpt.save(sd, ckpt)
        barrier()
        t_save = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        sd = state(rank, world, args.tensors, with_data=False)
        barrier()
        if prof is not None and args.profile == "load" and rep:
            prof.enable()
        t0 = time.perf_counter()
        distckpt.load(sd, ckpt)
        barrier()
        t_load = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        if rep:
            times["save"].append(t_save)
            times["load"].append(t_load)
            note("save")
            note("load")
        if rank == 0 and rep > 1:
            shutil.rmtree(Path(args.dir) / f"c{rep - 1}", ignore_errors=True)
    medians = {op: {k: statistics.median(v) for k, v in ph.items()} for op, ph in phases.items()}
    by_rank = [medians]
    if world > 1:
        by_rank = [None] * world
        tdist.all_gather_object(by_rank, medians)
    if rank == 0:
        out = io.StringIO()
        if prof is not None:
            pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(args.top)
        queue.put((times, out.getvalue(), by_rank))
    if world > 1:
        tdist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dir", default="/dev/shm/distckpt-fixed-cost")
    parser.add_argument("--profile", choices=["save", "load"], default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--sort",
        choices=["tottime", "cumulative"],
        default="tottime",
        help="order of the profile: own time or time including callees",
    )
    parser.add_argument("--phases", action="store_true", help="print each rank's median per phase")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    times, profile, by_rank = queue.get()
    for p in procs:
        p.join()
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{args.tensors} tensors, {args.ranks} rank(s), {args.reps} reps (ms):")
    for what, ts in times.items():
        print(f"  {what}: median {1e3 * statistics.median(ts):.1f}  best {1e3 * min(ts):.1f}")
    if args.phases:
        print(phase_table(by_rank))
    if profile:
        print(profile)
    return 0


def phase_table(by_rank) -> str:
    """Each phase's median per rank, ms (``by_rank``: per rank, op -> phase -> seconds)."""
    head = " / ".join(f"rank {r}" for r in range(len(by_rank)))
    lines = [f"| op | phase | {head} ms |", "|---|---|---:|"]
    for op in ("save", "load"):
        names = list(dict.fromkeys(n for r in by_rank for n in r[op]))
        for name in names + ["sum"]:
            vals = [sum(r[op].values()) if name == "sum" else r[op].get(name, 0.0) for r in by_rank]
            lines.append(f"| {op} | {name} | {' / '.join(f'{v * 1e3:.2f}' for v in vals)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
