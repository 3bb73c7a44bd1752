"""Conformance suite: every registered sharded strategy must pass these tests, on every store.

Each test saves with real gloo ranks under one parallel layout and loads under another; a new
strategy is added to BACKENDS and gets the whole suite. Tests that take the ``location`` fixture
run on a local directory and on the three clouds' servers on 127.0.0.1 (S3: moto; GCS:
fake-gcs-server; Azure Blob: Azurite; tests/conftest.py): one suite, strategy x store.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    check_is_distributed_checkpoint,
)
from distckpt import dist as ddist
from distckpt.commit import is_leftover
from distckpt.serialization import get_default_save_sharded_strategy
from distckpt.storage import open_store
from distckpt.strategies.base import SaveShardedStrategy
from tests.support import clouds, layouts
from tests.support.faults import tree_digest
from tests.support.harness import expect_all_ranks_raise, run_ranks

BACKENDS = ["torch_dist", "zarr", "torch_dcp"]  # torch_dcp: DCP's own engine, torch_dist format
STORES = ["local", "s3", "gcs", "azure"]
# DCP's engine writes through its own (local) storage writer, so it runs on local directories.
BACKEND_STORES = [(b, s) for b in BACKENDS for s in STORES if not (b == "torch_dcp" and s != "local")]


@pytest.fixture
def location(request, tmp_path):
    """Where the test's checkpoint goes, after the test's ``store`` parameter: a local directory
    or a fresh S3 / GCS / Azure prefix (a str)."""
    store = request.node.callspec.params["store"]
    if store == "local":
        return str(tmp_path)
    return request.getfixturevalue(clouds.URL_FIXTURES[store])


def _load_strategy(backend):
    """The load strategy a test of ``backend`` reads with: DCP's engine for ``torch_dcp``, the
    checkpoint's default otherwise."""
    if backend != "torch_dcp":
        return None
    from distckpt.strategies.base import StrategyAction, get_default_strategy

    return get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dcp", 1)


# --------------------------------------------------------------------------- rank functions


def _save_layout(ckpt, backend, layout, params, common=None):
    sd, _ = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), True, **params)
    if common is not None:
        sd["common"] = common
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))


def _load_layout(ckpt, layout, params, backend=None):
    sd, pieces = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), False, **params)
    loaded = distckpt.load(sd, ckpt, sharded_strategy=_load_strategy(backend))
    wrong = []
    for name, piece in pieces.items():
        got, want = loaded[name], piece.expected()
        if not layouts.bitwise_equal(got, want):
            wrong.append(name)
    return len(pieces), wrong


ROUND_TRIPS = [
    # (save layout, save world, save params, load layout, load world, load params)
    ("tp_dp", 4, {"tp": 2}, "tp_dp", 1, {"tp": 1}),  # TP2xDP2 -> TP1
    ("tp_dp", 2, {"tp": 2}, "tp_dp", 4, {"tp": 4}),  # TP2 -> TP4
    ("tp_dp", 4, {"tp": 2}, "tp_dp", 2, {"tp": 1}),  # TP2xDP2 -> TP1xDP2
    ("tp_dp", 1, {"tp": 1}, "tp_dp", 4, {"tp": 2}),
    ("grid", 4, {"rows": 2, "cols": 2}, "grid", 4, {"rows": 1, "cols": 4}),  # 2x2 grid -> 1x4
    ("grid", 4, {"rows": 2, "cols": 2}, "grid", 2, {"rows": 2, "cols": 1}),
    ("grid", 2, {"rows": 1, "cols": 2}, "grid", 1, {"rows": 1, "cols": 1}),
    ("uneven", 4, {}, "uneven", 2, {}),  # uneven with empty pieces
    ("uneven", 2, {}, "uneven", 4, {"parts": 3}),
    ("multi", 2, {}, "multi", 4, {}),  # several shards per rank
    ("multi", 4, {}, "multi", 1, {}),
    ("stacked", 2, {"pp": 2, "per_layer": True}, "stacked", 1, {"pp": 1, "per_layer": False}),
    ("stacked", 2, {"pp": 2, "per_layer": True}, "stacked", 4, {"pp": 4, "per_layer": True}),
    ("stacked", 1, {"pp": 1, "per_layer": False}, "stacked", 2, {"pp": 2, "per_layer": True}),
    ("stacked", 4, {"pp": 2, "per_layer": True}, "stacked", 4, {"pp": 3, "per_layer": True}),
    # flattened ranges (distributed-optimizer slices): other DP, other TP, flat <-> regular
    ("flat_optimizer", 4, {"tp": 2}, "flat_optimizer", 1, {"tp": 1}),
    ("flat_optimizer", 4, {"tp": 2}, "flat_optimizer", 2, {"tp": 2}),
    ("flat_optimizer", 4, {"tp": 2}, "flat_optimizer", 4, {"tp": 1}),
    ("flat_optimizer", 4, {"tp": 2, "empty": True}, "flat_optimizer", 4, {"tp": 1, "flat": False}),
    ("flat_optimizer", 4, {"tp": 2}, "flat_optimizer", 2, {"tp": 2, "flat": False}),
    ("flat_optimizer", 2, {"tp": 2, "flat": False}, "flat_optimizer", 4, {"tp": 2, "empty": True}),
    ("flat_optimizer", 1, {"tp": 1}, "flat_optimizer", 4, {"tp": 4, "flat": False}),
    ("wide", 2, {}, "wide", 4, {}),  # column blocks of chunks
    ("wide", 4, {}, "wide", 3, {}),
    ("fp8", 2, {}, "fp8", 4, {}),
    ("fp8", 4, {}, "fp8", 1, {}),
]


# On the object stores every third case runs: each layout family and flat <-> regular. On S3 all
# of them by default; on GCS and Azure every sixth (one case of each layout family) by default and
# the rest under ``slow``. DCP's engine goes through the same layouts once each (and flat <->
# regular both ways): the whole list again would add a minute to the suite for no new path.
_OBJECT_ROUND_TRIPS = set(range(0, len(ROUND_TRIPS), 3))
_OTHER_CLOUDS_DEFAULT = set(range(0, len(ROUND_TRIPS), 6))
_DCP_ROUND_TRIPS = {0, 4, 7, 9, 11, 15, 18, 20, 22, 24}


def _runs(backend, store, i):
    if store != "local":
        return i in _OBJECT_ROUND_TRIPS
    return backend != "torch_dcp" or i in _DCP_ROUND_TRIPS


def _marks(store, i):
    return pytest.mark.slow if store in ("gcs", "azure") and i not in _OTHER_CLOUDS_DEFAULT else ()


ROUND_TRIP_PARAMS = [
    pytest.param(b, st, c, id=f"{b}-{st}-{c[0]}-w{c[1]}-{c[3]}-w{c[4]}-{c[5]}", marks=_marks(st, i))
    for b, st in BACKEND_STORES
    for i, c in enumerate(ROUND_TRIPS)
    if _runs(b, st, i)
]


@pytest.mark.parametrize("backend,store,case", ROUND_TRIP_PARAMS)
def test_round_trip_reshards_bit_exactly(backend, store, case, location):
    save_layout, save_world, save_params, load_layout, load_world, load_params = case
    run_ranks(save_world, _save_layout, location, backend, save_layout, save_params)
    assert check_is_distributed_checkpoint(location)
    results = run_ranks(load_world, _load_layout, location, load_layout, load_params, backend)
    assert all(n > 0 for n, _ in results)
    assert [wrong for _, wrong in results] == [[]] * load_world


def test_save_and_load_without_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    sd, pieces = layouts.build("tp_dp", 0, 1, True, tp=1)
    distckpt.save(sd, tmp_path)
    sd, _ = layouts.build("tp_dp", 0, 1, False, tp=1)
    loaded = distckpt.load(sd, tmp_path)
    for name, piece in pieces.items():
        assert torch.equal(loaded[name], piece.expected())


# --------------------------------------------------------------------------- objects, common state


def _save_objects(ckpt, backend, replicas):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd = {
        "rng": layouts.rank_object(rank, world, True, replicas),
        "iteration": 7,
        "args": {"lr": 0.5, "layers": [1, 2]},
        "skip": LocalNonpersistentObject(object()),
    }
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))


def _load_objects(ckpt, cols):
    rank = ddist.get_rank()
    # Every rank asks for every object of the saved grid; rank 0's requests are the main replicas.
    sd = {
        f"rng{c}": ShardedObject("rng_state", None, (1, cols), (0, c), replica_id=rank) for c in range(cols)
    }
    sd["mine"] = LocalNonpersistentObject("not from disk")
    out = distckpt.load(sd, ckpt)
    return {
        k: (
            v
            if not isinstance(v, dict)
            else {kk: (vv.tolist() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
        )
        for k, v in out.items()
    }


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_objects_and_common_state_round_trip_on_another_world_size(backend, store, location):
    run_ranks(4, _save_objects, location, backend, 2)
    results = run_ranks(2, _load_objects, location, 2)
    for out in results:
        assert out["iteration"] == 7
        assert out["args"] == {"lr": 0.5, "layers": [1, 2]}
        assert out["mine"] == "not from disk"
        assert "skip" not in out
        for c in range(2):
            assert out[f"rng{c}"] == {"rank": c, "state": [10 * c, 10 * c + 1, 10 * c + 2], "name": f"obj{c}"}


def _split_factory(key, data, replica_id, flattened_range):
    half = data.shape[0] // 2
    return {
        "w": ShardedTensor.from_rank_offsets(f"{key}.w", data[:half], replica_id=replica_id),
        "v": ShardedTensor.from_rank_offsets(f"{key}.v", data[half:], replica_id=replica_id),
    }


def _merge_halves(loaded):
    return torch.cat([loaded["w"], loaded["v"]])


def _factory_round_trip(ckpt, backend):
    x = torch.arange(12.0).reshape(6, 2)
    sd = {
        "fc1": ShardedTensorFactory(
            "fc1", x.clone(), _split_factory, _merge_halves, replica_id=ddist.get_rank()
        )
    }
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))
    req = {
        "fc1": ShardedTensorFactory(
            "fc1", torch.zeros(6, 2), _split_factory, _merge_halves, replica_id=ddist.get_rank()
        )
    }
    out = distckpt.load(req, ckpt)
    separately = distckpt.load(
        {"w": ShardedTensor.from_rank_offsets("fc1.w", torch.zeros(3, 2), replica_id=ddist.get_rank())}, ckpt
    )
    return torch.equal(out["fc1"], x), torch.equal(separately["w"], x[:3])


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_factory_builds_on_save_and_merges_on_load(backend, store, location):
    assert run_ranks(2, _factory_round_trip, location, backend) == [(True, True)] * 2


def _content_metadata(ckpt, backend):
    sd, _ = layouts.build("uneven", ddist.get_rank(), ddist.get_world_size(), True)
    sd["iteration"] = 3
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1), content_metadata={"format": "v2"})
    return distckpt.load_content_metadata(ckpt), distckpt.load_common_state_dict(ckpt)


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_content_metadata_is_kept_in_the_common_state(backend, store, location):
    # As Megatron-Core does: Megatron-LM reads it back with
    # load_content_metadata(preloaded_state_dict=load_common_state_dict(dir)).
    expected = ({"format": "v2"}, {"iteration": 3, "content_metadata": {"format": "v2"}})
    assert run_ranks(2, _content_metadata, location, backend) == [expected] * 2


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_metadata_queries_describe_the_checkpoint(backend, store, location):
    run_ranks(4, _save_layout, location, backend, "tp_dp", {"tp": 2}, {"iteration": 11})
    meta = distckpt.load_tensors_metadata(location)
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items()} == {
        "col": ((8, 6), torch.float32),
        "row": ((6, 8), torch.float32),
        "emb": ((16, 4), torch.bfloat16),
        "half": ((4, 8), torch.float16),
        "bias": ((6,), torch.float32),
        "count": ((5,), torch.int64),
        "mask": ((3, 3), torch.bool),
        "steps": ((), torch.int32),
    }
    assert distckpt.load_common_state_dict(location) == {"common": {"iteration": 11}}
    plain = distckpt.load_plain_tensors(location)
    assert torch.equal(plain["row"], layouts.full_tensor("row", (6, 8)))
    assert set(distckpt.load_sharded_metadata(location)) == set(meta)


# --------------------------------------------------------------------------- strict modes


def _save_ab(ckpt, backend):
    rank = ddist.get_rank()
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.ones(2, 3) * rank, (0, rank, 2)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(4.0), replica_id=rank),
    }
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))


def _load_with_unexpected(ckpt, strict):
    rank = ddist.get_rank()
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2, 3), (0, rank, 2))}
    if rank == 1:  # only one rank asks for the absent key
        sd["c"] = ShardedTensor.from_rank_offsets("c", torch.zeros(2), replica_id=0)
    out = distckpt.load(sd, ckpt, strict=strict, validate_access_integrity=False)
    if isinstance(out, tuple):
        state, missing, unexpected = out
        return sorted(state), sorted(missing), sorted(unexpected), float(state["a"][0, 0])
    return sorted(out), None, None, float(out["a"][0, 0])


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
@pytest.mark.parametrize(
    "strict,expected_rank1",
    [
        ("log_unexpected", (["a"], None, None, 1.0)),
        ("log_all", (["a"], None, None, 1.0)),
        ("ignore_all", (["a"], None, None, 1.0)),
        ("return_unexpected", (["a"], [], ["c"], 1.0)),
        ("return_all", (["a"], ["b"], ["c"], 1.0)),
    ],
)
def test_strict_modes_that_skip_the_absent_key(backend, store, strict, expected_rank1, location):
    run_ranks(2, _save_ab, location, backend)
    results = run_ranks(2, _load_with_unexpected, location, strict)
    assert results[1] == expected_rank1
    assert results[0][0] == ["a"] and results[0][3] == 0.0


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
@pytest.mark.parametrize(
    "strict,match",
    [
        ("assume_ok_unexpected", r"'c' is not in checkpoint"),
        ("raise_unexpected", r"requested but not in the checkpoint: \['c'\]"),
        ("raise_all", r"requested but not in the checkpoint: \['c'\].*not requested by any rank: \['b'\]"),
    ],
)
def test_strict_modes_that_raise_do_so_on_every_rank(backend, store, strict, match, location):
    run_ranks(2, _save_ab, location, backend)
    expect_all_ranks_raise(2, _load_with_unexpected, location, strict, match=match)


def test_unknown_strict_mode_is_a_clear_error(tmp_path):
    run_ranks(1, _save_ab_single, str(tmp_path))
    with pytest.raises(distckpt.CheckpointingException, match="unknown strict mode 'sloppy'"):
        distckpt.load({}, tmp_path, strict="sloppy")


def _save_ab_single(ckpt):
    distckpt.save({"b": ShardedTensor.from_rank_offsets("b", torch.arange(4.0))}, ckpt)


def test_log_unexpected_names_the_key_in_the_log(tmp_path, caplog):
    distckpt.save({"b": ShardedTensor.from_rank_offsets("b", torch.arange(4.0))}, tmp_path)
    req = {
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(4)),
        "zz": ShardedTensor.from_rank_offsets("zz", torch.zeros(4)),
    }
    with caplog.at_level(logging.WARNING):
        out = distckpt.load(req, tmp_path, strict="log_unexpected")
    assert "zz" in caplog.text and set(out) == {"b"}


# --------------------------------------------------------------------------- bad input


def _save_bad(ckpt, backend, problem):
    rank = ddist.get_rank()
    shape, dtype = (4, 3), torch.float32
    offset = (2 * rank, 0)
    replica = 0
    if problem == "overlap":
        offset = (0, 0)  # both ranks write rows 0:2 as main replicas
    elif problem == "gap" and rank == 1:
        replica = 1  # rows 2:4 have no main replica
    elif problem == "dtype" and rank == 1:
        dtype = torch.float16
    elif problem == "shape" and rank == 1:
        shape = (5, 3)
    data = torch.ones(2, 3, dtype=dtype)
    sh = ShardedTensor("w", data, dtype, (2, 3), shape, offset, None, replica)
    distckpt.save({"w": sh}, ckpt, sharded_strategy=(backend, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "problem,match",
    [
        ("overlap", r"'w': main replicas overlap at global region \[0:2, 0:3\]"),
        ("gap", r"'w': global region \[2:4, 0:3\] of shape \[4, 3\] is not covered"),
        ("dtype", r"'w': ranks disagree on the dtype"),
        ("shape", r"'w': ranks disagree on the global shape"),
    ],
)
def test_invalid_sharding_fails_on_every_rank_and_writes_nothing(backend, problem, match, tmp_path):
    expect_all_ranks_raise(2, _save_bad, str(tmp_path), backend, problem, match=match)
    assert not check_is_distributed_checkpoint(tmp_path)
    assert not any(p.suffix in (".distcp", ".pt") for p in tmp_path.rglob("*"))


def _save_with_unknown_strategy(ckpt):
    distckpt.save(
        {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), replica_id=ddist.get_rank())},
        ckpt,
        sharded_strategy=("no_such_backend", 1),
    )


def test_unknown_strategy_lists_the_registered_ones_on_every_rank(tmp_path):
    expect_all_ranks_raise(
        2,
        _save_with_unknown_strategy,
        str(tmp_path),
        match=r"no save_sharded strategy registered for backend 'no_such_backend'.*torch_dist v1",
    )


def _load_from(path):
    distckpt.load(
        {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), replica_id=ddist.get_rank())}, path
    )


def test_missing_directory_is_a_clear_error_on_every_rank(tmp_path):
    expect_all_ranks_raise(2, _load_from, str(tmp_path / "nope"), match=r"nope does not exist")


def test_directory_that_is_not_a_checkpoint_is_a_clear_error_on_every_rank(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    expect_all_ranks_raise(2, _load_from, str(tmp_path), match=r"is not a distributed checkpoint")


# --------------------------------------------------------------------------- interrupted save


class _FailAfterWrite(SaveShardedStrategy):
    """Writes with the real strategy, then fails on one rank before the commit."""

    def __init__(self, backend, fail_rank):
        inner = get_default_save_sharded_strategy(backend)
        super().__init__(inner.backend, inner.version)
        self.inner, self.fail_rank = inner, fail_rank

    @property
    def can_handle_sharded_objects(self):
        return self.inner.can_handle_sharded_objects

    def save(self, sharded_state_dict, checkpoint_dir):
        self.inner.save(sharded_state_dict, checkpoint_dir)
        if ddist.get_rank() == self.fail_rank:
            raise RuntimeError("injected failure after the data files were written")


def _interrupted_save(ckpt, backend):
    sd, _ = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    distckpt.save(sd, ckpt, sharded_strategy=_FailAfterWrite(backend, fail_rank=1), overwrite=True)


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
@pytest.mark.parametrize("over_existing", [False, True])
def test_interrupted_save_is_never_taken_as_a_checkpoint(backend, store, over_existing, location):
    """A file system keeps the previous checkpoint bit-exact and drops the staging tree; an object
    store (overwrite=True) keeps the previous checkpoint too (the overwrite wrote under names of
    its own), and a fresh prefix's objects stay uncommitted, never a checkpoint."""
    before = None
    if over_existing:
        run_ranks(2, _save_layout, location, backend, "tp_dp", {"tp": 2})
        assert check_is_distributed_checkpoint(location)
        before = tree_digest(Path(location)) if store == "local" else None
    expect_all_ranks_raise(
        2, _interrupted_save, location, backend, match="injected failure after the data files were written"
    )
    if store != "local":
        assert open_store(location).list(), "data files were written before the failure"
    else:
        target = Path(location)
        assert [
            p.name
            for p in target.parent.iterdir()
            if is_leftover(p) and p.name.startswith(f".{target.name}.")
        ] == []  # staging dropped
    if over_existing:
        if before is not None:
            assert tree_digest(Path(location)) == before
        assert [wrong for _, wrong in run_ranks(2, _load_layout, location, "tp_dp", {"tp": 2})] == [[], []]
        return
    assert not check_is_distributed_checkpoint(location)
    expect_all_ranks_raise(2, _load_from, location, match="is not a distributed checkpoint")


# --------------------------------------------------------------------------- targets and shapes


def _fp8_subclass_round_trip(ckpt, backend):
    from tests.support.fp8_tensor import ScaledFp8Tensor

    rank = ddist.get_rank()
    values = layouts.full_tensor("fp8sub", (4, 6))[2 * rank : 2 * rank + 2]
    original = ScaledFp8Tensor.quantize(values, scale=0.5)
    sd = {"w": ShardedTensor.from_rank_offsets("w", original, (0, rank, 2))}
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))
    target = ScaledFp8Tensor(torch.zeros(2, 6, dtype=torch.uint8), scale=0.5)
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", target, (0, rank, 2))}, ckpt)
    return (
        out["w"] is target,
        type(out["w"]).__name__,
        torch.equal(target.payload, original.payload),
        int(target.payload.sum()) > 0,
    )


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_fp8_subclass_target_is_filled_in_place_not_replaced(backend, store, location):
    assert (
        run_ranks(2, _fp8_subclass_round_trip, location, backend)
        == [(True, "ScaledFp8Tensor", True, True)] * 2
    )


def _load_into_transposed_view(ckpt, backend):
    full = layouts.full_tensor("tv", (4, 6))
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, ckpt, sharded_strategy=(backend, 1))
    base = torch.zeros(6, 4)
    target = base.t()  # non-contiguous (4, 6) view of base
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, ckpt)
    return out["w"] is target and torch.equal(base.t(), full)


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_non_contiguous_target_is_filled_through_a_staging_copy(backend, store, location):
    assert run_ranks(1, _load_into_transposed_view, location, backend) == [True]


def _load_with_a_bad_request(ckpt, world):
    """Save a (world x 6) tensor, one row per rank; then load with every rank asking for its row
    but rank 1 asking for rank 0's (two main replicas of row 0, no one asks for row 1). Returns
    this rank's calls of the global check: how many, with how many ranks' tables."""
    from distckpt import loading

    rank = ddist.get_rank()
    full = layouts.full_tensor("bad", (world, 6))
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", full[rank : rank + 1].clone(), (0, rank, world))}, ckpt
    )
    seen = []
    check = loading.validate_global_integrity

    def spy(tables):
        seen.append(len(tables))
        return check(tables)

    loading.validate_global_integrity = spy
    try:
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1, 6), (0, rank, world))}, ckpt)
        row = 0 if rank == 1 else rank
        bad = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1, 6), (0, row, world))}
        try:
            distckpt.load(bad, ckpt)
        except distckpt.CheckpointingException as e:
            return seen, str(e)
        return seen, "loaded"
    finally:
        loading.validate_global_integrity = check


def test_a_bad_load_request_is_checked_on_rank_0_and_raised_on_every_rank(tmp_path):
    """The requests of all ranks are checked once, on rank 0, which alone receives the ranks'
    shard tables (at 16k ranks, every rank receiving every table would be gigabytes each); the
    verdict reaches every rank before anything is read."""
    results = run_ranks(3, _load_with_a_bad_request, str(tmp_path), 3)
    assert [seen for seen, _ in results] == [[3, 3], [], []]
    for _, message in results:
        assert (
            "load preparation failed on rank(s) 0" in message and "'w': main replicas overlap" in message
        ), message


def _load_other_shape(ckpt, backend, rows, allow):
    rank = ddist.get_rank()
    full = layouts.full_tensor("sm", (4, 6))
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", full[2 * rank : 2 * rank + 2].clone(), (0, rank, 2))},
        ckpt,
        sharded_strategy=(backend, 1),
    )
    local = rows // 2
    sh = ShardedTensor.from_rank_offsets(
        "w", torch.full((local, 6), 7.0), (0, rank, 2), allow_shape_mismatch=allow
    )
    out = distckpt.load({"w": sh}, ckpt)["w"]
    want = torch.zeros(rows, 6)
    n = min(rows, 4)
    want[:n] = full[:n]
    return torch.equal(out, want[rank * local : (rank + 1) * local])


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
@pytest.mark.parametrize("rows", [2, 6])
def test_allow_shape_mismatch_loads_the_overlap_and_zeroes_the_rest(backend, store, rows, location):
    assert run_ranks(2, _load_other_shape, location, backend, rows, True) == [True, True]


@pytest.mark.parametrize("backend,store", BACKEND_STORES)
def test_global_shape_mismatch_names_key_and_both_shapes_on_every_rank(backend, store, location):
    expect_all_ranks_raise(
        2,
        _load_other_shape,
        location,
        backend,
        6,
        False,
        match=r"'w': global shape \[6, 6\] was requested but the checkpoint stores \[4, 6\]",
    )


# --------------------------------------------------------------------------- async save


def _async_save_then_mutate(ckpt, backend):
    from distckpt.strategies.async_utils import AsyncCallsQueue

    sd, pieces = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    queue = AsyncCallsQueue()
    request = distckpt.save(sd, ckpt, sharded_strategy=(backend, 1), async_sharded_save=True)
    for sh in sd.values():  # training goes on and changes the parameters in place
        sh.data.fill_(0) if sh.data.dtype != torch.bool else sh.data.logical_not_()
    committed_before = check_is_distributed_checkpoint(ckpt)
    queue.schedule_async_request(request)
    queue.close()
    return committed_before, check_is_distributed_checkpoint(ckpt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save_holds_the_values_at_save_time(backend, tmp_path):
    from distckpt.strategies.base import AsyncSaveShardedStrategy

    if not isinstance(get_default_save_sharded_strategy(backend), AsyncSaveShardedStrategy):
        pytest.skip(f"{backend} has no async save capability")
    assert run_ranks(4, _async_save_then_mutate, str(tmp_path), backend) == [(False, True)] * 4
    results = run_ranks(2, _load_layout, str(tmp_path), "tp_dp", {"tp": 1})
    assert [wrong for _, wrong in results] == [[], []]


def _save_twice_same_structure(base, backend):
    from distckpt import saving

    for i in range(2):
        sd, _ = layouts.build("grid", ddist.get_rank(), ddist.get_world_size(), True, rows=2, cols=2)
        before = len(saving._VALIDATED_STRUCTURES)
        distckpt.save(sd, f"{base}/{i}", sharded_strategy=(backend, 1))
    return before == len(saving._VALIDATED_STRUCTURES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchanged_structure_is_validated_once(backend, tmp_path):
    assert run_ranks(4, _save_twice_same_structure, str(tmp_path), backend) == [True] * 4
    for i in range(2):
        results = run_ranks(4, _load_layout, str(tmp_path / str(i)), "grid", {"rows": 1, "cols": 4})
        assert [wrong for _, wrong in results] == [[]] * 4


def _load_into_parameters(ckpt, backend):
    full = layouts.full_tensor("param", (4, 6))
    rank = ddist.get_rank()
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", full, replica_id=rank)},
        ckpt,
        sharded_strategy=(backend, 1),
    )
    param = torch.nn.Parameter(torch.zeros(4, 3))  # a column block: not a direct read
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", param, (1, rank, 2))}, ckpt)
    return (
        out["w"] is param
        and param.requires_grad
        and torch.equal(param.detach(), full[:, 3 * rank : 3 * rank + 3])
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_that_require_grad_are_filled_in_place(backend, tmp_path):
    assert run_ranks(2, _load_into_parameters, str(tmp_path), backend) == [True, True]


def _async_save_with_writer_failure(ckpt, backend):
    from distckpt.strategies.async_utils import AsyncCallsQueue

    rank = ddist.get_rank()
    queue = AsyncCallsQueue()
    sd, _ = layouts.build("tp_dp", rank, ddist.get_world_size(), True, tp=2)
    request = distckpt.save(sd, f"{ckpt}/bad", sharded_strategy=(backend, 1), async_sharded_save=True)
    if rank == 1:
        write = request.async_fn

        def failing_write(*args):
            write(*args)
            raise OSError("injected failure in the background writer")

        request.async_fn = failing_write
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        first = "no error"
    except distckpt.CheckpointingException as e:
        first = str(e)
    committed_bad = check_is_distributed_checkpoint(f"{ckpt}/bad")
    sd, _ = layouts.build("tp_dp", rank, ddist.get_world_size(), True, tp=2)
    queue.schedule_async_request(
        distckpt.save(sd, f"{ckpt}/good", sharded_strategy=(backend, 1), async_sharded_save=True)
    )
    queue.close()
    return first, committed_bad, check_is_distributed_checkpoint(f"{ckpt}/good")


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_writer_failure_on_one_rank_raises_everywhere_and_commits_nothing(backend, tmp_path):
    from distckpt.strategies.base import AsyncSaveShardedStrategy

    if not isinstance(get_default_save_sharded_strategy(backend), AsyncSaveShardedStrategy):
        # A synchronous strategy refuses an async save on every rank, before writing anything.
        expect_all_ranks_raise(
            2, _async_save_with_writer_failure, str(tmp_path), backend, match="cannot save asynchronously"
        )
        return
    results = run_ranks(2, _async_save_with_writer_failure, str(tmp_path), backend)
    for message, committed_bad, committed_good in results:
        assert "rank" in message and "injected failure in the background writer" in message
        assert not committed_bad and committed_good
    loaded = run_ranks(2, _load_layout, str(tmp_path / "good"), "tp_dp", {"tp": 2})
    assert [wrong for _, wrong in loaded] == [[], []]
