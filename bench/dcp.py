"""PyTorch DCP with distckpt as its storage layer against DCP's own FileSystemWriter/Reader, and
both against the physical limit of the storage.

    python -m bench.dcp --size-mib 256 --reps 5                          # tmpfs (/dev/shm)
    python -m bench.dcp --dir s3://bench/dcp --moto --size-mib 64 --reps 3   # an S3 server (moto)

Each of ``--ranks`` gloo ranks holds ``--size-mib`` MiB of a GPT-like state as DTensors sharded by
rows on a CPU mesh (bf16 weights, fp32 Adam moments: what FSDP2's ``get_state_dict`` gives),
and every repetition (after ``--warmup`` unrecorded ones) times, between barriers:

- ``raw write`` / ``raw read``: each rank's bytes with ``os.write`` + ``fsync`` into one file and
  ``os.preadv`` back (object stores: one ``obstore.put`` / ``obstore.get`` of them), the limit;
- ``dcp.save``: ``dcp.save(sd, storage_writer=...)`` through DCP's ``FileSystemWriter`` (its
  defaults: one thread; and ``thread_count=2``), through ``distckpt.dcp.StorageWriter``, and
  ``distckpt.save`` of the same bytes as ShardedTensors (the writer's own speed);
- ``async_save`` blocking part: the time until ``dcp.async_save`` returns (staging: DCP's
  ``FileSystemWriter`` stages with its own copy, ``distckpt.dcp.StorageWriter`` into the reused
  staging pool); the background part is waited for, not timed;
- ``dcp.load`` into the same layout and resharded (every rank its rows split by columns:
  ``Shard(1)``) through ``FileSystemReader`` and ``distckpt.dcp.StorageReader`` (and the latter
  with ``checksums=False``: what checking every byte costs).

The async saves run on a gloo group of their own (as torchtitan's do), so their background
collectives never meet the timing barriers of the default group. Prints the median of each cell
(rank 0's barrier-to-barrier times), its ratio to the raw write or read, and DCP's own writer and
reader against distckpt's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch

from bench.common import barrier_time, drop, prepare_dir, raw_get, raw_put, raw_read, raw_write, spawn_ranks

SAVES = (
    "FileSystemWriter",
    "FileSystemWriter(thread_count=2)",
    "distckpt.dcp.StorageWriter",
    "distckpt.save",
)
ASYNC = ("async FileSystemWriter", "async distckpt.dcp.StorageWriter")
LOADS = (
    "FileSystemReader",
    "distckpt.dcp.StorageReader",
    "distckpt.dcp.StorageReader(checksums=False)",
    "FileSystemReader, resharded",
    "distckpt.dcp.StorageReader, resharded",
    "distckpt.dcp.StorageReader(checksums=False), resharded",
)


def _local_state(rank: int, world: int, size_mib: int):
    """This rank's rows of each tensor of a GPT-like state of about ``size_mib`` MiB per rank:
    per layer a [4h, h] bf16 weight and its two fp32 Adam moments (10 bytes per weight element)."""
    g = torch.Generator().manual_seed(1234 + rank)
    hidden = 1024
    rows = 4 * hidden // world
    layers = max(1, round(size_mib * 2**20 / (rows * hidden * 10)))
    out = {}
    for layer in range(layers):
        w = torch.randn(rows, hidden, generator=g)
        out[f"model.layers.{layer}.mlp.weight"] = w.to(torch.bfloat16)
        out[f"optim.state.layers.{layer}.mlp.weight.exp_avg"] = w * 0.1
        out[f"optim.state.layers.{layer}.mlp.weight.exp_avg_sq"] = w * w
    return out


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import distckpt
    import distckpt.dcp
    from distckpt import ShardedTensor, storage

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    async_group = tdist.new_group(backend="gloo")
    local = _local_state(rank, world, args.size_mib)
    tensors = list(local.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def dtensors(placement):
        out = {}
        for key, t in local.items():
            full = torch.Size((t.shape[0] * world, t.shape[1]))
            if placement == 0:
                out[key] = DTensor.from_local(
                    t, mesh, [Shard(0)], run_check=False, shape=full, stride=(full[1], 1)
                )
            else:
                cols = full[1] // world
                piece = torch.zeros(full[0], cols, dtype=t.dtype)
                out[key] = DTensor.from_local(
                    piece, mesh, [Shard(1)], run_check=False, shape=full, stride=(full[1], 1)
                )
        return out

    state = dtensors(0)
    sharded = {key: ShardedTensor.from_rank_offsets(key, t, (0, rank, world)) for key, t in local.items()}
    remote = "://" in args.dir
    root = args.dir.rstrip("/")
    times = {}

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    def where(name):
        return f"{root}/{name}"

    def clear(name):
        tdist.barrier()
        if rank == 0:
            if remote:
                store = storage.open_store(where(name))
                for obj in store.list():
                    store.delete(obj)
            else:
                drop(Path(where(name)))
        tdist.barrier()

    raw_name = f"raw_{rank}.bin"
    if remote:
        store = storage.open_store(root)
        raw = (
            ("raw write", lambda: raw_put(store, raw_name, tensors)),
            ("raw read", lambda b: raw_get(store, raw_name, b)),
        )
    else:
        raw_path = Path(root) / raw_name
        raw = (
            ("raw write", lambda: raw_write(raw_path, tensors)),
            ("raw read", lambda b: raw_read(raw_path, b)),
        )

    saves = {
        "distckpt.dcp.StorageWriter": lambda p: dcp.save(state, storage_writer=distckpt.dcp.StorageWriter(p)),
        "distckpt.save": lambda p: distckpt.save(sharded, p),
    }
    if not remote:
        saves["FileSystemWriter"] = lambda p: dcp.save(state, storage_writer=FileSystemWriter(p))
        saves["FileSystemWriter(thread_count=2)"] = lambda p: dcp.save(
            state, storage_writer=FileSystemWriter(p, thread_count=2)
        )
    asyncs = {"async distckpt.dcp.StorageWriter": lambda p: distckpt.dcp.StorageWriter(p)}
    if not remote:
        asyncs["async FileSystemWriter"] = lambda p: FileSystemWriter(p)
    loads = {
        "distckpt.dcp.StorageReader": (0, lambda p: distckpt.dcp.StorageReader(p)),
        "distckpt.dcp.StorageReader(checksums=False)": (
            0,
            lambda p: distckpt.dcp.StorageReader(p, checksums=False),
        ),
        "distckpt.dcp.StorageReader, resharded": (1, lambda p: distckpt.dcp.StorageReader(p)),
        "distckpt.dcp.StorageReader(checksums=False), resharded": (
            1,
            lambda p: distckpt.dcp.StorageReader(p, checksums=False),
        ),
    }
    if not remote:
        loads["FileSystemReader"] = (0, lambda p: FileSystemReader(p))
        loads["FileSystemReader, resharded"] = (1, lambda p: FileSystemReader(p))
    targets = {0: dtensors(0), 1: dtensors(1)}

    for rep in range(-args.warmup, args.reps):
        if rep == 0:
            times.clear()
        order = 1 if rep % 2 else -1  # alternate the order of the cells
        (wname, wfn), (rname, rfn) = raw
        record(wname, barrier_time(wfn)[0])
        bufs = [torch.zeros_like(t) for t in tensors]
        record(rname, barrier_time(rfn, bufs)[0])
        del bufs
        for name, fn in list(saves.items())[::order]:
            clear(name)
            record(name, barrier_time(fn, where(name))[0])
        for name, make in list(asyncs.items())[::order]:
            clear(name)
            writer = make(where(name))
            seconds, future = barrier_time(
                dcp.async_save, state, storage_writer=writer, process_group=async_group
            )
            record(name, seconds)
            future.result()
        source = where("distckpt.dcp.StorageWriter")
        for name, (layout, make) in list(loads.items())[::order]:
            record(name, barrier_time(dcp.load, targets[layout], storage_reader=make(source))[0])
    for name in list(saves) + list(asyncs):
        clear(name)
    if not remote:
        raw_path.unlink(missing_ok=True)
    else:
        store.delete(raw_name)
    if rank == 0:
        queue.put({"times": times, "bytes_per_rank": nbytes})
    tdist.barrier()
    tdist.destroy_process_group()


def report(results, args) -> str:
    times, nbytes = results["times"], results["bytes_per_rank"]
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"{args.ranks} ranks x {nbytes / 2**20:.0f} MiB, {args.dir}, median of {args.reps} "
        f"(torch {torch.__version__}, {os.cpu_count()} CPUs)",
        "",
        "| cell | seconds | GiB/s per rank | x raw |",
        "|---|---|---|---|",
    ]

    def row(name, limit):
        if name not in med:
            return
        s = med[name]
        ratio = f"{s / med[limit]:.2f}" if limit else "1.00"
        lines.append(f"| {name} | {s:.3f} | {nbytes / s / 2**30:.2f} | {ratio} |")

    row("raw write", None)
    for name in SAVES:
        row(name, "raw write")
    for name in ASYNC:  # the blocking part only
        row(name, "raw write")
    row("raw read", None)
    for name in LOADS:
        row(name, "raw read")
    pairs = [
        ("FileSystemWriter", "distckpt.dcp.StorageWriter", "save"),
        ("async FileSystemWriter", "async distckpt.dcp.StorageWriter", "async_save blocking part"),
        ("FileSystemReader", "distckpt.dcp.StorageReader", "load"),
        ("FileSystemReader, resharded", "distckpt.dcp.StorageReader, resharded", "resharded load"),
        ("distckpt.save", "distckpt.dcp.StorageWriter", "DCP writer vs distckpt.save"),
    ]
    lines.append("")
    for theirs, ours, what in pairs:
        if theirs in med and ours in med:
            lines.append(f"{what}: {med[theirs]:.3f} s -> {med[ours]:.3f} s ({med[theirs] / med[ours]:.2f}x)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-bench-dcp", help="a directory or an s3:// URL")
    parser.add_argument("--size-mib", type=int, default=256, help="state per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--moto", action="store_true", help="with an s3:// --dir: start a local moto S3 server first"
    )
    args = parser.parse_args()
    cleanup = prepare_dir(args.dir, args.moto)
    results = spawn_ranks(_rank_main, args.ranks, args, cleanup)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
