"""Writing a ``torch_dist`` save's files: staging waves of items to host memory, then writing them.

Each file of a :class:`~distckpt.strategies.torch_dist.plan.SavePlan` is an :class:`Output` (a raw
file descriptor on a local directory, a store's streaming writer elsewhere) written wave by wave
by a pool of writer threads; :func:`write_plan` returns the plan with the records of where every
item landed. Large tensor items get per-block CRC32Cs, written as the file's block table. The
threads share the local files: each wave's items are placed at their offsets and cut into parts
any thread writes (:mod:`.spans`), so a rank with more cores than files uses them all.

A plain (synchronous) save does not copy a CUDA tensor to host memory whole before writing it:
each writer thread streams the CUDA items of its parts through a few pinned slots
(:class:`~distckpt.io.device_io.DeviceToHost`), the next pieces' device-to-host copies
running on a side stream while the current piece is checksummed and written. A contiguous CPU
view that does not own its storage is written from the caller's memory (no copy). Both give the
bytes, CRC32Cs and block entries a whole host copy would (:func:`write_tensor_pieces`); the
slots, ``threads * SLOTS * slot`` bytes, come out of the host memory budget.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from distckpt import storage
from distckpt.budget import host_memory_budget
from distckpt.checksum import crc32c
from distckpt.formats import blockcrc
from distckpt.io.byteio import byte_view
from distckpt.io.device_io import PIECE_ALIGN, SLOT_BYTES, SLOTS, DeviceToHost, caller_streams, is_plain
from distckpt.io.filesystem import (
    ChecksummingSink,
    WriterSink,
    framed,
    write_bytes_item,
    write_tensor_item,
    write_tensor_pieces,
    zip_crc_disabled,
)
from distckpt.strategies.torch_dist import spans
from distckpt.strategies.torch_dist.metadata import Resolved
from distckpt.strategies.torch_dist.plan import SavePlan, Wave, WriteItem, plan_waves, standalone_cpu
from distckpt.strategies.torch_dist.records import Record
from distckpt.strategies.torch_dist.spans import DIRECT, RING, Routes, next_bytes, place, run, settle, tasks

logger = logging.getLogger(__name__)

Ring = Callable[[], DeviceToHost]  # makes a writer thread's slots


class Output:
    """One ``.distcp`` file being written across waves: a raw fd (local) or a store's streaming
    writer; the sink keeps the position and checksum between waves."""

    def __init__(self, location: Resolved, name: str):
        self.name = name
        self.location = location
        self.written: List[Tuple[WriteItem, int, int, int]] = []
        self.blocks: List[blockcrc.Entry] = []  # per-block CRC32Cs of the large tensor items
        self.table: Optional[Tuple[str, int, int]] = None  # the block table written: name, size, CRC
        self.fd = -1
        self.writer = None
        root = storage.local_root(location)
        # A store that lets its data files be written by path (the tiered save's local tier).
        direct = direct_root(location) if root is None else None
        self.direct = direct is not None
        root = root if direct is None else direct
        if root is None:
            self.writer = location.open_writer(name)
            self.sink: ChecksummingSink = WriterSink(self.writer)
        else:
            self.fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self.sink = ChecksummingSink(self.fd)

    def write(
        self, items: List[WriteItem], routes: Optional[Routes] = None, ring: Ring = DeviceToHost
    ) -> None:
        """Append ``items``: staged ones from their payload, routed ones (``routes``, see
        :func:`routes_of`) from their source, through slots (``ring()``) or directly."""
        with zip_crc_disabled():  # per thread (torch keeps it per context): here, not around the save
            self._write(items, routes or {}, ring)

    def _write(self, items: List[WriteItem], routes: Routes, make_ring: Ring) -> None:
        ringed = [it for it in items if routes.get(id(it)) == RING]
        ring = make_ring() if ringed else None
        try:
            pieces = ring.pieces([it.source for it in ringed]) if ring is not None else iter(())
            for it in items:
                route = routes.get(id(it))
                if route is not None:
                    src = it.source
                    chunks = next_bytes(pieces, it.nbytes) if route == RING else [byte_view(src)]
                    done = write_tensor_pieces(self.sink, src.dtype, it.chunk_size, chunks, self.blocks)
                    assert done is not None  # routes_of routes framed tensors only
                    self.written.append((it, *done))
                    it.source = None
                elif isinstance(it.payload, torch.Tensor):
                    self.written.append((it, *write_tensor_item(self.sink, it.payload, self.blocks)))
                else:
                    self.written.append((it, *write_bytes_item(self.sink, it.payload)))
        finally:
            if ring is not None:
                ring.close()

    def place(self, items: List[WriteItem], routes: Routes) -> Optional[List[Any]]:
        """The places of ``items``, next in this file, for threads to write at their offsets
        (:mod:`.spans`); None: this file's wave is written by one thread (:meth:`write`), a
        store's streaming writer or an item whose length is not known before it is written."""
        if self.fd < 0:
            return None
        self.sink.drain()  # what was gathered goes out at the fd's position first
        return place(items, self.sink.position, routes)

    def settle(self, placed: List[Any]) -> None:
        """Record the items :meth:`place` placed once every part of them is written."""
        written, entries = settle(placed)
        self.written.extend(written)
        self.blocks.extend(entries)
        if placed:
            self.sink.position = placed[-1].end
            os.lseek(self.fd, self.sink.position, os.SEEK_SET)  # a later one-thread wave goes on here
        for p in placed:
            p.item.source = None

    def close(self) -> int:
        """Make the file (and its block table, if it has large items) complete and durable;
        returns the file's size."""
        if self.writer is not None:
            self.sink.drain()
            self.writer.close()
        else:
            try:
                self.sink.fsync()
            finally:
                os.close(self.fd)
                self.fd = -1
            if self.direct:
                self.location.created(self.name)
        if self.blocks:
            data = blockcrc.encode(self.blocks)
            name = blockcrc.table_name(self.name)
            storage.write_bytes(self.location, name, data)
            self.table = (name, len(data), crc32c(data))
        return self.sink.position

    def abort(self) -> None:
        try:
            if self.writer is not None:
                self.writer.abort()
            elif self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        except Exception:  # noqa: BLE001 - the first error is the one reported
            logger.debug("closing %s after a failure", self.name, exc_info=True)


def direct_root(location: Resolved) -> Optional[Path]:
    """The directory a store lets its data files be written into by path, or None."""
    return None if isinstance(location, Path) else location.direct_root


# Devices whose tensors a plain save streams through slots. CPU tensors go the direct way (or, if
# they own their storage, as they are); tests add "cpu" to run the slot path without a GPU.
STREAMED_DEVICES = {"cuda"}


def routes_of(plan: SavePlan) -> Routes:
    """The items of a plain save (no staging pool) written without a whole host copy: plain
    contiguous tensors that :func:`write_tensor_pieces` frames, from a device of
    :data:`STREAMED_DEVICES` through slots, and CPU views into a larger storage directly (the
    copy they had was for ``torch.save``, which writes whole storages). On an object store too:
    a store's writer keeps a copy of what it buffers (see ``storage.Writer.write``), so a slot is
    refilled at once. Their ``copies`` flag is cleared: they cost the waves nothing."""
    if plan.staging is not None:
        return {}
    routes: Routes = {}
    for _, items in plan.jobs:
        for it in items:
            src = it.source
            if (
                src is None
                or not is_plain(src)
                or not src.is_contiguous()
                or not framed(src.dtype, it.chunk_size)
            ):
                continue
            if src.device.type in STREAMED_DEVICES:
                routes[id(it)] = RING
            elif src.device.type == "cpu" and it.copies and _shares_storage(src):
                routes[id(it)] = DIRECT
            else:
                continue
            it.copies = False
    return routes


def shared_slot_bytes() -> int:
    """The slot size of writer threads that share files: a quarter of a part (each task's next
    piece copies while its current one is written), a multiple of ``PIECE_ALIGN``."""
    return max(PIECE_ALIGN, spans.PART_BYTES // 4 // PIECE_ALIGN * PIECE_ALIGN)


def _shares_storage(t: torch.Tensor) -> bool:
    """A view into a larger storage (``torch.save`` would write all of it: a save copies it)."""
    return t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()


def slot_bytes_for(budget: int, threads: int) -> int:
    """The slot size of a plain save's writer threads: :data:`SLOT_BYTES`, or less so that all
    threads' slots take at most a quarter of ``budget``; a multiple of ``PIECE_ALIGN``."""
    fit = budget // (4 * max(1, threads) * SLOTS) // PIECE_ALIGN * PIECE_ALIGN
    return max(PIECE_ALIGN, min(SLOT_BYTES, fit))


def _stage_wave(plan: SavePlan, wave: Wave, routes: Optional[Routes] = None) -> Optional[Any]:
    """Copy the wave's items to host memory (into the pool when there is one), except the routed
    ones (written from their source); returns the pool's batch to release once written."""
    if plan.staging is not None:
        needed: Dict[Any, int] = defaultdict(int)
        for _, items in wave:
            for it in items:
                if it.source is not None and it.copies:
                    needed[plan.staging.key_of(it.source)] += 1
        plan.staging.keep_only(needed)
    for _, items in wave:
        for it in items:
            if it.source is not None and (routes is None or id(it) not in routes):
                src = it.source
                it.payload = standalone_cpu(src, it.chunk_size, plan.staging if it.copies else None)
                it.source = None
    return plan.staging.seal() if plan.staging is not None else None


def _write_wave(
    plan: SavePlan,
    wave: Wave,
    pool: Optional[ThreadPoolExecutor],
    last: bool,
    routes: Optional[Routes] = None,
    ring: Ring = DeviceToHost,
) -> None:
    """Write the wave's items (and, ``last``, close every file). With a ``pool`` the threads
    share the files: each local file's items are placed and cut into tasks (:mod:`.spans`), so
    more threads than files all write; a file that cannot be placed is one task."""
    routes = routes or {}
    names = dict(wave)
    if last:  # every file closes in the last wave, also those it adds nothing to
        names = {name: names.get(name, []) for name, _ in plan.jobs}
    outs = {}
    for name in names:
        out = plan.outputs.get(name)
        if out is None:
            out = plan.outputs[name] = Output(plan.checkpoint_dir, name)
        outs[name] = out
    if pool is None:
        for name, items in names.items():
            outs[name].write(items, routes, ring)
    else:
        work: List[Tuple[int, Any]] = []  # (bytes, call)
        spread: Dict[str, List[Any]] = {}
        for name, items in names.items():
            out = outs[name]
            placed = out.place(items, routes) if items else None
            if placed is None:
                work.append((sum(it.nbytes for it in items), partial(out.write, items, routes, ring)))
                continue
            spread[name] = placed
            work.extend((t.nbytes, partial(run, t, ring)) for t in tasks(out.fd, placed))
        work.sort(key=lambda w: -w[0])  # the largest first: the threads finish together
        _run_all(pool, [call for _, call in work])
        for name, placed in spread.items():
            outs[name].settle(placed)
    for items in names.values():
        for it in items:
            it.payload = None
    if last:
        calls = [partial(_close, plan, name, outs[name]) for name in names]
        if pool is None:
            for call in calls:
                call()
        else:
            _run_all(pool, calls)


def _close(plan: SavePlan, name: str, out: Output) -> None:
    plan.file_sizes[name] = out.close()
    if out.table is not None:
        table, size, crc = out.table
        plan.file_sizes[table] = size
        plan.table_crcs[table] = crc


def _run_all(pool: ThreadPoolExecutor, calls: List[Any]) -> None:
    """Run ``calls`` on the pool and wait for all of them (none may still write when a failure
    aborts the files); the first failure is raised."""
    futures = [pool.submit(call) for call in calls]
    error: Optional[BaseException] = None
    for fut in futures:
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001 - the first is raised once all have stopped
            if error is None:
                error = e
    if error is not None:
        raise error


def _abort_outputs(plan: SavePlan) -> None:
    for out in plan.outputs.values():
        out.abort()
    plan.outputs.clear()


# A plan with at most this many bytes is written by the calling thread, file after file: for a few
# MB, starting and feeding writer threads costs more than the writes themselves.
INLINE_WRITE_BYTES = 4 << 20


def _workers(plan: SavePlan, thread_count: int) -> int:
    """``thread_count`` threads for files written by path (they share the files' bytes), at
    most one per file for a store's streaming writers."""
    if storage.local_root(plan.checkpoint_dir) is not None or direct_root(plan.checkpoint_dir) is not None:
        return max(1, thread_count)
    return max(1, min(thread_count, len(plan.jobs)))


@contextmanager
def _writer_pool(plan: SavePlan, thread_count: int) -> Iterator[Optional[ThreadPoolExecutor]]:
    """The writer threads of ``plan`` (:func:`_workers`), or None: write inline (one thread, or
    a small plan)."""
    workers = _workers(plan, thread_count)
    if workers == 1 or sum(it.nbytes for _, items in plan.jobs for it in items) <= INLINE_WRITE_BYTES:
        yield None
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield pool


def write_waves(plan: SavePlan, waves: List[Wave], thread_count: int) -> None:
    """The blocking part of a bounded async save: stage and write every wave but the last, then
    stage the last one, which ``write_plan`` writes. A failure is kept in the plan and raised by
    ``write_plan`` (so every rank learns of it at finalization)."""
    plan.waves = len(waves)
    try:
        with _writer_pool(plan, thread_count) as pool:
            for wave in waves[:-1]:
                staged = _stage_wave(plan, wave)
                try:
                    _write_wave(plan, wave, pool, last=False)
                finally:
                    if staged is not None:
                        staged.release()
        plan.pending = waves[-1]
        plan.staged = _stage_wave(plan, plan.pending)
    except Exception as e:  # noqa: BLE001 - raised by write_plan, shared at finalization
        plan.error = e
        _abort_outputs(plan)
        if plan.staged is not None:
            plan.staged.release()
            plan.staged = None
        if plan.staging is not None:
            plan.staging.seal().release()  # this save's unsealed copies (another save's stay out)


def write_plan(plan: SavePlan, thread_count: int = 2, budget: Optional[int] = None) -> SavePlan:
    """Write the files of ``plan`` with ``thread_count`` threads (at most one per file for a store's
    streaming writers, see :func:`_workers`); no collectives.

    Writes what is left: the pending wave of an async save, or (a plain save) every item, in
    waves of at most ``budget`` bytes of host copies (None: :func:`distckpt.budget.host_memory_budget`).
    """
    try:
        if plan.error is not None:
            raise plan.error
        with _writer_pool(plan, thread_count) as pool:
            if plan.pending is not None:
                _write_wave(plan, plan.pending, pool, last=True)
            else:
                if budget is None:
                    budget = host_memory_budget()
                routes = routes_of(plan)
                ring: Ring = DeviceToHost
                if RING in routes.values():
                    threads = _workers(plan, thread_count) if pool is not None else 1
                    slot_bytes = slot_bytes_for(budget, threads)
                    if pool is not None:
                        # A part (spans.PART_BYTES) is one thread's task: its copies overlap its
                        # writes only if it takes several slots' worth.
                        slot_bytes = min(slot_bytes, shared_slot_bytes())
                    budget = max(1, budget - threads * SLOTS * slot_bytes)  # the slots' share
                    # the writer threads' copies wait for this thread's streams, not their own
                    after = caller_streams(
                        [it.source for _, items in plan.jobs for it in items if routes.get(id(it)) == RING]
                    )
                    ring = partial(DeviceToHost, slot_bytes, SLOTS, after)
                waves = plan_waves(plan.jobs, budget)
                plan.waves = len(waves)
                for i, wave in enumerate(waves):
                    staged = _stage_wave(plan, wave, routes)
                    try:
                        _write_wave(plan, wave, pool, i == len(waves) - 1, routes, ring)
                    finally:
                        if staged is not None:
                            staged.release()
    except BaseException:
        _abort_outputs(plan)
        raise
    finally:
        if plan.staged is not None:
            plan.staged.release()  # the next save may reuse the buffers now
            plan.staged = None
    records: List[Record] = []
    for name, _ in plan.jobs:
        for it, start, length, crc in plan.outputs[name].written:
            records.append(Record(it.fqn, it.chunk_offset, it.chunk_size, name, start, length, crc))
    plan.outputs.clear()
    plan.records = records
    plan.written = True
    return plan
