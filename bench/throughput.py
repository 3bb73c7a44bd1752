"""Benchmark distckpt against the physical limit of the storage, in one run.

    python -m bench.throughput --dir /dev/shm/bench --size-gib 2 --ranks 2 --reps 3 --out bench_out

(from the repository root; ``pip install -e .[bench]`` adds matplotlib for the chart.)

On N gloo ranks (one process each) it builds a GPT-like sharded state dict of about
``--size-gib`` GiB in total: bf16 weights split tensor-parallel over the N ranks (column- and
row-parallel), replicated layer norms (written by one rank), and fp32 optimizer states as
flattened slices (distributed-optimizer style). Then, each figure a median of ``--reps`` runs
(after ``--warmup`` unrecorded ones):

- raw:   ``os.write`` + fsync / ``os.read`` of the same per-rank bytes: the physical limit
- save, load (same layout), load resharded (every rank takes two interleaved TP pieces of a
  2N-way split, so it reads the same amount from parts of two stored chunks each) for the
  ``torch_dist`` and ``zarr`` backends
- async save: time until ``save`` returns (the blocking part) and until the checkpoint is
  committed, against a memcpy of the same local bytes
- fully parallel load: every rank asks for the whole model (TP1 x DPN); each stored chunk is read
  once and exchanged, against the plain load of the same request
- plain ``torch.distributed.checkpoint`` save/load of the same local tensors, as a reference
- peak RSS during a save, above the RSS before the state was built; and peak RSS of each path
  (save, async save, load, resharded load, fully parallel load) above the RSS just before it,
  with the default host memory budget and, with ``--rss-budget``, under that budget

It prints a table (GiB/s of the whole state, and each figure's ratio to its limit), writes
``bench.json`` and draws ``bench.png`` in ``--out``.

Object stores: ``--dir s3://bucket/prefix`` (any URL distckpt opens) measures save, load and
resharded load of each backend there against raw ``obstore.put``/``obstore.get`` of the same
per-rank bytes (one object per rank, multipart with the same part size and concurrency) in the
same run. ``--moto`` first starts a local moto S3 server and creates the bucket::

    python -m bench.throughput --dir s3://bench/run --moto --size-gib 0.25 --ranks 2 --reps 2

``--emulator`` starts the local server of any object-store URL's cloud, as the tests do (S3: moto;
GCS: fake-gcs-server behind the tests' XML-upload gateway; Azure: Azurite; the last two installed
by ``scripts/setup.sh``) and creates its bucket or container::

    python -m bench.throughput --dir gs://bench/run --emulator --size-gib 0.1 --ranks 2 --reps 3
    python -m bench.throughput --dir az://bench/run --emulator --size-gib 0.1 --ranks 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import sweep
from bench.common import (
    PeakRss,
    all_gather,
    barrier_time,
    build_state,
    copy_all,
    drop,
    empty_like_request,
    local_bytes,
    model_dims,
    pyplot,
    raw_get,
    raw_put,
    raw_read,
    raw_write,
    spawn_ranks,
    start_moto,
)

# --------------------------------------------------------------------------- measurements


_WRITE_THREADS = None  # --write-threads, set in each rank


def _save_strategy(threads):
    from distckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy(thread_count=threads, write_threads=_WRITE_THREADS)


def _time_save_and_loads(backend, sd, reshard, location, threads, record, results) -> None:
    """Record one save of ``sd`` to ``location``, then a same-layout and a resharded load."""
    import distckpt
    from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    strategy = _save_strategy(threads) if backend == "torch_dist" else (backend, 1)
    record(f"{backend} save", barrier_time(distckpt.save, sd, location, sharded_strategy=strategy)[0])
    record(f"{backend} load", barrier_time(distckpt.load, empty_like_request(sd), location)[0])
    counting = TorchDistLoadShardedStrategy() if backend == "torch_dist" else None
    record(
        f"{backend} load resharded",
        barrier_time(distckpt.load, empty_like_request(reshard), location, sharded_strategy=counting)[0],
    )
    if counting is not None:
        results["resharded load: bytes read / bytes requested"] = counting.bytes_read / local_bytes(reshard)
        results["resharded load: GET requests"] = counting.requests


def _run_facts(tdist, sd, world: int, hidden: int, layers: int):
    """This rank's main-replica bytes and tensors, and the results' header every run starts from."""
    mine = local_bytes(sd, main_only=True)
    tensors = [sh.data for sh in sd.values() if sh.replica_id == 0]
    sizes = all_gather(tdist, mine)
    results = {
        "bytes_total": sum(int(x) for x in sizes),
        "bytes_per_rank_max": max(sizes),
        "hidden": hidden,
        "layers": layers,
        "tensors": len(sd),
        "ranks": world,
    }
    return mine, tensors, results


def _report(tdist, rank: int, results: dict, times: dict, queue) -> None:
    """Rank 0 sends the medians and every repetition; then all ranks leave the group."""
    if rank == 0:
        results["seconds"] = {k: statistics.median(v) for k, v in times.items()}
        results["all_seconds"] = times
        queue.put(results)
    tdist.barrier()
    tdist.destroy_process_group()


def _rank_main_object_store(rank, world, port, args, queue):
    """The object-store run: raw obstore put/get against distckpt save/load of the same bytes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    global _WRITE_THREADS
    _WRITE_THREADS = args.write_threads
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun (the variable came too late)
    import torch.distributed as tdist

    from distckpt.storage import open_store

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    hidden, layers = model_dims(args.size_gib)
    sd = build_state(rank, world, hidden, layers)
    mine, tensors, results = _run_facts(tdist, sd, world, hidden, layers)
    times = {}
    reshard = build_state(rank, world, hidden, layers, pieces_per_rank=2, with_data=False)
    root = open_store(args.dir)
    raw_name = f"raw_{rank}.bin"

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    for rep in range(-args.warmup, args.reps):
        if rep == 0:
            times.clear()
        record("raw obstore.put", barrier_time(raw_put, root, raw_name, tensors)[0])
        bufs = [torch.zeros_like(t) for t in tensors]
        record("raw obstore.get", barrier_time(raw_get, root, raw_name, bufs)[0])
        bufs = None
        for backend in args.backends:
            url = f"{args.dir.rstrip('/')}/ckpt_{backend}_{rep + args.warmup}"
            _time_save_and_loads(backend, sd, reshard, url, args.threads, record, results)
            tdist.barrier()
            if rank == 0:
                ckpt = open_store(url)
                for name in ckpt.list():
                    ckpt.delete(name)
            tdist.barrier()
    root.delete(f"raw_{rank}.bin")
    _report(tdist, rank, results, times, queue)


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    global _WRITE_THREADS
    _WRITE_THREADS = args.write_threads
    torch.set_num_threads(1)  # one intra-op thread per rank, as under torchrun (the variable came too late)
    import psutil
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(args.dir)
    hidden, layers = model_dims(args.size_gib)
    rss_before_state = psutil.Process().memory_info().rss
    sd = build_state(rank, world, hidden, layers)
    mine, tensors, results = _run_facts(tdist, sd, world, hidden, layers)
    times = {}

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    reshard = build_state(rank, world, hidden, layers, pieces_per_rank=2, with_data=False)
    full_req = build_state(rank, world, hidden, layers, with_data=False, full=True)
    async_strategy = _save_strategy(args.threads)
    # Peak RSS first, before any other buffer exists: freed buffers stay in the allocator and
    # would be counted against the save.
    ckpt = root / "ckpt_rss"
    tdist.barrier()
    with PeakRss() as rss:
        distckpt.save(sd, ckpt, sharded_strategy=_save_strategy(args.threads))
    results["save peak RSS above baseline (x local bytes)"] = (rss.peak - rss_before_state) / local_bytes(sd)
    tdist.barrier()
    if rank == 0:
        drop(ckpt)
    budgets = [None] + ([args.rss_budget] if args.rss_budget else [])
    results["peak RSS MiB"] = {}
    for budget in budgets:
        distckpt.set_host_memory_budget(budget)
        label = "default budget" if budget is None else f"host budget {budget}"
        peaks = _rss_pass(rank, root, sd, reshard, full_req, args.threads, tdist)
        results["peak RSS MiB"][label] = {k: max(all_gather(tdist, v)) / 2**20 for k, v in peaks.items()}
        distckpt.set_host_memory_budget(None)
    for rep in range(-args.warmup, args.reps):
        if rep == 0:
            times.clear()  # warm-up repetitions are not recorded
        raw = root / f"raw_{rank}.bin"
        record("raw write", barrier_time(raw_write, raw, tensors)[0])
        bufs = [torch.zeros_like(t) for t in tensors]
        record("raw read", barrier_time(raw_read, raw, bufs)[0])
        staging = [torch.zeros_like(t) for t in tensors]
        record("memcpy", barrier_time(copy_all, staging, tensors)[0])
        bufs = staging = None
        raw.unlink()
        for backend in args.backends:
            ckpt = root / f"ckpt_{backend}"
            if rank == 0:
                drop(ckpt)
            tdist.barrier()
            _time_save_and_loads(backend, sd, reshard, ckpt, args.threads, record, results)
            if backend == "torch_dist":
                req = empty_like_request(full_req)
                record("torch_dist load TP1xDP (plain)", barrier_time(distckpt.load, req, ckpt)[0])
                req = None
                req = empty_like_request(full_req)
                fp = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
                record(
                    "torch_dist load TP1xDP (fully parallel)",
                    barrier_time(distckpt.load, req, ckpt, sharded_strategy=fp)[0],
                )
                req = None
            if rank == 0:
                drop(ckpt)
            tdist.barrier()
        ckpt = root / "ckpt_async"
        if rank == 0:
            drop(ckpt)
        tdist.barrier()
        queue_ = AsyncCallsQueue()
        tdist.barrier()
        t0 = time.perf_counter()
        request = distckpt.save(sd, ckpt, sharded_strategy=async_strategy, async_sharded_save=True)
        blocking = time.perf_counter() - t0
        queue_.schedule_async_request(request)
        queue_.maybe_finalize_async_calls(blocking=True)
        tdist.barrier()
        record("async save (blocking)", max(all_gather(tdist, blocking)))
        record("async save (total)", time.perf_counter() - t0)
        queue_.close()
        if rank == 0:
            drop(ckpt)
        ckpt = root / "ckpt_dcp"
        if rank == 0:
            drop(ckpt)
        tdist.barrier()
        plain = {f"r{rank}.{i}": t for i, t in enumerate(tensors)}
        record("torch DCP save", barrier_time(dcp.save, plain, storage_writer=dcp.FileSystemWriter(ckpt))[0])
        target = {k: torch.zeros_like(v) for k, v in plain.items()}
        record("torch DCP load", barrier_time(dcp.load, target, storage_reader=dcp.FileSystemReader(ckpt))[0])
        target = None
        if rank == 0:
            drop(ckpt)
        tdist.barrier()
    _report(tdist, rank, results, times, queue)


def _rss_pass(rank, root, sd, reshard, full_req, threads, tdist):
    """Peak RSS of each path above the RSS just before it (sampled every 2 ms; bytes): save,
    async save (until committed), load, resharded load, fully parallel load. One run each."""
    import psutil

    import distckpt
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    ckpt, peaks = root / "ckpt_rss_paths", {}

    def measure(name, fn):
        tdist.barrier()
        start = psutil.Process().memory_info().rss
        with PeakRss() as rss:
            fn()
        peaks[name] = max(0, rss.peak - start)

    def async_save():
        queue_ = AsyncCallsQueue()
        queue_.schedule_async_request(
            distckpt.save(
                sd,
                ckpt,
                sharded_strategy=_save_strategy(threads),
                async_sharded_save=True,
            )
        )
        queue_.close()

    if rank == 0:
        drop(ckpt)
    measure(
        "save",
        lambda: distckpt.save(sd, ckpt, sharded_strategy=_save_strategy(threads)),
    )
    tdist.barrier()
    if rank == 0:
        drop(ckpt)
    tdist.barrier()
    measure("async save", async_save)
    measure("load", lambda: distckpt.load(empty_like_request(sd), ckpt))
    measure("load resharded", lambda: distckpt.load(empty_like_request(reshard), ckpt))
    measure(
        "load TP1xDP fully parallel",
        lambda: distckpt.load(
            empty_like_request(full_req),
            ckpt,
            sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
        ),
    )
    tdist.barrier()
    if rank == 0:
        drop(ckpt)
    return peaks


# --------------------------------------------------------------------------- report

LIMITS = {
    "raw write": None,
    "raw read": None,
    "memcpy": None,
    "torch_dist save": "raw write",
    "zarr save": "raw write",
    "torch DCP save": "raw write",
    "torch_dist load": "raw read",
    "zarr load": "raw read",
    "torch DCP load": "raw read",
    "torch_dist load resharded": "raw read",
    "zarr load resharded": "raw read",
    "async save (blocking)": "memcpy",
    "async save (total)": "raw write",
    "torch_dist load TP1xDP (plain)": None,
    "torch_dist load TP1xDP (fully parallel)": None,
    "raw obstore.put": None,
    "raw obstore.get": None,
}
# On an object store the limits are the raw obstore calls.
OBJECT_STORE_LIMITS = {
    f"{b} {what}": "raw obstore.put" if what == "save" else "raw obstore.get"
    for b in ("torch_dist", "zarr")
    for what in ("save", "load", "load resharded")
}


def report(results, out_dir: Path) -> str:
    sec = results["seconds"]
    gib = results["bytes_total"] / 2**30
    lines = [
        f"state: {gib:.2f} GiB in {results['tensors']} tensors per rank, {results['ranks']} ranks "
        f"(hidden {results['hidden']}, {results['layers']} layers)",
        "",
        f"| {'measurement':42s} | {'seconds':>8s} | {'GiB/s':>7s} | ratio to limit |",
        f"|{'-' * 44}|{'-' * 10}|{'-' * 9}|{'-' * 16}|",
    ]
    ratios = {}
    object_store = "raw obstore.put" in sec
    for name, seconds in sec.items():
        limit = OBJECT_STORE_LIMITS.get(name) if object_store else LIMITS.get(name)
        nbytes = results["bytes_total"]
        if name.startswith("torch_dist load TP1xDP"):
            nbytes = results["bytes_total"] * results["ranks"]
        rate = nbytes / seconds / 2**30
        if limit == "memcpy" and limit in sec:
            # staging is a cost: our time / memcpy time (goal <= 1.2)
            ratio = seconds / sec[limit]
            text = f"{ratio:.2f}x memcpy time"
        elif limit and limit in sec:
            # throughput ratio: limit time / our time (1.0 = as fast as the limit)
            ratio = sec[limit] / seconds
            text = f"{ratio:.2f}x of {limit}"
        elif name == "torch_dist load TP1xDP (fully parallel)" and "torch_dist load TP1xDP (plain)" in sec:
            ratio = sec["torch_dist load TP1xDP (plain)"] / seconds
            text = f"{ratio:.2f}x of plain"
        else:
            ratio, text = None, "(limit)" if limit is None and name.startswith(("raw", "memcpy")) else ""
        ratios[name] = ratio
        lines.append(f"| {name:42s} | {seconds:8.3f} | {rate:7.2f} | {text:14s} |")
    if "torch_dist load resharded" in sec and "torch_dist load" in sec:
        lines.append("")
        lines.append(
            "resharded / same-layout load time: "
            f"{sec['torch_dist load resharded'] / sec['torch_dist load']:.2f}"
        )
    if "async save (blocking)" in sec and "memcpy" in sec:
        lines.append(f"async blocking / memcpy time: {sec['async save (blocking)'] / sec['memcpy']:.2f}")
    amplification = results.get("resharded load: bytes read / bytes requested")
    gets = results.get("resharded load: GET requests")
    if amplification is not None:
        lines.append(
            f"resharded load read {amplification:.2f} bytes from storage per byte requested (rank 0)"
            + (f", in {gets} GET requests" if gets else "")
        )
    rss = results.get("save peak RSS above baseline (x local bytes)")
    if rss is not None:
        lines.append(
            f"peak RSS during save, above the RSS before the state existed: {rss:.2f}x the rank's local bytes"
        )
    for label, peaks in results.get("peak RSS MiB", {}).items():
        lines.append(
            f"peak RSS above the start of each path, max over ranks ({label}): "
            + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items())
        )
    text = "\n".join(lines)
    results["ratios"] = ratios
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    _chart(results, out_dir / "bench.png")
    return text


def _chart(results, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return
    sec = results["seconds"]
    names = [n for n in sec if not n.startswith("torch_dist load TP1xDP")]
    rates = [results["bytes_total"] / sec[n] / 2**30 for n in names]
    colors = [
        "#888888"
        if n.startswith(("raw", "memcpy"))
        else "#1f77b4"
        if "distckpt" in n or n.startswith(("torch_dist", "zarr", "async"))
        else "#ff7f0e"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(names) + 1.2))
    ax.barh(names[::-1], rates[::-1], color=colors[::-1])
    ax.set_xlabel("GiB/s (whole state, all ranks)")
    ax.set_title(
        f"distckpt vs the storage limit: {results['bytes_total'] / 2**30:.1f} GiB, {results['ranks']} ranks"
    )
    for i, r in enumerate(rates[::-1]):
        ax.text(r, i, f" {r:.2f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _start_emulator(url: str):
    """The local server of ``url``'s cloud with its bucket; what reaches it goes into the
    environment (the ranks inherit it). Has ``stop()``."""
    import tempfile

    scheme, rest = url.split("://", 1)
    if scheme in ("s3", "s3a"):
        return start_moto(url)
    from tests.support import servers  # the tests' launchers (run from the repository root)

    bucket, workdir = rest.split("/", 1)[0], Path(tempfile.mkdtemp(prefix="bench-emulator-"))
    if scheme in ("gs", "gcs"):
        server = servers.start_gcs(bucket, workdir)
    elif scheme in ("az", "abfs", "abfss", "adl", "azure"):
        server = servers.start_azurite(bucket, workdir)
    else:
        raise SystemExit(f"--emulator: no local server for {scheme}:// URLs")
    os.environ.update(server.env)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default="/dev/shm/distckpt-bench", help="where checkpoints go (tmpfs or disk)"
    )
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrecorded repetitions first (the first touch of fresh memory is slow)",
    )
    parser.add_argument("--backends", default="torch_dist,zarr")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch_dist save thread_count (files and writer threads per rank; default: "
        "the library's: 2 files, at most one writer thread per core of the rank)",
    )
    parser.add_argument(
        "--write-threads",
        type=int,
        default=None,
        help="torch_dist save: writer threads per rank, whatever the files (they share them)",
    )
    parser.add_argument("--out", default="bench_out")
    parser.add_argument(
        "--rss-budget",
        default=None,
        help="also measure peak RSS per path under this host memory budget "
        "(DISTCKPT_HOST_MEMORY_BUDGET syntax: bytes, 256MiB, or a fraction of RAM)",
    )
    parser.add_argument(
        "--moto",
        action="store_true",
        help="with an s3:// --dir: start a local moto S3 server (and the bucket) first",
    )
    parser.add_argument(
        "--emulator",
        action="store_true",
        help="with an object-store --dir: start the local server of its cloud first (s3: moto, "
        "gs: fake-gcs-server, az: Azurite), as the tests do",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the full bench: torch_dist save/load/resharded load against raw I/O "
        "over --sizes-mib and --shapes, with a fixed + marginal cost fit per shape",
    )
    parser.add_argument("--sizes-mib", default="64,256,1024", help="sweep: sizes per rank")
    parser.add_argument(
        "--shapes",
        default=None,
        help="sweep: comma-separated h<hidden>-tp<degree>-opt<0|80> (default: a few)",
    )
    args = parser.parse_args()
    if args.sweep:
        return sweep.run(args)
    args.backends = [b for b in args.backends.split(",") if b]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    remote = "://" in args.dir
    server = _start_emulator(args.dir) if remote and (args.moto or args.emulator) else None
    if not remote:
        Path(args.dir).mkdir(parents=True, exist_ok=True)

    def cleanup():
        if not remote:
            shutil.rmtree(args.dir, ignore_errors=True)
        if server is not None:
            server.stop()

    results = spawn_ranks(_rank_main_object_store if remote else _rank_main, args.ranks, args, cleanup)
    results["machine"] = {"cpus": os.cpu_count(), "dir": args.dir, "torch": torch.__version__}
    print(report(results, out))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
