"""bench/tiered.py at a tiny size: it runs end to end (moto server, two gloo ranks), prints every
row and the ratios, checks its loads bit-exact and writes its JSON. A smoke test, not a
measurement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tiered

pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_tiered")
    out = tmp / "tiered.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.tiered",
            "--dir",
            str(tmp / "d"),
            "--ranks",
            "2",
            "--mib-per-rank",
            "4",
            "--remote-mib-s",
            "400",
            "--warmup",
            "0",
            "--reps",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return proc, tmp, out


@pytest.mark.slow
def test_prints_every_row_and_ratio_and_checks_pass(bench_run):
    proc, _, _ = bench_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for label, _, _ in tiered.ROWS:
        row = next((line for line in lines if line.startswith(label)), None)
        assert row is not None, label
        assert float(row[len(label) :].split()[0]) > 0  # seconds
    for label, _, _ in tiered.RATIOS:
        assert re.search(rf"^{re.escape(label)}:\s+\d+\.\d+$", proc.stdout, re.M), label
    goal = re.search(r"^tiered save blocking / local-only save \(goal <= 1\.1\):\s+(\S+)$", proc.stdout, re.M)
    assert goal and float(goal.group(1)) > 0
    assert "bit-exact, and each tiered restart read from the expected tier: True" in proc.stdout
    assert re.search(r"goal tiered save blocking <= 1\.1 x local-only: (met|MISSED)", proc.stdout)


@pytest.mark.slow
def test_writes_json_and_cleans_up(bench_run):
    proc, tmp, out = bench_run
    assert proc.returncode == 0
    data = json.loads(out.read_text())
    assert data["args"]["mib_per_rank"] == 4 and len(data["ranks"]) == 2
    assert {key for _, key, _ in tiered.ROWS} <= set(data["medians"])
    assert not (tmp / "d").exists()  # the local tier's directory is removed after the run
