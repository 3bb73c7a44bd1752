"""Checked reads of part of a stored item from a local file, block by block.

An item's tensor bytes are cut into blocks with a CRC32C each (a ``torch_dist`` file's block
table, :mod:`distckpt.formats.blockcrc`, or the manifest's block CRC32Cs of a zarr chunk).
:class:`BlockReader` reads only the blocks a load's copies take bytes from, and checks each one
before any of its bytes is copied. Used by the ``torch_dist`` and zarr readers.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.io.byteio import CRC_PIECE, byte_view, pread_exact
from distckpt.io.copies import CopyOp, Shape
from distckpt.io.device_io import HostBounce

# A checked read of part of an item from a local file takes the blocks its copies need at most
# this many bytes at a time into a scratch buffer, checks each block while it is in cache, then
# copies the window's elements out.
_WINDOW_BYTES = 512 << 10


class BlockReader:
    """Checked reads of one item's tensor bytes from a local file: every block (of the item's
    block table entry) that a copy takes bytes from is read and its CRC32C compared before any
    of its bytes is copied, as an object-store load checks a partial read, without reading the
    rest of the item. A box that is one element range lands in place (its whole blocks read
    straight into the destination, through the pinned slots for a CUDA one); other boxes are cut
    out of the checked blocks a window at a time. Also the zarr backend's reader of part of a
    chunk file (its block CRC32Cs from the manifest).

    Args:
        base: file offset of the tensor's byte 0.
        table: where the block CRC32Cs come from, for errors (the block table's name).
    """

    def __init__(self, fd: int, base: int, entry: blockcrc.Entry, block: int, what: str, table: str):
        self.fd, self.entry, self.block, self.what = fd, entry, block, what
        self.table = table
        self.base = base
        self.scratch: Optional[torch.Tensor] = None
        self._held = (0, 0)  # the blocks [a, b) the scratch buffer holds, checked

    def _check(self, first: int, view: memoryview) -> None:
        """Compare blocks ``first, first + 1, ...`` (their bytes in ``view``) with the table."""
        block, blocks = self.block, self.entry.blocks
        for p in range(0, len(view), block):
            i = first + p // block
            piece = view[p : p + block]
            if crc32c(piece) != blocks[i]:
                start = self.entry.payload_offset + i * block
                raise CheckpointingException(
                    f"{self.what}: CRC32C mismatch in block {i} "
                    f"(bytes [{start}, {start + len(piece)}) of the "
                    f"item) against {self.table}: the data is corrupted"
                )

    def _blocks(self, a: int, b: int) -> torch.Tensor:
        """Blocks ``[a, b)`` read into the scratch buffer and checked: a uint8 tensor of their bytes.
        Windows that follow each other share a block where a box's rows cross a block boundary:
        the blocks the buffer holds already are moved to its front, not read and checked again."""
        block = self.block
        lo, hi = a * block, min(b * block, self.entry.payload_length)
        if self.scratch is None or self.scratch.numel() < hi - lo:
            self.scratch = torch.empty(max(hi - lo, _WINDOW_BYTES + 2 * block), dtype=torch.uint8)
            self._held = (0, 0)
        out = self.scratch[: hi - lo]
        held_a, held_b = self._held
        done = 0
        if held_a <= a < held_b:
            done = min(held_b, b) * block - lo
            done = min(done, hi - lo)
            if a != held_a:
                out[:done].copy_(self.scratch[(a - held_a) * block : (a - held_a) * block + done].clone())
        view = byte_view(out)
        for p in range(done, hi - lo, CRC_PIECE):
            piece = view[p : p + CRC_PIECE]
            pread_exact(self.fd, piece, self.base + lo + p, self.what)
            self._check(a + p // block, piece)
        self._held = (a, b)
        return out

    def _range(self, lo: int, hi: int, dst: torch.Tensor, bounce: Optional[HostBounce]) -> None:
        """Tensor bytes ``[lo, hi)`` into the contiguous 1-D ``dst`` of the item's dtype."""
        block, size, isz = self.block, self.entry.payload_length, self.entry.dtype.itemsize
        first = -(-lo // block)  # whole blocks inside [lo, hi)
        last = hi // block if hi < size else len(self.entry.blocks)
        if first >= last:
            a = lo // block
            dst.copy_(
                self._blocks(a, -(-hi // block))[lo - a * block : hi - a * block].view(self.entry.dtype)
            )
            return
        if lo < first * block:
            a = first - 1
            dst[: (first * block - lo) // isz].copy_(
                self._blocks(a, first)[lo - a * block :].view(self.entry.dtype)
            )
        end = min(last * block, size)
        if hi > end:
            dst[(end - lo) // isz :].copy_(self._blocks(last, last + 1)[: hi - end].view(self.entry.dtype))
        middle = dst[(first * block - lo) // isz : (end - lo) // isz]
        if middle.device.type == "cpu":
            view = byte_view(middle)
            for p in range(0, len(view), CRC_PIECE):
                piece = view[p : p + CRC_PIECE]
                pread_exact(self.fd, piece, self.base + first * block + p, self.what)
                self._check(first + p // block, piece)
        else:
            bounce.fill(
                self.fd,
                self.base + first * block,
                middle,
                self.what,
                lambda pos, piece: self._check(first + pos // block, piece),
            )

    def _box(self, start: int, size: Shape, strides: Shape, dst: torch.Tensor) -> None:
        """The box of ``size`` elements at ``strides`` from element ``start`` into ``dst``,
        window by window."""
        isz, dtype = self.entry.dtype.itemsize, self.entry.dtype
        limit = max(1, _WINDOW_BYTES // isz)
        span = sum((n - 1) * t for n, t in zip(size, strides)) + 1
        if span > limit and size:
            inner = sum((n - 1) * t for n, t in zip(size[1:], strides[1:])) + 1
            if inner <= limit:
                per = max(1, (limit - inner) // strides[0] + 1) if strides[0] else size[0]
                for i in range(0, size[0], per):
                    k = min(per, size[0] - i)
                    self._box(start + i * strides[0], (k,) + tuple(size[1:]), strides, dst[i : i + k])
            else:
                for i in range(size[0]):
                    self._box(start + i * strides[0], tuple(size[1:]), tuple(strides[1:]), dst[i])
            return
        a, b = start * isz // self.block, -(-(start + span) * isz // self.block)
        src = self._blocks(a, b).view(dtype)
        dst.copy_(src.as_strided(size, strides, src.storage_offset() + start - a * self.block // isz))

    def copy(self, ops: List[CopyOp], bounce: Optional[HostBounce]) -> int:
        """Serve ``ops``; returns the tensor bytes they take."""
        isz, nbytes = self.entry.dtype.itemsize, 0
        for op in ops:
            if not op.numel:
                continue
            dst = op.dst
            if (
                op.is_range
                and dst.is_contiguous()
                and dst.dtype == self.entry.dtype
                and (dst.device.type == "cpu" or (bounce is not None and dst.device.type == "cuda"))
            ):
                self._range(op.start * isz, op.end * isz, dst.reshape(-1), bounce)
            else:
                self._box(op.start, tuple(op.size), tuple(op.strides), dst)
            nbytes += op.numel * isz
        return nbytes
