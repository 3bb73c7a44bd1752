"""Fully parallel save and load: same checkpoint, work spread over DP replicas, bytes read once."""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.serialization import get_default_load_sharded_strategy, get_default_save_sharded_strategy
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.strategies.base import LoadShardedStrategy, SaveShardedStrategy
from distckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_shards_to_ranks,
)
from distckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from distckpt.strategies.torch_dist.metadata import read_metadata
from tests.support import layouts
from tests.support.harness import expect_all_ranks_raise, run_ranks

TIMEOUT = 60
WORLD, TP = 4, 2  # 2 DP replicas of a TP2 model


# --------------------------------------------------------------------------- helpers (run on ranks)


_DP_GROUPS = []


def _dp_group():
    """This rank's data-parallel group (ranks with the same TP rank). Created once per worker
    process: every rank of the pool runs the same tests, so they create the groups together."""
    import torch.distributed as tdist

    if not _DP_GROUPS:
        _DP_GROUPS.extend(tdist.new_group([t + TP * d for d in range(WORLD // TP)]) for t in range(TP))
    return _DP_GROUPS[ddist.get_rank() % TP]


def _big(rank, with_data=True, tp=TP):
    """8 tensors of 64 KiB, split over ``tp`` ranks on axis 0 and replicated over the others: big
    enough that file sizes show who wrote what."""
    tp_rank, dp_rank = rank % tp, rank // tp
    rows = 64 // tp
    sd = {}
    for i in range(8):
        full = layouts.full_tensor(f"big{i}", (64, 256))
        local = full[rows * tp_rank : rows * (tp_rank + 1)].clone() if with_data else torch.zeros(rows, 256)
        sd[f"big{i}"] = ShardedTensor.from_rank_offsets(
            f"big{i}", local, (0, tp_rank, tp), replica_id=dp_rank
        )
    return sd


def _model(rank, world, with_data, replicas_of_object=2):
    sd, pieces = layouts.build("tp_dp", rank, world, with_data, tp=TP)
    sd.update(_big(rank, with_data))
    sd["rng"] = layouts.rank_object(rank, world, with_data, replicas=replicas_of_object)
    return sd, pieces


def _replica_ids(sd):
    return [sh.replica_id for sh in nested_values(sd)]


def _save(ckpt, fully_parallel, use_dp_group=False):
    rank = ddist.get_rank()
    sd, _ = _model(rank, ddist.get_world_size(), True)
    before = _replica_ids(sd)
    strategy = TorchDistSaveShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _dp_group() if use_dp_group else None)
    distckpt.save(sd, ckpt, sharded_strategy=strategy)
    return before == _replica_ids(sd)


def _bytes_per_rank(ckpt):
    sizes = defaultdict(int)
    for p in Path(ckpt).iterdir():
        m = re.fullmatch(r"__(\d+)_\d+\.distcp", p.name)
        if m:
            sizes[int(m.group(1))] += p.stat().st_size
    return [sizes[r] for r in range(WORLD)]


def _load_everything_single_process(ckpt):
    tensors = distckpt.load_plain_tensors(ckpt)
    objects = {c: ShardedObject("rng_state", None, (1, 2), (0, c)) for c in range(2)}
    objs = distckpt.load(objects, ckpt, validate_access_integrity=False)
    return tensors, objs


# --------------------------------------------------------------------------- distribution


def test_distribution_balances_bytes_among_holders_deterministically():
    holders = {("a",): [0, 1], ("b",): [0, 1], ("c",): [0, 1, 2], ("d",): [2], ("e",): [1, 2]}
    sizes = {("a",): 100, ("b",): 90, ("c",): 50, ("d",): 40, ("e",): 10}
    out = distribute_shards_to_ranks(holders, sizes, 3)
    # Megatron-Core's order: fewest holders first (d), then the largest (a, b, e), then c.
    assert out == {("a",): 0, ("b",): 1, ("c",): 2, ("d",): 2, ("e",): 2}
    assert max(sum(sizes[s] for s in out if out[s] == r) for r in range(3)) == 100
    assert distribute_shards_to_ranks(dict(reversed(list(holders.items()))), sizes, 3) == out
    assert all(out[s] in holders[s] for s in holders)


# --------------------------------------------------------------------------- save


@pytest.mark.parametrize("use_dp_group", [False, True], ids=["world", "dp_group"])
def test_fully_parallel_save_matches_a_plain_save_and_spreads_the_writing(use_dp_group, tmp_path):
    plain, parallel = tmp_path / "plain", tmp_path / "parallel"
    assert run_ranks(WORLD, _save, str(plain), False, timeout=TIMEOUT) == [True] * WORLD
    assert run_ranks(WORLD, _save, str(parallel), True, use_dp_group, timeout=TIMEOUT) == [True] * WORLD

    # The same checkpoint, bit for bit, naming the inner backend.
    assert json.loads((parallel / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    want_tensors, want_objects = _load_everything_single_process(plain)
    got_tensors, got_objects = _load_everything_single_process(parallel)
    assert set(got_tensors) == set(want_tensors)
    assert all(layouts.bitwise_equal(got_tensors[k], want_tensors[k]) for k in want_tensors)
    assert set(got_tensors) >= {"col", "row", "emb", "half", "bias", "count", "mask", "steps", "big0"}
    assert str(got_objects) == str(want_objects)

    # A plain save leaves the second DP replica (ranks 2 and 3) idle; a fully parallel one does not.
    plain_bytes, parallel_bytes = _bytes_per_rank(plain), _bytes_per_rank(parallel)
    assert plain_bytes[2] == plain_bytes[3] == 0
    assert min(parallel_bytes) > 0
    assert max(parallel_bytes) / min(parallel_bytes) < 1.25, parallel_bytes
    assert abs(sum(parallel_bytes) - sum(plain_bytes)) < 0.05 * sum(plain_bytes)


def _save_twice(ckpt, change_structure):
    rank = ddist.get_rank()
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), do_cache_distribution=True)
    cached = []
    for step in range(3):
        sd, _ = _model(rank, ddist.get_world_size(), True)
        if change_structure and step == 2 and rank == 1:
            # One rank's structure changes: every rank must recompute.
            sd["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(4))
        distckpt.save(sd, f"{ckpt}/step{step}", sharded_strategy=wrapper)
        cached.append(wrapper.last_distribution_cached)
    return cached


@pytest.mark.parametrize("change_structure", [False, True])
def test_save_distribution_cache_hits_while_the_structure_is_unchanged(change_structure, tmp_path):
    results = run_ranks(WORLD, _save_twice, str(tmp_path), change_structure, timeout=TIMEOUT)
    assert results == [[False, True, not change_structure]] * WORLD
    tensors, _ = _load_everything_single_process(tmp_path / "step2")
    assert layouts.bitwise_equal(tensors["big3"], layouts.full_tensor("big3", (64, 256)))


def _save_and_report_distribution(ckpt):
    rank = ddist.get_rank()
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    assert wrapper.cached_distribution is None
    sd, _ = _model(rank, ddist.get_world_size(), True)
    distckpt.save(sd, ckpt, sharded_strategy=wrapper)
    d = wrapper.cached_distribution
    return d.main_rank_for_shard, d.shards_in_this_group, d.all_ranks_for_shard


def test_cached_distribution_names_each_writer_by_megatron_shard_ids(tmp_path):
    """``wrapper.cached_distribution`` (Megatron-Core's attribute and form) says which rank
    wrote each shard: exactly the rank whose file holds it in ``.metadata``."""
    results = run_ranks(WORLD, _save_and_report_distribution, str(tmp_path), timeout=TIMEOUT)
    main, in_group, holders = results[0]
    assert all(r == results[0] for r in results)
    assert in_group == set(main) and set(holders) == set(main)
    md = read_metadata(tmp_path)
    written = {}
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata):
            written[(index.fqn, tuple(index.offset), None)] = int(info.relative_path.split("_")[2])
    tensor_ids = {sid for sid in main if isinstance(sid, tuple)}
    assert tensor_ids and tensor_ids == set(written)
    for sid in tensor_ids:
        assert main[sid] == written[sid] and main[sid] in holders[sid]


class _SyncOnlyStrategy(SaveShardedStrategy):
    def __init__(self):
        super().__init__("sync_only", 3)

    def save(self, sharded_state_dict, checkpoint_dir):
        pass


def test_save_wrapper_takes_backend_version_and_capabilities_from_the_inner_strategy(tmp_path):
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    assert (wrapper.backend, wrapper.version, wrapper.can_handle_sharded_objects) == ("torch_dist", 1, True)
    sync_only = FullyParallelSaveStrategyWrapper(_SyncOnlyStrategy())
    assert (sync_only.backend, sync_only.version, sync_only.can_handle_sharded_objects) == (
        "sync_only",
        3,
        False,
    )
    with pytest.raises(CheckpointingException, match="cannot save asynchronously"):
        sync_only.async_save({}, tmp_path)


def _async_save_through_the_queue(ckpt):
    rank = ddist.get_rank()
    sd = _big(rank)
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    queue = AsyncCallsQueue()
    queue.schedule_async_request(wrapper.async_save(sd, Path(ckpt)))
    for t in nested_values(sd):
        t.data.fill_(-1.0)  # training goes on: the staged bytes must not change
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    request = _big(rank, with_data=False)
    out = TorchDistLoadShardedStrategy().load(request, Path(ckpt))
    want = _big(rank)
    return finalized, all(torch.equal(out[k], want[k].data) for k in want)


def test_async_fully_parallel_save_through_the_queue_spreads_the_writing(tmp_path):
    assert (
        run_ranks(WORLD, _async_save_through_the_queue, str(tmp_path), timeout=TIMEOUT)
        == [([0], True)] * WORLD
    )
    written = _bytes_per_rank(tmp_path)
    assert min(written) > 0 and max(written) / min(written) < 1.25, written


# --------------------------------------------------------------------------- load


class CountingLoadStrategy(LoadShardedStrategy):
    """Passes loads to torch_dist and counts the bytes it was asked to read (and the objects)."""

    def __init__(self, fail_on_rank=None):
        self.inner = TorchDistLoadShardedStrategy()
        super().__init__(self.inner.backend, self.inner.version)
        self.fail_on_rank = fail_on_rank
        self.bytes_requested = 0
        self.objects_requested = 0

    @property
    def can_handle_sharded_objects(self):
        return True

    def load(self, sharded_state_dict, checkpoint_dir):
        if ddist.get_rank() == self.fail_on_rank:
            raise RuntimeError("injected read failure")
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                fr = sh.flattened_range
                numel = fr.stop - fr.start if fr is not None else math.prod(sh.local_shape)
                self.bytes_requested += numel * sh.dtype.itemsize
            else:
                self.objects_requested += 1
        return self.inner.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir):
        return self.inner.load_tensors_metadata(checkpoint_dir)


def _save_plain(ckpt):
    sd, _ = _model(ddist.get_rank(), ddist.get_world_size(), True)
    distckpt.save(sd, ckpt)


def _request(rank, world):
    """The model to load into, with awkward targets: one without data, one non-contiguous view."""
    sd, pieces = _model(rank, world, False)
    sd["col"].data = None
    base = torch.zeros(tuple(reversed(sd["row"].local_shape)))
    sd["row"].data = base.t()
    # Every rank asks for both objects; ranks 0 and 1 hold the main replicas.
    sd["rng"] = [ShardedObject("rng_state", None, (1, 2), (0, c), replica_id=rank) for c in range(2)]
    return sd, pieces, base


def _check(out, pieces, base, rank):
    wrong = [n for n, p in pieces.items() if not layouts.bitwise_equal(out[n], p.expected())]
    if not torch.equal(base.t(), pieces["row"].expected()):
        wrong.append("row (not filled in place)")
    big = _big(rank)
    wrong += [k for k in big if not torch.equal(out[k], big[k].data)]
    objs = [(o["rank"], o["state"].tolist(), o["name"]) for o in out["rng"]]
    if objs != [(c, [10 * c, 10 * c + 1, 10 * c + 2], f"obj{c}") for c in range(2)]:
        wrong.append(f"rng: {objs}")
    return wrong


def _load_fully_parallel(ckpt, algo, use_dp_group):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    counting = CountingLoadStrategy()
    wrapper = FullyParallelLoadStrategyWrapper(
        counting, _dp_group() if use_dp_group else None, exchange_algo=algo
    )
    sd, pieces, base = _request(rank, world)
    out = distckpt.load(sd, ckpt, sharded_strategy=wrapper)
    return _check(out, pieces, base, rank), counting.bytes_requested, counting.objects_requested


def _requested_global_bytes():
    """One copy of every tensor the model asks for: tp_dp's keys plus the big ones."""
    sizes = {
        "col": 8 * 6 * 4,
        "row": 6 * 8 * 4,
        "emb": 16 * 4 * 2,
        "half": 4 * 8 * 2,
        "bias": 6 * 4,
        "count": 5 * 8,
        "mask": 9,
        "steps": 4,
    }
    return sum(sizes.values()) + 8 * 64 * 256 * 4


@pytest.mark.parametrize("use_dp_group", [False, True], ids=["world", "dp_group"])
@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_fully_parallel_load_is_bit_exact_and_reads_every_byte_once(algo, use_dp_group, tmp_path):
    run_ranks(WORLD, _save_plain, str(tmp_path), timeout=TIMEOUT)
    results = run_ranks(WORLD, _load_fully_parallel, str(tmp_path), algo, use_dp_group, timeout=TIMEOUT)
    assert [wrong for wrong, _, _ in results] == [[]] * WORLD
    read = [b for _, b, _ in results]
    # bias, count, mask and steps are on every rank: with DP groups each group reads them once.
    everywhere = 6 * 4 + 5 * 8 + 9 + 4
    assert sum(read) == _requested_global_bytes() + (everywhere * (TP - 1) if use_dp_group else 0), read
    assert min(read) > 0, f"some rank read nothing: {read}"
    objects = [n for _, _, n in results]
    # Each object is read once: by one rank of the world, or once per DP group.
    assert sum(objects) == (2 if not use_dp_group else 2 * TP), objects


def _load_cached(ckpt, change_structure):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    wrapper = FullyParallelLoadStrategyWrapper(CountingLoadStrategy(), do_cache_distribution=True)
    cached, wrong = [], []
    for step in range(3):
        sd, pieces, base = _request(rank, world)
        if change_structure and step == 2 and rank == 3:
            del sd["big7"]
        out = distckpt.load(sd, ckpt, sharded_strategy=wrapper)
        cached.append(wrapper.last_distribution_cached)
        if not (change_structure and step == 2):
            wrong += _check(out, pieces, base, rank)
    return cached, wrong


@pytest.mark.parametrize("change_structure", [False, True])
def test_load_distribution_cache_hits_while_the_requests_are_unchanged(change_structure, tmp_path):
    run_ranks(WORLD, _save_plain, str(tmp_path), timeout=TIMEOUT)
    results = run_ranks(WORLD, _load_cached, str(tmp_path), change_structure, timeout=TIMEOUT)
    assert results == [([False, True, not change_structure], [])] * WORLD


def _load_with_failure(ckpt, algo):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    wrapper = FullyParallelLoadStrategyWrapper(CountingLoadStrategy(fail_on_rank=1), exchange_algo=algo)
    sd, _, _ = _request(rank, world)
    distckpt.load(sd, ckpt, sharded_strategy=wrapper)


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_a_read_failure_on_one_rank_raises_on_every_rank(algo, tmp_path):
    run_ranks(WORLD, _save_plain, str(tmp_path), timeout=TIMEOUT)
    expect_all_ranks_raise(
        WORLD,
        _load_with_failure,
        str(tmp_path),
        algo,
        match=r"failed on rank\(s\) 1: RuntimeError: injected read failure",
        timeout=TIMEOUT,
    )


def _load_fp8_subclass(ckpt, algo):
    from tests.support.fp8_tensor import ScaledFp8Tensor

    rank = ddist.get_rank()
    values = layouts.full_tensor("fp8sub", (4, 6))
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", ScaledFp8Tensor.quantize(values, 0.5), replica_id=rank)},
        ckpt,
    )
    target = ScaledFp8Tensor(torch.zeros(4, 6, dtype=torch.uint8), scale=0.5)
    wrapper = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo=algo)
    out = distckpt.load(
        {"w": ShardedTensor.from_rank_offsets("w", target, replica_id=rank)}, ckpt, sharded_strategy=wrapper
    )
    return out["w"] is target and torch.equal(target.payload, ScaledFp8Tensor.quantize(values, 0.5).payload)


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_subclass_targets_are_filled_in_place_on_loader_and_receivers(algo, tmp_path):
    assert run_ranks(2, _load_fp8_subclass, str(tmp_path / "ckpt"), algo, timeout=TIMEOUT) == [True, True]


def _round_trip_through_both_wrappers(ckpt, backend, algo, layout, save_params, load_params):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, _ = layouts.build(layout, rank, world, True, **save_params)
    sd["rng"] = layouts.rank_object(rank, world, True, replicas=2)
    saver = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(backend))
    distckpt.save(sd, ckpt, sharded_strategy=saver)
    sd, pieces = layouts.build(layout, rank, world, False, **load_params)
    sd["rng"] = ShardedObject("rng_state", None, (1, 2), (0, rank % 2), replica_id=rank // 2)
    loader = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt), exchange_algo=algo)
    out = distckpt.load(sd, ckpt, sharded_strategy=loader)
    wrong = [n for n, p in pieces.items() if not layouts.bitwise_equal(out[n], p.expected())]
    if out["rng"]["name"] != f"obj{rank % 2}":
        wrong.append("rng")
    return wrong


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
@pytest.mark.parametrize(
    "layout,save_params,load_params",
    [
        ("tp_dp", {"tp": 2}, {"tp": 2}),
        ("flat_optimizer", {"tp": 2}, {"tp": 2, "flat": False}),  # flattened ranges -> DP replicas
        ("stacked", {"pp": 2, "per_layer": True}, {"pp": 2, "per_layer": False}),
    ],
    ids=["tp_dp", "flat_to_replicated", "stacked"],
)
def test_both_wrappers_round_trip_any_backend(backend, algo, layout, save_params, load_params, tmp_path):
    results = run_ranks(
        WORLD,
        _round_trip_through_both_wrappers,
        str(tmp_path),
        backend,
        algo,
        layout,
        save_params,
        load_params,
        timeout=TIMEOUT,
    )
    assert results == [[]] * WORLD


def test_load_wrapper_delegates_queries_and_checks(tmp_path):
    inner = TorchDistLoadShardedStrategy()
    wrapper = FullyParallelLoadStrategyWrapper(inner)
    distckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}, tmp_path)
    assert set(wrapper.load_tensors_metadata(tmp_path)) == {"a"}
    assert set(wrapper.load_sharded_metadata(tmp_path)) == {"a"}
    with pytest.raises(CheckpointingException, match="cannot load a 'zarr' checkpoint"):
        wrapper.check_backend_compatibility("zarr")
    with pytest.raises(CheckpointingException, match="newer"):
        wrapper.check_version_compatibility(2)
    out = distckpt.load(
        {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4))}, tmp_path, sharded_strategy=wrapper
    )
    assert torch.equal(out["a"], torch.arange(4.0))
    with pytest.raises(CheckpointingException, match="unknown exchange_algo"):
        FullyParallelLoadStrategyWrapper(inner, exchange_algo="telepathy")


# --------------------------------------------------------------------------- CUDA (own processes)


def _cuda_worker(rank, world, backend, init_file, ckpt, algo, results):
    """One rank of a CUDA test: every rank asks for all of every tensor, into CUDA targets."""
    import traceback

    import torch.distributed as tdist

    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        tdist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            sd = _big(rank, with_data=False, tp=1)
            for sh in sd.values():
                sh.data = sh.data.cuda()
            wrapper = FullyParallelLoadStrategyWrapper(CountingLoadStrategy(), exchange_algo=algo)
            out = distckpt.load(sd, ckpt, sharded_strategy=wrapper)
            want = _big(rank, tp=1)
            ok = all(out[k].is_cuda and torch.equal(out[k].cpu(), want[k].data) for k in want)
            results.put((rank, ok, wrapper.base_strategy.bytes_requested))
        finally:
            tdist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc(), 0))


def _run_cuda(world, backend, tmp_path, algo):
    """Spawn ``world`` ranks of our own (the rank pool hides CUDA); return (rank, ok, bytes read)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_cuda_worker,
            args=(
                r,
                world,
                backend,
                str(tmp_path / f"store_{backend}_{algo}"),
                str(tmp_path / "ckpt"),
                algo,
                results,
            ),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        out = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_gloo_exchange_fills_cuda_targets(algo, tmp_path):
    run_ranks(WORLD, _save_plain, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    out = _run_cuda(2, "gloo", tmp_path, algo)  # both ranks may share one GPU with gloo
    assert [ok for _, ok, _ in out] == [True] * 2, out
    assert sum(b for _, _, b in out) == 8 * 64 * 256 * 4


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_nccl_exchange_goes_through_cuda_buffers(algo, tmp_path):
    world = min(WORLD, torch.cuda.device_count())
    if world < 2:
        pytest.skip("NCCL needs one GPU per rank; fewer than 2 GPUs")
    run_ranks(WORLD, _save_plain, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    out = _run_cuda(world, "nccl", tmp_path, algo)
    assert [ok for _, ok, _ in out] == [True] * world, out
    assert sum(b for _, _, b in out) == 8 * 64 * 256 * 4
