"""The names Megatron-Core and Megatron-LM import from ``megatron.core.dist_checkpointing``, under
the same module paths in distckpt, each doing its job; and the behaviours where Megatron-Core's
own tests found distckpt different (issue #38). Distributed behaviour runs on real gloo ranks.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor
from distckpt import dist as ddist
from distckpt.strategies.base import LoadShardedStrategy, SaveShardedStrategy
from distckpt.strategies.torch import TorchDistLoadShardedStrategy
from tests.support.harness import expect_all_ranks_raise

WORLD = 2
TIMEOUT = 90
ROOT = Path(__file__).resolve().parents[2]

# Every name api_gap.py found missing before issue #38: (distckpt module, attribute).
MEGATRON_NAMES = [
    ("distckpt.exchange_utils", "_get_empty_tensor_for_exchange"),
    ("distckpt.exchange_utils", "distribute_shards_to_ranks"),
    ("distckpt.optimizer", "KEEP_VARS_HINT"),
    ("distckpt.strategies.checkpointable", "CheckpointableShardedTensor"),
    ("distckpt.strategies.checkpointable", "LocalShardsContainer"),
    ("distckpt.strategies.filesystem_async", "FileSystemWriterAsync"),
    ("distckpt.strategies.filesystem_async", "_results_queue"),
    ("distckpt.strategies.fully_parallel", "_sharded_tensor_shard_id"),
    ("distckpt.strategies.torch", "MCoreLoadPlanner"),
    ("distckpt.tensor_aware_state_dict", "MCoreTensorAwareStateDict"),
    ("distckpt.utils", "_clean_metadata_for_serialization"),
]


def _row(rank: int, world: int, value: float = 0.0) -> ShardedTensor:
    """Rank ``rank``'s row of a (world, 4) tensor ``w`` filled with ``rank + value``."""
    return ShardedTensor.from_rank_offsets("w", torch.full((1, 4), rank + value), (0, rank, world))


# --------------------------------------------------------------------------- names and imports


@pytest.mark.parametrize("module,name", MEGATRON_NAMES, ids=[f"{m}.{n}" for m, n in MEGATRON_NAMES])
def test_every_name_megatron_imports_is_there(module, name):
    assert hasattr(importlib.import_module(module), name)


_ALIAS_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import distckpt
    alias = "megatron.core.dist_checkpointing"
    names = ["distckpt"] + [m.name for m in pkgutil.walk_packages(distckpt.__path__, "distckpt.")
                            if not m.name.endswith("__main__")]
    for name in names:
        sys.modules[alias + name[len("distckpt"):]] = importlib.import_module(name)
    import megatron.core
    megatron.core.dist_checkpointing = sys.modules[alias]
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.dist_checkpointing.optimizer import KEEP_VARS_HINT
    assert distrib_optimizer.KEEP_VARS_HINT is KEEP_VARS_HINT
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa
    assert fsa.FileSystemWriterAsync.__module__ == "distckpt.strategies.filesystem_async"
    print("imported")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="needs the megatron extra")
def test_megatron_core_optimizer_imports_with_distckpt_in_place():
    """Megatron-Core's distributed optimizer imports ``KEEP_VARS_HINT`` at import time: with
    distckpt registered under Megatron's module names (nothing of Megatron's dist_checkpointing
    loaded), it imports."""
    done = subprocess.run(
        [sys.executable, "-c", _ALIAS_SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]


def test_keep_vars_hint_explains_the_missing_parameters(caplog):
    from distckpt.optimizer import KEEP_VARS_HINT, get_param_id_to_sharded_param_map

    assert "keep_vars=True" in KEEP_VARS_HINT
    param = torch.nn.Parameter(torch.ones(2))
    copy = param.detach().clone()  # what state_dict() without keep_vars hands out
    with caplog.at_level(logging.WARNING):
        found = get_param_id_to_sharded_param_map({"p": ShardedTensor.from_rank_offsets("p", copy)}, [param])
    assert found == {}
    assert KEEP_VARS_HINT in caplog.text


def test_clean_metadata_for_serialization_drops_the_process_group_only():
    from distckpt.utils import _clean_metadata_for_serialization

    meta = {"dp_cp_group": object(), "distrib_optim_sharding_type": "dp_reshardable"}
    clean = _clean_metadata_for_serialization(meta)
    assert clean == {"distrib_optim_sharding_type": "dp_reshardable"}
    assert "dp_cp_group" in meta  # the caller's dict is untouched
    assert _clean_metadata_for_serialization(None) is None


def test_shard_id_is_equal_for_replicas_and_differs_between_pieces():
    from distckpt.strategies.fully_parallel import _sharded_tensor_shard_id

    a0 = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 0, 2), replica_id=0)
    a1 = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 0, 2), replica_id=1)
    b = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 1, 2))
    assert _sharded_tensor_shard_id(a0) == _sharded_tensor_shard_id(a1) == ("w", (0, 0), None)
    assert _sharded_tensor_shard_id(b) != _sharded_tensor_shard_id(a0)


def test_distribute_shards_to_ranks_takes_megatrons_order():
    from distckpt.exchange_utils import distribute_shards_to_ranks

    # 'rare' (one holder) goes first, so rank 1 is busy when 'big' is placed: 'big' goes to rank 0
    # although it is larger; 'cross' (a cross-group load) is placed last, on the least loaded rank.
    holders = {"big": [0, 1], "rare": [1], "small": [0, 1], "cross": [0, 1]}
    sizes = {"big": 100, "rare": 10, "small": 5, "cross": 1000}
    got = distribute_shards_to_ranks(holders, sizes, 2, {"cross"})
    assert got == {"rare": 1, "big": 0, "small": 1, "cross": 1}
    assert distribute_shards_to_ranks({"x": [0, 1]}, {"x": 1}, 2) == {"x": 0}


def _exchange(counting: bool):
    import distckpt.exchange_utils as ex

    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((3,), float(i)), replica_id=rank)
        for i in range(4)
    }
    distribution = ex.determine_main_replica_uniform_distribution(sd, None, ignore_groups=True)
    loaded, unloaded = {}, {}
    for sh in sd.values():
        sid = ex.sharded_tensor_shard_id(sh)
        if distribution.main_rank_for_shard[sid] == rank:
            loaded[sid] = sh.data.clone()
        else:
            unloaded[sid] = sh
    allocations = []
    real = ex._get_empty_tensor_for_exchange

    def counted(*args, **kwargs):
        allocations.append(args[0])
        return real(*args, **kwargs)

    with mock.patch.object(ex, "_get_empty_tensor_for_exchange", counted if counting else real):
        out = ex.exchange_by_distribution(loaded, unloaded, distribution, None, "broadcast")
    values = {sid[0]: out[sid].tolist() for sid in out}
    return len(loaded), len(allocations), values, world


def test_exchange_moves_each_shard_from_its_loader_and_the_buffer_hook_is_patchable(run_ranks):
    results = run_ranks(WORLD, _exchange, True, timeout=TIMEOUT)
    assert sum(r[0] for r in results) == 4  # each shard loaded by exactly one rank
    for n_loaded, n_alloc, values, _world in results:
        assert values == {f"t{i}": [float(i)] * 3 for i in range(4)}
        assert n_alloc == 4 - n_loaded  # one receive buffer per shard loaded elsewhere


def _checkpointable_round_trip(ckpt: str):
    from distckpt.strategies.checkpointable import CheckpointableShardedTensor, LocalShardsContainer

    rank, world = ddist.get_rank(), ddist.get_world_size()

    def state(value: float):
        first = ShardedTensor.from_rank_offsets("x", torch.full((3,), rank + value), (0, rank, 2 * world))
        second = ShardedTensor.from_rank_offsets(
            "x", torch.full((3,), rank + value), (0, world + rank, 2 * world)
        )
        one = CheckpointableShardedTensor.from_sh_ten(_row(rank, world, value))
        many = LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(s) for s in (first, second)])
        return {"w": one, "x": many}

    dcp.save(state(3.0), checkpoint_id=ckpt)
    back = state(9.0)
    dcp.load(back, checkpoint_id=ckpt)
    mine = back["w"]._sh_ten.data.tolist(), [s._sh_ten.data.tolist() for s in back["x"]._local_shards]
    ddist.barrier()
    # distckpt reads the same directory (a plain DCP checkpoint) with its own load.
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(world, 4), replica_id=rank)
    full = distckpt.load({"w": whole}, ckpt)["w"]
    return mine, full.tolist()


def test_checkpointable_shards_save_and_load_with_plain_dcp(run_ranks, tmp_path):
    results = run_ranks(WORLD, _checkpointable_round_trip, str(tmp_path / "c"), timeout=TIMEOUT)
    for rank, ((w, x), full) in enumerate(results):
        assert w == [[rank + 3.0] * 4]
        assert x == [[rank + 3.0] * 3, [rank + 3.0] * 3]
        assert full == [[3.0] * 4, [4.0] * 4]


def test_filesystem_writer_async_writes_through_its_patchable_hook(tmp_path):
    from distckpt.strategies import filesystem_async as fsa

    state = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    dcp.save(state, storage_writer=fsa.FileSystemWriterAsync(tmp_path / "ok", thread_count=2))
    back = {"a": torch.zeros(6), "b": torch.zeros(2, 2)}
    dcp.load(back, checkpoint_id=tmp_path / "ok")
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
    assert fsa._get_write_results_queue() is fsa._get_write_results_queue()

    buckets = []

    def failing(transforms, idx, bucket, results_queue, count_queue, use_fsync, **kwargs):
        buckets.append(idx)
        results_queue.put((idx, OSError("injected")))
        count_queue.get()
        count_queue.task_done()

    with mock.patch.object(fsa.FileSystemWriterAsync, "write_preloaded_data", staticmethod(failing)):
        with pytest.raises(dcp.CheckpointException, match="Worker failure"):
            dcp.save(state, storage_writer=fsa.FileSystemWriterAsync(tmp_path / "bad", thread_count=2))
    assert sorted(buckets) == [0, 1]
    assert not (tmp_path / "bad" / ".metadata").exists()


def _failing_async_save(ckpt: str):
    """distckpt's way to inject a writer failure: wrap the request's background write. A finalize
    fn added after distckpt's (as Megatron-LM adds its tracker update) must not run."""
    from distckpt.strategies.async_utils import AsyncCallsQueue

    rank, world = ddist.get_rank(), ddist.get_world_size()
    request = distckpt.save({"w": _row(rank, world)}, ckpt, async_sharded_save=True)
    if rank == 1:
        write = request.async_fn

        def failing(*args):
            write(*args)
            raise OSError("injected writer failure")

        request.async_fn = failing
    request.add_finalize_fn(lambda: Path(f"{ckpt}.tracker_{rank}").write_text("1"))
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as e:
        left = queue.get_num_unfinalized_calls()
        queue.close()
        raise CheckpointingException(f"{type(e).__name__} ({left} left): {e}") from e


def test_distckpts_writer_failure_is_injected_through_the_request(run_ranks, tmp_path):
    expect_all_ranks_raise(
        WORLD,
        _failing_async_save,
        str(tmp_path / "c"),
        match=r"RankErrors \(0 left\): async save \(call 0\) failed on rank\(s\) 1: "
        r"OSError: injected writer failure",
    )
    assert not distckpt.check_is_distributed_checkpoint(tmp_path / "c")
    assert not (tmp_path / "c" / "metadata.json").exists()
    assert not list(tmp_path.glob("c.tracker_*"))  # the chain stopped at distckpt's commit


class _LocalSaveFailed(Exception):
    """The request owner's own exception (NVRx's local manager raises its CheckpointingException)."""


def _foreign_request_fails_as_in_megatron(tmp: str):
    """A request built outside distckpt, as NVRx's local checkpoint manager builds one for
    Megatron-LM: rank 1's write raises; the finalize fn finds the save incomplete with a collective,
    cleans up and raises the owner's exception, which Megatron-LM's caller expects."""
    from distckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest

    rank = ddist.get_rank()
    piece = Path(tmp) / f"iter_1_{rank}.pt"

    def write():
        if rank == 1:
            raise Exception("TEST")
        piece.write_bytes(b"x")

    def finalize():
        complete = [None] * ddist.get_world_size()
        torch.distributed.all_gather_object(complete, piece.exists())
        if not all(complete):
            piece.unlink(missing_ok=True)
            raise _LocalSaveFailed("Failure during saving local checkpoint from iteration 1")

    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(write, (), [finalize]))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except _LocalSaveFailed as e:
        return f"{e} (context: {e.__context__})", piece.exists(), queue.get_num_unfinalized_calls()
    finally:
        queue.close()
    return None


def test_a_foreign_requests_finalize_fns_run_after_its_write_failed_as_megatron_does(run_ranks, tmp_path):
    results = run_ranks(WORLD, _foreign_request_fails_as_in_megatron, str(tmp_path))
    for message, piece_left, calls_left in results:
        assert message.startswith("Failure during saving local checkpoint from iteration 1 (context: ")
        assert "async save (call 0) failed on rank(s) 1: Exception: TEST" in message
        assert (piece_left, calls_left) == (False, 0)


def test_mcore_load_planner_checks_global_shapes_with_plain_dcp(tmp_path):
    from distckpt.strategies.torch import MCoreLoadPlanner

    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0).reshape(2, 4))}, tmp_path)
    right = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4))
    wrong = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 5))
    out = {"w": torch.zeros(2, 4)}
    dcp.load(out, checkpoint_id=tmp_path, planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[right]))
    assert torch.equal(out["w"], torch.arange(8.0).reshape(2, 4))
    with pytest.raises(BaseException, match="Global shape mismatch.*key w"):
        dcp.load(
            out, checkpoint_id=tmp_path, planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[wrong])
        )


def _reads_seen(ckpt: str):
    """distckpt's equivalent of patching MCoreLoadPlanner.create_local_plan: LoadPlan.add."""
    from distckpt.strategies.torch_dist.loadplan import LoadPlan

    rank, world = ddist.get_rank(), ddist.get_world_size()
    distckpt.save({"w": _row(rank, world)}, ckpt)
    seen = []
    real = LoadPlan.add

    def recording(self, stored, op):
        seen.append(stored.relative_path)
        return real(self, stored, op)

    with mock.patch.object(LoadPlan, "add", recording):
        whole = ShardedTensor.from_rank_offsets("w", torch.zeros(world, 4), replica_id=rank)
        distckpt.load({"w": whole}, ckpt)
    return sorted(set(seen))


def test_who_reads_what_is_observed_at_the_load_plan(run_ranks, tmp_path):
    results = run_ranks(WORLD, _reads_seen, str(tmp_path / "c"), timeout=TIMEOUT)
    for files in results:  # every rank asked for the whole tensor: it reads both ranks' files
        assert len(files) == 2 and all(f.endswith(".distcp") for f in files)


# --------------------------------------------------------------------------- MCoreTensorAwareStateDict


def _tensor_aware(algo: str, strict: str):
    from distckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict

    rank, world = ddist.get_rank(), ddist.get_world_size()

    def state(value: float, extra: bool = False):
        sd = {
            "w": _row(rank, world, value),
            "rep": ShardedTensor.from_rank_offsets("rep", torch.full((2,), 7.0 + value), replica_id=rank),
            "obj": ShardedObject("obj", {"v": 1}, (1,), (0,), replica_id=rank),
            "step": 5,
        }
        if extra:
            sd["nope"] = ShardedTensor.from_rank_offsets("nope", torch.zeros(1), replica_id=rank)
        return sd

    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state(0.0), algo)
    kept = len(list(tasd.tensors))
    popped = tasd.pop_tensors()
    assert tasd.is_hollow
    tasd.insert_tensors([t.clone() for t in popped])
    request = state(100.0, extra=strict != "assume_ok_unexpected")
    if strict == "assume_ok_unexpected":
        out = tasd.to_state_dict(request, algo=algo)
        return kept, out["w"].tolist(), out["rep"].tolist(), out["obj"], out["step"]
    out, missing, unexpected = tasd.to_state_dict(
        request, algo=algo, strict=strict, return_mismatch_keys=True
    )
    return sorted(missing), sorted(unexpected), "nope" in out


def _tensor_aware_missing_key():
    from distckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict

    rank, world = ddist.get_rank(), ddist.get_world_size()
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict({"w": _row(rank, world, 1.0)}, "atomic")
    nope = ShardedTensor.from_rank_offsets("nope", torch.zeros(1), replica_id=rank)
    request = {"w": _row(rank, world, 0.0), "nope": nope}
    try:
        tasd.to_state_dict(request)
    except AssertionError as e:
        return (
            type(e).__name__,
            isinstance(e, distckpt.CheckpointingException),
            "'nope'" in str(e),
            f"rank {rank}" in str(e),
        )
    return None


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_tensor_aware_state_dict_round_trips(run_ranks, algo):
    results = run_ranks(WORLD, _tensor_aware, algo, "assume_ok_unexpected", timeout=TIMEOUT)
    kept = sorted(r[0] for r in results)
    # fully parallel: the replicated 'rep' is kept by one rank only, and comes back to both
    assert kept == ([2, 2] if algo == "atomic" else [1, 2])
    for rank, (_, w, rep, obj, step) in enumerate(results):
        assert w == [[float(rank)] * 4] and rep == [7.0, 7.0] and obj == {"v": 1} and step == 5


def _tensor_aware_mismatch(strict: str, ask_extra: bool):
    """A container holding "w" and "old"; the request drops "old" and, with ``ask_extra``, asks
    for "nope" too. Returns (missing, unexpected, loaded w) or the error's type and key named."""
    from distckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict

    rank, world = ddist.get_rank(), ddist.get_world_size()
    old = ShardedTensor.from_rank_offsets("old", torch.ones(1), replica_id=rank)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict({"w": _row(rank, world, 1.0), "old": old}, "atomic")
    request = {"w": _row(rank, world, 0.0)}
    if ask_extra:
        request["nope"] = ShardedTensor.from_rank_offsets("nope", torch.zeros(1), replica_id=rank)
    try:
        out, missing, unexpected = tasd.to_state_dict(request, strict=strict, return_mismatch_keys=True)
    except AssertionError as e:
        return type(e).__name__, "'nope'" in str(e)
    return sorted(missing), sorted(unexpected), out["w"].tolist()


def test_tensor_aware_state_dict_reports_mismatched_keys(run_ranks):
    # A stored key nobody asks for is reported; a requested key the container lacks is never
    # skipped: every non-raising mode fails the fill on every rank, as Megatron-Core's does.
    results = run_ranks(WORLD, _tensor_aware_mismatch, "return_all", False, timeout=TIMEOUT)
    assert results == [(["old"], [], [[rank + 1.0] * 4]) for rank in range(WORLD)]
    for mode in ("return_all", "log_unexpected", "ignore_all"):
        results = run_ranks(WORLD, _tensor_aware_mismatch, mode, True, timeout=TIMEOUT)
        assert results == [("LocalShardMissingError", True)] * WORLD, mode
    expect_all_ranks_raise(WORLD, _tensor_aware, "atomic", "raise_all", match="Unexpected keys.*nope")


def test_tensor_aware_state_dict_under_assume_ok_fails_a_key_it_lacks_as_megatron_does(run_ranks):
    # No key check in this mode: the fill meets the absent key and every rank raises one error
    # that is ours and also the AssertionError Megatron-Core's container raises there.
    failures = run_ranks(WORLD, _tensor_aware_missing_key, timeout=TIMEOUT)
    assert failures == [("LocalShardMissingError", True, True, True)] * WORLD


# --------------------------------------------------------------------------- behaviour rows


def test_has_regular_grid():
    assert ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 0, 2)).has_regular_grid
    irregular = ShardedTensor("w", torch.ones(3), torch.float32, (3,), (5,), (0,), None)
    assert not irregular.has_regular_grid


def test_content_metadata_from_a_preloaded_common_state(tmp_path):
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "it": 3}
    distckpt.save(sd, tmp_path, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    common = distckpt.load_common_state_dict(tmp_path)
    assert common["it"] == 3
    want = {"distrib_optim_sharding_type": "dp_reshardable"}
    assert distckpt.load_content_metadata(preloaded_state_dict=common) == want
    loaded = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path)
    assert distckpt.load_content_metadata(preloaded_state_dict=loaded) == want
    assert distckpt.load_content_metadata(tmp_path) == want
    with pytest.raises(CheckpointingException, match="checkpoint_dir or a preloaded_state_dict"):
        distckpt.load_content_metadata()


class _WrappingLoad(LoadShardedStrategy):
    """A strategy written for Megatron-Core: its base class is built with no arguments."""

    def __init__(self):
        super().__init__()
        self.inner = TorchDistLoadShardedStrategy()
        self.calls = 0

    def load(self, sharded_state_dict, checkpoint_dir):
        self.calls += 1
        return self.inner.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir):
        return self.inner.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.inner.load_sharded_metadata(checkpoint_dir)


class _NoArgSave(SaveShardedStrategy):
    def __init__(self):
        super().__init__()

    def save(self, sharded_state_dict, checkpoint_dir):
        raise AssertionError("not used")


def test_strategies_build_with_no_arguments_and_load(tmp_path):
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(3.0))}, tmp_path)
    strategy = _WrappingLoad()
    assert strategy.backend is None and strategy.version is None
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3))}, tmp_path, strategy)
    assert strategy.calls == 1 and torch.equal(out["w"], torch.arange(3.0))
    assert _NoArgSave().backend is None
    # a strategy that names its backend still refuses another backend's checkpoint
    named = TorchDistLoadShardedStrategy()
    with pytest.raises(CheckpointingException, match="cannot load a 'zarr' checkpoint"):
        named.check_backend_compatibility("zarr")


def _strict_load(ckpt: str, strict: str):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    distckpt.save(
        {"w": _row(rank, world), "v": ShardedTensor.from_rank_offsets("v", torch.ones(2), replica_id=rank)},
        ckpt,
    )
    request = {
        "w": _row(rank, world),
        "u": ShardedTensor.from_rank_offsets("u", torch.ones(1), replica_id=rank),
    }
    try:
        distckpt.load(request, ckpt, strict=strict)
    except BaseException as e:  # noqa: BLE001 - the test looks at its type and text
        return (
            type(e).__name__,
            isinstance(e, CheckpointingException),
            isinstance(e, dcp.CheckpointException),
            str(e),
        )
    return None


def test_strict_errors_use_megatrons_words_on_every_rank(run_ranks, tmp_path):
    results = run_ranks(WORLD, _strict_load, str(tmp_path / "c"), "raise_all", timeout=TIMEOUT)
    for result in results:
        assert result is not None and result[1]
        text = result[3]
        assert "Unexpected keys" in text and "['u']" in text
        assert "Missing keys" in text and "['v']" in text
        assert "requested but not in the checkpoint" in text  # distckpt's detail is kept after it


def test_assume_ok_unexpected_raises_dcps_type_and_ours_on_every_rank(run_ranks, tmp_path):
    results = run_ranks(WORLD, _strict_load, str(tmp_path / "c"), "assume_ok_unexpected", timeout=TIMEOUT)
    for result in results:
        assert result is not None
        name, ours, dcps, text = result
        assert ours and dcps, result
        assert "Unexpected keys" in text and "'u'" in text and "rank" in text


def _save_with_common_difference(ckpt: str):
    rank = ddist.get_rank()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    try:
        distckpt.save(
            {"w": _row(rank, ddist.get_world_size()), "rank": rank},
            ckpt,
            preprocess_common_before_consistancy_check=lambda common: common,
        )
    finally:
        logging.getLogger().removeHandler(handler)
    return [m for m in records if "common state dict differs" in m]


def test_common_state_difference_is_logged_by_the_rank_that_differs(run_ranks, tmp_path):
    r0, r1 = run_ranks(WORLD, _save_with_common_difference, str(tmp_path / "c"), timeout=TIMEOUT)
    assert r0 == []
    assert r1 == [
        "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
        "Keys only on 1: [], Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]"
    ]


def _load_from_metadata(ckpt: str):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    distckpt.save({"w": _row(rank, world, 1.0)}, ckpt)
    request = distckpt.load_tensors_metadata(ckpt)
    assert request["w"].data.is_meta
    out = distckpt.load(request, ckpt, validate_access_integrity=False)["w"]  # every rank asks for all
    return out.is_meta, out.tolist()


def test_load_of_a_metadata_request_returns_real_tensors(run_ranks, tmp_path):
    for is_meta, values in run_ranks(WORLD, _load_from_metadata, str(tmp_path / "c"), timeout=TIMEOUT):
        assert not is_meta and values == [[1.0] * 4, [2.0] * 4]
