"""distckpt state dicts as PyTorch's sharded types, and the ``torch_dcp`` strategies' plug-ins.

``to_torch_state_dict`` is checked with PyTorch's own ``dcp.save`` / ``dcp.load`` on 2 gloo
ranks: DTensors where the layout is a placement on the caller's mesh, torch ShardedTensors
otherwise (uneven pieces, several pieces per rank, flattened slices). The strategies are checked
with DCP's fsspec storage plug-in. (The conformance suite runs the ``torch_dcp`` backend too.)
"""

from __future__ import annotations

import warnings

import torch

import distckpt
from distckpt import dist
from distckpt.strategies.base import StrategyAction, get_default_strategy
from distckpt.strategies.torch_dcp import (
    DCPPieces,
    TorchDCPLoadShardedStrategy,
    TorchDCPSaveShardedStrategy,
    to_torch_state_dict,
)
from tests.support import layouts
from tests.support.layouts import bitwise_equal, full_tensor

W = torch.arange(48, dtype=torch.float32).reshape(6, 8)


def _sharded(rank: int, world: int, fill: bool) -> dict:
    def data(t):
        return t.clone() if fill else torch.zeros_like(t)

    sd = {
        # TP-style Shard(1): a DTensor placement on a 1-D mesh of the world.
        "col": distckpt.ShardedTensor.from_rank_offsets(
            "col", data(W[:, 4 * rank : 4 * rank + 4]), (1, rank, world)
        ),
        # Replicated on every rank: Replicate().
        "rep": distckpt.ShardedTensor.from_rank_offsets("rep", data(W[0]), replica_id=rank),
    }
    # Uneven 1-D pieces (13 = 6 + 7 and 3 = 2 + 1: not torch.chunk's split, so not a DTensor).
    sd.update({p.name: p.sharded(fill) for p in layouts.uneven(rank, world)})
    sd.update({p.name: p.sharded(fill) for p in layouts.multi(rank, world)})
    sd.update({p.name: p.sharded(fill) for p in layouts.flat_optimizer(rank, world, tp=1, empty=True)})
    return sd


def _expected(name: str, rank: int, world: int) -> torch.Tensor:
    sd = _sharded(rank, world, True)
    return sd[name].data


def _convert_and_dcp_save(root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = to_torch_state_dict(_sharded(rank, world, True), mesh)
    kinds = {
        k: (
            "DTensor"
            if isinstance(v, DTensor)
            else "ShardedTensor"
            if isinstance(v, TorchShardedTensor)
            else type(v).__name__
        )
        for k, v in state.items()
    }
    dcp.save(state, checkpoint_id=root)
    # And PyTorch's load into the converted state dict of a fresh model fills its tensors.
    fresh = _sharded(rank, world, False)
    dcp.load(to_torch_state_dict(fresh, mesh, for_save=False), checkpoint_id=root)
    wrong = [name for name, sh in fresh.items() if not bitwise_equal(sh.data, _expected(name, rank, world))]
    return kinds, wrong


def test_conversion_gives_dtensors_or_torch_sharded_tensors_that_pytorch_saves_and_loads(run_ranks, tmp_path):
    results = run_ranks(2, _convert_and_dcp_save, str(tmp_path), timeout=120)
    kinds = results[0][0]
    assert kinds["col"] == "DTensor" and kinds["rep"] == "DTensor"
    assert kinds["uneven13"] == "ShardedTensor"
    assert kinds["multi"] == "ShardedTensor" and kinds["exp_avg"] == "ShardedTensor"
    assert [wrong for _, wrong in results] == [[], []]
    # distckpt reads what dcp.save wrote (a plain DCP directory), whole tensors bit-exact.
    plain = distckpt.load_plain_tensors(tmp_path)
    assert torch.equal(plain["col"], W) and torch.equal(plain["rep"], W[0])
    assert torch.equal(plain["multi"], full_tensor("multi", (16, 3)))
    assert torch.equal(plain["uneven13"], full_tensor("uneven13", (13,)))
    # Flattened slices: DCP holds the N-D reformulated tensor ([1, 1, 48] for one TP chunk).
    assert torch.equal(plain["exp_avg"].reshape(8, 6), full_tensor("exp_avg", (8, 6)))


def test_conversion_without_a_process_group_gives_dcp_checkpointables(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"w": distckpt.ShardedTensor.from_rank_offsets("w", W.clone())}
    sd.update({p.name: p.sharded() for p in layouts.multi(0, 1)})
    state = to_torch_state_dict(sd)
    assert isinstance(state["multi"], DCPPieces) and len(state["multi"].pieces) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from distckpt.strategies.torch_dcp import dcp_planners

        save_planner, _ = dcp_planners()
        dcp.save(state, checkpoint_id=str(tmp_path), planner=save_planner({}))
    plain = distckpt.load_plain_tensors(tmp_path)
    assert torch.equal(plain["w"], W) and torch.equal(plain["multi"], full_tensor("multi", (16, 3)))


def test_dcp_engine_with_the_fsspec_storage_plugin(tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    # The factories get the directory the save writes into (a staging directory until the commit).
    save = TorchDCPSaveShardedStrategy(storage_writer=lambda d: FsspecWriter(f"file://{d}"))
    sd = {p.name: p.sharded() for p in layouts.flat_optimizer(0, 1, tp=1) + layouts.tp_dp(0, 1, tp=1)}
    sd["obj"] = layouts.rank_object(0, 1)
    distckpt.save(sd, tmp_path / "ckpt", sharded_strategy=save)
    load = TorchDCPLoadShardedStrategy(storage_reader=lambda d: FsspecReader(f"file://{d}"))
    req = {p.name: p.sharded(False) for p in layouts.flat_optimizer(0, 1, tp=1) + layouts.tp_dp(0, 1, tp=1)}
    req["obj"] = layouts.rank_object(0, 1, with_data=False)
    out = distckpt.load(req, tmp_path / "ckpt", sharded_strategy=load)
    for p in layouts.flat_optimizer(0, 1, tp=1) + layouts.tp_dp(0, 1, tp=1):
        assert bitwise_equal(out[p.name], p.expected()), p.name
    assert out["obj"]["name"] == "obj0" and torch.equal(out["obj"]["state"], torch.arange(3))
    # The fast reader reads the DCP engine's files too (the format is torch_dist).
    fast = distckpt.load(
        {p.name: p.sharded(False) for p in layouts.tp_dp(0, 1, tp=1)},
        tmp_path / "ckpt",
        strict="assume_ok_unexpected",
    )
    assert all(bitwise_equal(fast[p.name], p.expected()) for p in layouts.tp_dp(0, 1, tp=1))


def test_strategies_are_registered_and_default_stays_the_fast_writer():
    from distckpt.serialization import get_default_save_sharded_strategy
    from distckpt.strategies.torch import TorchDistSaveShardedStrategy

    assert type(get_default_save_sharded_strategy()) is TorchDistSaveShardedStrategy
    s = get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dcp", 1)
    assert isinstance(s, TorchDCPSaveShardedStrategy) and s.backend == "torch_dist"
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dcp", 1), TorchDCPLoadShardedStrategy
    )
