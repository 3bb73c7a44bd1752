"""Fault injection: a save or load that fails anywhere, on any rank, fails on every rank, never
commits, and leaves the directory ready for the next save.

Faults come from tests/support/faults.py (strategy subclasses and patched storage calls that fail at a
named stage on chosen ranks). The SIGKILL tests at the end run real rank processes outside the
pool and kill one of them in the middle of a save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

import distckpt
from distckpt import check_is_distributed_checkpoint
from distckpt import dist as ddist
from distckpt.commit import is_leftover
from distckpt.formats.manifest import read_manifest, verify_files
from tests.support import faults
from tests.support.faults import RANK0_ONLY_STAGES, SAVE_STAGES, Fault, load_with_fault, save_with_fault
from tests.support.harness import expect_all_ranks_raise, run_ranks

REPO = Path(__file__).resolve().parents[2]

SAVE_FAULTS = [
    Fault(stage, (rank,))
    for stage in SAVE_STAGES
    for rank in ((0,) if stage in RANK0_ONLY_STAGES else (0, 1))
]


def _fault_id(fault: Fault) -> str:
    return f"{fault.stage}-rank{','.join(map(str, fault.ranks))}"


def _commit_files(ckpt: Path) -> List[str]:
    return sorted(n for n in ("metadata.json", ".metadata", ".distckpt_manifest.json") if (ckpt / n).exists())


# --------------------------------------------------------------------------- save faults


def _leftovers(parent: Path) -> List[str]:
    return sorted(p.name for p in parent.iterdir() if is_leftover(p))


@pytest.mark.parametrize("fault", SAVE_FAULTS, ids=_fault_id)
def test_save_fault_fails_every_rank_keeps_the_older_checkpoint_and_the_next_save_succeeds(fault, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)  # an older checkpoint, being overwritten
    before = faults.tree_digest(ckpt)
    rank = fault.ranks[0]
    cause = (
        "OSError: .*No space left"
        if fault.stage == "mid_file"
        else rf".*injected {fault.stage} fault on rank {rank}"
    )
    failure = expect_all_ranks_raise(
        2, save_with_fault, str(ckpt), 2, fault, match=rf"failed on rank\(s\) {rank}: {cause}"
    )
    assert all("distckpt.dist.RankErrors" in text for text in failure.errors.values())
    # Whatever the stage, the older checkpoint is untouched and loads bit-exactly; the failed
    # save's staging tree is gone.
    assert faults.tree_digest(ckpt) == before
    assert run_ranks(2, load_with_fault, str(ckpt), 1, None, True) == [[], []]
    if fault.stage != "async_write":  # a failed background write leaves its tree to the next save
        assert _leftovers(tmp_path) == []

    run_ranks(2, save_with_fault, str(ckpt), 3, None)
    assert run_ranks(2, load_with_fault, str(ckpt), 3, None, True) == [[], []]
    assert _leftovers(tmp_path) == []


def test_faults_on_several_ranks_are_all_reported_on_every_rank(tmp_path):
    expect_all_ranks_raise(
        4,
        save_with_fault,
        str(tmp_path),
        1,
        Fault("prepare", (1, 3)),
        match=r"failed on 2 rank\(s\):\s+rank 1: .*injected prepare fault on rank 1\s+"
        r"rank 3: .*injected prepare fault on rank 3",
    )
    assert not check_is_distributed_checkpoint(tmp_path)


def test_a_failure_after_every_byte_was_written_still_commits_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    expect_all_ranks_raise(
        2, save_with_fault, str(ckpt), 1, Fault("commit", (1,)), match="injected commit fault"
    )
    assert not ckpt.exists() and not check_is_distributed_checkpoint(ckpt)
    assert _leftovers(tmp_path) == []


def test_failed_mid_file_write_keeps_the_older_checkpoint_and_drops_the_partial_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)
    before = faults.tree_digest(ckpt)
    expect_all_ranks_raise(
        2, save_with_fault, str(ckpt), 2, Fault("mid_file", (1,)), match=r"failed on rank\(s\) 1"
    )
    assert faults.tree_digest(ckpt) == before
    assert _leftovers(tmp_path) == []


def test_storage_error_in_the_middle_of_a_file_is_reported_as_such(tmp_path):
    expect_all_ranks_raise(
        2,
        save_with_fault,
        str(tmp_path),
        1,
        Fault("mid_file", (1,)),
        match=r"failed on rank\(s\) 1: OSError: \[Errno 28\] No space left on device",
    )


def _save_with_unpicklable_common_view(ckpt):
    sd = faults.generation_state(ddist.get_rank(), ddist.get_world_size(), 1)
    distckpt.save(
        sd, ckpt, preprocess_common_before_consistancy_check=lambda common: {"lock": threading.Lock()}
    )


def test_unpicklable_common_view_is_a_checkpointing_error_on_every_rank(tmp_path):
    expect_all_ranks_raise(
        2, _save_with_unpicklable_common_view, str(tmp_path), match=r"CheckpointingException|RankErrors"
    )


def _save_with_bad_offset(ckpt, bad_rank):
    sd = faults.generation_state(ddist.get_rank(), ddist.get_world_size(), 2)
    if ddist.get_rank() == bad_rank:
        sd["col"].global_offset = (-4, 0)
    distckpt.save(sd, ckpt)


def test_save_rejected_by_validation_leaves_the_older_checkpoint_loadable(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(2, save_with_fault, ckpt, 1, None)
    expect_all_ranks_raise(2, _save_with_bad_offset, ckpt, 1, match=r"'col': negative global_offset")
    assert run_ranks(2, load_with_fault, ckpt, 1) == [[], []]


# --------------------------------------------------------------------------- load faults


def test_missing_data_file_of_one_ranks_pieces_fails_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)
    os.remove(ckpt / "__1_0.distcp")
    expect_all_ranks_raise(
        2,
        load_with_fault,
        str(ckpt),
        1,
        match=r"load failed on rank\(s\) 1: .*__1_0\.distcp: data file is missing",
    )


def test_read_error_on_one_rank_fails_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(2, save_with_fault, ckpt, 1, None)
    expect_all_ranks_raise(
        2,
        load_with_fault,
        ckpt,
        1,
        Fault("read", (1,)),
        match=r"load failed on rank\(s\) 1: OSError: .*injected read fault on rank 1",
    )
    assert run_ranks(2, load_with_fault, ckpt, 1) == [[], []]


def test_missing_metadata_file_fails_every_rank_naming_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)
    os.remove(ckpt / ".metadata")
    expect_all_ranks_raise(
        2, load_with_fault, str(ckpt), 1, match=r"\.metadata: DCP metadata file is missing"
    )


# --------------------------------------------------------------------------- SIGKILL


@dataclass
class KilledSave:
    """What the SIGKILL scenario left behind: the directory and how each rank process ended."""

    root: Path
    victim: int
    window: str
    returncodes: Dict[int, int] = field(default_factory=dict)
    logs: Dict[int, str] = field(default_factory=dict)

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def survivor(self) -> int:
        return 1 - self.victim


SCENARIOS = {"mid_write": 1, "before_commit": 0}  # window -> victim rank
STALL_TIMEOUT_S = 150
COLLECTIVE_TIMEOUT_S = 5
EXIT_TIMEOUT_S = 60


def _spawn(root: Path, window: str, victim: int) -> Dict[int, subprocess.Popen]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        GLOO_SOCKET_IFNAME="lo",
        DISTCKPT_COLLECTIVE_TIMEOUT=str(COLLECTIVE_TIMEOUT_S),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs = {}
    for rank in range(2):
        log = open(root / f"rank{rank}.log", "w")
        procs[rank] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.faults",
                "sigkill-rank",
                "--rank",
                str(rank),
                "--root",
                str(root),
                "--victim",
                str(victim),
                "--window",
                window,
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
    return procs


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """Both scenarios at once (two independent 2-rank groups): each saves generation 1 into a
    neighbour and a target directory, then overwrites the target with generation 2; the victim
    stalls in its window and is SIGKILLed there. Yields window -> KilledSave."""
    runs = {w: KilledSave(tmp_path_factory.mktemp(f"sigkill-{w}"), v, w) for w, v in SCENARIOS.items()}
    procs = {}
    try:
        for w, run in runs.items():
            procs[w] = _spawn(run.root, w, run.victim)
        deadline = time.monotonic() + STALL_TIMEOUT_S
        pending = set(runs)
        while pending:
            for w in list(pending):
                run = runs[w]
                if (run.root / f"stalled.{run.victim}").exists():
                    os.kill(procs[w][run.victim].pid, signal.SIGKILL)
                    pending.discard(w)
                elif any(p.poll() is not None for p in procs[w].values()):
                    pytest.fail(f"{w}: a rank exited before the victim stalled:\n" + _logs(run))
            if time.monotonic() > deadline:
                pytest.fail(
                    f"no stall within {STALL_TIMEOUT_S} s in {sorted(pending)}:\n"
                    + "\n".join(_logs(runs[w]) for w in pending)
                )
            time.sleep(0.05)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for w, group in procs.items():
            for rank, proc in group.items():
                runs[w].returncodes[rank] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for group in procs.values():
            for proc in group.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    for run in runs.values():
        run.logs = {r: (run.root / f"rank{r}.log").read_text() for r in range(2)}
    yield runs


def _logs(run: KilledSave) -> str:
    return "\n".join(f"--- rank {r} ---\n{(run.root / f'rank{r}.log').read_text()}" for r in range(2))


def _load_single_process(ckpt: Path, generation: int, verify: bool = False) -> List[str]:
    sd = faults.generation_state(0, 1, generation, with_data=False)
    loaded = distckpt.load(sd, ckpt, verify=verify)
    return faults.generation_mismatches(loaded, 0, 1, generation)


@pytest.mark.slow
@pytest.mark.parametrize("window", SCENARIOS)
def test_sigkill_kills_the_victim_and_the_survivor_fails_instead_of_committing(killed_saves, window):
    run = killed_saves[window]
    assert run.returncodes[run.victim] == -signal.SIGKILL
    assert run.returncodes[run.survivor] != 0, _logs(run)
    assert not list(run.root.glob("returned.*"))
    failure = (run.root / f"failed.{run.survivor}").read_text()
    # A peer that is gone before the stage: named by the check-in; one that dies inside the
    # collective: gloo's closed connection, named by stage.
    assert (
        f"rank(s) {run.victim} did not arrive within {COLLECTIVE_TIMEOUT_S} s" in failure
        or "commit: a collective failed" in failure
    ), failure


@pytest.mark.slow
@pytest.mark.parametrize("window", SCENARIOS)
def test_sigkill_leaves_the_overwritten_checkpoint_complete_and_bit_exact(killed_saves, window):
    run = killed_saves[window]
    before = json.loads((run.root / "phase1.json").read_text())["target"]
    assert faults.tree_digest(run.target) == before
    for verify in (False, True):
        assert _load_single_process(run.target, 1, verify) == []


@pytest.mark.slow
def test_sigkill_mid_write_partial_files_went_with_the_staging_tree_the_survivor_dropped(killed_saves):
    run = killed_saves["mid_write"]  # the survivor is rank 0, which aborts the staging tree
    assert _leftovers(run.root) == []


@pytest.mark.slow
def test_sigkill_just_before_commit_leaves_a_hidden_staging_tree_without_commit_marker(killed_saves):
    run = killed_saves["before_commit"]
    (staging,) = [p for p in run.root.iterdir() if is_leftover(p)]
    assert _commit_files(staging) == [".distckpt_manifest.json", ".metadata"]
    assert verify_files(staging, read_manifest(staging)) == []  # every byte is there; only the marker is not
    assert not check_is_distributed_checkpoint(staging)


@pytest.mark.slow
def test_the_next_save_removes_the_leftover_of_a_killed_save(killed_saves, tmp_path):
    run = killed_saves["before_commit"]
    for p in run.root.iterdir():
        if p.name == "target" or is_leftover(p):
            shutil.copytree(p, tmp_path / p.name, symlinks=True)
    assert len(_leftovers(tmp_path)) == 1
    save_with_fault(str(tmp_path / "target"), 3, None)
    assert _leftovers(tmp_path) == []
    assert _load_single_process(tmp_path / "target", 3, verify=True) == []


@pytest.mark.slow
@pytest.mark.parametrize("window", SCENARIOS)
def test_sigkill_leaves_the_neighbouring_checkpoint_untouched_and_loadable(killed_saves, window):
    run = killed_saves[window]
    before = json.loads((run.root / "phase1.json").read_text())["neighbour"]
    assert faults.tree_digest(run.root / "neighbour") == before
    assert _load_single_process(run.root / "neighbour", 1, verify=True) == []
