"""The load's bytes against the files it reads: is a same-layout load at the limit of its files?

    python tools/bench_files.py --shapes h1024-tp2-opt0,h4096-tp2-opt0 --sizes-mib 256 --reps 15

``tools/bench.py --sweep`` compares a load with raw read: ``preadv`` of the same bytes from a
file the benchmark wrote for the purpose. That file and the checkpoint's are different files, and
a page cache does not serve every file equally fast (where the kernel placed their pages). This
tool asks the narrower question. For each shape and size (2 gloo ranks, tmpfs), after a save and
one unrecorded round, it alternates in every repetition:

- ``raw read``: the sweep's reference, ``preadv`` per tensor from the raw file into buffers;
- ``files read``: a plain sequential ``preadv`` of the checkpoint files the same-layout load
  reads (those of the rank that holds its main replicas), whole, into the load's destination
  tensors: the physical limit of *those* files;
- ``load``: ``distckpt.load`` of the same layout, its total and its reading phase.

Every read here is warm (pages read before), so none of them pays the first read of fresh pages.
It prints per cell and rank the medians and two ratios: files read ÷ raw read (what the files
cost against the raw file) and load reading ÷ files read (what distckpt adds to reading them).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
                        piece = views[at][used:used + (size - offset - want)]
                        used += len(piece)
                        if used == len(views[at]):
                            at, used = at + 1, 0
                    else:
                        piece = scratch[:size - offset - want]
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


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun
    import torch.distributed as tdist

    import distckpt
    from distckpt.mapping import is_main_replica
    from tools.bench import _barrier_time, _drop, _raw_read, _raw_write
    from tools.bench_sweep import cells, sweep_state

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(args.dir)
    lines = []
    for shape_text, shape, size, layers in cells(args.shapes, args.sizes_mib):
        sd = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"])
        ckpt = root / "ckpt"
        if rank == 0:
            _drop(ckpt)
        tdist.barrier()
        distckpt.save(sd, ckpt)
        wanted = [sh.data for sh in sd.values()]  # what a same-layout load reads on this rank
        raw = root / f"raw_{rank}.bin"
        _raw_write(raw, wanted)
        bufs = [torch.zeros_like(t) for t in wanted]
        req = sweep_state(rank, world, shape["h"], layers, shape["tp"], shape["opt"], with_data=False)
        dests = [sh.data for sh in req.values()]
        files = sorted(ckpt.glob(f"__{rank % shape['tp']}_*.distcp"))  # the main replicas' writer
        times = {"raw read": [], "files read": [], "load": [], "load reading": []}
        for rep in range(-1, args.reps):
            r = _barrier_time(_raw_read, raw, bufs)[0]
            f = _barrier_time(read_files, files, dests)[0]
            ld = _barrier_time(distckpt.load, req, ckpt)[0]
            if rep >= 0:
                times["raw read"].append(r)
                times["files read"].append(f)
                times["load"].append(ld)
                times["load reading"].append(distckpt.last_timings("load").phases["reading"])
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = sum(t.numel() * t.element_size() for t in wanted)
        main = sum(1 for sh in sd.values() if is_main_replica(sh.replica_id))
        lines.append(f"| {shape_text} | {size:g} | {rank} | {len(wanted)} ({main} main) | {nbytes / 2**20:.0f} | "
                     f"{med['raw read'] * 1e3:.1f} | {med['files read'] * 1e3:.1f} | {med['load'] * 1e3:.1f} | "
                     f"{med['load reading'] * 1e3:.1f} | {med['files read'] / med['raw read']:.2f} | "
                     f"{med['load reading'] / med['files read']:.2f} |")
        raw.unlink()
        sd = wanted = bufs = req = dests = None
        tdist.barrier()
        if rank == 0:
            _drop(ckpt)
    gathered = [None] * world
    tdist.all_gather_object(gathered, lines)
    if rank == 0:
        queue.put([line for i in range(len(lines)) for rank_lines in gathered for line in rank_lines[i:i + 1]])
    tdist.barrier()
    tdist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-bench-files")
    parser.add_argument("--shapes", default="h1024-tp2-opt80,h1024-tp2-opt0,h4096-tp2-opt0,h1024-tp1-opt0")
    parser.add_argument("--sizes-mib", default="256,1024")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.sizes_mib = [float(s) for s in args.sizes_mib.split(",") if s]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    from tools.bench import spawn_ranks

    lines = spawn_ranks(rank_main, 2, args, lambda: shutil.rmtree(args.dir, ignore_errors=True))
    print(f"2 gloo ranks, {args.dir}, medians of {args.reps} after one warm round; every read is warm")
    print("| shape | MiB/rank | rank | tensors | MiB read | raw read ms | files read ms | load ms | "
          "load reading ms | files read ÷ raw read | load reading ÷ files read |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
