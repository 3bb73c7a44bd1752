"""distckpt.optimizer: optimizer state sharded like the parameters it belongs to."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import distckpt
from distckpt import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from distckpt.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    make_sharded_optimizer_tensor_flat,
    optim_state_to_sharding_state,
)


class TwoLayers(torch.nn.Module):
    """A column-parallel weight (by default rank 1 of TP 2) and a replicated bias."""

    def __init__(self, seed: int = 0, tp_rank: int = 1, tp: int = 2):
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(2, 3, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(3, generator=g))

    def sharded_state_dict(self):
        return {
            "weight": ShardedTensor.from_rank_offsets(
                "layer.weight", self.weight, (0, self.tp_rank, self.tp)
            ),
            "bias": ShardedTensor.from_rank_offsets("layer.bias", self.bias),
        }


def _trained_adam(model: torch.nn.Module, steps: int = 2) -> torch.optim.Adam:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        (model.weight.sum() * 2 + (model.bias**2).sum()).backward()
        opt.step()
    return opt


def _params(opt: torch.optim.Optimizer):
    return itertools.chain.from_iterable(g["params"] for g in opt.param_groups)


# --------------------------------------------------------------------------- id maps


def test_param_ids_follow_optimizer_order_and_keep_the_first_of_duplicates():
    a, b = torch.zeros(1), torch.zeros(2)
    assert get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}


def test_sharded_params_are_found_by_identity_of_their_data():
    model = TwoLayers()
    sd = model.sharded_state_dict()
    sd["not_a_param"] = ShardedTensor.from_rank_offsets("other", torch.zeros(1))
    opt = torch.optim.Adam([model.bias, model.weight])
    id_map = get_param_id_to_sharded_param_map({"nested": [sd]}, _params(opt))
    assert {i: sh.key for i, sh in id_map.items()} == {0: "layer.bias", 1: "layer.weight"}


def test_copies_instead_of_parameters_give_an_empty_map_and_a_warning(caplog):
    model = TwoLayers()
    sd = {"weight": ShardedTensor.from_rank_offsets("w", model.weight.detach().clone())}
    with caplog.at_level(logging.WARNING, logger="distckpt.optimizer"):
        assert get_param_id_to_sharded_param_map(sd, model.parameters()) == {}
    assert "keep_vars" in caplog.text


def test_factories_count_as_sharded_params():
    p = torch.nn.Parameter(torch.zeros(4))
    factory = ShardedTensorFactory("f", p, lambda *a: {}, lambda x: x)
    assert get_param_id_to_sharded_param_map({"f": factory}, [p]) == {0: factory}


# --------------------------------------------------------------------------- one tensor


def test_optimizer_tensor_is_sharded_like_its_param_under_a_prefixed_key():
    param = torch.zeros(2, 3, dtype=torch.bfloat16)
    sh = ShardedTensor.from_rank_offsets(
        "w", param, (0, 0, 4), (1, 1, 2), (2, 1, 2), replica_id=(0, 1, 3), prepend_axis_num=1
    )
    state = torch.ones(2, 3)  # fp32 state of a bf16 param
    out = make_sharded_optimizer_tensor(sh, state, "optimizer.state.exp_avg")
    assert out.key == "optimizer.state.exp_avg.w"
    assert out.data is state and out.dtype == torch.float32
    assert (out.global_shape, out.global_offset, out.replica_id, out.prepend_axis_num) == (
        sh.global_shape,
        sh.global_offset,
        sh.replica_id,
        sh.prepend_axis_num,
    )
    assert sh.key == "w" and sh.data is param  # the model's leaf is left alone


def test_optimizer_tensor_of_another_shape_is_rejected():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))
    with pytest.raises(CheckpointingException, match=r"optimizer.state.exp_avg.w.*\(3, 2\).*\(2, 3\)"):
        make_sharded_optimizer_tensor(sh, torch.zeros(3, 2), "optimizer.state.exp_avg")


def test_optimizer_tensor_of_a_flat_param_must_match_the_flat_range():
    sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=slice(1, 5))
    assert make_sharded_optimizer_tensor(sh, torch.ones(4), "s").flattened_range == slice(1, 5)
    with pytest.raises(CheckpointingException, match="flattened range"):
        make_sharded_optimizer_tensor(sh, torch.ones(5), "s")


def _halves(key, data, replica_id, flattened_range):
    return {
        "a": ShardedTensor.from_rank_offsets(f"{key}.a", data[:1], replica_id=replica_id),
        "b": ShardedTensor.from_rank_offsets(f"{key}.b", data[1:], replica_id=replica_id),
    }


def test_optimizer_state_of_a_factory_param_is_split_by_the_same_factory():
    factory = ShardedTensorFactory("fc1", torch.zeros(2, 3), _halves, torch.cat, replica_id=2)
    state = torch.arange(6.0).reshape(2, 3)
    out = make_sharded_optimizer_tensor(factory, state, "optimizer.state.exp_avg")
    assert isinstance(out, ShardedTensorFactory) and out.data is state and out.replica_id == 2
    built = out.build()
    assert {k: (v.key, v.data.tolist()) for k, v in built.items()} == {
        "a": ("optimizer.state.exp_avg.fc1.a", [[0.0, 1.0, 2.0]]),
        "b": ("optimizer.state.exp_avg.fc1.b", [[3.0, 4.0, 5.0]]),
    }


# --------------------------------------------------------------------------- flat slices


def test_flat_optimizer_slice_lies_on_its_params_grid():
    param = torch.zeros(2, 3)
    sh = ShardedTensor.from_rank_offsets(
        "w", param, (0, 1, 4), (1, 1, 2), replica_id=(0, 0, 5), prepend_axis_num=1
    )
    out = make_sharded_optimizer_tensor_flat(
        sh, torch.ones(4), slice(2, 6), "optimizer.state.exp_avg", replica_id=(0, 0, 0)
    )
    want = ShardedTensor.from_rank_offsets_flat(
        "optimizer.state.exp_avg.w",
        torch.ones(4),
        (2, 3),
        (0, 1, 4),
        (1, 1, 2),
        flattened_range=slice(2, 6),
        replica_id=(0, 0, 0),
        prepend_axis_num=1,
    )
    assert out.without_data() == want.without_data()


def test_flat_optimizer_slice_of_a_factory_param_passes_the_range_to_build():
    seen = {}

    def build(key, data, replica_id, flattened_range):
        seen.update(key=key, data=data, replica_id=replica_id, flattened_range=flattened_range)
        return {}

    factory = ShardedTensorFactory("f", torch.zeros(2, 3), build, torch.cat, replica_id=(0, 0, 1))
    state = torch.ones(3)
    make_sharded_optimizer_tensor_flat(factory, state, slice(1, 4), "s", replica_id=(0, 0, 0)).build()
    assert seen == {"key": "s.f", "data": state, "replica_id": (0, 0, 0), "flattened_range": slice(1, 4)}


def test_flat_optimizer_slice_needs_the_non_flat_param():
    sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(2), (2, 3), flattened_range=slice(0, 2))
    with pytest.raises(CheckpointingException, match="already flattened"):
        make_sharded_optimizer_tensor_flat(sh, torch.zeros(2), slice(0, 2), "s")


def test_flat_slices_of_two_dp_ranks_load_as_one_regular_tensor(tmp_path):
    param = torch.zeros(2, 3)
    sh = ShardedTensor.from_rank_offsets("w", param)
    state = torch.arange(6.0)
    # One process holds both DP ranks' slices: [0, 4) and [4, 6) of the flattened state.
    sd = {
        f"dp{r}": make_sharded_optimizer_tensor_flat(sh, state[a:b].clone(), slice(a, b), "optimizer.state.m")
        for r, (a, b) in enumerate([(0, 4), (4, 6)])
    }
    distckpt.save(sd, tmp_path)
    out = distckpt.load(
        {"m": make_sharded_optimizer_tensor(sh, torch.zeros(2, 3), "optimizer.state.m")}, tmp_path
    )
    assert torch.equal(out["m"], state.view(2, 3))


# --------------------------------------------------------------------------- whole state dicts


def test_state_dict_becomes_sharded_state_keyed_by_param_key():
    model = TwoLayers()
    opt = _trained_adam(model)
    sd = opt.state_dict()
    optim_state_to_sharding_state(
        sd,
        get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params(opt)),
        exclude_keys=("step",),
    )
    assert {i: {n: v.key for n, v in s.items()} for i, s in sd["state"].items()} == {
        0: {
            "exp_avg": "optimizer.state.exp_avg.layer.weight",
            "exp_avg_sq": "optimizer.state.exp_avg_sq.layer.weight",
        },
        1: {
            "exp_avg": "optimizer.state.exp_avg.layer.bias",
            "exp_avg_sq": "optimizer.state.exp_avg_sq.layer.bias",
        },
    }
    assert sd["state"][0]["exp_avg"].data is opt.state[model.weight]["exp_avg"]
    assert sd["state"][0]["exp_avg"].global_offset == (2, 0)


def test_param_groups_stay_common_except_their_process_local_params():
    model = TwoLayers()
    opt = _trained_adam(model)
    sd = opt.state_dict()
    optim_state_to_sharding_state(
        sd,
        get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params(opt)),
        exclude_keys=("step",),
    )
    (group,) = sd["param_groups"]
    assert isinstance(group["params"], LocalNonpersistentObject) and group["params"].unwrap() == [0, 1]
    assert group["lr"] == 0.1
    assert isinstance(opt.state_dict()["param_groups"][0]["params"], list)  # a copy was changed


def test_state_of_a_param_without_sharded_counterpart_is_an_error():
    model = TwoLayers()
    opt = _trained_adam(model)
    id_map = get_param_id_to_sharded_param_map(model.sharded_state_dict(), [model.weight])
    with pytest.raises(CheckpointingException, match="param id 1 has no sharded model parameter"):
        optim_state_to_sharding_state(opt.state_dict(), id_map, exclude_keys=("step",))


def test_a_scalar_state_like_adams_step_cannot_be_sharded_like_its_param():
    model = TwoLayers()
    opt = _trained_adam(model)
    id_map = get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params(opt))
    with pytest.raises(CheckpointingException, match=r"optimizer.state.step.layer.weight.*shape \(\)"):
        optim_state_to_sharding_state(opt.state_dict(), id_map)


def _sharded_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """The pattern for torch.optim.Adam: shard exp_avg(_sq), keep the (common) step count apart."""
    sd = opt.state_dict()
    (step,) = {float(s["step"]) for s in sd["state"].values()}
    optim_state_to_sharding_state(
        sd,
        get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params(opt)),
        exclude_keys=("step",),
    )
    sd["step"] = step
    return sd


def test_adam_state_round_trips_through_a_checkpoint(tmp_path):
    model = TwoLayers(tp_rank=0, tp=1)
    opt = _trained_adam(model)
    distckpt.save({"optimizer": _sharded_optimizer(model, opt)}, tmp_path)

    fresh_model = TwoLayers(seed=1, tp_rank=0, tp=1)
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    (fresh_model.weight.sum() + fresh_model.bias.sum()).backward()
    fresh.step()  # the state to load into exists now, with other values
    loaded = distckpt.load({"optimizer": _sharded_optimizer(fresh_model, fresh)}, tmp_path)["optimizer"]
    for state in loaded["state"].values():
        state["step"] = torch.tensor(loaded["step"])
    fresh.load_state_dict(loaded)
    for p_old, p_new in zip(model.parameters(), fresh_model.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[p_new][name], opt.state[p_old][name]), name
    assert fresh.param_groups[0]["lr"] == 0.1
    assert fresh.param_groups[0]["params"] == list(fresh_model.parameters())


def test_the_optimizer_itself_is_left_untouched():
    model = TwoLayers()
    opt = _trained_adam(model)
    sd = opt.state_dict()  # torch shares the per-param state dicts with the optimizer
    optim_state_to_sharding_state(
        sd,
        get_param_id_to_sharded_param_map(model.sharded_state_dict(), _params(opt)),
        exclude_keys=("step",),
    )
    for p in model.parameters():
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(type(v) is torch.Tensor for v in opt.state[p].values())
    assert opt.param_groups[0]["params"] == list(model.parameters())


def test_optimizer_state_of_another_shape_than_a_factory_param_is_rejected():
    factory = ShardedTensorFactory("fc1", torch.zeros(2, 3), _halves, torch.cat)
    with pytest.raises(CheckpointingException, match=r"optimizer.state.m.fc1.*\(3, 2\).*\(2, 3\)"):
        make_sharded_optimizer_tensor(factory, torch.zeros(3, 2), "optimizer.state.m")
