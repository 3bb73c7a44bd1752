"""Writing a ``torch_dist`` save's files: staging waves of items to host memory, then writing them.

Each file of a :class:`~distckpt.strategies.torch_dist.plan.SavePlan` is an :class:`Output` (a raw
file descriptor on a local directory, a store's streaming writer elsewhere) written wave by wave
by a pool of writer threads; :func:`write_plan` returns the plan with the records of where every
item landed. Large tensor items get per-block CRC32Cs, written as the file's block table.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from distckpt import storage
from distckpt.budget import host_memory_budget
from distckpt.checksum import crc32c
from distckpt.strategies import blockcrc
from distckpt.strategies.filesystem import (
    ChecksummingSink,
    WriterSink,
    write_bytes_item,
    write_tensor_item,
    zip_crc_disabled,
)
from distckpt.strategies.torch_dist.metadata import Resolved
from distckpt.strategies.torch_dist.plan import SavePlan, Wave, WriteItem, plan_waves, standalone_cpu
from distckpt.strategies.torch_dist.records import Record

logger = logging.getLogger(__name__)


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
        if root is None:
            self.writer = location.open_writer(name)
            self.sink: ChecksummingSink = WriterSink(self.writer)
        else:
            self.fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self.sink = ChecksummingSink(self.fd)

    def write(self, items: List[WriteItem]) -> None:
        for it in items:
            if isinstance(it.payload, torch.Tensor):
                self.written.append((it, *write_tensor_item(self.sink, it.payload, self.blocks)))
            else:
                self.written.append((it, *write_bytes_item(self.sink, it.payload)))

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


def _stage_wave(plan: SavePlan, wave: Wave) -> Optional[Any]:
    """Copy the wave's items to host memory (into the pool when there is one); returns the
    pool's batch to release once written."""
    if plan.staging is not None:
        needed: Dict[Any, int] = defaultdict(int)
        for _, items in wave:
            for it in items:
                if it.source is not None and it.copies:
                    needed[plan.staging.key_of(it.source)] += 1
        plan.staging.keep_only(needed)
    for _, items in wave:
        for it in items:
            if it.source is not None:
                src = it.source
                it.payload = standalone_cpu(src, it.chunk_size, plan.staging if it.copies else None)
                it.source = None
    return plan.staging.seal() if plan.staging is not None else None


def _write_wave(plan: SavePlan, wave: Wave, pool: Optional[ThreadPoolExecutor], last: bool) -> None:
    def one(name: str, items: List[WriteItem]) -> None:
        out = plan.outputs.get(name)
        if out is None:
            out = plan.outputs[name] = Output(plan.checkpoint_dir, name)
        out.write(items)
        for it in items:
            it.payload = None
        if last:
            plan.file_sizes[name] = out.close()
            if out.table is not None:
                table, size, crc = out.table
                plan.file_sizes[table] = size
                plan.table_crcs[table] = crc

    names = dict(wave)
    if last:  # every file closes in the last wave, also those it adds nothing to
        names = {name: names.get(name, []) for name, _ in plan.jobs}
    if pool is None:
        for name, items in names.items():
            one(name, items)
        return
    for fut in [pool.submit(one, name, items) for name, items in names.items()]:
        fut.result()


def _abort_outputs(plan: SavePlan) -> None:
    for out in plan.outputs.values():
        out.abort()
    plan.outputs.clear()


# A plan with at most this many bytes is written by the calling thread, file after file: for a few
# MB, starting and feeding writer threads costs more than the writes themselves.
INLINE_WRITE_BYTES = 4 << 20


@contextmanager
def _writer_pool(plan: SavePlan, thread_count: int) -> Iterator[Optional[ThreadPoolExecutor]]:
    """The writer threads of ``plan`` (one per file up to ``thread_count``), or None: write
    inline (a single file, one thread, or a small plan)."""
    workers = max(1, min(thread_count, len(plan.jobs)))
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
        with zip_crc_disabled(), _writer_pool(plan, thread_count) as pool:
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
    """Write the files of ``plan`` (threads, one per file up to ``thread_count``); no collectives.

    Writes what is left: the pending wave of an async save, or (a plain save) every item, in
    waves of at most ``budget`` bytes of host copies (None: :func:`distckpt.budget.host_memory_budget`).
    """
    try:
        if plan.error is not None:
            raise plan.error
        with zip_crc_disabled(), _writer_pool(plan, thread_count) as pool:
            if plan.pending is not None:
                _write_wave(plan, plan.pending, pool, last=True)
            else:
                if budget is None:
                    budget = host_memory_budget()
                waves = plan_waves(plan.jobs, budget)
                plan.waves = len(waves)
                for i, wave in enumerate(waves):
                    staged = _stage_wave(plan, wave)
                    try:
                        _write_wave(plan, wave, pool, last=i == len(waves) - 1)
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
