"""GPU benchmark: async save and load of CUDA tensors against the copy engine's limits, in one run.

    python -m bench.gpu --dir /dev/shm/distckpt-gpu --sizes-gib 1,4 --reps 3 --out bench_out

One process, one GPU (a gloo group of one rank). For each size it builds the GPT-like state of
``bench.common.build_state`` (bf16 weights, fp32 flattened optimizer states, layer norms) on the GPU and
measures, each figure the median of ``--reps`` runs after one unrecorded warm-up:

- D2H: copy every tensor into preallocated pinned host buffers (``non_blocking``), then
  synchronize: the limit of an async save's blocking part;
- async save blocking: time until ``distckpt.save(..., async_sharded_save=True)`` returns (the
  staging copy into the reused pinned pool, started first, with the validation and planning
  running meanwhile); and until committed; and the same with the copies started only once the
  save is planned (a strategy whose ``prestage`` does nothing), for comparison;
- H2D: copy preallocated pinned host buffers into the GPU tensors;
- raw read: ``os.preadv`` of the same bytes from ``--threads`` files on ``--dir`` (one thread
  each, as a load reads a save's files) into CPU buffers: the storage's limit;
- load to CPU, load to GPU (through pinned slots: the default) and load to GPU with
  ``pinned_slot_bytes=0`` (copies from pageable memory), same layout;
- load to GPU resharded: a TP split of twice as many pieces, this rank taking two of them.

It prints a table, with the ratios ``async blocking / D2H`` and ``load to GPU / H2D`` (the
issue's goals, both <= 1.2), ``load to GPU / raw read`` and ``(load to GPU - load to CPU) / H2D``
(what putting the bytes on the GPU adds to a CPU load, against the copy itself), and writes
``bench_gpu.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import build_state, free_port, model_dims, raw_read, raw_write

DEVICE = "cuda"  # --device cpu: a smoke test of this tool on a machine without a GPU


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _sync_time(fn, *args, **kwargs):
    _sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync()
    return time.perf_counter() - t0, out


def _on_gpu(sd, data: bool):
    out = {}
    for k, sh in sd.items():
        t = torch.empty(sh.data.shape, dtype=sh.data.dtype, device=DEVICE)
        if data:
            t.normal_()
        else:
            t.zero_()
        out[k] = replace(sh, data=t)
    return out


def _split(items, count, size):
    """``items`` in ``count`` groups of about equal total ``size``, largest first."""
    groups = [[] for _ in range(max(1, min(count, len(items))))]
    totals = [0] * len(groups)
    for it in sorted(items, key=size, reverse=True):
        g = totals.index(min(totals))
        groups[g].append(it)
        totals[g] += size(it)
    return groups


def _read_files(pool, files, groups, host):
    for f in [pool.submit(raw_read, path, [host[i] for i in group]) for path, group in zip(files, groups)]:
        f.result()


def _request(sd, device: str):
    return {
        k: replace(sh, data=torch.zeros(sh.data.shape, dtype=sh.data.dtype, device=device))
        for k, sh in sd.items()
    }


def measure(size_gib: float, args) -> dict:
    import distckpt
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

    hidden, layers = model_dims(size_gib)
    sd = _on_gpu(build_state(0, 1, hidden, layers, with_data=False), data=True)
    reshard = build_state(0, 1, hidden, layers, pieces_per_rank=2, with_data=False)
    tensors = [sh.data for sh in sd.values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    times: dict = {}

    def record(name, seconds):
        times.setdefault(name, []).append(seconds)

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=DEVICE == "cuda") for t in tensors]
    queue = AsyncCallsQueue()
    save_strategy = TorchDistSaveShardedStrategy(thread_count=args.threads)

    class CopiesAfterPlanning(TorchDistSaveShardedStrategy):
        def prestage(self, sharded_state_dict):
            return False

    late_strategy = CopiesAfterPlanning(thread_count=args.threads)

    def loader(**kw):
        return TorchDistLoadShardedStrategy(thread_count=args.threads, **kw)

    first_blocking = None
    for rep in range(-1, args.reps):

        def rec(name, seconds, keep=rep >= 0):
            if keep:
                record(name, seconds)

        rec(
            "D2H pinned",
            _sync_time(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors)])[0],
        )
        rec(
            "H2D pinned",
            _sync_time(lambda: [t.copy_(p, non_blocking=True) for p, t in zip(pinned, tensors)])[0],
        )
        # Raw read: the same bytes in ``threads`` files (as a save writes them), read in parallel.
        groups = _split(
            list(range(len(tensors))), args.threads, lambda i: tensors[i].numel() * tensors[i].element_size()
        )
        host = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
        files = [root / f"raw_{g}.bin" for g in range(len(groups))]
        for path, group in zip(files, groups):
            raw_write(path, [pinned[i] for i in group])
        with ThreadPoolExecutor(len(files)) as pool:
            rec("raw read", _sync_time(_read_files, pool, files, groups, host)[0])
        for path in files:
            path.unlink()
        host = None

        # The save's own order (copies started first, planning while they run), then the
        # copies only once planned (as before prestaging), into the same reused pinned pool.
        for label, strategy in (
            ("async save blocking", save_strategy),
            ("async save blocking, copies after planning", late_strategy),
        ):
            ckpt = root / f"ckpt_{rep + 1}"
            shutil.rmtree(ckpt, ignore_errors=True)
            _sync()
            t0 = time.perf_counter()
            request = distckpt.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
            blocking = time.perf_counter() - t0
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            total = time.perf_counter() - t0
            if rep == -1 and strategy is save_strategy:
                first_blocking = blocking
            rec(label, blocking)
            if strategy is save_strategy:
                rec("async save until committed", total)

        request_cpu = _request(sd, "cpu")
        rec("load to CPU", _sync_time(distckpt.load, request_cpu, ckpt, sharded_strategy=loader())[0])
        request_cpu = None
        for label, slot in (("load to GPU", None), ("load to GPU, pageable copies", 0)):
            req = _request(sd, DEVICE)
            strategy = loader(**({} if slot is None else {"pinned_slot_bytes": slot}))
            seconds, out = _sync_time(distckpt.load, req, ckpt, sharded_strategy=strategy)
            if rep == -1:  # check once that the bytes arrived
                bad = [k for k in sd if not torch.equal(out[k], sd[k].data)]
                if bad:
                    raise SystemExit(f"{label}: {len(bad)} tensors differ, e.g. {bad[0]}")
            rec(label, seconds)
            req = out = None
        req = _request(reshard, DEVICE)
        rec("load to GPU resharded", _sync_time(distckpt.load, req, ckpt, sharded_strategy=loader())[0])
        req = None
        shutil.rmtree(ckpt, ignore_errors=True)
    queue.close()
    staged = save_strategy._staging.allocated_bytes if save_strategy._staging is not None else 0
    # What torch's pinned allocator (pin_memory=True, blocks rounded up to powers of two) would hold.
    rounded = sum(1 << max(0, (t.numel() * t.element_size() - 1).bit_length()) for t in tensors)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size_gib": nbytes / 2**30,
        "tensors": len(sd),
        "hidden": hidden,
        "layers": layers,
        "threads": args.threads,
        "first async save blocking (allocates the pinned pool)": first_blocking,
        "staging pool GiB": staged / 2**30,
        "power-of-two pinned blocks GiB": rounded / 2**30,
        "seconds": med,
        "all": times,
        "ratios": {
            "async blocking / D2H": med["async save blocking"] / med["D2H pinned"],
            "async blocking, copies after planning / D2H": med["async save blocking, copies after planning"]
            / med["D2H pinned"],
            "load to GPU / H2D": med["load to GPU"] / med["H2D pinned"],
            "load to GPU / raw read": med["load to GPU"] / med["raw read"],
            "(load to GPU - load to CPU) / H2D": (med["load to GPU"] - med["load to CPU"])
            / med["H2D pinned"],
            "load to GPU pageable / load to GPU": med["load to GPU, pageable copies"] / med["load to GPU"],
            "load to GPU resharded / load to GPU": med["load to GPU resharded"] / med["load to GPU"],
        },
    }


def report(results: list) -> str:
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    lines = [f"device: {name}  torch {torch.__version__}"]
    for r in results:
        gib = r["size_gib"]
        lines.append(
            f"\n{gib:.2f} GiB in {r['tensors']} tensors (hidden {r['hidden']}, {r['layers']} layers), "
            f"{r['threads']} threads"
        )
        lines.append(f"  {'path':44s} {'seconds':>9s} {'GiB/s':>8s}")
        for name, s in r["seconds"].items():
            lines.append(f"  {name:44s} {s:9.4f} {gib / s:8.2f}")
        lines.append(
            f"  {'first async save blocking':44s} "
            f"{r['first async save blocking (allocates the pinned pool)']:9.4f}"
            "  (allocates the pinned pool)"
        )
        lines.append(
            f"  staging pool {r['staging pool GiB']:.3f} GiB for {gib:.3f} GiB staged (power-of-two pinned "
            f"blocks would be {r['power-of-two pinned blocks GiB']:.3f} GiB)"
        )
        for name, v in r["ratios"].items():
            lines.append(f"  {name:46s} {v:6.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm/distckpt-gpu")
    parser.add_argument("--sizes-gib", default="1,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="files per save and reader threads per load")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: run every path on host tensors (a smoke test of the tool itself)",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device; nothing to measure")
        return 0
    import torch.distributed as tdist

    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=0, world_size=1)
    try:
        results = [measure(float(s), args) for s in args.sizes_gib.split(",")]
    finally:
        tdist.destroy_process_group()
        shutil.rmtree(args.dir, ignore_errors=True)
    text = report(results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(results, indent=1))
    (out / "bench_gpu.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
