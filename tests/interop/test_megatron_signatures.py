"""Megatron-Core 0.19's forms of ``save``/``load`` and the strategy factories, beside 0.16's.

``save(..., async_strategy=..., verify_integrity=...)``, ``load(..., verify_integrity=...,
process_group=...)``: accepted with Megatron's meaning (distckpt.megatron_api). ``process_group``
is checked on real gloo ranks: a load on a one-rank group must not wait for the rank outside it.
"""

from __future__ import annotations

import time

import pytest
import torch

import distckpt
from distckpt import dist
from distckpt.serialization import get_default_load_sharded_strategy, get_default_save_sharded_strategy
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

FULL = torch.arange(32, dtype=torch.float32).reshape(4, 8)


def _sd(data: torch.Tensor, rank: int = 0, world: int = 1) -> dict:
    return {"w": distckpt.ShardedTensor.from_rank_offsets("w", data, (0, rank, world)), "step": 3}


def test_019_save_arguments_with_async_and_integrity(tmp_path):
    for engine in ("nvrx", "mcore"):
        ckpt = tmp_path / engine
        request = distckpt.save(
            _sd(FULL.clone()), ckpt, async_sharded_save=True, async_strategy=engine, verify_integrity=True
        )
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        assert distckpt.check_is_distributed_checkpoint(ckpt)
        out = distckpt.load(_sd(torch.zeros(4, 8)), ckpt, verify_integrity=True)
        assert torch.equal(out["w"], FULL) and out["step"] == 3
    with pytest.raises(distckpt.CheckpointingException, match="async_strategy='torch'.*unknown async engine"):
        distckpt.save(_sd(FULL.clone()), tmp_path / "bad", async_sharded_save=True, async_strategy="torch")
    assert not (tmp_path / "bad").exists()


def test_019_verify_integrity_on_load_catches_a_flipped_byte(tmp_path):
    distckpt.save(_sd(FULL.clone()), tmp_path)
    data = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-40] ^= 0xFF  # inside the tensor bytes of the last item
    data.write_bytes(bytes(raw))
    distckpt.load(_sd(torch.zeros(4, 8)), tmp_path, verify=False)  # the explicit opt-out reads it
    for checks in ({}, {"verify_integrity": True}):  # distckpt checks CRCs by default, too
        with pytest.raises(distckpt.CheckpointingException, match="CRC32C mismatch"):
            distckpt.load(_sd(torch.zeros(4, 8)), tmp_path, **checks)


def test_016_forms_still_work(tmp_path):
    distckpt.save(
        _sd(FULL.clone()), tmp_path, get_default_save_sharded_strategy("torch_dist", 1), None, True, False
    )
    out = distckpt.load(
        _sd(torch.zeros(4, 8)),
        tmp_path,
        get_default_load_sharded_strategy(tmp_path),
        None,
        True,
        "assume_ok_unexpected",
    )
    assert torch.equal(out["w"], FULL)


def test_default_strategy_factories_return_fresh_objects(tmp_path):
    a, b = get_default_save_sharded_strategy(), get_default_save_sharded_strategy()
    assert isinstance(a, TorchDistSaveShardedStrategy) and a is not b
    a.thread_count = 7
    assert get_default_save_sharded_strategy().thread_count != 7
    c, d = get_default_load_sharded_strategy(), get_default_load_sharded_strategy()  # 0.19: no directory
    assert isinstance(c, TorchDistLoadShardedStrategy) and c is not d
    distckpt.save(_sd(FULL.clone()), tmp_path)
    e, f = get_default_load_sharded_strategy(tmp_path), get_default_load_sharded_strategy(str(tmp_path))
    assert isinstance(e, TorchDistLoadShardedStrategy) and e is not f


def _load_on_a_group_of_one(root: str):
    import torch.distributed as tdist

    rank = dist.get_rank()
    distckpt.save(_sd(FULL[2 * rank : 2 * rank + 2].clone(), rank, 2), root)
    solo = tdist.new_group([0])  # every rank takes part in creating it
    if rank == 0:
        # Would hang (until the gloo timeout) if any collective ran on the world group.
        start = time.monotonic()
        out = distckpt.load(_sd(torch.zeros(4, 8)), root, process_group=solo, strict="raise_all")
        took = time.monotonic() - start
        result = (torch.equal(out["w"], FULL), out["step"], took)
        bad = None
        try:  # a failure inside the group is raised there, on its only member
            distckpt.load(
                {"x": distckpt.ShardedTensor.from_rank_offsets("x", torch.zeros(2))}, root, process_group=solo
            )
        except distckpt.CheckpointingException as e:
            bad = str(e)
        tdist.barrier()
        return result, bad
    time.sleep(3)  # rank 1 stays out of the load (and is busy elsewhere) ...
    tdist.barrier()  # ... and only meets rank 0 afterwards
    return None


def test_process_group_confines_every_collective_of_load(run_ranks, tmp_path):
    r0, r1 = run_ranks(2, _load_on_a_group_of_one, str(tmp_path), timeout=60)
    assert r1 is None
    (equal, step, took), bad = r0
    assert equal and step == 3 and took < 3
    assert "'x' is not in checkpoint" in bad
