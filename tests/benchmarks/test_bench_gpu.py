"""bench/gpu.py: the GPU benchmark's own paths, run on host tensors (``--device cpu``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_runs_every_path_and_reports_the_goal_ratios(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu",
            "--device",
            "cpu",
            "--sizes-gib",
            "0.02",
            "--reps",
            "1",
            "--dir",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads((out / "bench_gpu.json").read_text())
    assert set(result["seconds"]) == {
        "D2H pinned",
        "H2D pinned",
        "raw read",
        "async save blocking",
        "async save until committed",
        "async save blocking, copies after planning",
        "load to CPU",
        "load to GPU",
        "load to GPU, pageable copies",
        "load to GPU resharded",
    }
    assert all(s > 0 for s in result["seconds"].values())
    ratios = result["ratios"]
    assert {
        "async blocking / D2H",
        "load to GPU / H2D",
        "async blocking, copies after planning / D2H",
    } <= set(ratios)
    assert all(math.isfinite(v) for v in ratios.values())
    assert "async blocking / D2H" in proc.stdout
    assert not (tmp_path / "ckpt").exists()  # the checkpoints are removed
