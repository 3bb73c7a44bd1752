"""The rank pool: real gloo process groups, spawned once per session, that fail loudly."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import RankFailure, RankTimeout, expect_all_ranks_raise, get_pool


def _all_reduce_rank() -> int:
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def _rank_world_and_pid() -> tuple[int, int, int]:
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def _raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {dist.get_rank()}")
    return dist.get_rank()


def _raise_everywhere() -> None:
    raise RuntimeError(f"checkpoint is broken (seen by rank {dist.get_rank()})")


def _sleep_on_rank(slow_rank: int, seconds: float) -> int:
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def _die_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def _leave_env_and_cwd_changed(path: str) -> str:
    os.environ["DISTCKPT_HARNESS_LEAK"] = "1"
    os.chdir(path)
    return os.getcwd()


def _env_and_cwd() -> tuple[str | None, str]:
    return os.environ.get("DISTCKPT_HARNESS_LEAK"), os.getcwd()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_sums_rank_ids(run_ranks, world_size):
    expected = sum(range(world_size))
    assert run_ranks(world_size, _all_reduce_rank) == [expected] * world_size


def test_values_come_back_in_rank_order(run_ranks):
    values = run_ranks(4, _rank_world_and_pid)
    assert [(rank, world) for rank, world, _ in values] == [(r, 4) for r in range(4)]
    assert len({pid for _, _, pid in values}) == 4
    assert os.getpid() not in {pid for _, _, pid in values}


def test_pool_is_reused_across_runs(run_ranks):
    first = [pid for _, _, pid in run_ranks(2, _rank_world_and_pid)]
    second = [pid for _, _, pid in run_ranks(2, _rank_world_and_pid)]
    assert first == second
    assert get_pool(2).pids == first


def test_failure_on_one_rank_reports_its_traceback(run_ranks):
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _raise_on_rank, 1)
    failure = info.value
    assert set(failure.errors) == {1}
    assert "ValueError: deliberate failure on rank 1" in failure.errors[1]
    assert "_raise_on_rank" in failure.errors[1]  # the whole traceback, not only the last line
    assert failure.results == {0: 0}
    message = str(failure)
    assert "rank 1 of 2 failed" in message and "rank 0 returned" in message
    assert "deliberate failure on rank 1" in message


def test_pool_survives_a_failure(run_ranks):
    before = get_pool(2).pids
    with pytest.raises(RankFailure):
        run_ranks(2, _raise_on_rank, 0)
    assert run_ranks(2, _all_reduce_rank) == [1, 1]
    assert get_pool(2).pids == before


def test_expect_all_ranks_raise_checks_every_rank():
    failure = expect_all_ranks_raise(2, _raise_everywhere, match=r"RuntimeError: checkpoint is broken")
    assert sorted(failure.errors) == [0, 1]
    with pytest.raises(AssertionError, match="rank 0 did not raise"):
        expect_all_ranks_raise(2, _raise_on_rank, 1, match="deliberate failure")
    with pytest.raises(AssertionError, match="every rank returned"):
        expect_all_ranks_raise(2, _all_reduce_rank, match="anything")


def test_hang_raises_timeout_and_next_run_gets_a_fresh_pool(run_ranks):
    old_pids = [pid for _, _, pid in run_ranks(2, _rank_world_and_pid)]
    started = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(2, _sleep_on_rank, 1, 60, timeout=2)
    assert time.monotonic() - started < 20
    timeout = info.value
    assert timeout.missing == [1]
    assert timeout.results == {0: 0}
    assert "rank 1 of 2 did not answer within 2 s" in str(timeout)
    assert "_sleep_on_rank" in timeout.stacks[1]  # where the hung rank was stuck
    assert run_ranks(2, _all_reduce_rank) == [1, 1]
    assert set(get_pool(2).pids).isdisjoint(old_pids)


def test_dead_worker_is_reported_and_pool_respawns(run_ranks):
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _die_on_rank, 0, timeout=60)
    assert time.monotonic() - started < 15  # noticed promptly, not at the timeout
    assert "died" in info.value.errors[0] and "exit code 3" in info.value.errors[0]
    assert run_ranks(2, _all_reduce_rank) == [1, 1]


def test_tasks_do_not_leak_env_or_cwd(run_ranks, tmp_path):
    home = run_ranks(1, _env_and_cwd)[0][1]
    assert run_ranks(1, _leave_env_and_cwd_changed, str(tmp_path)) == [str(tmp_path)]
    assert run_ranks(1, _env_and_cwd) == [(None, home)]


def test_unpicklable_function_is_refused_before_sending():
    with pytest.raises(TypeError, match="module level"):
        get_pool(1).run(lambda: 1)
