"""Device behaviour: CPU paths never touch torch.cuda; CUDA tensors round-trip (GPU machines only)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from tests import layouts
from tests.harness import run_ranks

_CUDA_ENTRY_POINTS = ("is_available", "synchronize", "current_device", "device_count", "set_device",
                      "current_stream", "init")


def _cpu_save_load_without_cuda(ckpt):
    saved = {name: getattr(torch.cuda, name) for name in _CUDA_ENTRY_POINTS}

    def forbidden(*_a, **_k):
        raise AssertionError("torch.cuda was called on a CPU-only path")

    for name in saved:
        setattr(torch.cuda, name, forbidden)
    try:
        rank, world = ddist.get_rank(), ddist.get_world_size()
        sd, pieces = layouts.build("tp_dp", rank, world, True, tp=2)
        sd["obj"] = layouts.rank_object(rank, world)
        distckpt.save(sd, ckpt)
        request = distckpt.save(sd, f"{ckpt}_async", async_sharded_save=True)
        request.execute_sync()
        sd, pieces = layouts.build("tp_dp", rank, world, False, tp=1)
        out = distckpt.load(sd, ckpt, verify=True)
        return all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def test_cpu_save_and_load_never_call_torch_cuda(tmp_path):
    assert run_ranks(2, _cpu_save_load_without_cuda, str(tmp_path / "ckpt")) == [True, True]


@pytest.mark.cuda
def test_cuda_tensors_round_trip_in_one_process(tmp_path):
    full = layouts.full_tensor("cuda", (8, 6)).cuda()
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full), "o": ShardedObject("o", {"a": 1}, (1,), (0,))},
                  tmp_path)
    target = torch.zeros(8, 6, device="cuda")
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path)
    assert out["w"] is target and torch.equal(target, full)


def _nccl_rank(rank, world, port, ckpt, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    try:
        full = layouts.full_tensor("nccl", (8, 6)).cuda()
        local = full[4 * rank:4 * rank + 4].clone()
        distckpt.save({"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}, ckpt)
        from distckpt.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        queue.schedule_async_request(distckpt.save(
            {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}, f"{ckpt}_async",
            async_sharded_save=True))
        local.zero_()  # the staged copy must be what gets written
        queue.close()
        ok = True
        for path in (ckpt, f"{ckpt}_async"):
            target = torch.zeros(8, 6, device="cuda")
            out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", target, replica_id=rank)}, path)
            ok = ok and torch.equal(out["w"], full)
        results.put((rank, ok))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.cuda
def test_nccl_save_and_async_save_load_bit_exactly(tmp_path):
    world = min(2, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(_nccl_rank, args=(world, port, str(tmp_path / "ckpt"), results),
                                          nprocs=world, start_method="spawn", join=True)
    assert sorted(results.get() for _ in range(world)) == [(r, True) for r in range(world)]
