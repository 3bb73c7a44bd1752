"""Kept for old imports (re-exports only): writable byte views of tensors, exact reads with ``preadv``.

It now lives in :mod:`distckpt.io.byteio`. How bytes move has a floor of its own, below the
strategies (docs/architecture.md). Every public name importable from here before the move still is,
as the same object.
"""

from __future__ import annotations

from distckpt.io.byteio import CRC_PIECE, byte_view, pread_crc, pread_exact, pread_into

__all__ = ["CRC_PIECE", "byte_view", "pread_crc", "pread_exact", "pread_into"]
