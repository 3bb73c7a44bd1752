"""Save and load against the files they write and read: is each at the limit of its files?

    python -m bench.files --shapes h1024-tp2-opt0,h4096-tp2-opt0 --sizes-mib 256 --reps 15

``python -m bench.throughput --sweep`` compares a load with raw read: ``preadv`` of the same bytes from a
file the benchmark wrote for the purpose. That file and the checkpoint's are different files, and
a page cache does not serve every file equally fast (where the kernel placed their pages). This
benchmark asks the narrower question. For each shape and size (2 gloo ranks, tmpfs), after a save and
one unrecorded round, it alternates in every repetition:

- ``raw read``: the sweep's reference, ``preadv`` per tensor from the raw file into buffers;
- ``files read``: a plain sequential ``preadv`` of the checkpoint files the same-layout load
  reads (those of the rank that holds its main replicas), whole, into the load's destination
  tensors: the physical limit of *those* files;
- ``load``: ``distckpt.load`` of the same layout, its total and its reading phase.

Each cell runs two rounds of about ``--reps / 2`` repetitions: one with the raw file written
before the checkpoint, one with it written after (on tmpfs the file written second tends to get
pages that read faster). Every read here is warm (pages read before), so none of them pays the
first read of fresh pages.
It prints per cell and rank the medians and two ratios: files read ÷ raw read (what the files
cost against the raw file) and load reading ÷ files read (what distckpt adds to reading them).

The save side (a second table) asks the same of the writing. Alternating in every repetition:

- ``raw write``: the sweep's reference, ``os.write`` per tensor into one file, then ``fsync``;
- ``files write``: this rank's main-replica bytes written the way a save writes them, with no
  framing and no bookkeeping: into as many files as the save writes on this rank (its
  ``__<rank>_*.distcp``), tensors dealt to them as the save deals them, in 1 MiB blocks, each
  file fsynced;
- ``files write + CRC32C``: the same, each block checksummed just before it is written (the
  checksum every save keeps for its manifest and block tables): the floor of a checksummed save;
- ``save``: ``distckpt.save`` of the state, its total and its writing phase.

Ratios: files write + CRC32C ÷ raw write (what the files and the checksum cost against the raw
file) and save writing ÷ files write + CRC32C (what distckpt adds to writing them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import List

import torch

from bench.common import barrier_time, drop, raw_read, raw_write, spawn_ranks
from bench.sweep import cells, sweep_state
from distckpt.checksum import crc32c


def read_files(paths: List[Path], dests: List[torch.Tensor]) -> int:
    """Read ``paths`` whole, in order, into the bytes of ``dests`` (one ``preadv`` per at most
    1024 pieces; bytes beyond the destinations go to a small scratch buffer). Returns the bytes
    read."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in dests if t.numel()]
    scratch = memoryview(bytearray(1 << 20))
    at, used, total = 0, 0, 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                iov, want = [], 0
                while want < size - offset and len(iov) < 1024:
                    if at < len(views):
                        piece = views[at][used : used + (size - offset - want)]
                        used += len(piece)
                        if used == len(views[at]):
                            at, used = at + 1, 0
                    else:
                        piece = scratch[: size - offset - want]
                    iov.append(piece)
                    want += len(piece)
                n = os.preadv(fd, iov, offset)
                if n <= 0:
                    raise OSError(f"{path}: read returned {n} at offset {offset} of {size}")
                offset += n
                total += n
        finally:
            os.close(fd)
    return total


def write_files(paths: List[Path], tensors: List[torch.Tensor], checksum: bool, block: int = 1 << 20) -> int:
    """Write the bytes of ``tensors`` into ``paths``, dealt as a save deals its items to its files
    (largest first, each to the file with the fewest bytes so far), in ``block``-byte writes,
    each file fsynced; with ``checksum``, the CRC32C of each block first (as a save's sink does).
    Returns the bytes written."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]
    bins: List[List[memoryview]] = [[] for _ in paths]
    loads = [0] * len(paths)
    for view in sorted(views, key=len, reverse=True) if paths else ():
        b = loads.index(min(loads))
        bins[b].append(view)
        loads[b] += len(view)
    for path, views_of_file in zip(paths, bins):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            crc = 0
            for view in views_of_file:
                for start in range(0, len(view), block):
                    piece = view[start : start + block]
                    if checksum:
                        crc = crc32c(piece, crc)
                    while piece:
                        piece = piece[os.write(fd, piece) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(loads)


def save_lines(rank: int, world: int, args) -> List[str]:
    """The save side: raw write, the save's files written plainly (with and without CRC32C), the
    save; one table line per cell."""
    import torch.distributed as tdist

    import distckpt
    from distckpt.mapping import is_main_replica

    root = Path(args.dir)
    lines = []
    for shape_text, shape, size, layers in cells(args.shapes, args.sizes_mib):
        sd = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"])
        mine = [sh.data for sh in sd.values() if is_main_replica(sh.replica_id)]
        ckpt = root / "ckpt"
        if rank == 0:
            drop(ckpt)
        tdist.barrier()
        distckpt.save(sd, ckpt)
        count = len(list(ckpt.glob(f"__{rank}_*.distcp")))  # the files this rank's save writes
        raw = root / f"raw_{rank}.bin"
        plain = [root / f"plain_{rank}_{i}.bin" for i in range(count)]
        times = {
            "raw write": [],
            "files write": [],
            "files write + CRC32C": [],
            "save": [],
            "save writing": [],
        }
        for rep in range(-1, args.reps):
            r = barrier_time(raw_write, raw, mine)[0]
            raw.unlink()
            f = barrier_time(write_files, plain, mine, False)[0]
            for p in plain:  # gone before the next write: truncating a file frees its pages in the write
                p.unlink()
            fc = barrier_time(write_files, plain, mine, True)[0]
            for p in plain:
                p.unlink()
            if rank == 0:
                drop(ckpt)
            tdist.barrier()
            sv = barrier_time(distckpt.save, sd, ckpt)[0]
            if rep >= 0:
                for k, v in (
                    ("raw write", r),
                    ("files write", f),
                    ("files write + CRC32C", fc),
                    ("save", sv),
                    ("save writing", distckpt.last_timings("save").phases["writing"]),
                ):
                    times[k].append(v)
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = sum(t.numel() * t.element_size() for t in mine)
        floor = med["files write + CRC32C"]
        lines.append(
            f"| {shape_text} | {size:g} | {rank} | {len(mine)} | {count} | {nbytes / 2**20:.0f} | "
            f"{med['raw write'] * 1e3:.1f} | {med['files write'] * 1e3:.1f} | {floor * 1e3:.1f} | "
            f"{med['save'] * 1e3:.1f} | {med['save writing'] * 1e3:.1f} | "
            f"{floor / med['raw write']:.2f} | {med['save writing'] / floor:.2f} |"
        )
        sd = mine = None
        tdist.barrier()
        if rank == 0:
            drop(ckpt)
    return lines


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun
    import torch.distributed as tdist

    import distckpt
    from distckpt.mapping import is_main_replica

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(args.dir)
    saves = save_lines(rank, world, args) if "save" in args.ops else []
    lines = []
    for shape_text, shape, size, layers in cells(args.shapes, args.sizes_mib) if "load" in args.ops else ():
        sd = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"])
        ckpt = root / "ckpt"
        wanted = [sh.data for sh in sd.values()]  # what a same-layout load reads on this rank
        raw = root / f"raw_{rank}.bin"
        bufs = [torch.zeros_like(t) for t in wanted]
        req = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"], with_data=False)
        dests = [sh.data for sh in req.values()]
        times = {"raw read": [], "files read": [], "load": [], "load reading": []}
        # Two rounds: the raw file written before the checkpoint, then after it (on tmpfs the
        # file written second tends to read faster; see the sweep's docstring).
        for raw_first in (True, False):
            if rank == 0:
                drop(ckpt)
            tdist.barrier()
            for write in ("raw", "save") if raw_first else ("save", "raw"):
                if write == "raw":
                    raw_write(raw, wanted)
                else:
                    distckpt.save(sd, ckpt)
                tdist.barrier()
            files = sorted(ckpt.glob(f"__{rank % shape['tp']}_*.distcp"))  # the main replicas' writer
            for rep in range(-1, (args.reps + raw_first) // 2):
                r = barrier_time(raw_read, raw, bufs)[0]
                f = barrier_time(read_files, files, dests)[0]
                ld = barrier_time(distckpt.load, req, ckpt)[0]
                if rep >= 0:
                    times["raw read"].append(r)
                    times["files read"].append(f)
                    times["load"].append(ld)
                    times["load reading"].append(distckpt.last_timings("load").phases["reading"])
            raw.unlink()
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = sum(t.numel() * t.element_size() for t in wanted)
        main = sum(1 for sh in sd.values() if is_main_replica(sh.replica_id))
        lines.append(
            f"| {shape_text} | {size:g} | {rank} | {len(wanted)} ({main} main) | {nbytes / 2**20:.0f} | "
            f"{med['raw read'] * 1e3:.1f} | {med['files read'] * 1e3:.1f} | {med['load'] * 1e3:.1f} | "
            f"{med['load reading'] * 1e3:.1f} | {med['files read'] / med['raw read']:.2f} | "
            f"{med['load reading'] / med['files read']:.2f} |"
        )
        sd = wanted = bufs = req = dests = None
        tdist.barrier()
        if rank == 0:
            drop(ckpt)
    gathered = [None] * world
    tdist.all_gather_object(gathered, (saves, lines))

    def by_cell(part):  # rank 0's line of each cell, then rank 1's
        n = len(gathered[0][part])
        return [line for i in range(n) for rank_lines in gathered for line in rank_lines[part][i : i + 1]]

    if rank == 0:
        queue.put((by_cell(0), by_cell(1)))
    tdist.barrier()
    tdist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-bench-files")
    parser.add_argument("--shapes", default="h1024-tp2-opt80,h1024-tp2-opt0,h4096-tp2-opt0,h1024-tp1-opt0")
    parser.add_argument("--sizes-mib", default="256,1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ops", default="save,load", help="which sides to measure: save, load or both")
    args = parser.parse_args()
    args.ops = {s for s in args.ops.split(",") if s}
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.sizes_mib = [float(s) for s in args.sizes_mib.split(",") if s]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    saves, lines = spawn_ranks(rank_main, 2, args, lambda: shutil.rmtree(args.dir, ignore_errors=True))
    print(f"2 gloo ranks, {args.dir}, medians of {args.reps} after one warm round")
    if saves:
        print(
            "\n| shape | MiB/rank | rank | tensors written | files | MiB written | raw write ms | "
            "files write ms | "
            "files write + CRC32C ms | save ms | save writing ms | files + CRC32C ÷ raw write | "
            "save writing ÷ files + CRC32C |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for line in saves:
            print(line)
    if lines:
        print("\nEvery read is warm.")
        print(
            "| shape | MiB/rank | rank | tensors | MiB read | raw read ms | files read ms | load ms | "
            "load reading ms | files read ÷ raw read | load reading ÷ files read |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for line in lines:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
