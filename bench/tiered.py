"""Benchmark tiered checkpoints (distckpt.tiered) against local-only and direct object-store saves.

    python -m bench.tiered --dir /dev/shm/bench-tiered --ranks 2 --mib-per-rank 256 --remote-mib-s 200

The remote tier is a local moto S3 server (started here, on 127.0.0.1) behind a
``ThrottledStore`` that paces every rank's reads and writes to ``--remote-mib-s`` MiB/s: moto is
a functional stand-in, not a speed reference, so the throttle sets the remote's speed (as long
as moto keeps up with it). On ``--ranks`` gloo ranks, each holding ``--mib-per-rank`` MiB of
TP-sharded tensors (bench.local_tier's state), every figure is timed from a barrier before to a
barrier after (so the slowest rank counts):

- raw: ``os.write`` + fsync, and ``os.preadv``, of the same per-rank bytes under ``--dir``: the limit
- local-only save: ``distckpt.save`` into ``--dir`` (sync), and async (``async_sharded_save=True``
  scheduled on an ``AsyncCallsQueue``: the blocking part; then until committed)
- tiered save (``TieredCheckpointManager.save``, local tier under ``--dir``): the call only (the
  upload goes on in the background), then until ``close()`` has the upload committed remotely;
  the same with ``async_sharded_save=True``
- direct object-store save: ``distckpt.save`` into the throttled store (blocking: all of it)
- restart: ``find_latest()`` + ``load()`` of a fresh manager from the local copies; the same with
  the local copies removed (remote only, throttled); ``distckpt.load`` of the remote checkpoint
  directly; ``distckpt.load`` of the local-only checkpoint

and prints medians of ``--reps`` passes, the ratios (tiered / local-only blocking: the goal is
at most 1.1) and the save phases (``distckpt.last_timings``) of the last pass. Every load fills
zeroed tensors and is checked bit-exact; each tiered load's sources are checked too.
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

from bench.common import barrier_time, raw_read, raw_write, start_moto
from bench.local_tier import build_state
from distckpt.examples.launch import launch

GOAL = 1.1
"""Tiered save blocking time over local-only save blocking time: the goal of issue #37."""

# Row label, result key, the key it is compared with (None: no ratio), what the ratio is of.
ROWS = [
    ("raw os.write + fsync", "raw_write", None),
    ("raw os.read", "raw_read", None),
    ("local-only save", "local_save", "raw_write"),
    ("tiered save, blocking", "tiered_save", "local_save"),
    ("tiered save, until committed remotely", "tiered_committed", "local_save"),
    ("local-only async save, blocking", "local_async", "local_save"),
    ("tiered async save, blocking", "tiered_async", "local_async"),
    ("tiered async save, until committed", "tiered_async_committed", "local_save"),
    ("direct object-store save", "direct_save", "local_save"),
    ("restart: tiered, local copies", "restart_local", "raw_read"),
    ("restart: tiered, remote only", "restart_remote", "raw_read"),
    ("restart: distckpt.load of the remote", "load_remote", "raw_read"),
    ("restart: distckpt.load, local-only", "load_local", "raw_read"),
]

RATIOS = [
    (f"tiered save blocking / local-only save (goal <= {GOAL})", "tiered_save", "local_save"),
    ("tiered async blocking / local-only async blocking", "tiered_async", "local_async"),
    ("tiered save blocking / direct object-store save", "tiered_save", "direct_save"),
    ("tiered until committed / direct object-store save", "tiered_committed", "direct_save"),
    ("restart local copies / restart remote only", "restart_local", "restart_remote"),
    ("restart local copies / distckpt.load local-only", "restart_local", "load_local"),
]


def tensors_of(sd) -> list:
    return [v.data for v in sd.values() if isinstance(getattr(v, "data", None), torch.Tensor)]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bit_exact(loaded: dict, reference: dict) -> bool:
    """Every tensor of ``reference`` (a state dict) equal, byte for byte, to the loaded one."""
    for key, sh in reference.items():
        want = getattr(sh, "data", None)
        if not isinstance(want, torch.Tensor):
            continue
        got = loaded.get(key)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return False
        if not torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
            return False
    return True


def zero(request) -> None:
    for t in tensors_of(request):
        t.zero_()


def rank_main(args: argparse.Namespace) -> list:
    """Every rank: ``--warmup`` unrecorded passes (threads, connections, staging buffers, the
    first touch of fresh tmpfs pages), then ``--reps`` measured ones."""
    for i in range(args.warmup):
        _measure(args, f"warmup{i}")
    return [_measure(args, f"run{i}") for i in range(args.reps)]


def _measure(args: argparse.Namespace, name: str) -> dict:
    import distckpt
    from distckpt import dist
    from distckpt.storage import open_store
    from distckpt.storage.throttled import ThrottledStore
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.tiered import TieredCheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir) / name
    root.mkdir(parents=True, exist_ok=True)
    rate = args.remote_mib_s * 2**20
    # Each rank's own throttle: --remote-mib-s is per rank, as a per-node link share would be.
    remote = ThrottledStore(
        open_store(f"s3://{args.bucket}/{name}"), write_bytes_per_s=rate, read_bytes_per_s=rate
    )
    sd = build_state(rank, world, args.mib_per_rank)
    request = build_state(rank, world, args.mib_per_rank, with_data=False)
    out: dict = {"bytes_per_rank": nbytes(tensors_of(sd)), "ok": {}, "phases": {}, "sources": {}}

    raw = root / f"raw{rank}.bin"
    out["raw_write"], _ = barrier_time(raw_write, raw, tensors_of(sd))
    out["raw_read"], _ = barrier_time(raw_read, raw, tensors_of(request))
    os.remove(raw)

    # (a) local-only, sync and async
    queue = AsyncCallsQueue()
    out["local_save"], _ = barrier_time(distckpt.save, sd, root / "plain")
    out["phases"]["local-only save"] = str(distckpt.last_timings("save"))

    def schedule(save, *a, **kw):
        queue.schedule_async_request(save(*a, async_sharded_save=True, **kw))

    out["local_async"], _ = barrier_time(schedule, distckpt.save, sd, root / "plain-async")
    out["phases"]["local-only async save"] = str(distckpt.last_timings("async save"))
    barrier_time(queue.maybe_finalize_async_calls, blocking=True)

    # (b) tiered, sync: the call, then until the upload is committed
    tiers = TieredCheckpointManager(remote.child("tiered"), root / "tier-local", keep_local=2)
    out["tiered_save"], _ = barrier_time(tiers.save, sd, 100)
    out["phases"]["tiered save (its distckpt.save)"] = str(distckpt.last_timings("save"))
    closing, _ = barrier_time(tiers.close)
    out["tiered_committed"] = out["tiered_save"] + closing

    # (c) tiered, async: the blocking part, then until committed remotely
    atiers = TieredCheckpointManager(remote.child("tiered-async"), root / "tier-async", keep_local=2)
    out["tiered_async"], _ = barrier_time(schedule, atiers.save, sd, 100)
    out["phases"]["tiered async save"] = str(distckpt.last_timings("async save"))
    finishing, _ = barrier_time(lambda: (queue.maybe_finalize_async_calls(blocking=True), atiers.close()))
    out["tiered_async_committed"] = out["tiered_async"] + finishing
    queue.close()

    # (d) direct object-store save through the same throttle
    out["direct_save"], _ = barrier_time(distckpt.save, sd, remote.child("direct"))
    out["phases"]["direct object-store save"] = str(distckpt.last_timings("save"))

    # (e) restart: a fresh manager each time, as a restarted job would have
    def restart(local_dir: Path):
        mgr = TieredCheckpointManager(remote.child("tiered"), local_dir, keep_local=2)
        iteration = mgr.find_latest()
        return mgr.load(request, iteration), mgr.last_load

    zero(request)
    out["restart_local"], (loaded, report) = barrier_time(restart, root / "tier-local")
    # Only the small files the manifest does not list (metadata.json ...) come from the remote.
    everything = out["bytes_per_rank"]
    out["ok"]["restart_local"] = (
        bit_exact(loaded, sd) and report.local_bytes >= everything > report.remote_bytes
    )
    out["sources"]["restart_local"] = str(report)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "tier-local")
    dist.barrier()
    zero(request)
    out["restart_remote"], (loaded, report) = barrier_time(restart, root / "tier-local")
    out["ok"]["restart_remote"] = (
        bit_exact(loaded, sd) and report.remote_bytes >= everything > report.local_bytes
    )
    out["sources"]["restart_remote"] = str(report)
    zero(request)
    out["load_remote"], loaded = barrier_time(distckpt.load, request, remote.child("direct"))
    out["ok"]["load_remote"] = bit_exact(loaded, sd)
    zero(request)
    out["load_local"], loaded = barrier_time(distckpt.load, request, root / "plain")
    out["ok"]["load_local"] = bit_exact(loaded, sd)

    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        store = open_store(f"s3://{args.bucket}/{name}")
        for obj in store.list():
            store.delete(obj)
    dist.barrier()
    return out


def summarize(results: list) -> dict:
    """Medians over the passes of the figures (rank 0's copy: each is already the slowest rank's,
    barrier to barrier)."""
    passes = results[0]
    r = {key: statistics.median(p[key] for p in passes) for _, key, _ in ROWS}
    r["bytes_per_rank"] = passes[0]["bytes_per_rank"]
    return r


def report(args: argparse.Namespace, results: list) -> tuple:
    """The table, the ratios, the checks and the last pass's phases; and whether every check held."""
    r = summarize(results)
    gib = r["bytes_per_rank"] / 2**30
    lines = [
        f"{args.ranks} gloo ranks, {gib * 1024:.0f} MiB per rank, local tier {args.dir}, remote: moto S3 "
        f"throttled to {args.remote_mib_s:g} MiB/s per rank; median of {args.reps} passes after "
        f"{args.warmup} warm-up",
        f"{'':42} {'seconds':>8} {'GiB/s/rank':>10}  ratio",
    ]
    for label, key, base in ROWS:
        ratio = f"{r[key] / r[base]:6.2f} x {base}" if base else ""
        lines.append(f"{label:42} {r[key]:8.3f} {gib / r[key]:10.2f}  {ratio}".rstrip())
    lines.append("")
    for label, num, den in RATIOS:
        lines.append(f"{label + ':':56} {r[num] / r[den]:.2f}")
    every = [p for rank_passes in results for p in rank_passes]
    ok = all(all(p["ok"].values()) for p in every)
    verdict = "met" if r["tiered_save"] / r["local_save"] <= GOAL else "MISSED"
    lines.append(f"goal tiered save blocking <= {GOAL} x local-only: {verdict}")
    lines.append(f"bit-exact, and each tiered restart read from the expected tier: {ok}")
    lines.append("")
    lines.append("last pass, per rank (distckpt.last_timings and the tiered loads' sources):")
    for rank, rank_passes in enumerate(results):
        last = rank_passes[-1]
        for what, text in list(last["phases"].items()) + list(last["sources"].items()):
            lines.append(f"  rank {rank} {what}: {text}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-bench-tiered", help="the local tier's storage")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib-per-rank", type=int, default=64)
    parser.add_argument("--remote-mib-s", type=float, default=200, help="the remote's pace, per rank")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3, help="measured passes; medians are printed")
    parser.add_argument("--bucket", default="distckpt-bench")
    parser.add_argument("--json", default=None, help="also write every pass of every rank to this file")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.ranks < 1 or args.mib_per_rank < 1 or args.remote_mib_s <= 0:
        parser.error("--reps, --ranks, --mib-per-rank and --remote-mib-s must be positive")
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    server = start_moto(f"s3://{args.bucket}")  # its endpoint reaches the ranks through the environment
    try:
        results = launch(args.ranks, rank_main, args, timeout=1800)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    text, ok = report(args, results)
    print(text)
    if args.json:
        figures = summarize(results)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "medians": figures, "ranks": results}, indent=1)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
