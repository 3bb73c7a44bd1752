"""Reading part of a stored item against its file's block CRC32Cs (the block table).

A load that needs only part of a large item (a resharded load) reads only the blocks holding
the wanted bytes and checks each against its CRC32C from the file's block table
(:mod:`distckpt.formats.blockcrc`): from an object store as ranged GETs
(:func:`partial_read`, :class:`PartialRead`), from a local file through a
:class:`~distckpt.io.blockread.BlockReader` (:func:`local_block_table`,
:func:`table_entry`). A table that does not describe the item makes it read whole.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from distckpt import bounds, storage
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.formats.manifest import RangeChecksum
from distckpt.io.copies import CopyOp, copy_boxes
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME
from distckpt.strategies.torch_dist.stored import Stored

logger = logging.getLogger(__name__)

# An item is read in part only if its copies need less than this share of its elements ...
_PARTIAL_SHARE = 0.75


def partial_candidate(st: Stored, ops: List[CopyOp]) -> bool:
    """Whether a partial read of ``st`` may pay (then its file's block table is fetched)."""
    numel = math.prod(st.size)
    return (
        st.length >= blockcrc.MIN_PAYLOAD
        and numel > 0
        and sum(op.numel for op in ops) < _PARTIAL_SHARE * numel
    )


def block_table(store: storage.Store, name: str) -> Tuple[Optional[blockcrc.Table], int]:
    """The block table of data object ``name`` (None when it has none, or an unusable one: its
    items are then read whole) and the bytes fetched for it."""
    table = blockcrc.table_name(name)
    try:
        raw = store.get(table)
    except FileNotFoundError:
        return None, 0
    return _decoded(raw, store.where(table), name), len(raw)


def _decoded(raw: bytes, where: str, name: str) -> Optional[blockcrc.Table]:
    """Block table bytes decoded; None (logged: the items of data file ``name`` are read whole)
    when they are unusable."""
    try:
        return blockcrc.decode(raw, where)
    except CheckpointingException as e:
        logger.warning("%s; the items of %s are read whole", e, name)
        return None


@dataclass
class PartialRead:
    """The blocks of one item a load fetches: runs ``[first, last)`` of block indices."""

    st: Stored
    entry: blockcrc.Entry
    block: int
    runs: List[Tuple[int, int]]
    where: str

    def _span(self, a: int, b: int) -> Tuple[int, int]:
        """Payload bytes of blocks ``[a, b)``."""
        return a * self.block, min(b * self.block, self.entry.payload_length)

    def ranges(self) -> List[Tuple[int, int]]:
        base = self.st.file_offset + self.entry.payload_offset
        out = []
        for a, b in self.runs:
            lo, hi = self._span(a, b)
            out.append((base + lo, hi - lo))
        return out

    def copy(self, views: List[memoryview], ops: List[CopyOp], rank: int) -> None:
        """Check every fetched block against its CRC32C, then copy the ops' boxes out."""
        e, block = self.entry, self.block
        lo, hi = self._span(self.runs[0][0], self.runs[-1][1])
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        out = buf.numpy()
        for (a, b), view in zip(self.runs, views):
            for i in range(a, b):
                piece = view[(i - a) * block : (i - a) * block + block]
                if crc32c(piece) != e.blocks[i]:
                    start = e.payload_offset + i * block
                    raise CheckpointingException(
                        f"key {ops[0].key!r} in {self.where} at offset {self.st.file_offset} (rank {rank}): "
                        f"CRC32C mismatch in block {i} (bytes [{start}, {start + len(piece)}) of the item) "
                        f"against its block table {blockcrc.table_name(self.st.relative_path)}: the data is "
                        f"corrupted"
                    )
            s, t = self._span(a, b)
            out[s - lo : t - lo] = np.frombuffer(view, dtype=np.uint8)
        itemsize = e.dtype.itemsize
        copy_boxes(buf.view(e.dtype), lo // itemsize, [op for op in ops if op.numel])


def _read_whole(where: str, st: Stored, problem: Optional[str]) -> None:
    """Log why the block table cannot serve item ``st`` (it is read whole and checked against its
    own CRC32C instead): an entry that does not describe it, or a ``problem`` with the entry."""
    if problem is None:
        logger.info(
            "%s: the block table entry of the item at offset %d does not match it; reading it whole",
            where,
            st.file_offset,
        )
    else:
        logger.warning(
            "%s: block table entry of the item at offset %d: %s; reading it whole",
            where,
            st.file_offset,
            problem,
        )


def partial_read(
    st: Stored, ops: List[CopyOp], table: blockcrc.Table, checksums: Dict, gap: int, where: str
) -> Optional[PartialRead]:
    """The blocks of ``st`` its copies need, or None to read it whole: no block CRCs for it, a
    table entry that does not match the item's checksum (a stale or damaged table), or so much
    of the item needed that one whole read is cheaper."""
    e = table.entries.get(st.file_offset)
    expected = checksums.get((st.relative_path, st.file_offset))
    if e is None or expected is None or not partial_candidate(st, ops):
        return None
    itemsize = e.dtype.itemsize
    if expected.length != st.length or e.payload_length != math.prod(st.size) * itemsize:
        return _read_whole(where, st, None)
    block = table.block
    intervals = []
    for op in ops:
        for a, b in blockcrc.spans(op.start, op.size, op.strides, block // itemsize):
            intervals.append((a * itemsize, b * itemsize))
    runs = blockcrc.block_runs(intervals, block, len(e.blocks), max(0, gap // block))
    fetched = sum(min(b * block, e.payload_length) - a * block for a, b in runs)
    if not runs or fetched > _PARTIAL_SHARE * st.length:
        return None
    problem = e.problem(block, expected.length, expected.crc32c)
    if problem is not None:
        return _read_whole(where, st, problem)
    return PartialRead(st, e, block, runs, where)


def local_block_table(
    checkpoint_dir: Path, name: str, checksums: Dict
) -> Tuple[Optional[blockcrc.Table], bool]:
    """The block table of local data file ``name`` (None: it has none, or an unusable one) and
    whether the manifest vouches for it (its bytes match the manifest's checksum of the table
    file: then its entries need not be summed up against their items' CRC32Cs)."""
    table = blockcrc.table_name(name)
    path = bounds.inside(checkpoint_dir, table, checkpoint_dir / METADATA_FNAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, False
    listed = checksums.get((table, 0))
    vouched = listed is not None and listed.length == len(raw) and listed.crc32c == crc32c(raw)
    decoded = _decoded(raw, str(path), name)
    return decoded, vouched and decoded is not None


def table_entry(
    st: Stored, table: blockcrc.Table, expected: RangeChecksum, vouched: bool, where: str
) -> Optional[blockcrc.Entry]:
    """The block table's entry for item ``st`` when it describes the item the manifest checksums
    (else None: the item is read whole and checked against its own CRC32C)."""
    e = table.entries.get(st.file_offset)
    if e is None:
        return None
    if e.payload_length != math.prod(st.size) * e.dtype.itemsize:
        return _read_whole(where, st, None)
    if vouched:
        stale = e.item_length != expected.length or e.item_crc != expected.crc32c
        problem = "stale: it describes another item" if stale else None
    else:
        problem = e.problem(table.block, expected.length, expected.crc32c)
    if problem is not None:
        return _read_whole(where, st, problem)
    return e
