"""A plain save's write pipeline: tensors streamed through a few slots (device-to-host copies of
the next pieces while the current one is written) or written from a CPU view's own memory, with
the bytes, CRC32Cs and block tables a whole host copy gives.

The slot path runs on CPU tensors too (``write.STREAMED_DEVICES`` plus ``"cpu"``), so its logic is
tested without a GPU; the CUDA tests (``cuda`` marker) run the pinned path itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch

import distckpt
from distckpt import ShardedTensor
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.io.device_io import PIECE_ALIGN, SLOTS, DeviceToHost, save_slot_bytes
from distckpt.io.filesystem import ChecksummingSink, write_bytes_item, write_tensor_item, write_tensor_pieces
from distckpt.strategies.torch_dist import write as write_module
from distckpt.strategies.torch_dist.plan import DEFAULT_FILES_PER_RANK, writer_threads
from distckpt.strategies.torch_dist.save import TorchDistSaveShardedStrategy
from distckpt.strategies.torch_dist.write import slot_bytes_for, write_plan
from tests.support import faults
from tests.support.devices import streamed
from tests.support.harness import run_ranks

KiB, MiB = 1 << 10, 1 << 20
WORLD = 2
TIMEOUT = 120


def _data_files(root: Path) -> Dict[str, str]:
    """Digest of every data file and block table (the files whose bytes the pipeline writes)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.name.endswith(".distcp") or p.name.endswith(".distcp.crc")
    }


# --------------------------------------------------------------------------- the slots


def _walk(ring: DeviceToHost, tensors):
    """Every piece the ring hands out, copied (a piece is valid until the next one)."""
    return [(i, pos, bytes(view)) for i, pos, view in ring.pieces(tensors)]


def test_slots_hand_out_every_byte_in_order_large_tensors_in_slot_sized_pieces():
    slot = PIECE_ALIGN
    tensors = [
        torch.arange(3 * slot // 4 + 5, dtype=torch.int32),  # 3 slots and a bit: 4 pieces
        torch.arange(100, dtype=torch.int16),
        torch.empty(0),
        torch.arange(7, dtype=torch.float64),
    ]
    ring = DeviceToHost(slot, slots=2)
    try:
        pieces = _walk(ring, tensors)
    finally:
        ring.close()
    for i, t in enumerate(tensors):
        got = b"".join(b for j, _, b in pieces if j == i)
        assert got == t.numpy().tobytes(), i
    big = [(pos, len(b)) for j, pos, b in pieces if j == 0]
    assert [pos for pos, _ in big] == [0, slot, 2 * slot, 3 * slot]
    assert all(n == slot for _, n in big[:-1]) and big[-1][1] == 20
    # the two small tensors share the last piece's slot: 2 slots were enough for all of it
    assert [j for j, _, _ in pieces] == [0, 0, 0, 0, 1, 3]


def test_many_small_tensors_share_slots_and_memory_stays_within_the_slots():
    tensors = [torch.full((1000 + k,), k, dtype=torch.int32) for k in range(300)]  # ~1.2 MiB
    before = save_slot_bytes(reset_peak=True)[0]
    ring = DeviceToHost(PIECE_ALIGN, slots=3)
    try:
        pieces = _walk(ring, tensors)
        held = save_slot_bytes()[0] - before
    finally:
        ring.close()
    live, peak = save_slot_bytes()
    assert live == before and peak - before <= 3 * PIECE_ALIGN and held == 3 * PIECE_ALIGN
    assert len(pieces) == len(tensors)  # none was cut: each fits a slot whole
    assert [b for _, _, b in pieces] == [t.numpy().tobytes() for t in tensors]


def test_a_slot_size_that_is_not_whole_crc_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        DeviceToHost(PIECE_ALIGN + 1)
    with pytest.raises(ValueError, match="multiple"):
        DeviceToHost(0)


def test_slot_size_shrinks_with_the_budget_and_never_below_one_block():
    assert slot_bytes_for(1 << 40, 8) == 32 * MiB
    assert slot_bytes_for(64 * MiB, 2) == 4 * MiB  # a quarter of the budget over 2 x SLOTS slots
    assert slot_bytes_for(64 * MiB, 2) * 2 * SLOTS <= 64 * MiB // 4
    assert slot_bytes_for(1, 16) == PIECE_ALIGN


@pytest.mark.parametrize("local_ranks, threads", [(1, 8), (2, 8), (4, 4), (8, 2), (16, 1)])
def test_default_writer_threads_follow_the_cores_of_a_16_core_host(monkeypatch, local_ranks, threads):
    """A 16-core GPU host: one writer thread per core of the rank, at most 8; the files stay 2."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert writer_threads(DEFAULT_FILES_PER_RANK, False, None) == threads
    assert TorchDistSaveShardedStrategy().thread_count == DEFAULT_FILES_PER_RANK == 2
    assert writer_threads(3, True, None) == 3  # a count given is used as it is


def test_default_writer_threads_are_one_on_a_host_with_a_core_per_rank(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert writer_threads(DEFAULT_FILES_PER_RANK, False, None) == 1


# --------------------------------------------------------------------------- one item from pieces


@pytest.mark.parametrize(
    "shape, dtype",
    [((5,), torch.float32), ((33, 1000), torch.bfloat16), ((3, 256, 300), torch.float32), ((), torch.int64)],
)
def test_an_item_written_from_pieces_is_the_item_written_from_a_whole_copy(tmp_path, shape, dtype):
    t = (torch.arange(max(1, torch.Size(shape).numel())) % 251).to(dtype).reshape(shape)
    flat = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    results, files = [], []
    for name in ("whole", "pieces"):
        path = tmp_path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sink, blocks = ChecksummingSink(fd), []
        write_bytes_item(sink, b"x" * 13)  # the item starts off the 64-byte alignment
        if name == "whole":
            got = write_tensor_item(sink, t.clone(), blocks)
        else:
            cut = [flat[p : p + PIECE_ALIGN] for p in range(0, len(flat), PIECE_ALIGN)]
            got = write_tensor_pieces(sink, dtype, tuple(shape), cut, blocks)
        sink.fsync()
        os.close(fd)
        results.append((got, blocks))
        files.append(path.read_bytes())
    assert files[0] == files[1]
    assert results[0] == results[1]
    if len(flat) >= blockcrc.MIN_PAYLOAD:
        assert len(results[1][1]) == 1 and len(results[1][1][0].blocks) > 2


def test_pieces_that_cut_a_crc_block_or_miss_bytes_are_refused(tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        sink = ChecksummingSink(fd)
        with pytest.raises(ValueError, match="whole blocks"):
            write_tensor_pieces(sink, torch.uint8, (3 * PIECE_ALIGN,), [b"a" * 100, b"b" * 100], [])
        with pytest.raises(ValueError, match="bytes of a tensor"):
            write_tensor_pieces(sink, torch.uint8, (300,), [b"a" * 100], [])
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- whole saves


def _state(rank: int, clone: bool = False) -> dict:
    """Large tensors (several slots each), many small ones, views into a larger storage, a
    non-contiguous view and a dtype torch.save frames itself; ``clone``: each its own copy."""
    g = torch.Generator().manual_seed(100 + rank)
    base = torch.randn(4096, 160, generator=g)  # one storage, several contiguous views into it
    pieces = {
        "big.a": torch.randn(700, 1000, generator=g),
        "big.b": torch.randn(300, 900, generator=g).to(torch.bfloat16),
        "view.rows": base[1000:3000],
        "view.tail": base[3000:],
        "strided": base[:64, :100],  # non-contiguous: copied whole, as before
        "odd": torch.arange(1000, dtype=torch.int16),
    }
    if hasattr(torch, "float8_e4m3fn"):
        pieces["fp8"] = torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn)
    for k in range(150):
        pieces[f"small.{k}"] = torch.full((k + 1,), float(k + rank))
    sd = {}
    for name, t in pieces.items():
        if clone:
            t = t.clone()
        sd[name] = ShardedTensor.from_rank_offsets(name, t.unsqueeze(0), (0, rank, WORLD))
    return sd


def _save(ckpt: str, clone: bool, devices, budget) -> tuple:
    """Every rank: save ``_state`` with ``devices`` streamed; returns the slots' peak bytes."""
    rank = ddist.get_rank()
    before = save_slot_bytes(reset_peak=True)[0]
    with streamed(*devices):
        distckpt.set_host_memory_budget(budget)
        try:
            distckpt.save(_state(rank, clone), ckpt)
        finally:
            distckpt.set_host_memory_budget(None)
    live, peak = save_slot_bytes()
    return live - before, peak - before


def _load_check(ckpt: str) -> bool:
    rank = ddist.get_rank()
    want = _state(rank, clone=True)
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(sh.data), (0, rank, WORLD))
        for k, sh in want.items()
    }
    out = distckpt.load(request, ckpt, verify=True)
    return all(torch.equal(out[k].view(torch.uint8), want[k].data.view(torch.uint8)) for k in want)


def test_streamed_and_direct_saves_write_the_files_of_a_save_from_whole_copies(tmp_path):
    """The reference: every tensor its own storage (written as it is, the path before the
    pipeline). Then the same values as views (written from their memory), and through slots of
    256 KiB (an 8 MiB budget), smaller than the large items."""
    ref, direct, ring = tmp_path / "ref", tmp_path / "direct", tmp_path / "ring"
    run_ranks(WORLD, _save, str(ref), True, (), None, timeout=TIMEOUT)
    run_ranks(WORLD, _save, str(direct), False, (), None, timeout=TIMEOUT)
    slots = run_ranks(WORLD, _save, str(ring), False, ("cpu",), "8MiB", timeout=TIMEOUT)
    assert _data_files(ref) and any(n.endswith(".crc") for n in _data_files(ref))
    assert _data_files(direct) == _data_files(ref)
    assert _data_files(ring) == _data_files(ref)
    # the slots: taken, all given back, never more than the writer threads' share
    bound = 2 * SLOTS * slot_bytes_for(4 * MiB, 2)  # 8 MiB for 2 ranks: 4 MiB each, <= 2 threads
    assert slot_bytes_for(4 * MiB, 2) == PIECE_ALIGN
    assert all(live == 0 and 0 < peak <= bound for live, peak in slots), slots
    manifest_a = (ref / ".distckpt_manifest.json").read_text()
    assert '"torch_dist"' in manifest_a
    assert run_ranks(WORLD, _load_check, str(ring), timeout=TIMEOUT) == [True] * WORLD


@contextlib.contextmanager
def staged_copies() -> Iterator[list]:
    """The items copied whole (the staging path), by shape, for the duration."""
    seen, real = [], write_module.standalone_cpu

    def counting(t, shape, staging):
        seen.append(tuple(shape))
        return real(t, shape, staging)

    write_module.standalone_cpu = counting
    try:
        yield seen
    finally:
        write_module.standalone_cpu = real


def _plain_plan_under_a_small_budget(ckpt: str) -> tuple:
    rank = ddist.get_rank()
    with streamed("cpu"), staged_copies() as copied:
        plan = TorchDistSaveShardedStrategy().prepare(_state(rank), Path(ckpt))
        before = save_slot_bytes(reset_peak=True)[0]
        write_plan(plan, 2, budget=2 * MiB)
    live, peak = save_slot_bytes()
    return plan.waves, live - before, peak - before, sorted(copied)


def test_streamed_items_cost_the_waves_nothing_and_the_slots_fit_the_budget(tmp_path):
    out = run_ranks(WORLD, _plain_plan_under_a_small_budget, str(tmp_path), timeout=TIMEOUT)
    assert 700 * 1000 * 4 + 300 * 900 * 2 > 2 * MiB  # the two large items alone exceed the budget
    # copied whole: only the non-contiguous view and (if torch has it) the dtype torch.save frames
    expected = sorted([(1, 64, 100)] + ([(1, 64, 64)] if hasattr(torch, "float8_e4m3fn") else []))
    assert [o[3] for o in out] == [expected] * WORLD
    for waves, live, peak, _ in out:
        # the staged copies left (non-contiguous view, fp8) fit one wave; the slots of 2 writer
        # threads, 2 x 256 KiB each (the smallest slots), are what the save holds besides them
        assert waves == 1 and live == 0 and 0 < peak <= 2 * SLOTS * PIECE_ALIGN, out


def _save_failing_mid_pipeline(ckpt: str) -> tuple:
    """Every rank: a save whose storage fails on rank 1 after an item's first write (its frame's
    header: the rest of the item is still in the slots); returns what it raised and the slots
    held afterwards."""
    rank = ddist.get_rank()
    with streamed("cpu"), contextlib.ExitStack() as stack:
        if rank == 1:
            faults.sinks_patched(stack, faults.FaultySink, faults.FaultyPositionedSink)
        try:
            distckpt.save(_state(rank), ckpt)
        except Exception as e:  # noqa: BLE001 - what every rank raised is the test's subject
            return isinstance(e, CheckpointingException), str(e), save_slot_bytes()[0]
    return None


def test_a_write_error_mid_pipeline_fails_every_rank_alike_and_gives_the_slots_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = run_ranks(WORLD, _save_failing_mid_pipeline, str(ckpt), timeout=TIMEOUT)
    assert all(o is not None and o[0] for o in out), out
    assert out[0][1] == out[1][1] and "No space left on device" in out[0][1] and "rank(s) 1" in out[0][1]
    assert [o[2] for o in out] == [0] * WORLD
    assert not ckpt.exists() and [p.name for p in tmp_path.iterdir()] == []
    # the next save (same rank processes) succeeds and loads back
    run_ranks(WORLD, _save, str(ckpt), False, ("cpu",), None, timeout=TIMEOUT)
    assert run_ranks(WORLD, _load_check, str(ckpt), timeout=TIMEOUT) == [True] * WORLD


# --------------------------------------------------------------------------- CUDA


def _cuda_state(device) -> dict:
    g = torch.Generator().manual_seed(7)
    host = {
        "w": torch.randn(1500, 1024, generator=g).to(torch.bfloat16),  # 3 MiB: several 256 KiB slots
        "m": torch.randn(700, 1000, generator=g),
        "flat": torch.randn(5000, generator=g),
        "strided": torch.randn(64, 48, generator=g).t(),
    }
    host.update({f"s{k}": torch.full((k + 1,), float(k)) for k in range(100)})
    return {k: ShardedTensor.from_rank_offsets(k, t.to(device)) for k, t in host.items()}


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [None, "8MiB"])
def test_cuda_save_streams_through_pinned_slots_and_writes_the_cpu_saves_bytes(tmp_path, budget):
    distckpt.save(_cuda_state("cpu"), tmp_path / "cpu")
    before = save_slot_bytes(reset_peak=True)[0]
    distckpt.set_host_memory_budget(budget)
    try:
        with staged_copies() as copied:
            distckpt.save(_cuda_state("cuda"), tmp_path / "cuda")
    finally:
        distckpt.set_host_memory_budget(None)
    live, peak = save_slot_bytes()
    assert copied == [(48, 64)]  # no whole host copy of a contiguous CUDA tensor: only the transposed one
    assert _data_files(tmp_path / "cuda") == _data_files(tmp_path / "cpu")
    assert live == before and peak > before
    if budget is not None:
        assert peak - before <= 8 * MiB // 4
    target = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(sh.data))
        for k, sh in _cuda_state("cuda").items()
    }
    out = distckpt.load(target, tmp_path / "cuda", verify=True)
    want = _cuda_state("cuda")
    assert all(torch.equal(out[k], want[k].data) for k in want)


@pytest.mark.cuda
def test_cuda_save_sees_the_writes_queued_before_it(tmp_path):
    """The side stream waits for the caller's stream: a tensor filled by a kernel still queued
    when save starts is saved with its new values."""
    t = torch.zeros(4096, 1024, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
    t.fill_(3.0)
    distckpt.save({"t": ShardedTensor.from_rank_offsets("t", t)}, tmp_path)
    out = distckpt.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(4096, 1024))}, tmp_path)
    assert torch.equal(out["t"], torch.full((4096, 1024), 3.0))
