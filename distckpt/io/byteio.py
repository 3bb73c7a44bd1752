"""Byte-level helpers for reading files into tensors: writable byte views and exact ``preadv``s.

The ground floor of the strategies' file I/O: it knows nothing of archives or checkpoints.
"""

from __future__ import annotations

import os

import torch

from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, 0-dim and empty too), no copy."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill ``view`` with the bytes at ``offset``; a file that ends first is an error naming ``what``."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointingException(
                f"{what}: file is truncated (needed {len(view) - done} more bytes at offset {offset + done})"
            )
        done += n


def pread_into(fd: int, dest: torch.Tensor, offset: int, what: str) -> None:
    """Fill the contiguous CPU tensor ``dest`` with the bytes at ``offset``."""
    pread_exact(fd, byte_view(dest), offset, what)


# Reads whose CRC32C is computed as the bytes arrive go in pieces of this size, each checksummed
# right after its read while it is still in the CPU's cache (a second pass over a large buffer
# would read it from memory again).
CRC_PIECE = 256 << 10


def pread_crc(fd: int, view: memoryview, offset: int, what: str, crc: int = 0) -> int:
    """:func:`pread_exact` of ``view``, returning the CRC32C of the bytes read (continuing
    ``crc``), computed piece by piece as they arrive."""
    done, total = 0, len(view)
    while done < total:
        piece = view[done : done + CRC_PIECE]
        pread_exact(fd, piece, offset + done, what)
        crc = crc32c(piece, crc)
        done += len(piece)
    return crc
