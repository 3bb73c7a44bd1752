"""Benchmark the local tier (distckpt.local) against persistent checkpoints, in one run.

    python -m bench.local_tier --dir /dev/shm/bench-local --ranks 2 --node-size 1 --mib-per-rank 256

On ``--ranks`` gloo ranks (one process each, ``--node-size`` ranks per simulated node, each node
its own directory under ``--dir``), every rank holds ``--mib-per-rank`` MiB of TP-sharded tensors
(bf16 weights, fp32 optimizer states) plus an RNG ShardedObject and common values. It measures,
each time from a barrier before to a barrier after (so the slowest rank counts):

- raw:   ``os.write`` + fsync, and ``os.read`` (preadv), of the same per-rank bytes: the limit
- local save, replication factor 1 (own copy only) and ``--factor`` (own copy + replicas sent to
  peers on other nodes over gloo), until committed on every rank
- persistent ``distckpt.save`` of the same state (``torch_dist``), into ``--dir/persistent``
- recovery from own local copies (``find_latest`` + ``load``)
- recovery with one node lost (its directory deleted): its ranks fetch their pieces from peers
- recovery from the persistent checkpoint (``distckpt.load``), and with ``verify=True`` (every
  byte checked against its CRC32C, as the local tier always does)

and prints seconds, GiB/s per rank and the ratios. Every load fills the same preallocated tensors
in place and is checked bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

from bench.common import barrier_time, raw_read, raw_write  # the same raw baseline as every benchmark
from distckpt.examples.launch import launch


def build_state(rank: int, world: int, mib: int, with_data: bool = True) -> dict:
    """``mib`` MiB on this rank: per layer a bf16 weight and two fp32 optimizer states, TP-split."""
    from distckpt import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(77 + rank)
    cols = 1024
    per_layer = cols * (2 + 4 + 4)  # bytes per row of the three tensors
    rows = 1024
    layers = max(1, round(mib * 2**20 / (rows * per_layer)))
    sd = {}
    for layer in range(layers):
        for name, dtype in (
            ("weight", torch.bfloat16),
            ("exp_avg", torch.float32),
            ("exp_avg_sq", torch.float32),
        ):
            shape = (rows, cols)
            data = torch.randn(shape, generator=g).to(dtype) if with_data else torch.zeros(shape, dtype=dtype)
            sd[f"layer{layer}.{name}"] = ShardedTensor.from_rank_offsets(
                f"layer{layer}.{name}", data, (0, rank, world)
            )
    sd["rng"] = ShardedObject(
        "rng", {"state": torch.arange(16) + rank} if with_data else None, (world,), (rank,)
    )
    sd["iteration"] = 100
    return sd


def _tensors(sd) -> list:
    return [v.data for v in sd.values() if hasattr(v, "data") and isinstance(v.data, torch.Tensor)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _same(loaded: dict, reference: dict) -> bool:
    return all(
        torch.equal(
            loaded[k].view(torch.uint8) if loaded[k].dtype == torch.bfloat16 else loaded[k],
            reference[k].data.view(torch.uint8)
            if reference[k].data.dtype == torch.bfloat16
            else reference[k].data,
        )
        for k in reference
        if k.startswith("layer")
    )


def rank_main(args: argparse.Namespace) -> list:
    """Every rank: ``--warmup`` unrecorded passes (first-call costs: threads, caches, gloo
    connections, and the first touch of fresh tmpfs memory, which in a VM costs several times a
    normal write), then ``--reps`` measured passes."""
    for i in range(args.warmup):
        _measure(args, Path(args.dir) / f"warmup{i}", args.mib_per_rank)
    return [_measure(args, Path(args.dir) / f"run{i}", args.mib_per_rank) for i in range(args.reps)]


def _measure(args: argparse.Namespace, root: Path, mib: int) -> dict:
    import distckpt
    from distckpt import dist
    from distckpt.local import LocalCheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    node = root / f"node{rank // args.node_size}"
    node.mkdir(parents=True, exist_ok=True)
    sd = build_state(rank, world, mib)
    reference = {k: v for k, v in sd.items() if k.startswith("layer")}
    request = build_state(rank, world, mib, with_data=False)
    targets = _tensors(request)
    nbytes = _nbytes(_tensors(sd))
    out = {"bytes_per_rank": nbytes}

    raw = node / f"raw{rank}.bin"
    out["raw_write"], _ = barrier_time(raw_write, raw, _tensors(sd))
    out["raw_read"], _ = barrier_time(raw_read, raw, targets)
    os.remove(raw)

    def manager(directory: Path, factor: int) -> LocalCheckpointManager:
        return LocalCheckpointManager(
            directory / f"node{rank // args.node_size}", node_size=args.node_size, replication_factor=factor
        )

    f1, fn = manager(root / "f1", 1), manager(root / "local", args.factor)
    out["local_save_f1"], _ = barrier_time(f1.save, sd, 1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "f1", ignore_errors=True)
    dist.barrier()
    out[f"local_save_f{args.factor}"], _ = barrier_time(fn.save, sd, 1)
    out["persistent_save"], _ = barrier_time(distckpt.save, sd, root / "persistent")

    def local_load() -> tuple:
        fn.find_latest()
        return fn.load(request), fn.last_load.source

    # The bit-exact checks run outside the timed part, as for the persistent load.
    out["recover_local"], (loaded, source) = barrier_time(local_load)
    out["recover_local_ok"] = _same(loaded, reference) and source == "local"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "local" / "node1")
    dist.barrier()
    out["recover_peers"], (loaded, source) = barrier_time(local_load)
    out["recover_peers_source"] = source
    out["recover_peers_ok"] = _same(loaded, reference)
    out["recover_persistent"], loaded = barrier_time(distckpt.load, request, root / "persistent")
    out["recover_persistent_ok"] = _same(loaded, reference)
    out["recover_persistent_verified"], loaded = barrier_time(
        distckpt.load, request, root / "persistent", verify=True
    )
    out["recover_persistent_ok"] = out["recover_persistent_ok"] and _same(loaded, reference)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-bench-local")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--node-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3, help="measured passes; medians are printed")
    parser.add_argument("--factor", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        results = launch(args.ranks, rank_main, args, timeout=1200)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Each figure is already the slowest rank's (barrier to barrier): rank 0's copy is the run's.
    passes = results[0]
    r = {k: statistics.median(p[k] for p in passes) for k in passes[0] if isinstance(passes[0][k], float)}
    r["bytes_per_rank"] = passes[0]["bytes_per_rank"]
    gib = r["bytes_per_rank"] / 2**30
    f = args.factor
    rows = [
        ("raw os.write + fsync", r["raw_write"], None),
        ("raw os.read", r["raw_read"], None),
        ("local save, own copy only (factor 1)", r["local_save_f1"], r["raw_write"]),
        (f"local save + replication (factor {f})", r[f"local_save_f{f}"], r["raw_write"]),
        ("persistent distckpt.save (torch_dist)", r["persistent_save"], r["raw_write"]),
        ("recover from own local copies", r["recover_local"], r["raw_read"]),
        ("recover with node 1 lost (from peers)", r["recover_peers"], r["raw_read"]),
        ("recover from persistent (distckpt.load)", r["recover_persistent"], r["raw_read"]),
        ("  same, verify=True (CRC32C, as local)", r["recover_persistent_verified"], r["raw_read"]),
    ]
    print(
        f"{args.ranks} gloo ranks, {args.node_size} per node, {gib * 1024:.0f} MiB per rank, "
        f"replication factor {f}, storage {args.dir}; median of {args.reps} passes after "
        f"{args.warmup} warm-up"
    )
    print(f"{'':42} {'seconds':>8} {'GiB/s/rank':>10} {'x raw':>7}")
    for name, seconds, limit in rows:
        ratio = f"{seconds / limit:7.2f}" if limit else f"{'':>7}"
        print(f"{name:42} {seconds:8.3f} {gib / seconds:10.2f} {ratio}")
    print(
        f"local save (factor {f}) / persistent save:     {r[f'local_save_f{f}'] / r['persistent_save']:.2f}"
    )
    print(f"local save (factor 1) / persistent save:       {r['local_save_f1'] / r['persistent_save']:.2f}")
    print(f"recover local / recover persistent:           {r['recover_local'] / r['recover_persistent']:.2f}")
    print(
        "recover local / recover persistent verified:  "
        f"{r['recover_local'] / r['recover_persistent_verified']:.2f}"
    )
    print(f"recover from peers / recover persistent:      {r['recover_peers'] / r['recover_persistent']:.2f}")
    every = [p for rank_passes in results for p in rank_passes]
    checks = [
        all(p["recover_local_ok"] and p["recover_peers_ok"] and p["recover_persistent_ok"] for p in every)
    ]
    sources = [rank_passes[-1]["recover_peers_source"] for rank_passes in results]
    print(f"bit-exact: {checks[0]}; sources with node 1 lost: {sources}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": results}, indent=1))
    return 0 if checks[0] else 1


if __name__ == "__main__":
    sys.exit(main())
