"""What the default load checks cost: a load with its CRC32C checks (the default) against the same
load with ``verify=False`` and against a raw read of the same bytes, in one run.

    python -m bench.checks --dir /dev/shm/distckpt-checks --size-gib 1 --ranks 2 --reps 10

On N gloo ranks it saves the benchmarks' GPT-like state (``bench.common.build_state``, about
``--size-gib`` GiB in total) with each backend, then, for a same-layout and a resharded request
(interleaved TP pieces, as in ``bench.throughput``), alternates per repetition a raw
``os.preadv`` of the rank's bytes (the physical limit), ``load(..., verify=False)`` and the
default ``load``; the order of the two loads flips every
repetition so that neither always reads second. It prints the medians, each load's ratio to the
raw read and the checks' overhead (default ÷ ``verify=False`` − 1).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

import torch

from bench.common import (
    barrier_time,
    build_state,
    empty_like_request,
    model_dims,
    raw_read,
    raw_write,
    spawn_ranks,
)


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import os

    import torch.distributed as tdist

    import distckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    hidden, layers = model_dims(args.size_gib)
    state = build_state(rank, world, hidden, layers)
    tensors = [sh.data for sh in state.values()]
    raw = Path(args.dir) / f"raw_{rank}.bin"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw_write(raw, tensors)
    bufs = [torch.empty_like(t) for t in tensors]
    results = {}
    for backend in args.backends.split(","):
        location = Path(args.dir) / backend
        if rank == 0:
            shutil.rmtree(location, ignore_errors=True)
        tdist.barrier()
        distckpt.save(state, location, sharded_strategy=(backend, 1))
        for case, pieces in (("same layout", 1), ("resharded", 2)):
            request = empty_like_request(build_state(rank, world, hidden, layers, pieces_per_rank=pieces))
            times = {"raw read": [], "verify=False": [], "default": []}
            for rep in range(args.reps + 1):
                order = ("verify=False", "default") if rep % 2 == 0 else ("default", "verify=False")
                t_raw, _ = barrier_time(raw_read, raw, bufs)
                measured = {"raw read": t_raw}
                for mode in order:
                    verify = False if mode == "verify=False" else None
                    measured[mode], _ = barrier_time(distckpt.load, request, location, verify=verify)
                if rep:  # the first repetition warms the page cache and the allocator
                    for mode, t in measured.items():
                        times[mode].append(t)
            results[f"{backend} {case}"] = {m: statistics.median(v) for m, v in times.items()}
    raw.unlink()
    if rank == 0:
        queue.put(results)
    tdist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-checks")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--backends", default="torch_dist,zarr")
    args = parser.parse_args()
    results = spawn_ranks(rank_main, args.ranks, args, lambda: shutil.rmtree(args.dir, ignore_errors=True))
    print(f"{args.ranks} ranks, {args.size_gib:g} GiB in total, medians of {args.reps} (ms)\n")
    print("| load | raw read | verify=False | default | default's speed ÷ raw read's | checks' overhead |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in results.items():
        print(
            f"| {name} | {m['raw read'] * 1e3:.1f} | {m['verify=False'] * 1e3:.1f} | "
            f"{m['default'] * 1e3:.1f} "
            f"| {m['raw read'] / m['default']:.2f}x | {100 * (m['default'] / m['verify=False'] - 1):+.1f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
