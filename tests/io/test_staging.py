"""The process-wide staging pool: reuse across saves and strategy objects, the keying of prestaged
copies, the host memory budget (two saves in flight), prepare/release, and 100 saves in a row."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time

import psutil
import pytest
import torch

import distckpt
from distckpt import ShardedTensor
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.io import staging
from distckpt.io.staging import StagingPool
from distckpt.io.staging_buffers import StagingBuffers
from distckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from distckpt.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from distckpt.strategies.torch_dist import TorchDistSaveShardedStrategy
from tests.support.harness import run_ranks

TIMEOUT = 120
WORLD = 2
KiB, MiB = 1 << 10, 1 << 20


def _pool(budget: int, timeout: float = 30.0) -> StagingPool:
    return StagingPool(budget=lambda: budget, timeout=lambda: timeout)


# --------------------------------------------------------------------------- keying of prestaged copies


def _prestaged(src: torch.Tensor):
    """A view over a private pool with ``src`` prestaged; the buffer count after the prestage."""
    buffers = StagingBuffers()
    assert buffers.prestage(src)
    return buffers, buffers.pool.allocations


def test_an_unchanged_tensor_takes_its_prestaged_copy():
    src = torch.arange(16.0)
    buffers, allocations = _prestaged(src)
    got = buffers.acquire(src.detach())  # another tensor object over the same storage and view
    assert buffers.pool.allocations == allocations and torch.equal(got, torch.arange(16.0))
    buffers.seal().release()


def test_a_tensor_changed_in_place_after_the_prestage_is_copied_again():
    for change in (lambda t: t.add_(1), lambda t: t.copy_(torch.zeros(16)), lambda t: t[3:5].fill_(-1)):
        src = torch.arange(16.0)
        buffers, allocations = _prestaged(src)
        change(src)
        assert torch.equal(buffers.acquire(src), src)
        buffers.seal().release()


def test_another_tensor_at_the_same_address_is_copied_again():
    memory = bytearray(torch.arange(16.0).numpy().tobytes())
    first = torch.frombuffer(memory, dtype=torch.float32)
    buffers, _ = _prestaged(first)
    second = torch.frombuffer(memory, dtype=torch.float32)  # same address, another storage
    assert second.data_ptr() == first.data_ptr()
    second.fill_(7.0)  # first's version counter did not move: only the storage tells them apart
    assert first._version == 0
    assert torch.equal(buffers.acquire(second), torch.full((16,), 7.0))
    buffers.seal().release()


def test_a_resized_tensor_is_copied_again():
    for new_size in (8, 64):  # smaller keeps the address, larger reallocates the storage
        src = torch.arange(16.0)
        buffers, _ = _prestaged(src)
        src.resize_(new_size)
        src[:8] = 5.0
        got = buffers.acquire(src)
        assert got.shape == (new_size,) and torch.equal(got[:8], torch.full((8,), 5.0))
        buffers.seal().release()


def test_another_view_or_dtype_of_the_same_memory_is_copied_again():
    src = torch.arange(16.0)
    views = [src.view(4, 4), src.view(4, 4).t(), src[4:12], src.view(torch.int32), src.view(torch.uint8)]
    buffers, _ = _prestaged(src)
    for view in views:
        got = buffers.acquire(view)
        assert got.dtype == view.dtype and got.shape == view.shape and torch.equal(got, view)
    assert torch.equal(buffers.acquire(src), torch.arange(16.0))  # the early copy, still there
    buffers.seal().release()
    assert buffers.in_use == 0


def test_buffers_are_reused_only_for_the_same_bytes_and_dtype():
    buffers = StagingBuffers()
    a = buffers.acquire(torch.ones(8))  # 32 bytes float32
    buffers.seal().release()
    b = buffers.acquire(torch.ones(8, dtype=torch.int32))  # 32 bytes, other dtype
    c = buffers.acquire(torch.ones(4, 2))  # 32 bytes float32: a's buffer
    d = buffers.acquire(torch.ones(9))  # 36 bytes
    buffers.seal().release()
    assert c.data_ptr() == a.data_ptr() and len({a.data_ptr(), b.data_ptr(), d.data_ptr()}) == 3
    assert buffers.pool.allocations == 3


# --------------------------------------------------------------------------- the budget


def test_the_pool_drops_free_buffers_to_stay_within_the_budget():
    pool = _pool(1000)
    first = StagingBuffers(pool)
    for _ in range(2):
        first.acquire(torch.ones(100))  # 400 bytes each
    first.seal().release()
    second = StagingBuffers(pool)
    for _ in range(3):
        second.acquire(torch.ones(75))  # 300 bytes each: the free 400s must go first
    second.seal().release()
    assert pool.peak_allocated_bytes <= 1000 and pool.allocated_bytes == 900
    pool.keep_only({(300, torch.float32, False): 1})  # the next save needs one: the pool shrinks
    assert pool.allocated_bytes == 300


def test_a_save_larger_than_the_budget_fails_clearly_and_one_large_copy_alone_is_allowed():
    pool = _pool(1000)
    buffers = StagingBuffers(pool)
    buffers.acquire(torch.ones(200))  # 800 bytes
    with pytest.raises(CheckpointingException, match="host memory budget of 1000 bytes"):
        buffers.acquire(torch.ones(100))
    assert buffers.acquire(torch.ones(100), wait=False) is None
    buffers.discard_unsealed()
    big = buffers.acquire(torch.ones(1000))  # 4000 bytes, nothing else held: a wave of its own
    assert big.shape == (1000,)
    buffers.seal().release()


def _release_later(batch, delay):
    timer = threading.Timer(delay, batch.release)
    timer.start()
    return timer


def test_a_second_save_in_flight_waits_for_the_first_ones_buffers():
    pool = _pool(1000, timeout=30)
    save1 = StagingBuffers(pool)
    save1.acquire(torch.ones(200))  # 800 bytes, being written in the background
    batch1 = save1.seal()
    _release_later(batch1, 0.5)
    save2 = StagingBuffers(pool)
    start = time.monotonic()
    copy = save2.acquire(torch.full((100,), 3.0))  # 400 bytes: does not fit beside save 1's 800
    waited = time.monotonic() - start
    assert waited >= 0.4 and torch.equal(copy, torch.full((100,), 3.0))
    assert pool.peak_allocated_bytes <= 1000
    save2.seal().release()


def test_a_second_save_gives_up_after_the_timeout_with_a_clear_error():
    pool = _pool(1000, timeout=0.3)
    save1 = StagingBuffers(pool)
    save1.acquire(torch.ones(200))
    batch1 = save1.seal()
    save2 = StagingBuffers(pool)
    start = time.monotonic()
    with pytest.raises(CheckpointingException, match="held by another save in flight; waited 0.3 s"):
        save2.acquire(torch.ones(100))
    assert 0.25 <= time.monotonic() - start < 10
    batch1.release()
    assert save2.acquire(torch.ones(100)).shape == (100,)  # once save 1 is written
    save2.seal().release()


def test_an_abandoned_batch_gives_its_buffers_back():
    pool = _pool(1000)
    buffers = StagingBuffers(pool)
    buffers.acquire(torch.ones(200))
    batch = buffers.seal()
    del buffers, batch  # a save dropped without being written
    gc.collect()
    assert pool.staged_bytes == 0 and pool.in_use == 0


def test_release_staging_memory_waits_for_a_save_in_flight_then_frees_everything():
    distckpt.release_staging_memory()
    buffers = StagingBuffers(staging.pool())
    buffers.acquire(torch.ones(1000))
    batch = buffers.seal()
    free = StagingBuffers(staging.pool())
    free.acquire(torch.ones(10))
    free.seal().release()
    with pytest.raises(CheckpointingException, match="still held by an async save in flight"):
        distckpt.release_staging_memory(timeout=0.2)
    assert staging.pool().allocated_bytes == 4000  # the free buffer went at once
    _release_later(batch, 0.3)
    assert distckpt.release_staging_memory(timeout=30) == 4000
    assert staging.pool().allocated_bytes == 0 and staging.pool().in_use == 0


# --------------------------------------------------------------------------- through distckpt.save


def _state(rank: int, layers: int, width: int = 64, fill=None):
    sd = {}
    for i in range(layers):
        t = torch.arange(width * 16, dtype=torch.float32).reshape(width, 16) + 1000 * i + 100000 * rank
        if fill is not None:
            t.fill_(fill)
        sd[f"layer{i}"] = ShardedTensor.from_rank_offsets(f"layer{i}", t, (0, rank, WORLD))
    return sd


def _check(ckpt, layers, width=64, offset=0.0):
    rank = ddist.get_rank()
    want = _state(rank, layers, width)
    out = distckpt.load(_state(rank, layers, width, fill=0.0), ckpt)
    return [k for k in want if not torch.equal(out[k], want[k].data + offset)]


def _saves_with_fresh_strategies(base):
    """Three async saves, each with a new strategy object: the pool is allocated once."""
    distckpt.release_staging_memory()
    rank, pool = ddist.get_rank(), staging.pool()
    allocations, queue = [], AsyncCallsQueue()
    strategies = [
        lambda: None,
        TorchDistSaveShardedStrategy,
        lambda: FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()),
    ]
    for i, make in enumerate(strategies):
        sd = _state(rank, 6)
        request = distckpt.save(sd, f"{base}/{i}", sharded_strategy=make(), async_sharded_save=True)
        for sh in sd.values():
            sh.data.add_(1.0)  # training goes on right after save returns
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        allocations.append(pool.allocations)
    queue.close()
    return allocations, [_check(f"{base}/{i}", 6) for i in range(3)]


def test_fresh_strategy_objects_share_the_process_wide_pool(tmp_path):
    for allocations, wrong in run_ranks(WORLD, _saves_with_fresh_strategies, str(tmp_path), timeout=TIMEOUT):
        assert allocations[0] > 0 and allocations[1:] == [allocations[0]] * 2, allocations
        assert wrong == [[], [], []]


def _two_saves_in_flight(base, backend, budget, timeout, gate_after):
    """Save 1 is stuck behind a blocked writer while save 2 stages: save 2 waits for save 1's
    buffers (the budget holds one save), or gives up after the collective timeout."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(budget)
    distckpt.set_collective_timeout(timeout)
    try:
        distckpt.release_staging_memory()
        pool, rank = staging.pool(), ddist.get_rank()
        pool.reset_peak()
        queue, gate = AsyncCallsQueue(), threading.Event()
        queue.schedule_async_request(AsyncRequest(gate.wait, (60,)))  # the writer is busy
        sd1 = _state(rank, 4, WIDE)
        queue.schedule_async_request(
            distckpt.save(sd1, f"{base}/1", sharded_strategy=(backend, 1), async_sharded_save=True)
        )
        for sh in sd1.values():
            sh.data.add_(1.0)
        threading.Timer(gate_after, gate.set).start()  # the writer gets going later
        start = time.monotonic()
        sd2 = _state(rank, 4, WIDE)
        request2 = distckpt.save(sd2, f"{base}/2", sharded_strategy=(backend, 1), async_sharded_save=True)
        blocked = time.monotonic() - start
        for sh in sd2.values():
            sh.data.add_(1.0)
        queue.schedule_async_request(request2)
        error = None
        try:
            queue.close()
        except CheckpointingException as e:
            error = str(e)
        return blocked, pool.peak_allocated_bytes, error, _check(f"{base}/1", 4, WIDE, 0.0)
    finally:
        distckpt.set_collective_timeout(None)
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]


WIDE = 512  # 32 KiB per layer: one save's 4 layers are 128 KiB per rank (budgets go down to 64 KiB)
STATE_BYTES = 4 * WIDE * 16 * 4


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_two_saves_in_flight_stay_within_the_budget_the_second_waits(backend, tmp_path):
    budget = STATE_BYTES + STATE_BYTES // 2  # room for one save, not two
    results = run_ranks(
        WORLD, _two_saves_in_flight, str(tmp_path), backend, budget, 30.0, 1.0, timeout=TIMEOUT
    )
    for blocked, peak, error, wrong in results:
        assert blocked >= 0.8 and peak <= budget and error is None and wrong == [], results
    assert run_ranks(WORLD, _check, str(tmp_path / "2"), 4, WIDE, timeout=TIMEOUT) == [[], []]


def test_two_saves_in_flight_past_the_timeout_fail_on_every_rank(tmp_path):
    state_bytes = STATE_BYTES
    results = run_ranks(
        WORLD, _two_saves_in_flight, str(tmp_path), "torch_dist", state_bytes, 2.0, 5.0, timeout=TIMEOUT
    )
    for blocked, peak, error, wrong in results:
        assert blocked >= 1.8, results  # it waited the collective timeout, then gave up
        assert error is not None and "host memory budget" in error and "in flight" in error, results
        assert peak <= state_bytes and wrong == []
    assert not distckpt.check_is_distributed_checkpoint(str(tmp_path / "2"))


def _prepare_then_save(base, stage_cpu_tensors):
    distckpt.release_staging_memory()
    rank, pool = ddist.get_rank(), staging.pool()
    sd = _state(rank, 5)
    strategy = TorchDistSaveShardedStrategy(stage_cpu_tensors=stage_cpu_tensors)
    reserved = distckpt.prepare_staging(sd, strategy)
    allocations = pool.allocations
    distckpt.save(sd, base, sharded_strategy=strategy, async_sharded_save=True).execute_sync()
    after = pool.allocations - allocations
    freed = distckpt.release_staging_memory()
    return reserved, after, freed, pool.allocated_bytes, _check(base, 5)


def test_prepare_staging_allocates_what_the_first_save_takes(tmp_path):
    state_bytes = 5 * 64 * 16 * 4
    for reserved, after, freed, left, wrong in run_ranks(
        WORLD, _prepare_then_save, str(tmp_path / "a"), True, timeout=TIMEOUT
    ):
        assert (reserved, after, freed, left, wrong) == (state_bytes, 0, state_bytes, 0, [])
    for reserved, after, *_ in run_ranks(
        WORLD, _prepare_then_save, str(tmp_path / "b"), False, timeout=TIMEOUT
    ):
        assert reserved == 0 and after == 0  # CPU tensors written from the caller's memory


def test_prepare_staging_stays_within_the_budget_and_keeps_the_state_dict():
    distckpt.release_staging_memory()
    factory_built = []

    def build(key, data, replica_id, flattened_range):
        factory_built.append(key)
        return {"a": ShardedTensor.from_rank_offsets(f"{key}.a", data[:2].clone())}

    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(256, 256)),  # 256 KiB
        "v": ShardedTensor.from_rank_offsets("v", torch.ones(64, 256)),  # 64 KiB
        "f": distckpt.ShardedTensorFactory("f", torch.ones(4, 8), build, lambda x: x),
    }
    distckpt.set_host_memory_budget(200 * KiB)
    try:
        reserved = distckpt.prepare_staging(sd)
    finally:
        distckpt.set_host_memory_budget(None)
    assert reserved == 64 * KiB + 2 * 8 * 4  # the 256 KiB one does not fit
    assert staging.pool().allocated_bytes <= 200 * KiB
    assert isinstance(sd["f"], distckpt.ShardedTensorFactory) and factory_built == ["f"]
    distckpt.release_staging_memory()


# --------------------------------------------------------------------------- 100 saves in a row


def _hundred_saves(base, budget):
    """100 async saves, layers added and removed: the pool stays within the budget, ends at what
    the last save needed, and the process's memory does not grow with the saves."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(budget)
    try:
        distckpt.release_staging_memory()
        pool, rank = staging.pool(), ddist.get_rank()
        process = psutil.Process()
        queue = AsyncCallsQueue()
        peaks, rss, over = [], [], []
        for i in range(100):
            layers = 2 + (i * 7) % 23  # 2 .. 24 layers of 8 KiB per rank: 16 .. 192 KiB
            width = 64 + 32 * (i % 3)  # and their shapes change too
            sd = _state(rank, layers, width)
            pool.reset_peak()
            ckpt = f"{base}/{i}"
            strategy = None if i % 2 else TorchDistSaveShardedStrategy()  # a fresh one every time
            queue.schedule_async_request(
                distckpt.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
            )
            queue.maybe_finalize_async_calls(blocking=True)
            if rank == 0 and i >= 2:
                shutil.rmtree(f"{base}/{i - 2}")  # committed on every rank: nobody reads it
            peaks.append(pool.peak_allocated_bytes)
            needed = layers * width * 16 * 4
            if pool.allocated_bytes > min(needed, budget):
                over.append((i, pool.allocated_bytes, needed))
            rss.append(process.memory_info().rss)
        queue.close()
        wrong = _check(ckpt, layers, width)
        return max(peaks), over, rss, wrong
    finally:
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]


def test_a_hundred_saves_with_changing_shapes_stay_within_the_budget(tmp_path):
    budget = 96 * KiB  # smaller than the largest states: those save in waves
    start = time.monotonic()
    results = run_ranks(WORLD, _hundred_saves, str(tmp_path), budget, timeout=300)
    for peak, over, rss, wrong in results:
        assert peak <= budget and over == [] and wrong == [], (peak, over, wrong)
        # The process's memory settles: the last 50 saves add less than the budget plus 16 MiB of
        # allocator slack to the most it held over the first 50 (it would grow by the pool's
        # size per save if buffers leaked).
        assert max(rss[50:]) - max(rss[:50]) < budget + 16 * MiB, [r >> 20 for r in rss[::10]]
    assert time.monotonic() - start < 120


# --------------------------------------------------------------------------- the local tier


def _local_tier_shares_the_pool(root):
    from distckpt.local import LocalCheckpointManager

    distckpt.release_staging_memory()
    rank, pool = ddist.get_rank(), staging.pool()
    distckpt.save(_state(rank, 4), f"{root}/global", async_sharded_save=True).execute_sync()
    allocations = pool.allocations
    manager = LocalCheckpointManager(f"{root}/local{rank}", replication_factor=1)
    manager.save(_state(rank, 4), 1, is_async=True).execute_sync()
    reused = pool.allocations == allocations and pool.staged_bytes == 0
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(64 * KiB)
    error = None
    try:
        manager.save(_state(rank, 4, WIDE), 2, is_async=True)  # 128 KiB per rank: no waves here
    except CheckpointingException as e:
        error = str(e)
    finally:
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]
    return reused, error, pool.staged_bytes, manager.find_latest()


def test_the_local_tier_stages_through_the_same_pool_within_the_budget(tmp_path):
    for reused, error, staged, latest in run_ranks(
        WORLD, _local_tier_shares_the_pool, str(tmp_path), timeout=TIMEOUT
    ):
        assert reused and staged == 0 and latest == 1
        assert error is not None and "host memory budget of 65536 bytes" in error


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_an_async_cuda_save_holds_the_values_at_save_time_whatever_stream_changes_them(tmp_path):
    distckpt.release_staging_memory()
    pool = staging.pool()
    torch.manual_seed(0)
    model = {f"w{i}": torch.randn(512, 1024, device="cuda") for i in range(8)}  # 2 MiB each
    side = torch.cuda.Stream()
    allocations = []
    for n, stream in enumerate([torch.cuda.current_stream(), side, side]):
        expected = {k: t.cpu() for k, t in model.items()}
        sd = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in model.items()}
        request = distckpt.save(sd, tmp_path / str(n), async_sharded_save=True)  # a fresh default strategy
        with torch.cuda.stream(stream):  # the next training step overwrites every parameter at once
            for t in model.values():
                t.mul_(-3.0).add_(1.0)
        request.execute_sync()
        allocations.append(pool.allocations)
        targets = {k: torch.empty(512, 1024, device="cuda") for k in model}
        distckpt.load(
            {k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}, tmp_path / str(n)
        )
        assert all(torch.equal(targets[k].cpu(), expected[k]) for k in model), n
    assert allocations[1:] == [allocations[0]] * 2  # later saves reuse the pinned buffers
    assert pool.staged_bytes == 0 and pool.allocated_bytes == 8 * (2 << 20)
    assert distckpt.release_staging_memory() == 8 * (2 << 20) and pool.pinned_registrations == 0


@pytest.mark.cuda
def test_prepare_staging_pins_what_the_first_cuda_save_takes(tmp_path):
    distckpt.release_staging_memory()
    pool = staging.pool()
    model = {f"w{i}": torch.randn(256, 1024, device="cuda") for i in range(4)}  # 1 MiB each
    sd = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in model.items()}
    assert distckpt.prepare_staging(sd) == 4 << 20 and pool.pinned_registrations == 4
    allocations = pool.allocations
    distckpt.save(sd, tmp_path, async_sharded_save=True).execute_sync()
    assert pool.allocations == allocations  # the first save only copied
    distckpt.release_staging_memory()
