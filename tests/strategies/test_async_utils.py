"""AsyncRequest, AsyncCallsQueue and StagingBuffers: ordering, cross-rank finalization, failures."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from distckpt import dist as ddist
from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    StagingBuffers,
    is_distckpt_finalize_fn,
)
from tests.support.harness import expect_all_ranks_raise, run_ranks

TIMEOUT = 30


def _write_after(path, data: bytes, delay: float = 0.0):
    """A fake background writer: sleeps, then writes ``data`` to ``path``."""
    time.sleep(delay)
    Path(path).write_bytes(data)


def _fail_after(delay: float, message: str):
    time.sleep(delay)
    raise OSError(message)


def _commit(path):
    """A fake finalize step of the caller's own: marks the save committed."""
    Path(path).write_text("committed")


def _own_commit(path):
    """A finalize step that counts as distckpt's own (a distckpt function): never run after a
    failed write, like ``save``'s commit of ``metadata.json``."""
    return functools.partial(atomic_write_bytes, str(path), b"committed")


class _CleanedUp(Exception):
    """Raised by a request owner's finalize fn that found its save incomplete (as NVRx's does)."""


# --------------------------------------------------------------------------- AsyncRequest


def test_request_is_frozen_once_scheduled(tmp_path):
    queue = AsyncCallsQueue()
    request = AsyncRequest(_write_after, (tmp_path / "a", b"x"), [])
    request.add_finalize_fn(lambda: None)
    queue.schedule_async_request(request)
    assert request.is_frozen
    with pytest.raises(CheckpointingException, match="frozen"):
        request.add_finalize_fn(lambda: None)
    with pytest.raises(CheckpointingException, match="frozen"):
        request.async_fn = None
    queue.close()


def test_execute_sync_runs_the_write_then_every_finalize_fn_in_order(tmp_path):
    order = []
    request = AsyncRequest(
        lambda p: (order.append("write"), Path(p).write_bytes(b"x")),
        (tmp_path / "d",),
        [lambda: order.append("metadata")],
    )
    request.add_finalize_fn(lambda: order.append("commit"))
    request.execute_sync()
    assert order == ["write", "metadata", "commit"]
    assert (tmp_path / "d").read_bytes() == b"x"


def test_execute_sync_skips_finalization_when_the_write_fails(tmp_path):
    request = AsyncRequest(_fail_after, (0.0, "disk full"), [lambda: _commit(tmp_path / "commit")])
    with pytest.raises(CheckpointingException, match="OSError: disk full"):
        request.execute_sync()
    assert not (tmp_path / "commit").exists()


def _execute_sync_failing_on_rank1(tmp):
    rank = ddist.get_rank()
    fn, args = (_fail_after, (0.0, "no space left")) if rank == 1 else (_write_after, (f"{tmp}/d", b"x"))
    AsyncRequest(fn, args, [lambda: _commit(f"{tmp}/commit{rank}")]).execute_sync()


def test_execute_sync_failure_on_one_rank_raises_everywhere_before_any_finalize(tmp_path):
    expect_all_ranks_raise(
        2,
        _execute_sync_failing_on_rank1,
        str(tmp_path),
        match=r"synchronous save failed on rank\(s\) 1: OSError: no space left",
        timeout=TIMEOUT,
    )
    assert not list(tmp_path.glob("commit*"))


# --------------------------------------------------------------------------- AsyncCallsQueue, one process


def test_schedule_returns_at_once_and_the_write_runs_in_the_background(tmp_path):
    queue = AsyncCallsQueue()
    start = time.perf_counter()
    idx = queue.schedule_async_request(
        AsyncRequest(_write_after, (tmp_path / "data", b"abc", 0.3), [lambda: _commit(tmp_path / "commit")])
    )
    assert time.perf_counter() - start < 0.1
    assert idx == 0
    assert queue.maybe_finalize_async_calls(no_dist=True) == []
    assert queue.get_num_unfinalized_calls() == 1
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert (tmp_path / "data").read_bytes() == b"abc" and (tmp_path / "commit").exists()
    assert queue.get_num_unfinalized_calls() == 0
    queue.close()


def test_requests_finish_out_of_order_but_finalize_in_order(tmp_path):
    queue = AsyncCallsQueue(persistent=False)  # one thread per request: they overlap
    finalized = []
    for i, delay in enumerate([1.0, 0.0, 0.0]):
        queue.schedule_async_request(
            AsyncRequest(_write_after, (tmp_path / f"d{i}", b"x", delay), [lambda i=i: finalized.append(i)])
        )
    deadline = time.monotonic() + 0.8
    while not (tmp_path / "d2").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "d2").exists() and not (tmp_path / "d0").exists()
    assert queue.maybe_finalize_async_calls(no_dist=True) == []
    assert finalized == []
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0, 1, 2]
    assert finalized == [0, 1, 2]
    queue.close()


def test_request_without_async_fn_is_only_finalized(tmp_path):
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: _commit(tmp_path / "commit")]))
    assert queue.maybe_finalize_async_calls(no_dist=True) == [0]
    assert (tmp_path / "commit").exists()
    queue.close()


def test_close_abort_cancels_pending_work_and_commits_nothing(tmp_path):
    queue = AsyncCallsQueue()
    release = threading.Event()
    queue.schedule_async_request(AsyncRequest(release.wait, (10,), [lambda: _commit(tmp_path / "c0")]))
    queue.schedule_async_request(
        AsyncRequest(_write_after, (tmp_path / "d1", b"x"), [lambda: _commit(tmp_path / "c1")])
    )
    start = time.perf_counter()
    queue.close(abort=True)
    assert time.perf_counter() - start < 1
    release.set()
    time.sleep(0.1)
    assert not (tmp_path / "d1").exists(), "a request that had not started must be cancelled"
    assert not (tmp_path / "c0").exists() and not (tmp_path / "c1").exists()
    assert queue.get_num_unfinalized_calls() == 0
    with pytest.raises(CheckpointingException, match="closed"):
        queue.schedule_async_request(AsyncRequest(None))


def test_close_waits_for_work_in_flight_and_finalizes_it(tmp_path):
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        AsyncRequest(_write_after, (tmp_path / "d", b"x", 0.2), [lambda: _commit(tmp_path / "commit")])
    )
    queue.close()
    assert (tmp_path / "commit").exists()
    assert queue.get_num_unfinalized_calls() == 0


# --------------------------------------------------------------------------- AsyncCallsQueue, real ranks


def _finalize_only_when_every_rank_is_done(tmp):
    rank = ddist.get_rank()
    queue = AsyncCallsQueue()
    finalized = []
    # Rank 1's write is slow: rank 0 is done locally but must not finalize yet.
    queue.schedule_async_request(
        AsyncRequest(
            _write_after, (f"{tmp}/d{rank}", b"x", 1.0 if rank else 0.0), [lambda: finalized.append("call 0")]
        )
    )
    time.sleep(0.1)
    early = queue.maybe_finalize_async_calls()
    finalized_early = list(finalized)
    late = queue.maybe_finalize_async_calls(blocking=True)
    both_written = os.path.exists(f"{tmp}/d0") and os.path.exists(f"{tmp}/d1")
    queue.close()
    return early, finalized_early, late, finalized, both_written


def test_a_call_is_finalized_only_once_its_work_is_done_on_every_rank(tmp_path):
    results = run_ranks(2, _finalize_only_when_every_rank_is_done, str(tmp_path), timeout=TIMEOUT)
    assert results == [([], [], [0], ["call 0"], True)] * 2


def _failure_in_one_worker(tmp):
    rank = ddist.get_rank()
    queue = AsyncCallsQueue()
    fn, args = (
        (_fail_after, (0.1, "injected write failure on rank 1"))
        if rank == 1
        else (_write_after, (f"{tmp}/d0_{rank}", b"x"))
    )
    # The caller's own fn runs (it does not raise); distckpt's commit and what follows it do not.
    finalize_fns = [
        lambda: _commit(f"{tmp}/checked0_{rank}"),
        _own_commit(f"{tmp}/commit0_{rank}"),
        lambda: _commit(f"{tmp}/tracker0_{rank}"),
    ]
    queue.schedule_async_request(AsyncRequest(fn, args, finalize_fns))
    queue.schedule_async_request(
        AsyncRequest(
            _write_after, (f"{tmp}/d1_{rank}", b"y", 0.1), [lambda: _commit(f"{tmp}/commit1_{rank}")]
        )
    )
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = None
    except CheckpointingException as e:
        error = str(e)
    after_failure = queue.get_num_unfinalized_calls()
    later = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    marks = sorted(p.name for p in Path(tmp).iterdir() if p.name.endswith(f"_{rank}") and p.name[0] != "d")
    return error, after_failure, later, marks


def test_a_failed_write_on_one_rank_raises_on_every_rank_and_commits_nothing(tmp_path):
    results = run_ranks(2, _failure_in_one_worker, str(tmp_path), timeout=TIMEOUT)
    errors = {r[0] for r in results}
    assert len(errors) == 1, f"ranks raised different errors: {errors}"
    error = errors.pop()
    assert "async save (call 0) failed on rank(s) 1" in error
    assert "OSError: injected write failure on rank 1" in error
    for rank, (_, after_failure, later, marks) in enumerate(results):
        assert after_failure == 1  # call 0 dropped, call 1 still queued
        assert later == [1]  # the later request is unaffected
        # call 0: the caller's check ran on every rank; distckpt's commit and the fn after it
        # ran nowhere, not even on rank 0 whose write succeeded
        assert marks == [f"checked0_{rank}", f"commit1_{rank}"]


def _close_with_a_failure(tmp):
    rank = ddist.get_rank()
    queue = AsyncCallsQueue()
    fn, args = (_fail_after, (0.0, "boom")) if rank == 0 else (_write_after, (f"{tmp}/x{rank}", b"x"))
    queue.schedule_async_request(AsyncRequest(fn, args, [_own_commit(f"{tmp}/c0_{rank}")]))
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: _commit(f"{tmp}/c1_{rank}")]))
    try:
        queue.close()
    except CheckpointingException as e:
        return str(e), os.path.exists(f"{tmp}/c0_{rank}"), os.path.exists(f"{tmp}/c1_{rank}")
    return None


def test_close_finalizes_the_rest_then_raises_the_failure_on_every_rank(tmp_path):
    results = run_ranks(2, _close_with_a_failure, str(tmp_path), timeout=TIMEOUT)
    assert results[0] == results[1]
    message, committed0, committed1 = results[0]
    assert "failed on rank(s) 0: OSError: boom" in message
    assert (committed0, committed1) == (False, True)


def _owner_judges_its_failed_save(tmp, fail_on_ranks):
    """A request built outside distckpt (as NVRx's local checkpoint manager builds one): its
    finalize fn finds out with a collective whether every rank wrote, cleans up this rank's file
    and raises its own exception; a later finalize fn (Megatron-LM's tracker update) must not run."""
    rank = ddist.get_rank()
    queue = AsyncCallsQueue()
    mine = Path(tmp) / f"piece_{rank}"
    fn, args = (_fail_after, (0.1, "TEST")) if rank == 1 else (_write_after, (mine, b"x"))

    def check_and_clean_up():
        written = [None] * ddist.get_world_size()
        torch.distributed.all_gather_object(written, mine.exists())
        if not all(written):
            mine.unlink(missing_ok=True)
            if rank in fail_on_ranks:
                raise _CleanedUp(f"save incomplete on ranks {[r for r, w in enumerate(written) if not w]}")

    queue.schedule_async_request(
        AsyncRequest(fn, args, [check_and_clean_up, lambda: _commit(f"{tmp}/tracker_{rank}")])
    )
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        outcome = "returned"
    except _CleanedUp as e:
        outcome = f"own: {e}"
    except CheckpointingException as e:
        outcome = f"agreed: {e}"
    left = queue.get_num_unfinalized_calls()
    # The ranks still agree on every collective: a next request is finalized normally.
    queue.schedule_async_request(AsyncRequest(None, (), [lambda: _commit(f"{tmp}/next_{rank}")]))
    after = queue.maybe_finalize_async_calls()
    queue.close()
    return outcome, left, after, mine.exists()


def test_a_failed_requests_own_finalize_fns_run_and_their_exception_reaches_the_caller(tmp_path):
    results = run_ranks(2, _owner_judges_its_failed_save, str(tmp_path), (0, 1), timeout=TIMEOUT)
    for outcome, left, after, still_there in results:
        assert outcome == "own: save incomplete on ranks [1]"
        assert (left, after, still_there) == (0, [1], False)  # rank 0's piece was cleaned up
    assert not list(tmp_path.glob("tracker_*"))
    assert (tmp_path / "next_0").exists() and (tmp_path / "next_1").exists()


def test_a_finalize_fn_raising_on_one_rank_leaves_the_agreed_error_on_the_others(tmp_path):
    results = run_ranks(2, _owner_judges_its_failed_save, str(tmp_path), (1,), timeout=TIMEOUT)
    assert results[1][0] == "own: save incomplete on ranks [1]"
    assert results[0][0].startswith("agreed: async save (call 0) failed on rank(s) 1: OSError: TEST")
    assert [r[1:] for r in results] == [(0, [1], False)] * 2
    # Rank 0's fns all ran (none raised there), rank 1's stopped at the one that raised.
    assert [p.name for p in tmp_path.glob("tracker_*")] == ["tracker_0"]


def test_without_collectives_a_failed_request_runs_its_own_finalize_fns(tmp_path):
    order = []

    def cleanup():
        order.append("cleanup")
        raise _CleanedUp("cleaned up")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(_fail_after, (0.0, "disk full"), [cleanup, order.clear]))
    with pytest.raises(_CleanedUp, match="cleaned up") as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert "OSError: disk full" in str(info.value.__context__)  # the write's failure, chained
    assert order == ["cleanup"]
    # Nobody raises: the write's failure is raised after the fns ran.
    queue.schedule_async_request(AsyncRequest(_fail_after, (0.0, "disk full"), [lambda: order.append("ran")]))
    with pytest.raises(CheckpointingException, match="OSError: disk full"):
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert order == ["cleanup", "ran"]
    queue.close()


def test_finalize_fns_written_in_distckpt_are_told_apart_from_the_callers():
    class Committer:
        def commit(self):
            pass

    assert is_distckpt_finalize_fn(_own_commit("x"))
    assert is_distckpt_finalize_fn(functools.partial(_own_commit("x")))
    assert is_distckpt_finalize_fn(ddist.get_rank)
    assert is_distckpt_finalize_fn(StagingBuffers.discard_unsealed)
    assert not is_distckpt_finalize_fn(lambda: None)
    assert not is_distckpt_finalize_fn(Committer().commit)
    assert not is_distckpt_finalize_fn(functools.partial(_commit, "x"))
    assert not is_distckpt_finalize_fn(print)


def _queue_on_rank0_only(tmp):
    if ddist.get_rank() != 0:
        return None
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        AsyncRequest(_write_after, (f"{tmp}/d", b"x"), [lambda: _commit(f"{tmp}/c")])
    )
    done = queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close(abort=True)
    return done


def test_no_dist_finalizes_on_one_rank_without_collectives(tmp_path):
    assert run_ranks(2, _queue_on_rank0_only, str(tmp_path), timeout=TIMEOUT) == [[0], None]
    assert (tmp_path / "c").exists()


def _empty_queue_checks():
    queue = AsyncCallsQueue()
    # Ranks may check an empty queue any number of times: no collective is run.
    out = [queue.maybe_finalize_async_calls() for _ in range(ddist.get_rank() + 1)]
    queue.close()
    return out


def test_an_empty_queue_runs_no_collective():
    assert run_ranks(2, _empty_queue_checks, timeout=TIMEOUT) == [[[]], [[], []]]


# --------------------------------------------------------------------------- StagingBuffers


def test_staged_copy_is_independent_of_the_source():
    staging = StagingBuffers()
    src = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous source
    copy = staging.acquire(src)
    src.add_(100)
    staging.seal()
    assert copy.is_contiguous() and copy.shape == (3, 2)
    assert torch.equal(copy, torch.arange(6.0).reshape(2, 3).t())


def test_buffers_are_reused_once_released():
    staging = StagingBuffers()
    first = staging.acquire(torch.ones(4, 4))
    staging.seal()
    staging.release_all()
    again = staging.acquire(torch.full((2, 8), 3.0))  # same bytes and dtype, other shape
    other_dtype = staging.acquire(torch.ones(4, 4, dtype=torch.float64))
    staging.seal()
    assert again.data_ptr() == first.data_ptr()
    assert other_dtype.data_ptr() != first.data_ptr()
    assert torch.equal(again, torch.full((2, 8), 3.0))
    assert staging.allocated_bytes == 64 + 128


def _write_staged(path, tensors, batch, start):
    start.wait(10)
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.numpy().tobytes())
    batch.release()


def test_reuse_never_corrupts_a_write_in_flight(tmp_path):
    staging = StagingBuffers()
    queue = AsyncCallsQueue()
    start = threading.Event()
    model = [torch.full((256,), 1.0), torch.full((64, 4), 2.0)]
    copies1 = [staging.acquire(t) for t in model]
    batch1 = staging.seal()
    queue.schedule_async_request(AsyncRequest(_write_staged, (tmp_path / "save1", copies1, batch1, start)))
    # Training goes on and the next save stages while save 1 has not written a byte yet.
    for t in model:
        t.fill_(9.0)
    copies2 = [staging.acquire(t) for t in model]
    batch2 = staging.seal()
    assert not {c.data_ptr() for c in copies1} & {c.data_ptr() for c in copies2}
    start.set()
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    written = torch.frombuffer(bytearray((tmp_path / "save1").read_bytes()), dtype=torch.float32)
    assert torch.equal(written[:256], torch.full((256,), 1.0))
    assert torch.equal(written[256:], torch.full((256,), 2.0))
    # Save 1's buffers came back; save 3 reuses them while save 2's stay out of the pool.
    copies3 = [staging.acquire(t) for t in model]
    staging.seal()
    assert {c.data_ptr() for c in copies3} == {c.data_ptr() for c in copies1}
    batch2.release()
    assert staging.in_use == 2
    queue.close()


def test_release_is_idempotent():
    staging = StagingBuffers()
    staging.acquire(torch.ones(3))
    batch = staging.seal()
    batch.release()
    batch.release()
    staging.release_all()
    a = staging.acquire(torch.ones(3))
    b = staging.acquire(torch.ones(3))
    assert a.data_ptr() != b.data_ptr(), "a buffer was handed out twice"


@pytest.mark.cuda
def test_cuda_tensors_are_staged_into_pinned_memory_with_one_synchronize():
    staging = StagingBuffers()
    src = [torch.randn(1024, 1024, device="cuda") for _ in range(3)]
    copies = [staging.acquire(t) for t in src]
    batch = staging.seal()
    for c, t in zip(copies, src):
        assert c.device.type == "cpu" and c.is_pinned()
        assert torch.equal(c, t.cpu())
    batch.release()
    again = staging.acquire(src[0])
    staging.seal()
    # All three buffers share one pool key: any of them may come back, none is allocated anew.
    assert again.data_ptr() in {c.data_ptr() for c in copies} and again.is_pinned()
    assert torch.equal(again, src[0].cpu())


def test_a_prestaged_copy_is_taken_by_the_acquire_of_the_same_view_only():
    staging = StagingBuffers()
    src = torch.arange(12.0)
    assert staging.prestage(src)
    early_bytes = staging.allocated_bytes
    assert staging.acquire(src[:6]).data_ptr() != 0 and staging.allocated_bytes == early_bytes + 24
    got = staging.acquire(src)
    assert staging.allocated_bytes == early_bytes + 24  # no new buffer for the same view
    assert torch.equal(got, torch.arange(12.0))
    again = staging.acquire(src)  # a second acquire copies anew
    assert torch.equal(again, src) and again.data_ptr() != got.data_ptr()
    staging.seal().release()
    assert staging.in_use == 0
    # Changed in place after the prestage (its version counter moved): copied again, never stale.
    assert staging.prestage(src)
    src.add_(100)
    assert torch.equal(staging.acquire(src), torch.arange(12.0) + 100)
    staging.seal().release()
    assert staging.in_use == 0


def test_discarding_an_unsealed_save_gives_every_buffer_back():
    staging = StagingBuffers()
    staging.prestage(torch.ones(4))
    staging.acquire(torch.ones(8))
    assert staging.in_use == 2
    staging.discard_unsealed()
    assert staging.in_use == 0
    assert torch.equal(staging.acquire(torch.full((4,), 3.0)), torch.full((4,), 3.0))  # no stale early copy


@pytest.mark.cuda
def test_an_async_cuda_save_copies_each_tensor_once_and_a_failed_one_keeps_no_buffer(tmp_path):
    import distckpt
    from distckpt import ShardedTensor
    from distckpt.core import CheckpointingException
    from distckpt.strategies.torch import TorchDistSaveShardedStrategy

    model = {f"w{i}": torch.randn(64, 32, device="cuda") for i in range(5)}
    distckpt.release_staging_memory()  # the process-wide pool starts empty
    strategy = TorchDistSaveShardedStrategy()
    request = distckpt.save(
        {k: ShardedTensor.from_rank_offsets(k, t) for k, t in model.items()},
        tmp_path / "ok",
        sharded_strategy=strategy,
        async_sharded_save=True,
    )
    assert strategy.staging_pool.allocated_bytes == 5 * 64 * 32 * 4  # the early copies were taken up
    for t in model.values():
        t.zero_()
    request.execute_sync()
    targets = {k: torch.empty(64, 32, device="cuda") for k in model}
    distckpt.load({k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}, tmp_path / "ok")
    assert all(torch.count_nonzero(t) > 0 for t in targets.values())  # the saved values, not the zeros
    bad = {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4, device="cuda"), (0, 0, 2)),
        "v": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4, device="cuda"), (0, 0, 2)),
    }  # overlap
    with pytest.raises(CheckpointingException):
        distckpt.save(bad, tmp_path / "bad", sharded_strategy=strategy, async_sharded_save=True)
    assert strategy.staging_pool.in_use == 0


@pytest.mark.cuda
def test_cuda_staging_pins_exactly_the_bytes_staged_and_unpins_what_the_pool_drops():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current", 0) if stats else 0
    staging = StagingBuffers()
    src = [torch.randn(3 << 18, device="cuda") for _ in range(4)]  # 3 MiB each: torch would pin 4 MiB
    copies = [staging.acquire(t) for t in src]
    staging.seal().release()
    assert all(c.is_pinned() and torch.equal(c, t.cpu()) for c, t in zip(copies, src))
    assert staging.allocated_bytes == 4 * (3 << 20) and staging.pool.pinned_registrations == 4
    if stats:
        assert stats().get("allocated_bytes.current", 0) == before  # nothing from torch's rounding pool
    staging.keep_only({})
    assert staging.pool.pinned_registrations == 0 and staging.allocated_bytes == 0
