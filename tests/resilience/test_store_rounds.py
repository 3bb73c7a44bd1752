"""Stages carried by the rendezvous store (``distckpt.dist.store_rounds``).

On a TCPStore (the rank pool's, like ``torchrun``'s) the object stages of a save or load (gather
and decide, error agreement, small all-reduces) run through the store alone: every rank posts
its payload, rank 0 decides and posts the outcome. These tests pin what that path must keep from
the collective one: the same results and errors, a bound on every wait that names the absent
rank, and no rank left inside a collective, so a stalled stage does not cost the group.
"""

from __future__ import annotations

import os
import time

import pytest

import distckpt
from distckpt import CheckpointingException, checkin, process_group
from distckpt import dist as ddist
from tests.support.faults import Fault, load_with_fault, save_with_fault
from tests.support.harness import run_ranks


def _set_rounds(setting: str) -> None:
    os.environ[ddist.STORE_ROUNDS_ENV] = setting  # the pool restores the environment after the task


def _rounds_in_use(setting: str):
    _set_rounds(setting)
    return ddist.store_rounds() is not None


def test_the_pool_store_carries_the_stages_unless_told_not_to():
    assert run_ranks(2, _rounds_in_use, "auto") == [True, True]
    assert run_ranks(2, _rounds_in_use, "0") == [False, False]


def test_the_setting_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(ddist.STORE_ROUNDS_ENV, "sometimes")
    with pytest.raises(CheckpointingException, match="DISTCKPT_STORE_ROUNDS='sometimes'"):
        ddist.store_rounds()


def _save_load_and_fail(setting: str, ckpt: str):
    _set_rounds(setting)
    save_with_fault(ckpt, 1, None)
    exact = load_with_fault(ckpt, 1)
    try:
        save_with_fault(ckpt, 2, Fault("prepare", (1, 3)))
        failure = "saved"
    except CheckpointingException as e:
        failure = str(e)
    maxima = ddist.all_reduce_max([ddist.get_rank(), -ddist.get_rank()], stage="maxima")
    gathered = ddist.all_gather_or_raise("gathered", None, ddist.get_rank() * 10)
    return exact, failure, maxima, gathered, load_with_fault(ckpt, 1)


def test_the_store_and_the_collectives_give_the_same_results_and_errors(tmp_path):
    through_store = run_ranks(4, _save_load_and_fail, "1", str(tmp_path / "store"))
    through_group = run_ranks(4, _save_load_and_fail, "0", str(tmp_path / "group"))
    assert [r[2:4] for r in through_store] == [([3, 0], [0, 10, 20, 30])] * 4
    for rank, (a, b) in enumerate(zip(through_store, through_group)):
        assert a[0] == b[0] == [] and a[4] == b[4] == []  # exact, and the failed save changed nothing
        assert a[2:4] == b[2:4]
        assert a[1] == b[1].replace("group", "store"), (rank, a[1], b[1])  # the same words, path aside
        assert "failed on 2 rank(s)" in a[1] and "injected prepare fault on rank 3" in a[1], a[1]


def _slow_decision(timeout: float, setting: str):
    """Rank 0 takes ``timeout + 1`` s to decide a stage; afterwards every rank runs one more."""
    _set_rounds(setting)
    rank = ddist.get_rank()

    def decide(payloads):
        time.sleep(timeout + 1.0)
        return sum(payloads)

    distckpt.set_collective_timeout(timeout)
    start = time.monotonic()
    try:
        outcome = ddist.gather_and_decide("slow stage", None, rank, decide)
    except distckpt.CollectiveTimeout as e:
        outcome = str(e), e.missing
    finally:
        distckpt.set_collective_timeout(None)
    elapsed = round(time.monotonic() - start, 2)
    ddist.reset_failures()  # what the next save or load does first
    after = ddist.gather_and_decide("next stage", None, rank, sum)
    return outcome, elapsed, after


def test_a_rank_0_that_decides_too_slowly_is_named_everywhere_and_the_group_goes_on():
    results = run_ranks(4, _slow_decision, 1.5, "1")
    outcomes = {str(outcome) for outcome, _, _ in results}
    assert len(outcomes) == 1, results  # rank 0 raises the others' verdict when it is done
    message, missing = results[1][0]
    assert missing == [0] and message.startswith("slow stage: rank(s) 0 did not arrive within 1.5 s"), message
    for rank in (1, 2, 3):
        assert 1.4 <= results[rank][1] < 6, results
    assert results[0][1] >= 2.4, results
    # No rank was left inside a collective: the next stage works on the same group.
    assert [after for _, _, after in results] == [6] * 4


class _RefusedOnRank0:
    """Pickles anywhere; unpickling it on rank 0 fails (a class rank 0 cannot import, say)."""

    def __reduce__(self):
        return _refuse_on_rank_0, (42,)


def _refuse_on_rank_0(value: int) -> int:
    if ddist.get_rank() == 0:
        raise ImportError("no module named 'only_on_rank_2'")
    return value


def _payload_rank_0_cannot_read():
    _set_rounds("1")
    payload = _RefusedOnRank0() if ddist.get_rank() == 2 else 1
    try:
        ddist.gather_and_decide("odd payload", None, payload, len)
    except CheckpointingException as e:
        return str(e)
    return "decided"


def test_a_payload_rank_0_cannot_unpickle_fails_every_rank_naming_its_sender():
    messages = run_ranks(4, _payload_rank_0_cannot_read)
    assert len(set(messages)) == 1, messages
    assert "failed on rank(s) 2: its payload cannot be unpickled on rank 0" in messages[0], messages[0]
    assert "only_on_rank_2" in messages[0], messages[0]


def _large(size: int, setting: str):
    _set_rounds(setting)
    rank = ddist.get_rank()
    mine = bytes([rank]) * size
    decided = ddist.gather_and_decide("large outcome", None, mine, lambda ps: b"".join(ps))
    everyone = ddist.all_gather_or_raise("large payloads", None, mine)
    return (
        len(decided),
        decided[::size] == bytes(range(4)),
        [p[:1] * len(p) == p and len(p) for p in everyone],
    )


def test_an_outcome_larger_than_the_store_takes_follows_as_a_broadcast():
    size = checkin.OUTCOME_LIMIT // 2  # four of them: twice what the store carries
    for length, ordered, payloads in run_ranks(4, _large, size, "1"):
        assert length == 4 * size and ordered
        assert payloads == [size] * 4


def _verdict_of_an_earlier_failure(failing: int):
    """Rank ``failing`` words a verdict into the next stage (what a rank whose collective failed
    does) and stays away from it; the others run that stage through the store."""
    _set_rounds("1")
    rank = ddist.get_rank()
    gid = process_group.group_id(process_group.group_ranks(None))
    distckpt.set_collective_timeout(30)
    start = time.monotonic()
    try:
        if rank == failing:
            checkin.post_verdict(None, "earlier stage: a collective failed on rank 2")
            checkin.check_ins[gid] += 1  # keeps the pool's stage numbers in step
            return "stayed away"
        ddist.gather_and_decide("next stage", None, rank, sum)
        return "decided"
    except distckpt.CollectiveTimeout as e:
        return str(e), round(time.monotonic() - start, 2)
    finally:
        distckpt.set_collective_timeout(None)
        ddist.reset_failures()


def test_rank_0_raises_a_posted_verdict_at_once_instead_of_waiting_for_the_rank_that_posted_it():
    results = run_ranks(4, _verdict_of_an_earlier_failure, 2)
    assert results[2] == "stayed away"
    for rank in (0, 1, 3):
        message, elapsed = results[rank]
        assert message == "earlier stage: a collective failed on rank 2" and elapsed < 5, results
