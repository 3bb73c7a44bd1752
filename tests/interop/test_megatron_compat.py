"""Megatron-Core's sharded classes are taken as they are; nothing sharded is pickled as common state.

Runs without megatron-core: the leaves are tests/support/megatron_lookalike.py's classes, which carry
Megatron's class path and fields (tests/interop/test_megatron_gpt.py runs the real ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor, ShardedTensorFactory
from distckpt import dist as ddist
from distckpt.foreign import from_foreign, normalize_sharded_state_dict, sharded_lookalike
from distckpt.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from distckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from distckpt.validation import check_common_state
from tests.support import megatron_lookalike as mlk
from tests.support.harness import expect_all_ranks_raise, run_ranks

WORLD = 2
TIMEOUT = 60

mlk.install()


def _weight(rank: int) -> torch.Tensor:
    """Rank ``rank``'s half (rows) of a 4x6 global weight."""
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)[2 * rank : 2 * rank + 2].clone()


def _split_columns(key, data, replica_id, flattened_range):
    """A factory's build: store the tensor as two column blocks, in Megatron's classes."""
    rank = ddist.get_rank()
    return {
        "left": mlk.ShardedTensor.split(f"{key}.left", data[:, :3].contiguous(), 0, rank, WORLD, replica_id),
        "right": mlk.ShardedTensor.split(
            f"{key}.right", data[:, 3:].contiguous(), 0, rank, WORLD, replica_id
        ),
    }


def _join_columns(loaded):
    return torch.cat([loaded["left"], loaded["right"]], dim=1)


def _state(ns, rank: int, fill: bool) -> dict:
    """The same state dict in Megatron's classes (``ns=mlk``) or distckpt's (``ns=distckpt``)."""
    w = _weight(rank) if fill else torch.zeros(2, 6)
    if ns is mlk:
        weight = mlk.ShardedTensor.split("layer.weight", w, 0, rank, WORLD)
    else:
        weight = ShardedTensor.from_rank_offsets("layer.weight", w, (0, rank, WORLD))
    return {
        "model": {
            "weight": weight,
            "fused": ns.ShardedTensorFactory("layer.fused", 10 * w, _split_columns, _join_columns),
        },
        "rng": [ns.ShardedObject("rng", {"rank": rank} if fill else None, (WORLD,), (rank,))],
        "local": ns.LocalNonpersistentObject(f"kept on rank {rank}"),
        "iteration": 7,
    }


def _save_and_load_both_ways(root):
    rank = ddist.get_rank()
    for ns, name in ((mlk, "megatron"), (distckpt, "distckpt")):
        distckpt.save(_state(ns, rank, fill=True), Path(root) / name)
    request = _state(mlk, rank, fill=False)
    target = request["model"]["weight"].data
    loaded = distckpt.load(request, Path(root) / "megatron")
    same_as_ours = distckpt.load(_state(distckpt, rank, fill=False), Path(root) / "distckpt")
    return {
        "in_place": loaded["model"]["weight"] is target and torch.equal(target, _weight(rank)),
        "fused": torch.equal(loaded["model"]["fused"], 10 * _weight(rank)),
        "rng": loaded["rng"] == [{"rank": rank}],
        "local": loaded["local"] == f"kept on rank {rank}",
        "iteration": loaded["iteration"] == 7,
        "same": _equal(loaded, same_as_ours),
    }


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_megatron_leaves_save_and_load_like_distckpts_own(tmp_path):
    results = run_ranks(WORLD, _save_and_load_both_ways, str(tmp_path), timeout=TIMEOUT)
    assert (
        results == [dict.fromkeys(("in_place", "fused", "rng", "local", "iteration", "same"), True)] * WORLD
    )
    ours, theirs = (distckpt.load_plain_tensors(tmp_path / n) for n in ("distckpt", "megatron"))
    assert sorted(theirs) == ["layer.fused.left", "layer.fused.right", "layer.weight"]
    assert all(torch.equal(ours[k], theirs[k]) for k in ours) and ours.keys() == theirs.keys()
    assert (
        distckpt.load_sharded_metadata(tmp_path / "megatron").keys()
        == distckpt.load_sharded_metadata(tmp_path / "distckpt").keys()
    )
    assert distckpt.load_common_state_dict(tmp_path / "megatron") == {"iteration": 7}


def _strict_load_with_an_unknown_key(root):
    rank = ddist.get_rank()
    distckpt.save(_state(mlk, rank, fill=True), root)
    request = _state(mlk, rank, fill=False)
    request["extra"] = mlk.ShardedTensor.split("not.saved", torch.zeros(2), 0, rank, WORLD)
    _, missing, unexpected = distckpt.load(request, root, strict="return_all")
    return sorted(missing), sorted(unexpected)


def test_strict_modes_see_megatron_keys(tmp_path):
    assert (
        run_ranks(WORLD, _strict_load_with_an_unknown_key, str(tmp_path), timeout=TIMEOUT)
        == [([], ["not.saved"])] * WORLD
    )


def _async_fully_parallel(root):
    rank = ddist.get_rank()
    state = _state(mlk, rank, fill=True)
    # Both ranks hold the same replica of a second tensor: the wrapper must pick one writer.
    state["shared"] = mlk.ShardedTensor.split("shared", torch.ones(3), 0, 0, 1, replica_id=rank)
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        distckpt.save(state, root, sharded_strategy=wrapper, async_sharded_save=True)
    )
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    request = _state(mlk, rank, fill=False)
    request["shared"] = mlk.ShardedTensor.split("shared", torch.zeros(3), 0, 0, 1, replica_id=rank)
    loaded = distckpt.load(
        request, root, sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    )
    return (
        finalized,
        torch.equal(loaded["model"]["weight"], _weight(rank)),
        torch.equal(loaded["shared"], torch.ones(3)),
    )


def test_async_and_fully_parallel_save_and_load_take_megatron_leaves(tmp_path):
    assert (
        run_ranks(WORLD, _async_fully_parallel, str(tmp_path), timeout=TIMEOUT) == [([0], True, True)] * WORLD
    )


# --------------------------------------------------------------------------- common-state guard


class OtherLibShardedTensor:
    """A sharded description from a library distckpt does not know."""

    def __init__(self, key, data):
        self.key, self.data, self.global_shape, self.global_offset, self.replica_id = key, data, (4,), (0,), 0


def _save_with_common(root, what):
    rank = ddist.get_rank()
    state = {"weight": ShardedTensor.from_rank_offsets("w", _weight(rank), (0, rank, WORLD))}
    if what == "megatron_in_tuple" and rank == 1:  # one rank only: every rank must still raise
        state["extra"] = {"pair": (1, mlk.ShardedTensor.split("bias", torch.ones(2), 0, rank, WORLD))}
    elif what == "other_library":
        state["opt"] = [OtherLibShardedTensor("moment", torch.zeros(2))]
    elif what == "large_tensor" and rank == 0:
        state["buffer"] = torch.zeros(300_000)
    distckpt.save(state, root)


@pytest.mark.parametrize(
    "what, match",
    [
        (
            "megatron_in_tuple",
            r"common state key \['extra'\]\['pair'\]\[1\] is a Megatron-Core ShardedTensor; it would be "
            r"pickled whole",
        ),
        (
            "other_library",
            r"common state key \['opt'\]\[0\] is an instance of .*OtherLibShardedTensor with key, "
            r"replica_id and global shape/offset fields",
        ),
        (
            "large_tensor",
            r"common state key \['buffer'\] is a torch tensor of 1200000 bytes .* above the "
            r"1048576-byte limit",
        ),
    ],
)
def test_a_sharded_or_large_value_in_the_common_state_fails_on_every_rank(tmp_path, what, match):
    expect_all_ranks_raise(WORLD, _save_with_common, str(tmp_path), what, match=match, timeout=TIMEOUT)
    assert not distckpt.check_is_distributed_checkpoint(tmp_path)


def _save_large_common_on_purpose(root):
    distckpt.save({"buffer": torch.arange(300_000)}, root, max_common_tensor_bytes=None)
    return torch.equal(distckpt.load({}, root)["buffer"], torch.arange(300_000))


def test_large_common_tensors_are_allowed_on_purpose(tmp_path):
    assert run_ranks(WORLD, _save_large_common_on_purpose, str(tmp_path), timeout=TIMEOUT) == [True] * WORLD


def test_the_limit_can_come_from_the_environment(monkeypatch):
    big = {"b": torch.zeros(1000)}
    monkeypatch.setenv("DISTCKPT_MAX_COMMON_TENSOR_BYTES", "100")
    with pytest.raises(CheckpointingException, match="4000 bytes .* above the 100-byte limit"):
        check_common_state(big)
    check_common_state(big, max_tensor_bytes=None)
    monkeypatch.setenv("DISTCKPT_MAX_COMMON_TENSOR_BYTES", "none")
    check_common_state(big)
    monkeypatch.setenv("DISTCKPT_MAX_COMMON_TENSOR_BYTES", "lots")
    with pytest.raises(CheckpointingException, match="DISTCKPT_MAX_COMMON_TENSOR_BYTES='lots'"):
        check_common_state(big)


class _Config:
    def __init__(self, inner):
        self.inner = inner


@pytest.mark.parametrize(
    "value, found",
    [
        ({"a": [1, 2.0, "x", None, torch.zeros(3)], "b": _Config({"c": (1, 2)})}, None),
        ({"a": {"b": ((ShardedObject("o", 1, (1,), (0,)),),)}}, "a distckpt ShardedObject"),
        ({"a": _Config(_Config([mlk.ShardedObject("o", 1, (1,), (0,))]))}, "a Megatron-Core ShardedObject"),
        ({"a": mlk.LocalNonpersistentObject(1)}, "a Megatron-Core LocalNonpersistentObject"),
    ],
)
def test_the_guard_looks_inside_containers_and_plain_objects(value, found):
    if found is None:
        check_common_state(value)
    else:
        with pytest.raises(CheckpointingException, match=found):
            check_common_state(value)


def test_lookalike_detection_by_name_and_fields():
    class ShardedThing:
        pass

    class WeightFactory:
        pass

    assert "sharded class distckpt does not know" in sharded_lookalike(ShardedThing())
    assert "sharded class distckpt does not know" in sharded_lookalike(WeightFactory())
    assert "key, replica_id and global shape/offset" in sharded_lookalike(OtherLibShardedTensor("k", None))
    assert sharded_lookalike(_Config(1)) is None and sharded_lookalike(torch.zeros(2)) is None


# --------------------------------------------------------------------------- conversion details


def test_conversion_shares_the_tensor_and_keeps_every_field():
    data = torch.zeros(2, 3)
    theirs = mlk.ShardedTensor(
        "k",
        data,
        torch.float32,
        (2, 3),
        (1, 4, 3),
        (0, 2, 0),
        (1, 2, 1),
        replica_id=(0, 1),
        prepend_axis_num=1,
        allow_shape_mismatch=True,
    )
    ours = from_foreign(theirs)
    assert type(ours) is ShardedTensor and ours.data is data
    assert (
        ours.global_shape,
        ours.global_offset,
        ours.axis_fragmentations,
        ours.replica_id,
        ours.prepend_axis_num,
        ours.allow_shape_mismatch,
    ) == ((1, 4, 3), (0, 2, 0), (1, 2, 1), (0, 1), 1, True)


def test_a_factory_built_from_megatron_objects_builds_distckpt_objects():
    sd = {"f": [mlk.ShardedTensorFactory("f", torch.ones(2, 6), _split_columns, _join_columns)]}
    normalize_sharded_state_dict(sd)
    assert type(sd["f"][0]) is ShardedTensorFactory
    built = sd["f"][0].build()
    assert {k: type(v) for k, v in built.items()} == {"left": ShardedTensor, "right": ShardedTensor}


def test_invalid_megatron_fields_are_a_clear_error():
    bad = mlk.ShardedTensor("k", torch.zeros(2), torch.float32, (2,), (1,), (0,), None)
    with pytest.raises(CheckpointingException, match="ShardedTensor 'k'.*exceeds global size"):
        normalize_sharded_state_dict({"x": bad})


def test_optimizer_helpers_take_megatron_model_state():
    param = torch.nn.Parameter(torch.ones(2, 6))
    model_sd = {"w": mlk.ShardedTensor.split("w", param, 0, 1, 2)}
    id_map = get_param_id_to_sharded_param_map(model_sd, [param])
    assert type(id_map[0]) is ShardedTensor and id_map[0].data is param
    moment = make_sharded_optimizer_tensor(
        mlk.ShardedTensor.split("w", param, 0, 1, 2), torch.zeros(2, 6), "opt"
    )
    assert (type(moment), moment.key, moment.global_offset) == (ShardedTensor, "opt.w", (2, 0))
    optim_sd = {"state": {0: {"exp_avg": torch.zeros(2, 6)}}, "param_groups": [{"params": [0]}]}
    optim_state_to_sharding_state(optim_sd, {0: mlk.ShardedTensor.split("w", param, 0, 1, 2)})
    assert optim_sd["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.w"


def test_a_megatron_class_without_a_field_distckpt_needs_is_a_clear_error():
    class ShardedObject:  # an unknown Megatron version: no global_offset
        def __init__(self):
            self.key, self.data, self.global_shape, self.replica_id = "rng", None, (1,), 0

    ShardedObject.__module__ = mlk.MEGATRON_MAPPING
    with pytest.raises(
        CheckpointingException,
        match=r"Leaf 'rng': Megatron-Core ShardedObject without "
        r"field\(s\) \['global_offset'\]",
    ):
        normalize_sharded_state_dict({"x": [ShardedObject()]})


def test_an_unknown_sharded_class_under_megatrons_path_is_refused_in_the_common_state():
    class ShardedTensorV2:
        pass

    ShardedTensorV2.__module__ = mlk.MEGATRON_MAPPING
    with pytest.raises(
        CheckpointingException,
        match=r"key \['x'\] is an instance of .*ShardedTensorV2, a sharded "
        r"class distckpt does not know",
    ):
        check_common_state({"x": ShardedTensorV2()})
