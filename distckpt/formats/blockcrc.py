"""Per-block CRC32C of tensor payloads: what lets a ranged read be checked without the whole item.

The manifest checksums each item of a ``.distcp`` file whole. An object-store load that needs
only part of an item (resharding) would have to fetch it whole to check that CRC. So while the
writer checksums an item it also records the CRC32C of every :data:`BLOCK_SIZE` block of the
tensor's bytes (blocks aligned to the start of the tensor bytes inside the ``torch.save``
archive), and the rank that writes ``__R_B.distcp`` also writes its *block table*
``__R_B.distcp.crc`` (format in docs/formats.md). A loading rank fetches the table of a file it
reads partially (one small GET), then only the blocks that hold the bytes it wants.

Cost at save time: nearly none per byte. The item's CRC is no longer computed over the bytes in one
pass but combined from the block CRCs: ``crc(A || B) = shift_len(B)(crc(A)) ^ crc(B)``, where the
shift is multiplication by ``x^(8 len)`` modulo the CRC polynomial, a linear map on 32 bits applied
with four 256-entry tables (about a microsecond in Python, once per full block). Each byte of a
full block goes through the CRC instruction once; the last, shorter block of an item twice (its
own CRC, and the running one continued over it), which is cheaper than a shift by an arbitrary
length.

Trust: a table is bound to the items it describes. Each entry repeats its item's offset, length
and whole-item CRC32C, and the CRCs of its segments (archive header, every block, trailer) must
combine to that CRC; a loader compares both with the checksum the manifest (or the sidecar index)
gives for the item, so a stale table (an older save's, left on an object store) or a damaged one
is never believed: the item is then fetched whole and checked against its own CRC, as without a
table. The table carries its own CRC32C too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from distckpt import bounds
from distckpt.checksum import (  # noqa: F401  (the CRC32C algebra's home; importable from here too)
    BLOCK_SIZE,
    combine,
    crc32c,
    extend,
    shift,
    shift_tables,
)
from distckpt.core import CheckpointingException

# Items with fewer tensor bytes than this get no entry: such an item is read whole anyway.
MIN_PAYLOAD = 2 * BLOCK_SIZE
SUFFIX = ".crc"
MAGIC = b"DCKBLKCR"
VERSION = 1

_HEADER = struct.Struct("<8sIII")  # magic, version, block size, entry count
_ENTRY = struct.Struct("<QQIQQIIB3xI")  # item offset, length, crc; payload offset, length;
# head crc, tail crc, dtype code, block count
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def table_name(data_name: str) -> str:
    """The block table of data file ``data_name``."""
    return data_name + SUFFIX


# --------------------------------------------------------------------------- table


@dataclass
class Entry:
    """One item's block CRCs; offsets of the payload are relative to the item's start."""

    item_offset: int
    item_length: int
    item_crc: int
    payload_offset: int
    payload_length: int
    head_crc: int
    tail_crc: int
    dtype: torch.dtype
    blocks: List[int]

    def combined(self, block: int) -> int:
        """The item's CRC32C as its segments' CRCs add up to."""
        crc = self.head_crc
        for i, c in enumerate(self.blocks):
            crc = combine(crc, c, min(block, self.payload_length - i * block))
        return combine(crc, self.tail_crc, self.item_length - self.payload_offset - self.payload_length)

    def problem(self, block: int, length: int, crc: int) -> Optional[str]:
        """Why this entry cannot be trusted for the item of ``length`` bytes with CRC32C ``crc``
        (a stale or damaged table), or None: the item it describes, blocks that fit it, block
        CRCs that add up to its CRC32C. A load checks this before reading single blocks."""
        if self.item_length != length or self.item_crc != crc:
            return (
                f"stale: the table says {self.item_length} bytes with CRC32C {self.item_crc:#010x}, "
                f"the item has {length} bytes with {crc:#010x}"
            )
        if self.payload_offset + self.payload_length > self.item_length or len(self.blocks) != -(
            -self.payload_length // block
        ):
            return "its blocks do not fit the item (damaged table)"
        if self.combined(block) != self.item_crc:
            return "its block CRC32Cs do not add up to the item's CRC32C (damaged table)"
        return None


def dtype_code(dtype: torch.dtype) -> Optional[int]:
    return _DTYPE_CODE.get(dtype)


def encode(entries: Sequence[Entry], block: int = BLOCK_SIZE) -> bytes:
    out = bytearray(_HEADER.pack(MAGIC, VERSION, block, len(entries)))
    for e in entries:
        out += _ENTRY.pack(
            e.item_offset,
            e.item_length,
            e.item_crc,
            e.payload_offset,
            e.payload_length,
            e.head_crc,
            e.tail_crc,
            _DTYPE_CODE[e.dtype],
            len(e.blocks),
        )
        out += struct.pack(f"<{len(e.blocks)}I", *e.blocks)
    out += struct.pack("<I", crc32c(out))
    return bytes(out)


@dataclass
class Table:
    block: int
    entries: Dict[int, Entry]  # by item offset


def decode(raw, source: str) -> Table:
    """Parse a block table, checking every claim (hostile input: see distckpt/bounds.py)."""
    raw = bytes(raw)
    if len(raw) < _HEADER.size + 4 or raw[:8] != MAGIC:
        raise CheckpointingException(f"{source}: not a block CRC table")
    (stored,) = struct.unpack_from("<I", raw, len(raw) - 4)
    if crc32c(memoryview(raw)[:-4]) != stored:
        raise CheckpointingException(f"{source}: block CRC table is corrupted (its CRC32C does not match)")
    _, version, block, count = _HEADER.unpack_from(raw)
    if version > VERSION:
        raise CheckpointingException(
            f"{source}: block CRC table version {version} is newer than this distckpt"
        )
    if not 4096 <= block <= (1 << 30) or block % 16:
        raise CheckpointingException(
            f"{source}: block size {block} is not in [4096, 2^30] or not a multiple of 16"
        )
    pos, end = _HEADER.size, len(raw) - 4
    if count > (end - pos) // _ENTRY.size:
        raise CheckpointingException(f"{source}: claims {count} entries, too many for its {len(raw)} bytes")
    entries: Dict[int, Entry] = {}
    for _ in range(count):
        if pos + _ENTRY.size > end:
            raise CheckpointingException(f"{source}: truncated entry at byte {pos}")
        (off, length, crc, poff, plen, head, tail, code, n) = _ENTRY.unpack_from(raw, pos)
        pos += _ENTRY.size
        bounds.natural(off, source, "item offset")
        bounds.natural(length, source, "item length")
        if code >= len(_DTYPES):
            raise CheckpointingException(f"{source}: unknown dtype code {code}")
        if poff + plen > length or n != -(-plen // block) or pos + 4 * n > end:
            raise CheckpointingException(
                f"{source}: entry of the item at offset {off}: payload [{poff}, {poff + plen}) in an item of "
                f"{length} bytes with {n} blocks of {block} bytes does not add up"
            )
        blocks = list(struct.unpack_from(f"<{n}I", raw, pos))
        pos += 4 * n
        entries[off] = Entry(off, length, crc, poff, plen, head, tail, _DTYPES[code], blocks)
    if pos != end:
        raise CheckpointingException(f"{source}: {end - pos} stray bytes after the last entry")
    return Table(block, entries)


# --------------------------------------------------------------------------- reading parts


def spans(start: int, size: Sequence[int], strides: Sequence[int], gap: int) -> List[Tuple[int, int]]:
    """Element intervals ``[lo, hi)`` that a box (``size`` elements at ``strides`` from element
    ``start``) touches, with intervals closer than ``gap`` elements merged (so their count stays
    below the item's size over ``gap``)."""
    if any(s == 0 for s in size):
        return []
    runs = [(0, 1)]
    for n, st in zip(reversed(size), reversed(strides)):
        if n == 1:
            continue
        width = runs[-1][1]
        if len(runs) == 1 and st - width < gap:  # the copies touch or nearly: one interval
            runs = [(0, (n - 1) * st + width)]
            continue
        out: List[Tuple[int, int]] = []
        for i in range(n):
            base = i * st
            for lo, hi in runs:
                lo, hi = lo + base, hi + base
                if out and lo - out[-1][1] < gap:
                    out[-1] = (out[-1][0], max(out[-1][1], hi))
                else:
                    out.append((lo, hi))
        runs = out
    return [(lo + start, hi + start) for lo, hi in runs]


def block_runs(
    intervals: List[Tuple[int, int]], block: int, n_blocks: int, gap_blocks: int
) -> List[Tuple[int, int]]:
    """Runs ``[first, last)`` of block indices covering byte ``intervals`` (of the payload), runs
    separated by at most ``gap_blocks`` blocks merged (as an object store client coalesces
    ranges: a gap that short costs less to transfer than another request)."""
    out: List[Tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if hi <= lo:
            continue
        a, b = lo // block, min(n_blocks, -(-hi // block))
        if out and a - out[-1][1] <= gap_blocks:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
