"""bench/gpu.py and bench/gpu_check.sh without a GPU: the ratios and goals from recorded figures, the
table and JSON, the arguments, the no-CUDA exit, the memory check's schedule and verdict, and the
whole GPU script run with its bench steps on host tensors (a smoke test, not a measurement)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu
from bench.common import build_state

ROOT = Path(__file__).resolve().parents[2]

# One size as an H100 run might record it: seconds of three repetitions (medians are the middle).
RECORDED = {
    "pinning": [0.2],
    "D2H pinned": [0.05, 0.04, 0.06],
    "H2D pinned": [0.05, 0.05, 0.05],
    "raw write": [0.9, 0.8, 1.0],
    "raw read": [0.25, 0.2, 0.3],
    "dcp.save default": [1.6, 1.5, 1.7],
    "dcp.save thread_count=8": [1.1, 1.0, 1.2],
    "dcp.async_save default blocking": [2.0, 2.0, 2.0],
    "dcp.load": [1.6, 1.6, 1.6],
    "async save blocking, first save": [0.4],
    "async save blocking": [0.055, 0.05, 0.06],
    "save": [1.0, 0.9, 1.1],
    "load": [0.3, 0.3, 0.3],
    "load resharded": [0.33, 0.33, 0.33],
}


def recorded_result(times=RECORDED):
    return gpu.summarize(
        times, size_gib=2.5, tensors=70, hidden=2048, layers=5, save_files=2, threads=2, reps=3
    )


def test_ratios_from_recorded_medians():
    r = recorded_result()
    assert r["seconds"]["D2H pinned"] == 0.05  # the median, not the first or the mean
    v = r["ratios"]
    expect = {
        "async blocking, first save ÷ D2H": 0.4 / 0.05,
        "async blocking, later saves ÷ D2H": 0.055 / 0.05,
        "sync save ÷ dcp.save default": 1.0 / 1.6,
        "sync save ÷ dcp.save thread_count=8": 1.0 / 1.1,
        "sync save ÷ max(D2H, raw write)": 1.0 / 0.9,
        "load ÷ raw read": 0.3 / 0.25,
        "load ÷ max(raw read, H2D)": 0.3 / 0.25,
        "dcp.load ÷ load": 1.6 / 0.3,
        "resharded ÷ same-layout load": 0.33 / 0.3,
        "dcp.async_save default blocking ÷ async blocking": 2.0 / 0.055,
    }
    for name, value in expect.items():
        assert v[name] == pytest.approx(value), name
    # Not recorded (no DefaultStager in that torch, no prepare_staging): no figure, no verdict.
    assert v["dcp.async_save DefaultStager blocking ÷ async blocking"] is None
    assert v["async blocking after prepare_staging ÷ D2H"] is None


def test_goals_met_and_not_met():
    goals = recorded_result()["goals"]
    assert set(goals) == set(gpu.GOALS)
    met = {name: g["met"] for name, g in goals.items()}
    assert met == {
        "async blocking, first save ÷ D2H": False,  # 8 > 2 + 0.2 / 0.05 = 6
        "async blocking, later saves ÷ D2H": True,  # 1.1 <= 1.2
        "sync save ÷ dcp.save default": True,  # 0.625 <= 1 / 1.5
        "sync save ÷ dcp.save thread_count=8": False,  # 0.91 > 1 / 1.2
        "sync save ÷ max(D2H, raw write)": True,  # 1.11 <= 1.25
        "load ÷ raw read": False,  # 1.2 > 1.15
        "dcp.load ÷ load": True,  # 5.3 >= 5
        "resharded ÷ same-layout load": True,  # 1.1 <= 1.2
    }
    assert goals["async blocking, first save ÷ D2H"]["target"] == pytest.approx(6.0)


def test_a_goal_met_exactly_at_its_bound_and_missing_figures_have_no_verdict():
    times = {k: list(v) for k, v in RECORDED.items()}
    times["async save blocking"] = [0.06]  # 0.06 / 0.05 = 1.2: the bound itself
    times["dcp.load"] = [1.5]  # 1.5 / 0.3 = 5: likewise
    del times["raw read"]
    goals = recorded_result(times)["goals"]
    assert goals["async blocking, later saves ÷ D2H"]["met"] is True
    assert goals["dcp.load ÷ load"]["met"] is True
    assert goals["load ÷ raw read"]["met"] is None
    times["async save blocking"] = [0.0601]
    assert recorded_result(times)["goals"]["async blocking, later saves ÷ D2H"]["met"] is False


def test_table_and_json(tmp_path):
    r2 = recorded_result({**RECORDED, "dcp.async_save DefaultStager blocking": [0.5]})
    r2["size_gib"], r2["notes"] = 4.0, ["stopped after 2 of 3 repetitions"]
    report = {
        "machine": {"device": "NVIDIA H100 (recorded)", "cores": 16, "torch": "2.11", "python": "3.12"},
        "results": [recorded_result(), r2],
    }
    text = gpu.write_report(report, tmp_path / "out")
    assert (tmp_path / "out" / "bench_gpu.txt").read_text() == text + "\n"
    assert json.loads((tmp_path / "out" / "bench_gpu.json").read_text()) == json.loads(json.dumps(report))
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == "| | 2.50 GiB, 70 tensors | 4.00 GiB, 70 tensors | goal |"
    assert all(row.count("|") == 5 for row in rows)  # one table: a column per size and the goal
    by_name = {row.split("|")[1].replace("*", "").strip(): row for row in rows}
    for name in recorded_result()["ratios"]:
        assert name in by_name, name
    assert (
        "| 0.91 NOT MET | 0.91 NOT MET | ≤ 0.83 (1.2× faster) |"
        in by_name["sync save ÷ dcp.save thread_count=8"]
    )
    assert "| 1.10 met |" in by_name["async blocking, later saves ÷ D2H"]
    assert "| n/a | 9.09 |" in by_name["dcp.async_save DefaultStager blocking ÷ async blocking"]
    assert "| 1.0000 | 1.0000 |" in by_name["sync save (s)"]
    # a figure nobody recorded has no row at all
    assert not any("DefaultStager(): until written" in row for row in rows)
    assert "note: stopped after 2 of 3 repetitions" in text


def test_arguments():
    args = gpu.parse_args([])
    assert (args.sizes, args.reps, args.device, args.threads, args.memory_check) == (
        [2.5],
        3,
        "cuda",
        0,
        False,
    )
    args = gpu.parse_args(["--sizes-gib", "1, 4", "--memory-check", "--saves", "7", "--device", "cpu"])
    assert (args.sizes, args.memory_check, args.saves, args.device) == ([1.0, 4.0], True, 7, "cpu")
    for bad in (["--sizes-gib", "0"], ["--sizes-gib", ","], ["--reps", "0"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "d")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == gpu.NO_CUDA
    assert not (tmp_path / "out").exists() and not (tmp_path / "d").exists()


def test_layer_schedule_adds_and_removes_layers():
    schedule = gpu.layer_schedule(100)
    assert len(schedule) == 100
    counts = [len(ids) for ids in schedule]
    assert min(counts) == 2 and max(counts) == 6
    seen_removed, middle = set(), 0
    for before, after in zip(schedule, schedule[1:]):
        added, removed = set(after) - set(before), set(before) - set(after)
        assert len(added) + len(removed) == 1  # one layer added or removed at every save
        assert not added & seen_removed  # a removed layer never comes back: new keys instead
        seen_removed |= removed
        middle += any(min(before) < i < max(before) for i in removed)
    assert len(seen_removed) > 20 and middle == len(seen_removed)  # removed from the middle


def test_memory_verdict_flags_growth_beyond_the_budget():
    mib = 2**20
    samples = [
        {"pinned": 100 * mib, "pinned_peak": 150 * mib},
        {"pinned": 120 * mib, "pinned_peak": 120 * mib},
    ]
    assert gpu.memory_verdict(samples, 200 * mib, 1000 * mib, 1100 * mib) == []
    flags = gpu.memory_verdict(samples, 140 * mib, 1000 * mib, 1100 * mib)
    assert len(flags) == 1 and "pinned" in flags[0]  # the peak between samples counts
    flags = gpu.memory_verdict(samples, 200 * mib, 1000 * mib, 1300 * mib)
    assert len(flags) == 1 and "resident memory grew by" in flags[0]
    assert gpu.memory_verdict([{"pinned": None}], 1, 0, 0) == []  # no figure: nothing to flag


def test_mismatches_compares_each_piece_with_its_region():
    sd = build_state(0, 1, 64, 1)
    reshard = build_state(0, 1, 64, 1, pieces_per_rank=2, with_data=False)

    def piece(sh):  # the region of the whole that ``sh`` asks for, as a load returns it
        src = next(s for s in sd.values() if s.key == sh.key)
        whole = src.data.reshape(src.local_shape)
        region = whole[tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))]
        return region.reshape(sh.data.shape).clone()

    loaded = {k: piece(sh) for k, sh in reshard.items()}
    assert gpu._mismatches(sd, reshard, loaded) == []
    key = next(k for k, sh in reshard.items() if sh.flattened_range is not None and k.endswith("#1"))
    loaded[key].view(-1)[-1] += 1
    assert gpu._mismatches(sd, reshard, loaded) == [key]


# --------------------------------------------------------------------------- the GPU script, on CPU


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """bench/gpu_check.sh run once, its bench steps on host tensors at a tiny size."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_SIZES_GIB="0.02",
        GPU_CHECK_HIDDEN="0",
        GPU_CHECK_SAVES="8",
        GPU_CHECK_MEMORY_HIDDEN="64",
    )
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


@pytest.mark.slow
def test_script_runs_every_step_within_six_minutes(script_run):
    proc, out = script_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    budget = re.search(r"step timeouts: .* = (\d+) s", proc.stdout)
    assert budget and int(budget.group(1)) < 360
    assert "bench.gpu: ok" in proc.stdout and "memory check: ok" in proc.stdout
    if not torch.cuda.is_available():
        assert "CUDA tests: skipped (no CUDA device)" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())  # what a lent machine sends back
    assert {"gpu_check.log", "env.txt", "bench_gpu.json", "bench_gpu.txt", "memory_check.json"} <= set(files)


@pytest.mark.slow
def test_script_checks_the_projects_own_dependencies(script_run):
    tomllib = pytest.importorskip("tomllib")
    _, out = script_run
    env = (out / "env.txt").read_text()
    checked = re.findall(r"^dependency ([\w.-]+): ", env, re.M)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert checked == [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in deps]
    assert "fastcrc" in checked and "crc32c" not in env  # what distckpt imports, not an extra
    assert "import distckpt: ok" in env


@pytest.mark.slow
def test_script_bench_step_measured_every_path(script_run):
    _, out = script_run
    report = json.loads((out / "bench_gpu.json").read_text())
    (result,) = report["results"]
    assert result["problems"] == []  # every load returned the saved bytes
    must = {key for key, _ in gpu.SECONDS_ROWS} - {"dcp.async_save DefaultStager returns"}
    from torch.distributed.checkpoint import staging

    if not hasattr(staging, "DefaultStager"):
        must -= {k for k in must if "DefaultStager" in k}
    import distckpt

    if not hasattr(distckpt, "prepare_staging"):
        must -= {"prepare_staging", "async save blocking, after prepare_staging"}
    assert must <= set(result["seconds"])
    assert all(s > 0 for s in result["seconds"].values())
    assert all(v is not None and math.isfinite(v) for k, v in result["ratios"].items() if k in gpu.GOALS)
    # the raw I/O uses the threads of distckpt's default save and load (one process on this host)
    from distckpt.strategies.torch_dist.load import TorchDistLoadShardedStrategy
    from distckpt.strategies.torch_dist.save import TorchDistSaveShardedStrategy

    assert result["save_files"] == 2
    assert result["threads"] == TorchDistSaveShardedStrategy().writer_threads()
    assert result["read_threads"] == TorchDistLoadShardedStrategy().reader_threads()
    assert set(result["phases"]) >= {"async save", "async save, first", "save", "load", "load resharded"}
    assert (out / "bench_gpu.txt").read_text().startswith("device: cpu (smoke test")
    for where in (Path("/dev/shm/distckpt-gpu"), Path("/tmp/distckpt-gpu")):  # the run removed its files
        assert not list(where.glob("bench_gpu_*"))


@pytest.mark.slow
def test_script_memory_step_saved_with_changing_shapes(script_run):
    _, out = script_run
    r = json.loads((out / "memory_check.json").read_text())
    assert r["saves"] == 8 and r["flags"] == []
    assert [s["layers"] for s in r["samples"]] == [len(ids) for ids in gpu.layer_schedule(8)]
    assert r["budget_bytes"] > 0 and r["rss_end"] > 0
    sizes = {s["state_bytes"] for s in r["samples"]}
    assert len(sizes) > 1  # the state really changed shape
    if r["pinned_max"] is not None:  # the pool's figure: at least the largest state was staged
        assert r["pinned_max"] >= max(s["state_bytes"] for s in r["samples"])


def test_a_failing_path_is_reported_once_and_the_others_go_on(tmp_path):
    run = gpu.Run({}, {}, tmp_path, gpu.Clock("cpu"))
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no space left on device")

    for _ in range(3):
        run.attempt("dcp.async_save", broken, ours=False)
        run.attempt("distckpt", broken)
        run.attempt("limits", run.rec, "D2H pinned", 0.5)
    assert len(calls) == 2  # each failed path tried once, then left out
    assert run.notes == ["dcp.async_save failed: OSError: no space left on device"]  # DCP's: a note
    assert run.problems == ["distckpt failed: OSError: no space left on device"]  # ours: exit status 1
    assert run.times == {}  # the warm-up records nothing
    run.keep = True
    run.attempt("limits", run.rec, "D2H pinned", 0.5)
    assert run.times == {"D2H pinned": [0.5]}
