"""Kept for old imports (re-exports only): the zip frame of a ``torch.save`` item, framed and parsed.

It now lives in :mod:`distckpt.formats.zip_archive`. On-disk formats have a floor of their own,
below the strategies (docs/architecture.md). Every public name importable from here before the move
still is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.zip_archive import (
    ALIGN,
    SERIALIZATION_ID,
    TAIL_BYTES,
    ArchiveLayout,
    contiguous_strides,
    expected_frame,
    framed_layout,
    read_archive_layout,
    tensor_archive_frame,
)

__all__ = [
    "ALIGN",
    "ArchiveLayout",
    "SERIALIZATION_ID",
    "TAIL_BYTES",
    "contiguous_strides",
    "expected_frame",
    "framed_layout",
    "read_archive_layout",
    "tensor_archive_frame",
]
