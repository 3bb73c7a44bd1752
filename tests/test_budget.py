"""The host memory budget: the setting, async save staging in waves, fully parallel load in waves."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch

import distckpt
from distckpt import ShardedTensor, budget
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.strategies.torch import TorchDistSaveShardedStrategy
from tests.support import layouts
from tests.support.harness import run_ranks

TIMEOUT = 90
WORLD = 2
MiB = 1 << 20


# --------------------------------------------------------------------------- the setting


@pytest.fixture
def clean_budget(monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    distckpt.set_host_memory_budget(None)
    yield monkeypatch
    distckpt.set_host_memory_budget(None)


def test_default_is_a_fraction_of_ram_split_between_the_local_ranks(clean_budget):
    ram = psutil.virtual_memory().total
    assert distckpt.host_memory_budget() == int(ram * budget.DEFAULT_FRACTION)
    clean_budget.setenv("LOCAL_WORLD_SIZE", "4")
    assert distckpt.host_memory_budget() == int(ram * budget.DEFAULT_FRACTION) // 4


@pytest.mark.parametrize(
    "raw, expected",
    [("1048576", MiB), ("512MiB", 512 * MiB), ("2GB", 2 * 10**9), ("3 KiB", 3 << 10), (" 64k ", 64000)],
)
def test_env_bytes(clean_budget, raw, expected):
    clean_budget.setenv(budget.ENV_VAR, raw)
    clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
    assert distckpt.host_memory_budget() == max(budget.MIN_BUDGET, expected)


def test_env_fraction_and_local_ranks(clean_budget):
    ram = psutil.virtual_memory().total
    clean_budget.setenv(budget.ENV_VAR, "0.5")
    clean_budget.setenv("LOCAL_WORLD_SIZE", "2")
    assert distckpt.host_memory_budget() == int(ram * 0.5) // 2


def test_set_wins_over_env_and_none_goes_back(clean_budget):
    clean_budget.setenv(budget.ENV_VAR, "8MiB")
    clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
    distckpt.set_host_memory_budget(2 * MiB)
    assert distckpt.host_memory_budget() == 2 * MiB
    distckpt.set_host_memory_budget(None)
    assert distckpt.host_memory_budget() == 8 * MiB


@pytest.mark.parametrize("raw", ["abc", "0", "1.5", "-3", "12 parsecs", "0.0", ""])
def test_bad_env_value_is_a_clear_error(clean_budget, raw):
    clean_budget.setenv(budget.ENV_VAR, raw)
    if raw == "":  # empty means unset
        assert distckpt.host_memory_budget() > 0
        return
    with pytest.raises(CheckpointingException, match=budget.ENV_VAR):
        distckpt.host_memory_budget()


@pytest.mark.parametrize("value", [0, -1, 1.5, 0.0, True, "x", [1]])
def test_bad_set_value_is_a_clear_error(clean_budget, value):
    with pytest.raises(CheckpointingException, match="set_host_memory_budget"):
        distckpt.set_host_memory_budget(value)


def test_bad_local_world_size_is_a_clear_error(clean_budget):
    clean_budget.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(CheckpointingException, match="LOCAL_WORLD_SIZE"):
        distckpt.host_memory_budget()


# --------------------------------------------------------------------------- async save in waves


def _state(rank, fill=None):
    """About 3.3 MiB per rank: tensors of 16..512 KiB (all under a 1 MiB budget), a flattened
    piece and an object."""
    sd = {}
    for i, rows in enumerate([8, 32, 64, 128, 256, 16, 512, 100, 300, 1000, 800]):
        full = layouts.full_tensor(f"t{i}", (WORLD * rows, 256))
        local = full[rank * rows : (rank + 1) * rows].clone()
        if fill is not None:
            local.fill_(fill)
        sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", local, (0, rank, WORLD))
    sd["obj"] = distckpt.ShardedObject("obj", {"rank": rank}, (WORLD,), (rank,), replica_id=0)
    return sd


def _async_save(ckpt, host_budget):
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(host_budget)
    try:
        rank = ddist.get_rank()
        sd = _state(rank)
        strategy = TorchDistSaveShardedStrategy()
        queue = AsyncCallsQueue()
        queue.schedule_async_request(
            distckpt.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
        )
        staging = strategy._staging
        for t in sd.values():
            if isinstance(t, ShardedTensor):
                t.data.fill_(-1.0)  # training goes on: the staged bytes must not change
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        return staging.peak_staged_bytes, staging.allocated_bytes
    finally:
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]


def _load(ckpt):
    rank = ddist.get_rank()
    want = _state(rank)
    request = _state(rank, fill=0.0)
    request["obj"] = distckpt.ShardedObject("obj", None, (WORLD,), (rank,), replica_id=0)
    out = distckpt.load(request, ckpt)
    wrong = [k for k in want if k != "obj" and not layouts.bitwise_equal(out[k], want[k].data)]
    if out["obj"] != {"rank": rank}:
        wrong.append("obj")
    return wrong


def _files(ckpt: Path):
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp"}


def test_async_save_under_a_tiny_budget_is_bit_identical_and_stages_at_most_the_budget(tmp_path):
    bounded, unbounded = tmp_path / "bounded", tmp_path / "unbounded"
    peaks = run_ranks(WORLD, _async_save, str(bounded), MiB, timeout=TIMEOUT)
    free = run_ranks(WORLD, _async_save, str(unbounded), 1 << 40, timeout=TIMEOUT)
    local_bytes = sum(rows * 256 * 4 for rows in [8, 32, 64, 128, 256, 16, 512, 100, 300, 1000, 800])
    assert local_bytes > 3 * MiB
    for peak, allocated in peaks:
        assert 0 < peak <= MiB and allocated <= MiB, peaks
    assert all(peak == local_bytes for peak, _ in free), free  # the unbounded save stages it all
    assert _files(bounded) == _files(unbounded)
    md_a = distckpt.strategies.torch.read_metadata(bounded)
    md_b = distckpt.strategies.torch.read_metadata(unbounded)
    assert md_a.state_dict_metadata == md_b.state_dict_metadata and md_a.storage_data == md_b.storage_data
    assert run_ranks(WORLD, _load, str(bounded), timeout=TIMEOUT) == [[]] * WORLD


def _plain_save_in_waves(ckpt):
    from distckpt.strategies import torch as torch_strategy

    rank = ddist.get_rank()
    plan = TorchDistSaveShardedStrategy().prepare(_state(rank), Path(ckpt))
    for _, bucket in plan.jobs:  # pretend every item needs a copy (as CUDA tensors do)
        for it in bucket:
            it.copies = it.source is not None
    torch_strategy.write_plan(plan, 2, budget=MiB)
    return plan.waves, sorted((r.relative_path, r.offset, r.length, r.crc32c) for r in plan.records)


def _plain_save_at_once(ckpt):
    from distckpt.strategies import torch as torch_strategy

    plan = TorchDistSaveShardedStrategy().prepare(_state(ddist.get_rank()), Path(ckpt))
    torch_strategy.write_plan(plan, 2, budget=None)
    return plan.waves, sorted((r.relative_path, r.offset, r.length, r.crc32c) for r in plan.records)


def test_plain_save_writes_copies_in_waves_with_the_same_records(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    waves = run_ranks(WORLD, _plain_save_in_waves, str(tmp_path / "a"), timeout=TIMEOUT)
    once = run_ranks(WORLD, _plain_save_at_once, str(tmp_path / "b"), timeout=TIMEOUT)
    assert all(n >= 4 for n, _ in waves), waves
    assert all(n == 1 for n, _ in once), once
    assert [r for _, r in waves] == [r for _, r in once]
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


# --------------------------------------------------------------------------- fully parallel load in waves


def _replicated(rank, fill=None):
    """Every rank holds the same tensors (data parallel): each is read once and exchanged."""
    sd = {}
    for i, rows in enumerate([64, 256, 512, 16, 1000, 300, 700, 128]):
        t = layouts.full_tensor(f"r{i}", (rows, 256))
        if fill is not None:
            t = t.clone().fill_(fill)
        sd[f"r{i}"] = ShardedTensor.from_rank_offsets(f"r{i}", t, replica_id=rank)
    sd["obj"] = distckpt.ShardedObject("obj", {"v": 7} if fill is None else None, (1,), (0,), replica_id=rank)
    return sd


def _save_replicated(ckpt):
    distckpt.save(_replicated(ddist.get_rank()), ckpt)


def _fully_parallel_load(ckpt, host_budget, algo):
    from distckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(host_budget)
    try:
        rank = ddist.get_rank()
        wrapper = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo=algo)
        out = distckpt.load(_replicated(rank, fill=0.0), ckpt, sharded_strategy=wrapper)
        want = _replicated(rank)
        wrong = [k for k in want if k != "obj" and not layouts.bitwise_equal(out[k], want[k].data)]
        if out["obj"] != {"v": 7}:
            wrong.append("obj")
        return wrapper.last_waves, wrong
    finally:
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_fully_parallel_load_under_a_tiny_budget_is_bit_exact_in_waves(algo, tmp_path):
    run_ranks(WORLD, _save_replicated, str(tmp_path), timeout=TIMEOUT)
    bounded = run_ranks(WORLD, _fully_parallel_load, str(tmp_path), MiB, algo, timeout=TIMEOUT)
    free = run_ranks(WORLD, _fully_parallel_load, str(tmp_path), 1 << 40, algo, timeout=TIMEOUT)
    assert all(wrong == [] for _, wrong in bounded + free), (bounded, free)
    # ~3 MiB of pieces, ~1.5 MiB read by each rank for the other: at least 2 waves of <= 1 MiB.
    assert all(waves >= 2 for waves, _ in bounded) and len({w for w, _ in bounded}) == 1, bounded
    assert [w for w, _ in free] == [1] * WORLD


def test_load_waves_keep_every_rank_under_the_budget():
    from distckpt.strategies.fully_parallel import ShardDistribution, load_waves

    sizes = {("tensor", f"k{i}"): (i + 1) * 100 for i in range(20)}
    assignment = {sid: i % 3 for i, sid in enumerate(sizes)}
    dist_ = ShardDistribution(assignment, {sid: (0, 1, 2) for sid in sizes}, sizes)
    waves = load_waves(dist_, 1000, 3)
    assert len(waves) > 1
    assert sorted(s for w in waves for s in w.assignment) == sorted(sizes)
    for w in waves:  # each rank reads at most the budget in a wave, or one larger piece alone
        for rank, load in enumerate(w.bytes_per_rank(3)):
            assert load <= 1000 or list(w.assignment.values()).count(rank) == 1, (rank, w)


# --------------------------------------------------------------------------- zarr async save in waves


def _zarr_async_save(ckpt, host_budget):
    from distckpt.strategies.zarr import ZarrSaveShardedStrategy

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    distckpt.set_host_memory_budget(host_budget)
    try:
        rank = ddist.get_rank()
        sd = _state(rank)
        strategy = ZarrSaveShardedStrategy()
        queue = AsyncCallsQueue()
        queue.schedule_async_request(
            distckpt.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
        )
        for t in sd.values():
            if isinstance(t, ShardedTensor):
                t.data.fill_(-1.0)  # training goes on: the staged bytes must not change
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        return strategy._staging.peak_staged_bytes, strategy._staging.allocated_bytes
    finally:
        distckpt.set_host_memory_budget(None)
        del os.environ["LOCAL_WORLD_SIZE"]


def _chunk_files(ckpt: Path):
    return {
        str(p.relative_to(ckpt)): p.read_bytes()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and "/c/" in f"/{p.relative_to(ckpt)}"
    }


def test_zarr_async_save_under_a_tiny_budget_writes_the_same_chunks(tmp_path):
    bounded, unbounded = tmp_path / "bounded", tmp_path / "unbounded"
    peaks = run_ranks(WORLD, _zarr_async_save, str(bounded), MiB, timeout=TIMEOUT)
    free = run_ranks(WORLD, _zarr_async_save, str(unbounded), 1 << 40, timeout=TIMEOUT)
    for peak, allocated in peaks:
        assert 0 < peak <= MiB and allocated <= MiB, peaks
    assert all(peak > 3 * MiB for peak, _ in free), free
    chunks = _chunk_files(bounded)
    assert len(chunks) >= 2 * 11 and chunks == _chunk_files(unbounded)
    assert run_ranks(WORLD, _load, str(bounded), timeout=TIMEOUT) == [[]] * WORLD


# --------------------------------------------------------------------------- writer threads


def test_cores_per_rank_splits_the_host_unless_a_launcher_pinned_the_rank(clean_budget):
    usable = len(os.sched_getaffinity(0))
    clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
    assert budget.cores_per_rank() == usable
    clean_budget.setenv("LOCAL_WORLD_SIZE", str(usable))
    assert budget.cores_per_rank() == 1
    clean_budget.setenv("LOCAL_WORLD_SIZE", str(4 * usable))
    assert budget.cores_per_rank() == 1  # never below one core
    # A save where one rank of the host writes gives that rank the host's cores; a count above
    # the host's ranks never lowers a rank's share.
    clean_budget.setenv("LOCAL_WORLD_SIZE", str(usable))
    with budget.ranks_doing_io(1):
        assert budget.cores_per_rank() == usable
    with budget.ranks_doing_io(8 * usable):
        assert budget.cores_per_rank() == 1
    assert budget.cores_per_rank() == 1  # back to every rank of the host after the block
    if os.cpu_count() and os.cpu_count() > 1 and usable == os.cpu_count():
        before = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, {min(before)})
            assert budget.cores_per_rank() == 1  # pinned: the affinity is the share, not divided again
            os.sched_setaffinity(0, before)
            clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
            assert budget.cores_per_rank() == usable
        finally:
            os.sched_setaffinity(0, before)


def test_the_default_save_writes_two_files_with_at_most_one_thread_per_core(clean_budget, tmp_path):
    default = TorchDistSaveShardedStrategy()
    clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
    assert default.thread_count == 2
    assert default.writer_threads() == min(2, len(os.sched_getaffinity(0)))
    clean_budget.setenv("LOCAL_WORLD_SIZE", str(os.cpu_count() * 2))
    assert default.writer_threads() == 1
    # Given counts are taken as they are, threads included (I/O-bound storage wants them).
    assert TorchDistSaveShardedStrategy(thread_count=3).writer_threads() == 3
    with pytest.raises(CheckpointingException, match="thread_count must be"):
        TorchDistSaveShardedStrategy(thread_count=0)
    # On an object store every file is an upload: all of them at once whatever the cores.
    from distckpt import storage
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    store = storage.resolve("memory://threads")
    assert default.writer_threads(store) == 2
    reader = TorchDistLoadShardedStrategy()
    assert reader.reader_threads(tmp_path) == 1 and reader.reader_threads(store) == 4
    clean_budget.setenv("LOCAL_WORLD_SIZE", "1")
    assert reader.reader_threads(tmp_path) == min(4, len(os.sched_getaffinity(0)))
    assert TorchDistLoadShardedStrategy(thread_count=3).reader_threads(tmp_path) == 3
    # One writer thread, still two files: the layout does not depend on the host.
    sd = {
        k: ShardedTensor.from_rank_offsets(k, torch.arange(3 << 20, dtype=torch.float32) + i)
        for i, k in enumerate(("a", "b"))
    }
    distckpt.save(sd, tmp_path / "ckpt", sharded_strategy=default)
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert names == ["__0_0.distcp", "__0_1.distcp"], names
    loaded = distckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.zeros(3 << 20)) for k in sd}, tmp_path / "ckpt"
    )
    assert all(torch.equal(loaded[k], sd[k].data) for k in sd)


class _RecordingWriters(TorchDistSaveShardedStrategy):
    """The default strategy, remembering the cores and writer threads its save was given."""

    def writer_threads(self, checkpoint_dir=None) -> int:
        self.seen = (budget.cores_per_rank(), super().writer_threads(checkpoint_dir))
        return self.seen[1]


def _writer_cores(ckpt, layout):
    from distckpt.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    rank = ddist.get_rank()
    t = torch.arange(4 << 20, dtype=torch.float32)
    if layout == "tp":  # both ranks hold a main replica
        sd = {"w": ShardedTensor.from_rank_offsets("w", t.clone(), (0, rank, WORLD))}
    else:  # data parallel: rank 1 holds replicas only
        sd = {"w": ShardedTensor.from_rank_offsets("w", t.clone(), replica_id=rank)}
    inner = _RecordingWriters()
    strategy = FullyParallelSaveStrategyWrapper(inner) if layout == "dp, fully parallel" else inner
    target = Path(ckpt) / layout.replace(", ", "_")
    if layout == "dp, async":
        distckpt.save(sd, target, sharded_strategy=strategy, async_sharded_save=True).execute_sync()
    else:
        distckpt.save(sd, target, sharded_strategy=strategy)
    # Outside the save, every rank of the host counts again.
    return inner.seen, budget.cores_per_rank()


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or len(os.sched_getaffinity(0)) < (os.cpu_count() or 1),
    reason="needs two unpinned cores to tell one writer from two",
)
@pytest.mark.parametrize("layout", ["tp", "dp", "dp, async", "dp, fully parallel"])
def test_ranks_that_write_alone_on_a_host_get_the_idle_ranks_cores(layout, tmp_path):
    usable = len(os.sched_getaffinity(0))
    seen = run_ranks(WORLD, _writer_cores, str(tmp_path), layout, timeout=TIMEOUT)
    (cores0, threads0), after0 = seen[0]
    assert after0 == usable // WORLD
    if layout in ("dp", "dp, async"):
        # Only rank 0 writes: it takes both ranks' cores, and two writer threads for its two files.
        assert cores0 == usable and threads0 == 2
    else:
        # Both ranks write (the fully parallel wrapper may hand replicas to rank 1): a share each.
        assert [s[0][0] for s in seen] == [usable // WORLD] * WORLD
        assert threads0 == min(2, usable // WORLD)
