"""Writer threads sharing a rank's files (``torch_dist/spans.py``): each wave's items placed at
their offsets and cut into parts that any thread writes, with the files, records and block
tables the one-thread writer makes, on every route an item can take (a staged copy, the caller's
own memory, slots, a byte item) and with items that cannot be placed (one thread for that wave).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import threading
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.io.device_io import SLOTS, save_slot_bytes
from distckpt.strategies.torch_dist import spans
from distckpt.strategies.torch_dist import write as write_module
from distckpt.strategies.torch_dist.plan import DEFAULT_FILES_PER_RANK
from distckpt.strategies.torch_dist.save import TorchDistSaveShardedStrategy
from distckpt.strategies.torch_dist.write import write_plan
from tests.support import faults
from tests.support.devices import streamed
from tests.support.harness import run_ranks

KiB, MiB = 1 << 10, 1 << 20
BLOCK = blockcrc.BLOCK_SIZE
WORLD = 2
TIMEOUT = 120


@contextlib.contextmanager
def small_parts(part_bytes: int = BLOCK) -> Iterator[None]:
    """Parts of ``part_bytes`` (one CRC32C block by default): a few MiB make dozens of parts."""
    saved = spans.PART_BYTES
    spans.PART_BYTES = part_bytes
    try:
        yield
    finally:
        spans.PART_BYTES = saved


@contextlib.contextmanager
def counted_tasks() -> Iterator[dict]:
    """How many tasks ran, and on how many threads, for the duration."""
    seen: dict = {"tasks": 0, "threads": set()}
    lock, real = threading.Lock(), write_module.run

    def counting(task, *args):
        with lock:
            seen["tasks"] += 1
            seen["threads"].add(threading.get_ident())
        return real(task, *args)

    write_module.run = counting
    try:
        yield seen
    finally:
        write_module.run = real


def _state(rank: int = 0, fp8: bool = True, world: int = 1) -> dict:
    """Items of every kind: tensors of many parts, many small ones, views into one storage (the
    caller's memory), a non-contiguous view (a copy), byte items (objects) and, if torch has it,
    a dtype torch.save frames itself (an item that cannot be placed)."""
    g = torch.Generator().manual_seed(7 + rank)
    base = torch.randn(3000, 200, generator=g)
    pieces = {
        "big.f32": torch.randn(900, 1000, generator=g),  # 3.4 MiB: 14 parts of a block
        "big.bf16": torch.randn(700, 1100, generator=g).to(torch.bfloat16),
        "view.rows": base[100:2100],
        "view.tail": base[2100:],
        "strided": base[:80, :90],  # copied (staged), as are the two below: waves under a budget
        "strided.b": base[:30, :40],
        "strided.c": base[:10, :20],
        "mid": torch.arange(BLOCK // 2 + 3, dtype=torch.int32),  # just over 2 blocks
        "odd": torch.arange(999, dtype=torch.int16),
    }
    if fp8 and hasattr(torch, "float8_e4m3fn"):
        pieces["fp8"] = torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn)
    for k in range(60):
        pieces[f"small.{k}"] = torch.full((k + 1,), float(k + rank))
    sd: dict = {
        name: ShardedTensor.from_rank_offsets(name, t.unsqueeze(0), (0, rank, world))
        for name, t in pieces.items()
    }
    for k in range(3):
        blob = {"k": k, "blob": bytes(range(k * 40))}
        sd[f"obj.{k}"] = ShardedObject(f"obj.{k}", blob, (world,), (rank,))
    return sd


def _digests(root: Path) -> Dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.name.endswith(".distcp") or p.name.endswith(".distcp.crc")
    }


def _write(root: Path, threads: int, budget=None, fp8: bool = True, devices=()) -> tuple:
    root.mkdir()
    with streamed(*devices):
        plan = TorchDistSaveShardedStrategy().prepare(_state(fp8=fp8), root)
        write_plan(plan, threads, budget=budget)
    return plan.records, plan.file_sizes, plan.table_crcs, plan.waves


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize("budget", [None, 4 * KiB])
@pytest.mark.parametrize("devices", [(), ("cpu",)], ids=["copies-and-views", "slots"])
def test_threads_sharing_the_files_write_what_one_thread_writes(tmp_path, threads, budget, devices):
    with small_parts():
        ref = _write(tmp_path / "one", 1, budget, devices=devices)
        with counted_tasks() as seen:
            got = _write(tmp_path / "many", threads, budget, devices=devices)
    assert _digests(tmp_path / "many") == _digests(tmp_path / "one")
    assert got == ref
    assert len(_digests(tmp_path / "one")) == 2 * DEFAULT_FILES_PER_RANK  # 2 files, 2 block tables
    # the files' bytes were shared: far more tasks than files, on the writer threads
    assert seen["tasks"] > 10 and threading.main_thread().ident not in seen["threads"], seen
    if budget is not None:
        assert ref[3] >= 3  # several waves: placed ones and the fp8 item's one-thread wave alternate


def test_shared_writers_take_slots_of_a_quarter_part_each_task_overlapping_copies_and_writes(tmp_path):
    """Slots of a quarter of a part: a task's next piece is copied while its current one is
    written; all threads' slots together stay within threads x SLOTS x that size."""
    with small_parts(4 * BLOCK):
        assert write_module.shared_slot_bytes() == BLOCK
        start = save_slot_bytes(reset_peak=True)[0]
        _write(tmp_path / "many", 3, devices=("cpu",))
        live, peak = save_slot_bytes()
    assert live == start and 0 < peak - start <= 3 * SLOTS * BLOCK


def test_a_file_with_an_item_that_cannot_be_placed_is_written_by_one_thread(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 dtype in this torch")
    with small_parts(), counted_tasks() as seen:
        _write(tmp_path / "with", 3)
    with_fp8 = seen["tasks"]
    with small_parts(), counted_tasks() as seen:
        _write(tmp_path / "without", 3, fp8=False)
    # the fp8 item's file went to one thread whole: fewer tasks than when both files are shared
    assert 0 < with_fp8 < seen["tasks"]


def test_parts_cover_every_byte_once_and_cut_tensors_on_crc_blocks(tmp_path):
    plan = TorchDistSaveShardedStrategy().prepare(_state(fp8=False), tmp_path)
    items = [it for _, bucket in plan.jobs for it in bucket]
    for it in items:  # staged, as a plain save's waves stage them
        if it.source is not None:
            it.payload, it.source = write_module.standalone_cpu(it.source, it.chunk_size, None), None
    placed = spans.place(items, 13, {})
    assert placed is not None and placed[0].start == 13
    cut = spans.tasks(-1, placed, 4 * BLOCK)
    covered, pos = [], 13
    for task in cut:
        assert task.offset == pos  # tasks are contiguous and start where the last one ended
        for part in task.parts:
            assert part.lo % BLOCK == 0 and part.hi - part.lo <= 4 * BLOCK
            covered.append((id(part.placed), part.lo, part.hi))
            pos += part.nbytes
    assert pos == placed[-1].end
    for p in placed:
        mine = sorted((lo, hi) for key, lo, hi in covered if key == id(p))
        assert mine[0][0] == 0 and mine[-1][1] == p.length
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    with pytest.raises(ValueError, match="multiple"):
        spans.tasks(-1, placed, BLOCK + 1)


def test_an_item_of_unknown_length_leaves_the_file_to_one_thread():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 dtype in this torch")
    t = torch.randn(8, 8).to(torch.float8_e4m3fn)
    item = write_module.WriteItem("fp8", (0, 0), (8, 8), t, t.numel())
    assert spans.place([item], 0, {}) is None


def test_a_storage_error_in_one_part_stops_the_save_and_leaves_no_thread_writing(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with small_parts(), contextlib.ExitStack() as stack:
        faults.sinks_patched(stack, faults.FaultySink, faults.FaultyPositionedSink)
        plan = TorchDistSaveShardedStrategy().prepare(_state(fp8=False), root)
        with pytest.raises(OSError) as err:
            write_plan(plan, 4)
    assert err.value.errno == errno.ENOSPC
    assert plan.outputs == {} and not plan.written


# --------------------------------------------------------------------------- whole saves, 2 ranks


class ManyWriters(TorchDistSaveShardedStrategy):
    """The default 2 files per rank, written by 4 threads (as on a GPU host with 4 cores a rank)."""

    def writer_threads(self, checkpoint_dir=None) -> int:
        return 4


def _save_and_load(ckpt: str, async_save: bool) -> bool:
    rank = ddist.get_rank()
    with small_parts():
        request = distckpt.save(_state(rank, world=WORLD), ckpt, ManyWriters(), async_sharded_save=async_save)
        if async_save:
            request.execute_sync()
    want = _state(rank, world=WORLD)
    back = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(sh.data), (0, rank, WORLD))
        for k, sh in want.items()
        if isinstance(sh, ShardedTensor)
    }
    out = distckpt.load(back, ckpt, verify=True)
    return all(torch.equal(out[k].view(torch.uint8), want[k].data.view(torch.uint8)) for k in back)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_with_more_writers_than_files_loads_back_verified(tmp_path, async_save):
    assert (
        run_ranks(WORLD, _save_and_load, str(tmp_path / "ckpt"), async_save, timeout=TIMEOUT)
        == [True] * WORLD
    )
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) == WORLD * DEFAULT_FILES_PER_RANK


def _save_failing(ckpt: str) -> tuple:
    rank = ddist.get_rank()
    with small_parts(), contextlib.ExitStack() as stack:
        if rank == 1:
            faults.sinks_patched(stack, faults.FaultySink, faults.FaultyPositionedSink)
        try:
            distckpt.save(_state(rank, fp8=False, world=WORLD), ckpt, ManyWriters())
        except CheckpointingException as e:
            return str(e)
    return None


def test_a_failing_part_on_one_rank_fails_the_save_on_every_rank_alike(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = run_ranks(WORLD, _save_failing, str(ckpt), timeout=TIMEOUT)
    assert out[0] is not None and out[0] == out[1]
    assert "No space left on device" in out[0] and "rank(s) 1" in out[0]
    assert not ckpt.exists()


@pytest.mark.cuda
def test_writer_threads_copy_after_the_work_queued_on_the_callers_stream(tmp_path):
    """A save made under ``torch.cuda.stream(s)``: the writer threads (4, sharing the files) wait
    for ``s``, where a kernel still fills the tensor when ``save`` starts."""
    side = torch.cuda.Stream()
    t = torch.zeros(8, 1024, 1024, device="cuda")  # 32 MiB: many parts of a block
    with small_parts(), torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the caller's stream busy
        t.fill_(3.0)
        distckpt.save({"t": ShardedTensor.from_rank_offsets("t", t)}, tmp_path, ManyWriters())
    out = distckpt.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(8, 1024, 1024))}, tmp_path)
    assert torch.equal(out["t"], torch.full((8, 1024, 1024), 3.0))
