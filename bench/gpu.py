"""GPU benchmark: distckpt's default calls on CUDA tensors against PyTorch DCP and the limits, in one run.

    python -m bench.gpu --dir /dev/shm/distckpt-gpu --sizes-gib 2.5 --hidden 2048 --reps 3 --out OUT
    python -m bench.gpu --memory-check --saves 100 --dir /dev/shm/distckpt-gpu --out OUT

One process, one GPU (a gloo group of one rank). For each size it builds the GPT-like state of
``bench.common.build_state`` on the GPU (bf16 weights, fp32 flattened optimizer-like states,
layer norms) and times, median of ``--reps`` runs after one unrecorded warm-up:

- the limits: a pinned device-to-host copy of the same bytes (``D2H``; pinning the buffers is
  timed once), the copy back (``H2D``), a raw write and a raw read of the same bytes with
  ``bench.common.raw_write``/``raw_read``, one thread per file, as many threads as distckpt's
  default save writes with (or ``--threads``);
- PyTorch DCP on the same tensors: ``dcp.save`` with its defaults and with
  ``FileSystemWriter(thread_count=8)``, ``dcp.async_save`` with its defaults and with one
  ``DefaultStager()`` kept across saves (blocking part: until its staging completed; skipped with a
  note where torch has no ``DefaultStager``), ``dcp.load`` into CUDA tensors;
- distckpt exactly as Megatron-Core code calls it, with no strategy argument (a fresh default
  strategy each call): ``save(..., async_sharded_save=True)`` scheduled on an ``AsyncCallsQueue``
  (the blocking part is ``distckpt.last_timings("async save")``; the first save of the process
  separately), the synchronous ``save``, ``load`` into CUDA tensors of the same layout and
  resharded (a TP split in two pieces); once, after the repetitions, an async save after
  ``release_staging_memory()`` and ``prepare_staging(state)``, where distckpt has them.

Each load's bytes are compared with the saved ones once (in the warm-up); a path that raises is
reported and left out of the later repetitions (exit status 1 where it is distckpt's).

It prints one table (a column per size) with every ratio of issue #36 beside its goal, and writes
``bench_gpu.json`` and ``bench_gpu.txt`` into ``--out``. ``--memory-check`` instead makes 100
async saves in a row while layers are added and removed, and reports the pinned and resident
memory against the host memory budget (``memory_check.json``, ``memory_check.txt``; exit status 1
when either grew beyond the budget).

Without CUDA it says so and exits 0; ``--device cpu`` runs every path on host tensors, a smoke test
of this tool and not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import (
    balanced_groups,
    build_state,
    free_port,
    model_dims,
    parallel_raw_read,
    parallel_raw_write,
    pinned_like,
    proc_status_bytes,
    rss_bytes,
)

NO_CUDA = "bench.gpu: no CUDA device (torch.cuda.is_available() is False): nothing measured"

# --------------------------------------------------------------------------- ratios and goals


def _div(a, b):
    return None if a is None or not b else a / b


def _max(*values):
    return None if any(v is None for v in values) else max(values)


def ratios(sec: dict) -> dict:
    """Issue #36's ratios from the median seconds of one size (None where a figure is missing)."""
    g = sec.get
    later = g("async save blocking")
    return {
        "async blocking, first save ÷ D2H": _div(g("async save blocking, first save"), g("D2H pinned")),
        "async blocking, later saves ÷ D2H": _div(later, g("D2H pinned")),
        "async blocking after prepare_staging ÷ D2H": _div(
            g("async save blocking, after prepare_staging"), g("D2H pinned")
        ),
        "sync save ÷ dcp.save default": _div(g("save"), g("dcp.save default")),
        "sync save ÷ dcp.save thread_count=8": _div(g("save"), g("dcp.save thread_count=8")),
        "sync save ÷ max(D2H, raw write)": _div(g("save"), _max(g("D2H pinned"), g("raw write"))),
        "load ÷ raw read": _div(g("load"), g("raw read")),
        "load ÷ max(raw read, H2D)": _div(g("load"), _max(g("raw read"), g("H2D pinned"))),
        "dcp.load ÷ load": _div(g("dcp.load"), g("load")),
        "resharded ÷ same-layout load": _div(g("load resharded"), g("load")),
        "dcp.async_save default blocking ÷ async blocking": _div(g("dcp.async_save default blocking"), later),
        "dcp.async_save DefaultStager blocking ÷ async blocking": _div(
            g("dcp.async_save DefaultStager blocking"), later
        ),
    }


def _first_save_target(sec: dict):
    # Item 2: the first save blocks at most 2x the D2H copy plus the pinning itself.
    d2h, pinning = sec.get("D2H pinned"), sec.get("pinning")
    return None if not d2h or pinning is None else 2 + pinning / d2h


# ratio -> (comparison, target: a number or a function of the seconds, the goal in words)
GOALS = {
    "async blocking, first save ÷ D2H": ("<=", _first_save_target, "≤ 2 + pinning÷D2H"),
    "async blocking, later saves ÷ D2H": ("<=", 1.2, "≤ 1.2"),
    "sync save ÷ dcp.save default": ("<=", 1 / 1.5, "≤ 0.67 (1.5× faster)"),
    "sync save ÷ dcp.save thread_count=8": ("<=", 1 / 1.2, "≤ 0.83 (1.2× faster)"),
    "sync save ÷ max(D2H, raw write)": ("<=", 1.25, "≤ 1.25"),
    "load ÷ raw read": ("<=", 1.15, "≤ 1.15"),
    "dcp.load ÷ load": (">=", 5.0, "≥ 5"),
    "resharded ÷ same-layout load": ("<=", 1.2, "≤ 1.2"),
}


def verdicts(sec: dict, values: dict) -> dict:
    """For each goal: its target, and whether the ratio meets it (None: not measured)."""
    out = {}
    for name, (op, target, words) in GOALS.items():
        t = target(sec) if callable(target) else target
        v = values.get(name)
        met = None if v is None or t is None else (v <= t if op == "<=" else v >= t)
        out[name] = {"goal": words, "op": op, "target": t, "met": met}
    return out


def summarize(times: dict, **facts) -> dict:
    """One size's result from every recorded time (name -> seconds of each repetition): the
    medians, the ratios, the goals met, and ``facts`` (size, tensors, files, phases, notes ...)."""
    med = {k: statistics.median(v) for k, v in times.items() if v}
    values = ratios(med)
    facts.setdefault("phases", {})
    facts.setdefault("notes", [])
    facts.setdefault("problems", [])
    return {**facts, "seconds": med, "all": times, "ratios": values, "goals": verdicts(med, values)}


# --------------------------------------------------------------------------- the report

SECONDS_ROWS = [
    ("pinning", "pinning the D2H buffers (allocate + register), once"),
    ("D2H pinned", "D2H, pinned, bare"),
    ("H2D pinned", "H2D, pinned, bare"),
    ("raw write", "raw write (the save's threads, a file each)"),
    ("raw read", "raw read (the load's threads, a file each)"),
    ("dcp.save default", "dcp.save, defaults"),
    ("dcp.save thread_count=8", "dcp.save, FileSystemWriter(thread_count=8)"),
    ("dcp.async_save default blocking", "dcp.async_save, defaults: blocking"),
    ("dcp.async_save default until written", "dcp.async_save, defaults: until written"),
    ("dcp.async_save DefaultStager returns", "dcp.async_save, DefaultStager(): until it returns"),
    ("dcp.async_save DefaultStager blocking", "dcp.async_save, DefaultStager(): until staged"),
    ("dcp.async_save DefaultStager until written", "dcp.async_save, DefaultStager(): until written"),
    ("dcp.load", "dcp.load into CUDA tensors"),
    ("async save blocking, first save", "**async save blocking, first save of the process**"),
    ("async save blocking", "**async save blocking** (last_timings, 2nd and later saves)"),
    ("async save blocking, wall", "async save: until save() returns (wall clock)"),
    ("async save, until its copies are done", "async save: until the device is idle after it returns"),
    ("async save until committed", "async save: until committed"),
    ("prepare_staging", "distckpt.prepare_staging(state), the pool emptied first"),
    ("async save blocking, after prepare_staging", "async save blocking, after prepare_staging"),
    ("save", "**sync save**"),
    ("load", "**load into CUDA tensors**"),
    ("load resharded", "load into CUDA tensors, resharded"),
]


def _fmt(v, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def render(report: dict) -> str:
    """One markdown table, a column per size: the seconds, then every ratio with its goal."""
    m = report["machine"]
    results = report["results"]
    lines = [
        f"device: {m['device']}, {m['cores']} cores, torch {m['torch']}, python {m['python']}"
        + (f", DefaultStager: {m['default_stager']}" if m.get("default_stager") else ""),
        "",
        "| | "
        + " | ".join(f"{r['size_gib']:.2f} GiB, {r['tensors']} tensors" for r in results)
        + " | goal |",
        "|---|" + "---:|" * len(results) + "---|",
    ]
    files = " | ".join(
        f"{r['save_files']} files; {r['threads']} write, {r.get('read_threads', r['threads'])} read threads"
        for r in results
    )
    lines.append(f"| default save's files; threads of the save and load (and of raw I/O) | {files} | |")
    for key, label in SECONDS_ROWS:
        if all(r["seconds"].get(key) is None for r in results):
            continue
        lines.append(f"| {label} (s) | " + " | ".join(_fmt(r["seconds"].get(key)) for r in results) + " | |")
    for name in results[0]["ratios"]:
        cells = []
        for r in results:
            v, goal = r["ratios"].get(name), r["goals"].get(name)
            mark = "" if goal is None or goal["met"] is None else (" met" if goal["met"] else " NOT MET")
            cells.append(_fmt(v, 2) + mark)
        words = GOALS[name][2] if name in GOALS else ""
        label = f"**{name}**" if name in GOALS else name
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {words} |")
    for r in results:
        lines.append("")
        lines.append(f"{r['size_gib']:.2f} GiB, phases of the last run (distckpt.last_timings):")
        for op, text in r["phases"].items():
            lines.append(f"  {op}: {text}")
        for note in r["notes"]:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def write_report(report: dict, out: Path, stem: str = "bench_gpu") -> str:
    """Write ``<stem>.json`` and ``<stem>.txt`` (the table) into ``out``; return the table."""
    text = render(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.txt").write_text(text + "\n")
    return text


def machine(device: str) -> dict:
    from torch.distributed.checkpoint import staging

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test, not a measurement)",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "default_stager": "yes" if hasattr(staging, "DefaultStager") else "absent in this torch",
    }


# --------------------------------------------------------------------------- measuring


class Clock:
    """Wall-clock timing that waits for the device before and after."""

    def __init__(self, device: str):
        self.device = device

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn, *args, **kwargs):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return time.perf_counter() - t0, out


def _default_threads(distckpt, ckpt) -> tuple:
    """The threads distckpt's default save writes ``ckpt``'s files with and its default load reads
    them with (0 where it cannot say: an older distckpt, one thread per file)."""
    try:
        from distckpt.strategies.torch_dist.load import TorchDistLoadShardedStrategy
        from distckpt.strategies.torch_dist.save import TorchDistSaveShardedStrategy

        save = int(TorchDistSaveShardedStrategy().writer_threads(ckpt))
        load = int(TorchDistLoadShardedStrategy().reader_threads(ckpt))
    except Exception:  # noqa: BLE001
        return 0, 0
    return save, load


def _on_device(sd, device: str, fill: bool):
    out = {}
    for k, sh in sd.items():
        t = torch.empty(sh.data.shape, dtype=sh.data.dtype, device=device)
        t.normal_() if fill else t.zero_()
        out[k] = replace(sh, data=t)
    return out


def _mismatches(sd, request, loaded) -> list:
    """Keys of ``request`` whose loaded tensor differs from the same region of the full ``sd``
    (any layout: each requested piece is cut out of the saved whole by its global offset)."""
    full = {sh.key: sh for sh in sd.values()}
    bad = []
    for k, sh in request.items():
        src = full[sh.key]
        whole = src.data.reshape(src.local_shape)
        ref = whole[tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))]
        if not torch.equal(loaded[k].reshape(-1), ref.reshape(-1)):
            bad.append(k)
    return bad


def _dcp_default_stager(device: str, notes: list):
    """One ``DefaultStager()`` (with its defaults) to keep across saves, or None with a note.
    On the CPU smoke test its pinned, non-blocking copies are turned off (they need CUDA)."""
    from torch.distributed.checkpoint import staging

    cls = getattr(staging, "DefaultStager", None)
    if cls is None:
        notes.append("torch.distributed.checkpoint.staging.DefaultStager absent in this torch: skipped")
        return None
    try:
        if device == "cuda":
            return cls()
        return cls(staging.StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False))
    except Exception as e:  # noqa: BLE001 - reported, and that comparison skipped
        notes.append(f"DefaultStager() failed ({type(e).__name__}: {e}): skipped")
        return None


def _warm_up(distckpt, path: Path) -> None:
    """A save and a load of one small CPU tensor: the process's one-time costs (lazy imports, the
    first collectives) are paid here, so the first async save of CUDA tensors shows its own."""
    from distckpt import ShardedTensor

    sd = {"warm_up": ShardedTensor.from_rank_offsets("warm_up", torch.ones(1024))}
    distckpt.save(sd, path)
    distckpt.load({"warm_up": ShardedTensor.from_rank_offsets("warm_up", torch.zeros(1024))}, path)
    shutil.rmtree(path, ignore_errors=True)


class Run:
    """One size's measurements: the state on the device, where its checkpoints go, what was timed."""

    def __init__(self, sd, reshard, root: Path, clock: Clock):
        self.sd, self.reshard, self.root, self.clock = sd, reshard, root, clock
        self.tensors = [sh.data for sh in sd.values()]
        self.plain = {k: sh.data for k, sh in sd.items()}  # what DCP saves: the same device tensors
        self.times: dict = {}
        self.phases: dict = {}
        self.problems: list = []
        self.notes: list = []
        self.failed: set = set()  # paths that raised: not tried again
        self.keep = False  # record this repetition (False: the warm-up)
        self.save_files = None  # data files distckpt's default save wrote
        self.save_threads = None  # threads distckpt's default save writes them with
        self.load_threads = None  # and its default load reads them with

    def rec(self, name: str, seconds: float) -> None:
        if self.keep:
            self.times.setdefault(name, []).append(seconds)

    def fresh(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def check(self, what: str, bad: list) -> None:
        if bad and not self.keep:  # checked once, in the warm-up
            self.problems.append(f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}")

    def distckpt_paths(self, distckpt, queue, first: bool) -> None:
        """distckpt as Megatron-Core code calls it: no strategy argument, a fresh default each call."""
        clock, sd = self.clock, self.sd
        ckpt = self.fresh("distckpt_async")
        clock.sync()
        t0 = time.perf_counter()
        request = distckpt.save(sd, ckpt, async_sharded_save=True)
        wall = time.perf_counter() - t0
        clock.sync()
        copies_done = time.perf_counter() - t0
        blocking = distckpt.last_timings("async save").total_s
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        committed = time.perf_counter() - t0
        if first:
            self.times["async save blocking, first save"] = [blocking]
            self.phases["async save, first"] = str(distckpt.last_timings("async save"))
        self.rec("async save blocking", blocking)
        self.rec("async save blocking, wall", wall)
        self.rec("async save, until its copies are done", copies_done)
        self.rec("async save until committed", committed)
        self.phases["async save"] = str(distckpt.last_timings("async save"))
        shutil.rmtree(ckpt, ignore_errors=True)

        ckpt = self.fresh("distckpt_sync")
        self.rec("save", clock.time(distckpt.save, sd, ckpt)[0])
        self.phases["save"] = str(distckpt.last_timings("save"))
        if self.save_files is None:
            self.save_files = len(list(ckpt.glob("*.distcp"))) or 1
            self.save_threads, self.load_threads = _default_threads(distckpt, ckpt)
            self.save_threads = self.save_threads or self.save_files
            self.load_threads = self.load_threads or self.save_files
        for name, layout in (("load", sd), ("load resharded", self.reshard)):
            request = _on_device(layout, clock.device, fill=False)
            seconds, out = clock.time(distckpt.load, request, ckpt)
            self.rec(name, seconds)
            self.phases[name] = str(distckpt.last_timings("load"))
            self.check(f"distckpt {name}", _mismatches(sd, request, out))
            request = out = None
        shutil.rmtree(ckpt, ignore_errors=True)

    def dcp_save_and_load(self, dcp) -> None:
        """``dcp.save`` with its defaults, then ``dcp.load`` of that checkpoint."""
        clock, plain = self.clock, self.plain
        ckpt = self.fresh("dcp_default")
        self.rec("dcp.save default", clock.time(dcp.save, plain, checkpoint_id=str(ckpt))[0])
        request = {k: torch.zeros_like(t) for k, t in plain.items()}
        self.rec("dcp.load", clock.time(dcp.load, request, checkpoint_id=str(ckpt))[0])
        self.check("dcp.load", [k for k in plain if not torch.equal(request[k], plain[k])])
        shutil.rmtree(ckpt, ignore_errors=True)

    def dcp_save_8_threads(self, dcp) -> None:
        ckpt = self.fresh("dcp_t8")
        writer = dcp.FileSystemWriter(str(ckpt), thread_count=8)
        self.rec("dcp.save thread_count=8", self.clock.time(dcp.save, self.plain, storage_writer=writer)[0])
        shutil.rmtree(ckpt, ignore_errors=True)

    def dcp_async_default(self, dcp) -> None:
        ckpt = self.fresh("dcp_async")
        self.clock.sync()
        t0 = time.perf_counter()
        future = dcp.async_save(self.plain, checkpoint_id=str(ckpt))
        self.rec("dcp.async_save default blocking", time.perf_counter() - t0)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        self.rec("dcp.async_save default until written", time.perf_counter() - t0)
        shutil.rmtree(ckpt, ignore_errors=True)

    def dcp_async_stager(self, dcp, stager) -> None:
        """``dcp.async_save`` through one ``DefaultStager()``: blocking until its staging completed."""
        ckpt = self.fresh("dcp_async_stager")
        self.clock.sync()
        t0 = time.perf_counter()
        response = dcp.async_save(self.plain, checkpoint_id=str(ckpt), async_stager=stager)
        self.rec("dcp.async_save DefaultStager returns", time.perf_counter() - t0)
        if hasattr(response, "staging_completion"):
            response.staging_completion.result()  # until then the caller must not change the tensors
            self.rec("dcp.async_save DefaultStager blocking", time.perf_counter() - t0)
            response.upload_completion.result()
        else:
            self.rec("dcp.async_save DefaultStager blocking", time.perf_counter() - t0)
            response.result()
        self.rec("dcp.async_save DefaultStager until written", time.perf_counter() - t0)
        shutil.rmtree(ckpt, ignore_errors=True)

    def prepared_save(self, distckpt, queue) -> None:
        """Item 2's other way: the pool emptied, then allocated ahead of an async save on request."""
        distckpt.release_staging_memory()
        self.times["prepare_staging"] = [self.clock.time(distckpt.prepare_staging, self.sd)[0]]
        ckpt = self.fresh("distckpt_prepared")
        request = distckpt.save(self.sd, ckpt, async_sharded_save=True)
        self.times["async save blocking, after prepare_staging"] = [
            distckpt.last_timings("async save").total_s
        ]
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        shutil.rmtree(ckpt, ignore_errors=True)

    def attempt(self, name: str, fn, *args, ours: bool = True) -> None:
        """``fn(*args)``; where it raises, the path is reported (a problem where it is distckpt's or
        the limits', a note where it is DCP's) and left out of the later repetitions."""
        if name in self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one failed path must not cost the others' figures
            self.failed.add(name)
            (self.problems if ours else self.notes).append(f"{name} failed: {type(e).__name__}: {e}")
            traceback.print_exc()

    def limits(self, pinned, threads: int, read_threads: int) -> None:
        """The same bytes through the copy engine, and through plain file I/O: written with
        ``threads`` threads (a file each), read back with ``read_threads``."""
        clock, tensors = self.clock, self.tensors
        d2h = clock.time(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors)])[0]
        self.rec("D2H pinned", d2h)
        h2d = clock.time(lambda: [t.copy_(p, non_blocking=True) for p, t in zip(pinned, tensors)])[0]
        self.rec("H2D pinned", h2d)
        groups = balanced_groups(list(range(len(pinned))), threads, lambda i: pinned[i].numel())
        files = [self.fresh(f"raw_{g}.bin") for g in range(len(groups))]
        self.rec(
            "raw write", clock.time(parallel_raw_write, files, [[pinned[i] for i in g] for g in groups])[0]
        )
        host = [torch.zeros_like(p) for p in pinned]  # pages touched now: the read pays no faults
        if read_threads != threads:  # the same bytes in as many files as threads read them
            for path in files:
                path.unlink()
            groups = balanced_groups(list(range(len(pinned))), read_threads, lambda i: pinned[i].numel())
            files = [self.fresh(f"raw_{g}.bin") for g in range(len(groups))]
            parallel_raw_write(files, [[pinned[i] for i in g] for g in groups])
        self.rec("raw read", clock.time(parallel_raw_read, files, [[host[i] for i in g] for g in groups])[0])
        for path in files:
            path.unlink()


def measure(size_gib: float, args, clock: Clock, first_save: bool) -> dict:
    """Every path of one size: a warm-up, then ``args.reps`` recorded repetitions (fewer where
    ``args.max_seconds`` would be passed), then a save after ``prepare_staging``."""
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.strategies.async_utils import AsyncCallsQueue

    hidden, layers = model_dims(size_gib)
    if args.hidden:
        hidden = args.hidden
        layers = max(1, round(size_gib * 2**30 / (120 * hidden * hidden)))
    sd = _on_device(build_state(0, 1, hidden, layers, with_data=False), clock.device, fill=True)
    reshard = build_state(0, 1, hidden, layers, pieces_per_rank=2, with_data=False)
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(sd, reshard, args.work, clock)
    t_start = time.perf_counter()
    pinned, unpin = pinned_like(run.tensors)
    run.times["pinning"] = [time.perf_counter() - t_start]
    stager = _dcp_default_stager(clock.device, run.notes)
    if first_save:
        _warm_up(distckpt, args.work / "warm_up")
    queue = AsyncCallsQueue()
    rep_seconds: list = []
    done = 0
    for rep in range(-1, args.reps):
        rep_t0 = time.perf_counter()
        run.keep = rep >= 0
        # distckpt's async save first: the warm-up's is the process's first save.
        run.attempt("distckpt", run.distckpt_paths, distckpt, queue, first_save and rep == -1)
        run.attempt("dcp.save and dcp.load", run.dcp_save_and_load, dcp, ours=False)
        run.attempt("dcp.save(thread_count=8)", run.dcp_save_8_threads, dcp, ours=False)
        run.attempt("dcp.async_save", run.dcp_async_default, dcp, ours=False)
        if stager is not None:
            run.attempt("dcp.async_save with DefaultStager()", run.dcp_async_stager, dcp, stager, ours=False)
        run.attempt(
            "limits",
            run.limits,
            pinned,
            args.threads or run.save_threads or 1,
            args.threads or run.load_threads or 1,
        )
        rep_seconds.append(time.perf_counter() - rep_t0)
        done = rep + 1
        if 1 <= done < args.reps and args.max_seconds:
            if time.perf_counter() - t_start + max(rep_seconds) > args.max_seconds:
                run.notes.append(
                    f"stopped after {done} of {args.reps} repetitions (--max-seconds {args.max_seconds})"
                )
                break
    if hasattr(distckpt, "prepare_staging") and hasattr(distckpt, "release_staging_memory"):
        run.attempt("prepare_staging", run.prepared_save, distckpt, queue)
    run.attempt("closing the queue", queue.close)
    if stager is not None and hasattr(stager, "close"):
        run.attempt("closing the DefaultStager", stager.close, ours=False)
    unpin()
    return summarize(
        run.times,
        size_gib=sum(t.numel() * t.element_size() for t in run.tensors) / 2**30,
        tensors=len(sd),
        hidden=hidden,
        layers=layers,
        save_files=run.save_files,
        threads=args.threads or run.save_threads,
        read_threads=args.threads or run.load_threads,
        reps=done,
        phases=run.phases,
        notes=run.notes,
        problems=run.problems,
    )


# --------------------------------------------------------------------------- the 100-save memory check


def pinned_held():
    """(bytes of staging memory distckpt holds now, the most it held since the last call, where the
    figures come from). With the process-wide pool (``distckpt.io.staging.pool()``): its
    allocated bytes and peak (pinned for CUDA tensors); without it: torch's pinned host allocator
    (``torch.cuda.host_memory_stats``); else (None, None, why)."""
    try:
        from distckpt.io import staging
    except ImportError:
        staging = None
    if staging is not None and hasattr(staging, "pool"):
        p = staging.pool()
        now, peak = p.allocated_bytes, getattr(p, "peak_allocated_bytes", p.allocated_bytes)
        if hasattr(p, "reset_peak"):
            p.reset_peak()
        return now, peak, "distckpt.io.staging.pool(): allocated bytes"
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        if "allocated_bytes.current" in stats:
            now = int(stats["allocated_bytes.current"])
            return now, now, "torch.cuda.host_memory_stats(): torch's pinned allocator"
    return None, None, "no figure: distckpt.io.staging absent, and no CUDA"


def layer_schedule(saves: int, low: int = 2, high: int = 6) -> list:
    """The layer ids of each save: a layer is added (a new id) or removed (from the middle) at every
    save, the count going ``low`` .. ``high`` and back, so shapes and keys keep changing."""
    current = list(range(low))
    next_id = low
    grow = True
    out = []
    for _ in range(saves):
        out.append(list(current))
        if grow and len(current) >= high or not grow and len(current) <= low:
            grow = not grow
        if grow:
            current.append(next_id)
            next_id += 1
        else:
            current.pop(len(current) // 2)
    return out


def memory_verdict(samples: list, budget: int, rss_start: int, rss_end: int) -> list:
    """What grew beyond the host memory budget over the saves: a list of flags (empty: none).
    ``rss_start``/``rss_end`` leave out the state itself where it lives in host memory (--device cpu)."""
    flags = []
    pinned = [s.get("pinned_peak") or s["pinned"] for s in samples if s.get("pinned") is not None]
    if pinned and max(pinned) > budget:
        flags.append(f"pinned memory held reached {max(pinned)} bytes, above the budget of {budget}")
    if rss_end - rss_start > budget:
        flags.append(f"resident memory grew by {rss_end - rss_start} bytes, above the budget of {budget}")
    return flags


def memory_check(args, clock: Clock) -> dict:
    import distckpt
    from distckpt.budget import host_memory_budget
    from distckpt.strategies.async_utils import AsyncCallsQueue

    device = clock.device
    schedule = layer_schedule(args.saves)
    top = max(max(ids) for ids in schedule) + 1
    layer_key = re.compile(r"\.layers\.(\d+)\.")
    full = build_state(0, 1, args.memory_hidden, top, with_data=False)
    by_layer: dict = {}
    for k in full:
        m = layer_key.search(k)
        by_layer.setdefault(int(m.group(1)), []).append(k)
    live: dict = {}  # layer id -> its ShardedTensors on the device

    def state_for(ids):
        for gone in set(live) - set(ids):
            del live[gone]
        for new in set(ids) - set(live):
            live[new] = _on_device({k: full[k] for k in by_layer[new]}, device, fill=True)
        return {k: sh for i in ids for k, sh in live[i].items()}

    budget = host_memory_budget()
    root = args.work / "memory"
    root.mkdir(parents=True, exist_ok=True)
    queue = AsyncCallsQueue()
    sd = state_for(schedule[0])
    clock.sync()
    pinned_held()  # starts the pool's peak from here
    rss_start = rss_bytes()
    samples, notes = [], []
    t_start = time.perf_counter()
    for i, ids in enumerate(schedule):
        sd = state_for(ids)
        ckpt = root / f"ckpt_{i % 3}"
        shutil.rmtree(ckpt, ignore_errors=True)
        request = distckpt.save(sd, ckpt, async_sharded_save=True)
        blocking = distckpt.last_timings("async save").total_s
        queue.schedule_async_request(request)
        if queue.get_num_unfinalized_calls() >= args.in_flight:
            queue.maybe_finalize_async_calls(blocking=True)
        pinned, peak, source = pinned_held()
        samples.append(
            {
                "save": i + 1,
                "layers": len(ids),
                "state_bytes": sum(sh.data.numel() * sh.data.element_size() for sh in sd.values()),
                "blocking_s": blocking,
                "rss": rss_bytes(),
                "pinned": pinned,
                "pinned_peak": peak,
                "vm_pin": proc_status_bytes("VmPin"),
                "vm_lck": proc_status_bytes("VmLck"),
            }
        )
        if args.max_seconds and time.perf_counter() - t_start > args.max_seconds and i + 1 < len(schedule):
            notes.append(f"stopped after {i + 1} of {len(schedule)} saves (--max-seconds {args.max_seconds})")
            break
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    problems = []
    last = root / f"ckpt_{(len(samples) - 1) % 3}"
    request = _on_device(sd, device, fill=False)
    bad = _mismatches(sd, request, distckpt.load(request, last))
    if bad:
        problems.append(f"the last save loads back wrong: {len(bad)} tensors differ, e.g. {bad[0]}")
    request = None
    pinned_end, _, source = pinned_held()
    rss_end = rss_bytes()
    shutil.rmtree(root, ignore_errors=True)
    # On the CPU smoke test the state is in host memory: its own growth is not the saves'.
    host_state = [s["state_bytes"] if device == "cpu" else 0 for s in (samples[0], samples[-1])]
    flags = memory_verdict(samples, budget, rss_start - host_state[0], rss_end - host_state[1]) + problems
    if len(samples) < args.saves:
        flags.append(f"only {len(samples)} of {args.saves} saves ran")
    return {
        "device": machine(device)["device"],
        "saves": len(samples),
        "in_flight": args.in_flight,
        "budget_bytes": budget,
        "largest_state_bytes": max(s["state_bytes"] for s in samples),
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_peak": max(s["rss"] for s in samples),
        # a leak shows here too, while the first saves' growth (the pool filling) does not
        "rss_growth_second_half": rss_end - samples[len(samples) // 2]["rss"],
        "pinned_source": source,
        "pinned_max": max(
            (s.get("pinned_peak") or s["pinned"] for s in samples if s["pinned"] is not None), default=None
        ),
        "pinned_end": pinned_end,
        "samples": samples,
        "notes": notes,
        "flags": flags,
    }


def render_memory(r: dict) -> str:
    mib = 2**20

    def m(v):
        return "n/a" if v is None else f"{v / mib:.1f} MiB"

    lines = [
        f"memory check on {r['device']}: {r['saves']} async saves (layers added and removed, "
        f"at most {r['in_flight']} in flight), host memory budget {m(r['budget_bytes'])}, "
        f"largest state {m(r['largest_state_bytes'])}",
        f"  RSS start {m(r['rss_start'])}, end {m(r['rss_end'])} (grew {m(r['rss_end'] - r['rss_start'])}), "
        f"peak {m(r['rss_peak'])}; grew {m(r['rss_growth_second_half'])} over the second half of the saves",
        f"  pinned held ({r['pinned_source']}): max {m(r['pinned_max'])}, end {m(r['pinned_end'])}",
    ]
    for s in r["samples"][:: max(1, len(r["samples"]) // 10)]:
        lines.append(
            f"  save {s['save']:3d}: {s['layers']} layers, state {m(s['state_bytes'])}, "
            f"blocking {s['blocking_s'] * 1e3:.1f} ms, RSS {m(s['rss'])}, pinned {m(s['pinned'])}"
        )
    lines += [f"  note: {n}" for n in r["notes"]]
    lines += [f"  FLAG: {f}" for f in r["flags"]] or ["  no growth beyond the budget"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default="/dev/shm/distckpt-gpu", help="where the checkpoints go (removed after)"
    )
    parser.add_argument("--sizes-gib", default="2.5", help="comma-separated state sizes, one column each")
    parser.add_argument(
        "--hidden", type=int, default=0, help="hidden size (default: bench.common.model_dims)"
    )
    parser.add_argument("--reps", type=int, default=3, help="recorded repetitions after one warm-up")
    parser.add_argument(
        "--threads", type=int, default=0, help="raw I/O threads (default: the default save's writer threads)"
    )
    parser.add_argument("--max-seconds", type=float, default=0, help="stop repeating past this (0: never)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the tool"
    )
    parser.add_argument("--memory-check", action="store_true", help="the 100-save memory check instead")
    parser.add_argument("--saves", type=int, default=100, help="memory check: saves in a row")
    parser.add_argument("--memory-hidden", type=int, default=512, help="memory check: hidden size")
    parser.add_argument(
        "--in-flight", type=int, default=2, help="memory check: async saves in flight at most"
    )
    args = parser.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes_gib.split(",") if s.strip()]
    if not args.sizes or any(s <= 0 for s in args.sizes):
        parser.error(f"--sizes-gib {args.sizes_gib!r}: positive sizes expected")
    if args.reps < 1 or args.saves < 1 or args.in_flight < 1 or args.threads < 0:
        parser.error("--reps, --saves and --in-flight must be at least 1, --threads at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    import torch.distributed as tdist

    clock = Clock(args.device)
    args.work = Path(args.dir) / f"bench_gpu_{os.getpid()}"  # all this run writes, removed at the end
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    tdist.init_process_group("gloo", rank=0, world_size=1)
    out = Path(args.out)
    try:
        if args.memory_check:
            result = memory_check(args, clock)
            text = render_memory(result)
            out.mkdir(parents=True, exist_ok=True)
            (out / "memory_check.json").write_text(json.dumps(result, indent=1))
            (out / "memory_check.txt").write_text(text + "\n")
            print(text)
            return 1 if result["flags"] else 0
        results = [measure(size, args, clock, first_save=i == 0) for i, size in enumerate(args.sizes)]
    finally:
        tdist.destroy_process_group()
        shutil.rmtree(args.work, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(args.dir).rmdir()  # only if this run made it and left it empty
    report = {"machine": machine(args.device), "results": results}
    print(write_report(report, out))
    problems = [p for r in results for p in r["problems"]]
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
