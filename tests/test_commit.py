"""The commit protocol (distckpt/commit.py) and the collective timeouts (distckpt/dist.py).

Single-process tests drive the protocol's steps directly; the rank tests run real gloo groups.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import distckpt
from distckpt import CheckpointingException, commit
from distckpt import dist as ddist
from distckpt.core import CheckpointingConfig
from tests.support import faults
from tests.support.faults import load_with_fault, save_with_fault
from tests.support.harness import expect_all_ranks_raise, run_ranks


def _save(ckpt: Path, generation: int) -> None:
    faults.save_with_fault(str(ckpt), generation, None)


def _load(ckpt: Path, generation: int, verify: bool = True):
    return faults.load_with_fault(str(ckpt), generation, None, verify)


def _leftovers(parent: Path):
    return sorted(p.name for p in parent.iterdir() if commit.is_leftover(p))


# --------------------------------------------------------------------------- overwrite


def test_overwrite_replaces_the_whole_tree_and_leaves_no_staging_behind(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 1)
    inode = ckpt.stat().st_ino
    _save(ckpt, 2)
    assert _load(ckpt, 2) == []
    assert ckpt.stat().st_ino != inode  # a new directory was swapped in
    assert _leftovers(tmp_path) == []


def test_files_that_are_not_checkpoint_files_survive_an_overwrite(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 1)
    (ckpt / "README.txt").write_text("notes of the run")
    (ckpt / "extras").mkdir()
    (ckpt / "extras" / "config.yaml").write_text("lr: 1")
    stale = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    _save(ckpt, 2)
    assert (ckpt / "README.txt").read_text() == "notes of the run"
    assert (ckpt / "extras" / "config.yaml").read_text() == "lr: 1"
    assert commit.foreign_entries(ckpt) == ["README.txt", "extras"]
    assert stale and all((ckpt / n).exists() for n in stale)  # same names, rewritten by the new save
    assert _load(ckpt, 2) == []


def test_a_save_into_an_existing_empty_directory_commits_there(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _save(ckpt, 1)
    assert _load(ckpt, 1) == []


def test_a_symlinked_target_keeps_its_link_and_the_real_directory_is_replaced(tmp_path):
    real = tmp_path / "iter_1"
    _save(real, 1)
    link = tmp_path / "latest"
    link.symlink_to(real.name)
    _save(link, 2)
    assert link.is_symlink() and _load(real, 2) == [] and _load(link, 2) == []


def test_fallback_without_exchange_commits_too(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "exchange_directories", lambda a, b: False)
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 1)
    _save(ckpt, 2)
    assert _load(ckpt, 2) == [] and _leftovers(tmp_path) == []


def _half_done_fallback_swap(tmp_path: Path) -> Path:
    """The state a crash between the two renames of the fallback leaves: no target, the old tree
    at -old-<id>, the committed new one at -staging-<id>."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 1)
    new = tmp_path / "new"
    _save(new, 2)
    os.rename(ckpt, commit.leftover_name(ckpt, commit.OLD_MARK, "abc123"))
    os.rename(new, commit.leftover_name(ckpt, commit.STAGING_MARK, "abc123"))
    return ckpt


def test_a_load_finishes_a_fallback_swap_interrupted_between_its_renames(tmp_path):
    ckpt = _half_done_fallback_swap(tmp_path)
    assert not ckpt.exists()
    assert _load(ckpt, 2) == []


def test_the_next_save_finishes_an_interrupted_swap_and_removes_every_leftover(tmp_path):
    ckpt = _half_done_fallback_swap(tmp_path)
    commit.leftover_name(ckpt, commit.STAGING_MARK, "deadbeef").mkdir()  # an abandoned save
    _save(ckpt, 3)
    assert _load(ckpt, 3) == [] and _leftovers(tmp_path) == []


def test_an_uncommitted_staging_tree_is_never_promoted(tmp_path):
    ckpt = tmp_path / "ckpt"
    staging = commit.leftover_name(ckpt, commit.STAGING_MARK, "abc")
    _save(staging, 1)
    os.remove(staging / "metadata.json")
    commit.leftover_name(ckpt, commit.OLD_MARK, "abc").mkdir()
    with pytest.raises(CheckpointingException, match="does not exist"):
        _load(ckpt, 1)


def test_a_staging_directory_removed_during_the_save_is_not_committed(tmp_path):
    protocol = commit.RenameCommit()
    target = tmp_path / "ckpt"
    staging = protocol.begin(target, "one")
    protocol.cleanup_leftovers(target)  # a second job's save to the same place
    staging.path.mkdir()  # re-created by a late writer
    with pytest.raises(CheckpointingException, match="staging directory was replaced"):
        protocol.commit(staging, CheckpointingConfig("torch_dist"))
    assert not target.exists()


def test_a_staging_tree_missing_a_file_of_its_manifest_is_not_committed(tmp_path):
    protocol = commit.RenameCommit()
    target = tmp_path / "ckpt"
    _save(target, 1)
    before = faults.tree_digest(target)
    staging = protocol.begin(target, "two")
    _save(tmp_path / "other", 2)
    for p in (tmp_path / "other").iterdir():
        os.rename(p, staging.path / p.name)
    os.remove(next(staging.path.glob("*.distcp")))
    with pytest.raises(CheckpointingException, match=r"\.distcp: missing from the staging directory"):
        protocol.commit(staging, CheckpointingConfig("torch_dist"))
    assert faults.tree_digest(target) == before


def _fail_creating_the_staging_directory(ckpt: str):
    def refuse(self, target, save_id, overwrite=None):
        raise PermissionError(
            13, "Permission denied", str(commit.leftover_name(target, commit.STAGING_MARK, save_id))
        )

    with faults.patched(commit.RenameCommit, "begin", refuse):
        save_with_fault(ckpt, 2, None)


def test_permission_error_creating_the_staging_directory_fails_every_rank_and_keeps_the_old_checkpoint(
    tmp_path,
):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)
    before = faults.tree_digest(ckpt)
    expect_all_ranks_raise(
        2,
        _fail_creating_the_staging_directory,
        str(ckpt),
        match=r"validation failed on rank\(s\) 0: PermissionError: .*distckpt-staging",
    )
    assert faults.tree_digest(ckpt) == before
    assert run_ranks(2, load_with_fault, str(ckpt), 1, None, True) == [[], []]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_parent_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(2, save_with_fault, str(ckpt), 1, None)
    before = faults.tree_digest(ckpt)
    os.chmod(tmp_path, 0o555)
    try:
        expect_all_ranks_raise(2, save_with_fault, str(ckpt), 2, None, match="Permission denied")
    finally:
        os.chmod(tmp_path, 0o755)
    assert faults.tree_digest(ckpt) == before


# --------------------------------------------------------------------------- readers


def test_a_load_that_sees_the_checkpoint_swapped_under_it_raises_instead_of_mixing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 1)
    _save(tmp_path / "second", 2)
    from distckpt.strategies import torch as torch_strategy

    real = torch_strategy.TorchDistLoadShardedStrategy.load

    def load_then_overwrite(self, sharded_state_dict, checkpoint_dir):
        out = real(self, sharded_state_dict, checkpoint_dir)
        _save(ckpt, 2)  # another job commits while this load runs
        return out

    monkeypatch.setattr(torch_strategy.TorchDistLoadShardedStrategy, "load", load_then_overwrite)
    with pytest.raises(CheckpointingException, match="replaced or modified while it was being loaded"):
        distckpt.load(faults.generation_state(0, 1, 1, with_data=False), ckpt)


# --------------------------------------------------------------------------- collective timeouts


def _hang_rank(ckpt: str, hung: int, timeout: float, op: str):
    """Every rank but ``hung`` runs ``op`` with a short timeout; ``hung`` stalls, then checks in
    once, late (which also keeps the check-in counters of the pool in step)."""
    rank = ddist.get_rank()
    if rank == hung:
        time.sleep(timeout + 1.0)
        try:
            ddist.check_in("late", timeout=30)
        except distckpt.CollectiveTimeout as e:
            return "late", str(e)
        return "no error"
    distckpt.set_collective_timeout(timeout)
    start = time.monotonic()
    try:
        if op == "save":
            save_with_fault(ckpt, 2, None)
        else:
            load_with_fault(ckpt, 1)
    except distckpt.CollectiveTimeout as e:
        return str(e), e.missing, round(time.monotonic() - start, 2)
    finally:
        distckpt.set_collective_timeout(None)
    return "returned"


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_rank_that_never_arrives_is_named_on_every_other_rank_within_the_timeout(op, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_ranks(4, save_with_fault, str(ckpt), 1, None)
    results = run_ranks(4, _hang_rank, str(ckpt), 2, 1.5, op)
    stage = "validation" if op == "save" else "load preparation"
    for rank in (0, 1, 3):
        message, missing, elapsed = results[rank]
        assert missing == [2] and message.startswith(f"{stage}: rank(s) 2 did not arrive within 1.5 s"), (
            message
        )
        assert 1.4 <= elapsed < 6, elapsed  # FileStore waits in whole seconds
    # The same error everywhere, also on the rank that arrives late (at once, not after a timeout).
    assert len({results[r][0] for r in (0, 1, 3)}) == 1 and results[2] == ("late", results[0][0])
    assert run_ranks(4, load_with_fault, str(ckpt), 1) == [[]] * 4  # the old checkpoint, intact


def _stall_inside_first_collective(ckpt: str, stalled: int, timeout: float):
    """Every rank saves with a short timeout; ``stalled`` checks in like the others, then stalls
    for ``timeout + 2`` s inside the stage's collective before it joins. Afterwards every rank
    tries one more collective (as the next save would), which distckpt must refuse at once (the
    group is out of step). The stages run as collectives of the process group (not through the
    store, where no rank is ever inside a collective)."""
    os.environ[ddist.STORE_ROUNDS_ENV] = "0"  # the pool restores the environment after the task
    rank = ddist.get_rank()
    real = ddist._slot_round
    stalls = []

    def slow_slot_round(obj, group):
        if not stalls:
            stalls.append(rank)
            time.sleep(timeout + 2.0)
        return real(obj, group)

    if rank == stalled:
        ddist._slot_round = slow_slot_round
    distckpt.set_collective_timeout(timeout)
    start = time.monotonic()
    try:
        save_with_fault(ckpt, 2, None)
        outcome = "returned", round(time.monotonic() - start, 2)
    except distckpt.CollectiveTimeout as e:
        outcome = str(e), round(time.monotonic() - start, 2)
    finally:
        ddist._slot_round = real
        distckpt.set_collective_timeout(None)
    ddist.reset_failures()  # what the next save or load does first
    start = time.monotonic()
    try:
        ddist.all_gather_object(rank, stage="next")
        refusal = "issued"
    except distckpt.CollectiveTimeout as e:
        refusal = str(e)
    return outcome, refusal, round(time.monotonic() - start, 2)


@pytest.mark.slow
def test_a_rank_that_stalls_inside_a_collective_is_an_error_on_every_rank_within_the_timeout(tmp_path):
    """Checking in is not enough: a rank that stalls after it (inside the collective) must not
    hold the others to the process group's own timeout (45 s in the rank pool). The abandoned
    collective leaves the group out of step, so distckpt refuses to use it again."""
    ckpt = tmp_path / "ckpt"
    run_ranks(4, save_with_fault, str(ckpt), 1, None)
    results = run_ranks(4, _stall_inside_first_collective, str(ckpt), 2, 1.5, breaks_group=True)
    messages = {outcome[0] for outcome, _, _ in results}
    assert len(messages) == 1, results
    message = messages.pop()
    assert "a collective failed" in message and "did not complete within 1.5 s" in message, message
    for rank in (0, 1, 3):
        assert 1.4 <= results[rank][0][1] < 6, results
    assert results[2][0][1] >= 3.5, results  # the stalled rank raised the same error when it came back
    for _, refusal, elapsed in results:
        assert refusal.startswith("next: refused, the process group is out of step") and message in refusal, (
            refusal
        )
        assert elapsed < 0.5, results
    assert run_ranks(4, load_with_fault, str(ckpt), 1) == [[]] * 4  # the old checkpoint, intact


def _receive_from_a_late_sender(timeout: float):
    """Rank 0 waits to receive a tensor that rank 1 sends only ``timeout + 1.5`` s later."""
    import torch

    distckpt.set_collective_timeout(timeout)
    start = time.monotonic()
    try:
        if ddist.get_rank() == 0:
            ddist.send_recv([], [(torch.zeros(4), 1)])
        else:
            time.sleep(timeout + 1.5)
            ddist.send_recv([(torch.ones(4), 0)], [])
        return "completed", round(time.monotonic() - start, 2)
    except distckpt.CollectiveTimeout as e:
        return str(e), round(time.monotonic() - start, 2)
    finally:
        distckpt.set_collective_timeout(None)


def test_a_point_to_point_receive_is_bounded_by_the_collective_timeout():
    results = run_ranks(2, _receive_from_a_late_sender, 1.0, breaks_group=True)
    message, elapsed = results[0]
    assert (
        message.startswith("point-to-point exchange: a collective failed")
        and "did not complete within 1 s" in message
    )
    assert 0.9 <= elapsed < 4, results


def test_collective_timeout_comes_from_the_environment_and_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(ddist.TIMEOUT_ENV, "12.5")
    assert distckpt.collective_timeout() == 12.5
    distckpt.set_collective_timeout(3)
    try:
        assert distckpt.collective_timeout() == 3
    finally:
        distckpt.set_collective_timeout(None)
    monkeypatch.setenv(ddist.TIMEOUT_ENV, "soon")
    with pytest.raises(CheckpointingException, match="DISTCKPT_COLLECTIVE_TIMEOUT='soon'"):
        distckpt.collective_timeout()
    monkeypatch.delenv(ddist.TIMEOUT_ENV)
    assert distckpt.collective_timeout() == ddist.DEFAULT_TIMEOUT_S
    with pytest.raises(CheckpointingException, match="must be positive"):
        distckpt.set_collective_timeout(0)
