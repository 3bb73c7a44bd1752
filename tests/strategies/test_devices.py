"""Device behaviour: CPU paths never touch torch.cuda; CUDA tensors round-trip (GPU machines only)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from tests.support import layouts
from tests.support.harness import run_ranks

_CUDA_ENTRY_POINTS = (
    "is_available",
    "synchronize",
    "current_device",
    "device_count",
    "set_device",
    "current_stream",
    "init",
)


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
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", full), "o": ShardedObject("o", {"a": 1}, (1,), (0,))},
        tmp_path,
    )
    target = torch.zeros(8, 6, device="cuda")
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path)
    assert out["w"] is target and torch.equal(target, full)


def _nccl_rank(rank, world, port, ckpt, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    try:
        full = layouts.full_tensor("nccl", (8, 6)).cuda()
        local = full.chunk(world)[rank].clone()  # world 1 (one GPU): the whole tensor
        distckpt.save({"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}, ckpt)
        from distckpt.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        queue.schedule_async_request(
            distckpt.save(
                {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))},
                f"{ckpt}_async",
                async_sharded_save=True,
            )
        )
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
    torch.multiprocessing.start_processes(
        _nccl_rank,
        args=(world, port, str(tmp_path / "ckpt"), results),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    assert sorted(results.get() for _ in range(world)) == [(r, True) for r in range(world)]


@pytest.mark.parametrize("slot_bytes", [1, 7, 64, 4096])
def test_host_bounce_fills_a_tensor_across_slot_boundaries(tmp_path, slot_bytes):
    from distckpt.io.device_io import HostBounce

    data = torch.arange(250, dtype=torch.int32)
    path = tmp_path / "bytes"
    path.write_bytes(b"\xff" * 13 + data.numpy().tobytes() + b"\xee" * 5)
    dst = torch.zeros(250, dtype=torch.int32)
    fd = os.open(path, os.O_RDONLY)
    bounce = HostBounce(slot_bytes, slots=2)
    try:
        bounce.fill(fd, 13, dst[:100], "test")
        bounce.fill(fd, 13 + 400, dst[100:], "test")
    finally:
        bounce.close()
        os.close(fd)
    assert torch.equal(dst, data)


@pytest.mark.parametrize("slot_bytes", [40, 100, 4096])
def test_host_bounce_cuts_column_blocks_out_of_whole_rows(tmp_path, slot_bytes):
    from distckpt.io.device_io import HostBounce
    from distckpt.strategies.torch import CopyOp

    item = torch.arange(9 * 10, dtype=torch.int32).reshape(9, 10)
    path = tmp_path / "bytes"
    path.write_bytes(b"\xff" * 8 + item.numpy().tobytes())
    left, right = torch.zeros(6, 4, dtype=torch.int32), torch.zeros(6, 6, dtype=torch.float64)
    boxes = [
        CopyOp("k", 2 * 10, (6, 4), (10, 1), left),  # rows 2..7, columns 0..3
        CopyOp("k", 3 * 10 + 4, (6, 6), (10, 1), right),  # rows 3..8, columns 4..9 (another dtype)
        CopyOp("k", 1, (5,), (3,), torch.zeros(5, dtype=torch.int32)),
    ]  # one axis: not served
    fd = os.open(path, os.O_RDONLY)
    bounce = HostBounce(slot_bytes, slots=2)
    try:
        rest = bounce.fill_boxes(fd, 8, torch.int32, boxes, "test")
    finally:
        bounce.close()
        os.close(fd)
    assert rest == [boxes[2]]
    assert torch.equal(left, item[2:8, :4]) and torch.equal(right, item[3:9, 4:].double())


def test_host_bounce_leaves_rows_larger_than_a_slot_to_another_path(tmp_path):
    from distckpt.io.device_io import HostBounce
    from distckpt.strategies.torch import CopyOp

    box = CopyOp("k", 0, (2, 3), (100, 1), torch.zeros(2, 3))
    assert HostBounce(64).fill_boxes(-1, 0, torch.float32, [box], "test") == [box]


def test_a_negative_pinned_slot_size_is_refused():
    from distckpt.core import CheckpointingException
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    with pytest.raises(CheckpointingException, match="pinned_slot_bytes"):
        TorchDistLoadShardedStrategy(pinned_slot_bytes=-1)


@pytest.mark.cuda
@pytest.mark.parametrize("slot_bytes", [0, 4096, 1 << 20])
def test_cuda_targets_load_through_pinned_slots_or_pageable_memory(tmp_path, slot_bytes):
    """Tensors larger than a slot (several slots per item, slots reused) and a resharded box
    (column block: the pageable path) land bit-exactly on the GPU."""
    from distckpt.io import device_io
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    g = torch.Generator().manual_seed(5)
    big = torch.randn(512, 256, generator=g).to(torch.bfloat16)  # 256 KiB: 64 slots of 4 KiB
    cols = torch.randn(256, 128, generator=g)  # 128 KiB: read through a mapping, not the small-item path
    distckpt.save(
        {
            "big": ShardedTensor.from_rank_offsets("big", big),
            "cols": ShardedTensor.from_rank_offsets("cols", cols),
        },
        tmp_path,
    )
    device_io._pool.clear()
    big_t = torch.zeros(512, 256, dtype=torch.bfloat16, device="cuda")
    cols_t = torch.zeros(256, 64, device="cuda")  # the right half: a strided box of the stored chunk
    strategy = TorchDistLoadShardedStrategy(pinned_slot_bytes=slot_bytes)
    out = distckpt.load(
        {
            "big": ShardedTensor.from_rank_offsets("big", big_t),
            "cols": ShardedTensor.from_rank_offsets("cols", cols_t, (1, 1, 2)),
        },
        tmp_path,
        sharded_strategy=strategy,
        validate_access_integrity=False,
    )
    torch.cuda.synchronize()
    assert out["big"] is big_t and torch.equal(big_t.cpu(), big)
    assert torch.equal(cols_t.cpu(), cols[:, 64:])
    pooled = [b for bufs in device_io._pool.values() for b in bufs]
    if slot_bytes:
        assert pooled and all(b.is_pinned() and b.numel() == slot_bytes for b in pooled)
    else:
        assert not pooled


def test_the_save_slots_on_cpu_tensors_never_call_torch_cuda(monkeypatch):
    """The slot path of a plain save, run on CPU tensors (its CPU-testable form), stays off
    torch.cuda: no stream, event or pinned allocation."""
    from distckpt.io.device_io import PIECE_ALIGN, DeviceToHost

    def forbidden(*_a, **_k):
        raise AssertionError("torch.cuda was called on a CPU-only path")

    for name in (*_CUDA_ENTRY_POINTS, "Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    tensors = [torch.arange(PIECE_ALIGN, dtype=torch.int32), torch.ones(10)]
    ring = DeviceToHost(PIECE_ALIGN, slots=2)
    try:
        got = [(i, bytes(v)) for i, _, v in ring.pieces(tensors)]
    finally:
        ring.close()
    assert b"".join(b for i, b in got if i == 0) == tensors[0].numpy().tobytes()
    assert [b for i, b in got if i == 1] == [tensors[1].numpy().tobytes()]


@pytest.mark.cuda
def test_a_load_under_a_busy_side_stream_lands_after_the_targets_zeroing(tmp_path):
    """The targets are zeroed by work still queued on the caller's stream ``s`` when ``load``
    starts; the reader threads' copies wait for ``s`` (not their own default streams), so the
    loaded values are not overwritten by the zeroing."""
    want = torch.arange(8 * 1024 * 1024, dtype=torch.float32).reshape(8, 1024, 1024)
    distckpt.save({"t": ShardedTensor.from_rank_offsets("t", want)}, tmp_path)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        target = torch.empty(8, 1024, 1024, device="cuda")
        torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
        target.zero_()
        out = distckpt.load({"t": ShardedTensor.from_rank_offsets("t", target)}, tmp_path)
    torch.cuda.synchronize()
    assert torch.equal(out["t"].cpu(), want)
