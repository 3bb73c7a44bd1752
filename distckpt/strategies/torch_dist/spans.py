"""Writing a local ``.distcp`` file with several threads, each part of it at its own offset.

A file's items are laid end to end, and each item's length is known before a byte of it is
written: a tensor item is its archive header, the tensor's bytes and its trailer, and the frame
(:func:`~distckpt.formats.zip_archive.expected_frame`) depends only on the dtype, the shape
and where the item starts modulo 64; a byte item (a pickled object) is its bytes. So once a wave
of a file's items is known, :func:`place` gives every item its offset, and :func:`tasks` cuts
the file into *parts* (a large tensor's bytes into pieces of :data:`PART_BYTES`, a multiple of
the CRC32C block; small items whole, a run of them to one task). Any writer thread may write
any task with positioned writes (``pwrite``/``pwritev``), checksumming as it goes, and
:func:`settle` combines the parts' CRC32Cs into each item's, with the same per-block CRC32Cs as
one pass over the item: the files, records and block tables are byte for byte those of the
one-thread writer (:meth:`~distckpt.strategies.torch_dist.write.Output.write`).

This is what lets a rank use the cores it has without changing its files: a save writes
``thread_count`` files per rank (Megatron-Core's layout, 2 by default), and as many threads as
the rank has cores for (up to 8) share their bytes. A task's tensor bytes come from a staged
host copy, from the caller's own CPU memory (:data:`DIRECT`), or from a device through the
thread's pinned slots (:data:`RING`, :class:`~distckpt.io.device_io.DeviceToHost`),
the next piece's copy running while the current one is written.

An item whose length is not known in advance (a tensor ``torch.save`` frames itself) makes
:func:`place` return None, and that file's wave is written by one thread as before. A store's
streaming writer (an object store) is sequential: its files are always written that way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from distckpt.formats import blockcrc
from distckpt.formats.zip_archive import ALIGN, SERIALIZATION_ID, expected_frame, tensor_archive_frame
from distckpt.io.byteio import byte_view
from distckpt.io.device_io import DeviceToHost
from distckpt.io.filesystem import ChecksummingSink
from distckpt.strategies.torch_dist.plan import WriteItem

# How a plain save's item reaches its file without a staged copy (see write.routes_of).
RING = "ring"  # in pieces through a writer thread's slots (DeviceToHost)
DIRECT = "direct"  # from the source's own memory (a contiguous CPU view)
Routes = Dict[int, str]  # id(item) -> RING or DIRECT; items not in it are staged

# A large tensor's bytes are cut into parts of this many bytes (a multiple of the CRC32C block,
# so each part's block CRC32Cs are the item's): 32 MiB keeps a 400 MB embedding busy on 8
# threads, and costs a thread a task switch (a few microseconds) per 32 MiB written.
PART_BYTES = 32 << 20


class PositionedSink(ChecksummingSink):
    """A :class:`ChecksummingSink` that writes at a file offset (``pwrite``), not at the fd's
    position, so threads can fill disjoint ranges of one file; ``position`` is the file offset
    of the next byte accepted."""

    def __init__(self, fd: int, offset: int):
        super().__init__(fd)
        self.position = offset
        self._at = offset  # the file offset of the next byte that goes out

    def _out(self, view) -> None:
        view = memoryview(view).cast("B")
        while view:
            n = os.pwrite(self.fd, view, self._at)
            self._at += n
            view = view[n:]

    def _writev(self, views) -> None:
        total = sum(len(v) for v in views)
        done = os.pwritev(self.fd, views, self._at)
        self._at += done
        if done < total:  # a short write: finish it view by view
            for v in views:
                v = memoryview(v).cast("B")
                if done >= len(v):
                    done -= len(v)
                    continue
                self._out(v[done:])
                done = 0


@dataclass
class Placed:
    """One item of a file's wave with its place in the file: ``header`` + ``length`` bytes of
    content + ``trailer`` from ``start``. The content is a tensor's bytes (``dtype`` set) or a
    byte item's bytes; ``route``: RING, DIRECT or None (a staged payload, or bytes)."""

    item: WriteItem
    start: int
    header: bytes
    trailer: bytes
    length: int
    dtype: Optional[torch.dtype]
    route: Optional[str]
    # One entry per part, by part index: (CRC32C, bytes written, block CRC32Cs).
    results: Dict[int, Tuple[int, int, List[int]]] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.header) + self.length + len(self.trailer)

    @property
    def blocks(self) -> bool:
        """Whether the item gets per-block CRC32Cs (as the one-thread writer gives them)."""
        return self.dtype is not None and self.length >= blockcrc.MIN_PAYLOAD

    def content(self) -> memoryview:
        """The content's bytes in host memory (not for RING items)."""
        src = self.item.source if self.route is not None else self.item.payload
        if isinstance(src, torch.Tensor):
            return byte_view(src)
        return memoryview(src).cast("B")


def place(items: List[WriteItem], start: int, routes: Routes) -> Optional[List[Placed]]:
    """Every item's place in a file where they follow each other from offset ``start``; None if
    an item's length cannot be known before it is written."""
    out: List[Placed] = []
    pos = start
    for it in items:
        route = routes.get(id(it))
        if route is not None:
            frame = expected_frame(it.source.dtype, tuple(it.chunk_size), pos % ALIGN)
            if frame is None:
                return None
            header, trailer, layout = frame
            placed = Placed(it, pos, header, trailer, layout.data_length, it.source.dtype, route)
        elif isinstance(it.payload, torch.Tensor):
            pair = tensor_archive_frame(it.payload, SERIALIZATION_ID, pos)
            if pair is None:
                return None
            payload = it.payload
            nbytes = payload.numel() * payload.element_size()
            placed = Placed(it, pos, pair[0], pair[1], nbytes, payload.dtype, None)
        elif isinstance(it.payload, (bytes, bytearray, memoryview)):
            placed = Placed(it, pos, b"", b"", memoryview(it.payload).nbytes, None, None)
        else:
            return None
        out.append(placed)
        pos = placed.end
    return out


@dataclass
class Part:
    """Content bytes ``[lo, hi)`` of ``placed`` (with its header if ``lo`` is 0, its trailer if
    ``hi`` is its length), part number ``index`` of the item."""

    placed: Placed
    index: int
    lo: int
    hi: int

    @property
    def first(self) -> bool:
        return self.lo == 0

    @property
    def last(self) -> bool:
        return self.hi == self.placed.length

    @property
    def nbytes(self) -> int:
        return (
            self.hi
            - self.lo
            + (len(self.placed.header) if self.first else 0)
            + (len(self.placed.trailer) if self.last else 0)
        )


@dataclass
class Task:
    """Consecutive parts of one file, written by one thread from ``offset`` on."""

    fd: int
    offset: int
    parts: List[Part] = field(default_factory=list)
    nbytes: int = 0


def tasks(fd: int, placed: List[Placed], part_bytes: Optional[int] = None) -> List[Task]:
    """The file's bytes as tasks of about ``part_bytes`` (None: :data:`PART_BYTES`): large items
    cut into parts of ``part_bytes`` content bytes, small consecutive items gathered into one task."""
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    if part_bytes <= 0 or part_bytes % blockcrc.BLOCK_SIZE:
        raise ValueError(f"part_bytes must be a positive multiple of {blockcrc.BLOCK_SIZE}")
    out: List[Task] = []
    current: Optional[Task] = None
    for p in placed:
        cuts = list(range(0, p.length, part_bytes)) or [0]
        for index, lo in enumerate(cuts):
            part = Part(p, index, lo, min(p.length, lo + part_bytes))
            if current is None:
                current = Task(fd, p.start + (0 if part.first else len(p.header) + lo))
            current.parts.append(part)
            current.nbytes += part.nbytes
            if current.nbytes >= part_bytes:
                out.append(current)
                current = None
    if current is not None:
        out.append(current)
    return out


def run(task: Task, ring: Callable[[], DeviceToHost] = DeviceToHost) -> None:
    """Write ``task`` (any thread), recording each part's CRC32C, length and block CRC32Cs in
    its item's ``results``. RING parts come through slots of their own (``ring()``)."""
    sink = PositionedSink(task.fd, task.offset)
    ringed = [part for part in task.parts if part.placed.route == RING and part.hi > part.lo]
    slots = ring() if ringed else None
    try:
        pieces = slots.pieces([_device_bytes(part) for part in ringed]) if slots is not None else iter(())
        for part in task.parts:
            p = part.placed
            sink.crc = 0
            if part.first:
                sink.write(p.header)
            crcs: List[int] = []
            if p.route == RING:
                chunks: Iterator = next_bytes(pieces, part.hi - part.lo)
            else:
                chunks = iter((p.content()[part.lo : part.hi],))
            for chunk in chunks:
                if p.blocks:
                    crcs.extend(sink.write_blocks(chunk, blockcrc.BLOCK_SIZE))
                else:
                    sink.write(chunk)
            if part.last:
                sink.write(p.trailer)
            p.results[part.index] = (sink.crc, part.nbytes, crcs)
        sink.drain()
    finally:
        if slots is not None:
            slots.close()


def _device_bytes(part: Part) -> torch.Tensor:
    """The part's bytes of its (contiguous, device) source, as a flat byte tensor."""
    src = part.placed.item.source.detach().reshape(-1).view(torch.uint8)
    return src[part.lo : part.hi]


def next_bytes(pieces: Iterator[Tuple[int, int, memoryview]], nbytes: int) -> Iterator[memoryview]:
    """The next pieces of ``pieces`` (``DeviceToHost.pieces``) up to ``nbytes`` bytes: one item's
    or part's bytes."""
    done = 0
    while done < nbytes:
        _, _, view = next(pieces)
        done += len(view)
        yield view


def settle(placed: List[Placed]) -> Tuple[List[Tuple[WriteItem, int, int, int]], List[blockcrc.Entry]]:
    """Once every task of ``placed`` has run: each item's (item, offset, length, CRC32C) and the
    block entries of those with per-block CRC32Cs, in file order, as the one-thread writer gives
    them."""
    written: List[Tuple[WriteItem, int, int, int]] = []
    entries: List[blockcrc.Entry] = []
    for p in placed:
        crc, crcs = 0, []
        for index in range(len(p.results)):
            part_crc, nbytes, part_blocks = p.results[index]
            crc = part_crc if index == 0 else blockcrc.combine(crc, part_crc, nbytes)
            crcs.extend(part_blocks)
        length = p.end - p.start
        written.append((p.item, p.start, length, crc))
        if p.blocks:
            entries.append(
                blockcrc.Entry(
                    p.start,
                    length,
                    crc,
                    len(p.header),
                    p.length,
                    blockcrc.crc32c(p.header),
                    blockcrc.crc32c(p.trailer),
                    p.dtype,
                    crcs,
                )
            )
    return written, entries
