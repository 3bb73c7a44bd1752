"""Cooperative load: when data-parallel replicas need the same bytes, read them once.

    python -m bench.coop --ranks 4 --size-gib 0.25 --reps 3 --bandwidth-mib 200,800 --moto

Every rank asks for the whole model (TP1 x DP-world: each rank a replica), from a checkpoint
saved TP-split over the ranks. Two ways to load it:

- plain ``distckpt.load``: every rank reads every byte from storage, so storage serves
  ``world`` x the model;
- ``FullyParallelLoadStrategyWrapper`` (cooperative): each stored piece is read by one rank and
  sent to the others over the process group (gloo here), so storage serves the model once.

Storages, in one run:

- ``tmpfs``: a local directory on /dev/shm (the mmap fast path). Reading is a memory copy, faster
  than any exchange: the worst case for cooperation.
- ``throttled <B> MiB/s``: the same files through a store that serves all ranks together at
  ``B`` MiB/s (one token bucket shared by every process: a shared file system or a bucket
  prefix at its limit). It has no mmap, so the loader takes its object-store path (ranged reads).
- ``s3 (moto)`` with ``--moto``: a local moto S3 server on 127.0.0.1.

For each it prints the median seconds of both loads, the bytes each storage served per byte of
the model, and the speed-up of the cooperative load. Raw baseline in the same run: ``os.read`` of
the model's bytes once per rank on tmpfs (the memory-copy limit every load is bound by).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.common import (
    barrier_time,
    build_state,
    empty_like_request,
    free_port,
    model_dims,
    raw_read,
    raw_write,
    start_moto,
)
from distckpt.storage.local import LocalStore


class ThrottledStore(LocalStore):
    """A local directory served like a remote store at a bandwidth shared by every process.

    ``clock`` is a shared double: the time at which the link is next free. A read of ``n`` bytes
    reserves ``n / rate`` seconds of the link after that and sleeps until its slot ends, so all
    ranks together never get more than ``rate`` bytes per second.
    """

    supports_mmap = False  # the loader takes the object-store path: ranged reads through get_ranges
    # No per-request latency here, only bandwidth: a gap between two wanted ranges costs its bytes
    # and a second request costs nothing, so ranges are never merged across gaps (an object store
    # merges gaps up to its ``coalesce`` option, 1 MiB by default, to save round trips).
    coalesce = 0

    def __init__(self, root, rate: float, clock, lock):
        super().__init__(root)
        self.rate, self.clock, self.lock = rate, clock, lock
        self.served = 0
        self._served_lock = threading.Lock()

    def _pay(self, n: int) -> None:
        with self.lock:
            start = max(time.time(), self.clock.value)
            self.clock.value = start + n / self.rate
            end = self.clock.value
        with self._served_lock:
            self.served += n
        delay = end - time.time()
        if delay > 0:
            time.sleep(delay)

    def get(self, name: str) -> bytes:
        data = super().get(name)
        self._pay(len(data))
        return data

    def get_ranges(self, name, starts, lengths):
        out = super().get_ranges(name, starts, lengths)
        self._pay(sum(lengths))
        return out


def _check(req, ref) -> None:
    for k, sh in req.items():
        if not torch.equal(sh.data, ref[k]):
            raise RuntimeError(f"cooperative bench: {k} differs between loads")


def _rank_main(rank, world, port, args, clock, lock, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun (the variable came too late)
    import torch.distributed as tdist

    import distckpt
    from distckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    hidden, layers = model_dims(args.size_gib)
    sd = build_state(rank, world, hidden, layers)
    full = build_state(rank, world, hidden, layers, with_data=False, full=True)
    model_bytes = sum(sh.data.numel() * sh.data.element_size() for sh in full.values())
    tensors = [sh.data for sh in empty_like_request(full).values()]
    root = Path(args.dir)
    local = root / "ckpt"
    if rank == 0:
        shutil.rmtree(local, ignore_errors=True)
    tdist.barrier()
    distckpt.save(sd, local)
    locations = [("tmpfs", lambda: local)]
    for mib in args.bandwidth_mib:
        locations.append(
            (f"throttled {mib:g} MiB/s", lambda mib=mib: ThrottledStore(local, mib * 2**20, clock, lock))
        )
    if args.moto:
        url = f"{args.s3_url.rstrip('/')}/coop"
        distckpt.save(sd, url)
        locations.append(("s3 (moto)", lambda: url))
    times, served, reference = {}, {}, None
    for rep in range(-args.warmup, args.reps):
        raw = root / f"raw_{rank}.bin"
        raw_write(raw, tensors)
        t, _ = barrier_time(raw_read, raw, tensors)
        raw.unlink()
        if rep >= 0:
            times.setdefault("raw os.read of the model, each rank", []).append(t)
        for name, where in locations:
            for mode in ("plain", "cooperative"):
                inner = TorchDistLoadShardedStrategy()
                strategy = inner if mode == "plain" else FullyParallelLoadStrategyWrapper(inner)
                req = empty_like_request(full)
                t, _ = barrier_time(distckpt.load, req, where(), sharded_strategy=strategy)
                if reference is None:
                    reference = {k: sh.data.clone() for k, sh in req.items()}
                else:
                    _check(req, reference)
                if rep >= 0:
                    times.setdefault(f"{name}: {mode}", []).append(t)
                    out = [None] * world
                    tdist.all_gather_object(out, inner.bytes_read)
                    served[f"{name}: {mode}"] = sum(out) / model_bytes
                req = None
    tdist.barrier()
    if rank == 0:
        shutil.rmtree(local, ignore_errors=True)
        queue.put(
            {
                "seconds": {k: statistics.median(v) for k, v in times.items()},
                "all_seconds": times,
                "served per model byte": served,
                "model bytes": model_bytes,
                "ranks": world,
                "locations": [n for n, _ in locations],
            }
        )
    tdist.barrier()
    tdist.destroy_process_group()


def report(res) -> str:
    sec, served = res["seconds"], res["served per model byte"]
    gib = res["model bytes"] / 2**30
    lines = [
        f"{res['ranks']} ranks, each loading the whole model ({gib:.3f} GiB) saved TP-split; medians",
        "",
        "| storage | plain load s | cooperative load s | storage bytes per model byte (plain / coop) "
        "| cooperative speed-up |",
        "|---|---:|---:|---|---:|",
    ]
    for name in res["locations"]:
        p, c = sec[f"{name}: plain"], sec[f"{name}: cooperative"]
        lines.append(
            f"| {name} | {p:.3f} | {c:.3f} | {served[f'{name}: plain']:.2f} / "
            f"{served[f'{name}: cooperative']:.2f} | {p / c:.2f}x |"
        )
    lines.append(
        f"\nraw os.read of the model on each rank (tmpfs, same run): "
        f"{sec['raw os.read of the model, each rank']:.3f} s"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-coop")
    parser.add_argument("--size-gib", type=float, default=0.25, help="model size (each rank loads all of it)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--bandwidth-mib",
        default="200,1000",
        help="aggregate read bandwidths of the throttled store, MiB/s (comma-separated)",
    )
    parser.add_argument("--moto", action="store_true", help="also load from a local moto S3 server")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    args.bandwidth_mib = [float(x) for x in args.bandwidth_mib.split(",") if x]
    args.s3_url = "s3://coop/run"
    server = start_moto(args.s3_url) if args.moto else None
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue, clock, lock = ctx.SimpleQueue(), ctx.Value("d", 0.0, lock=False), ctx.Lock()
    try:
        mp.spawn(_rank_main, args=(args.ranks, port, args, clock, lock, queue), nprocs=args.ranks)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        if server is not None:
            server.stop()
    res = queue.get()
    res["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coop.json").write_text(json.dumps(res, indent=2))
    print(report(res))
    print(f"\nwrote {out / 'coop.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
