"""Kept for old imports (re-exports only): the items of ``.distcp`` files, written and read.

The item I/O now lives in :mod:`distckpt.io.filesystem`, the byte helpers it used to re-export in
:mod:`distckpt.io.byteio` and the archive format's names in :mod:`distckpt.formats.zip_archive`
(formats and I/O have floors of their own, below the strategies: docs/architecture.md). Every name
importable from here before the move still is, as the same object.
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
from distckpt.io.byteio import CRC_PIECE, byte_view, pread_crc, pread_exact, pread_into
from distckpt.io.filesystem import (
    ChecksummingSink,
    WriterSink,
    copy_framed_from,
    framed,
    read_framed_crc,
    read_framed_into,
    save_to_sink,
    write_bytes_item,
    write_tensor_item,
    write_tensor_pieces,
    zip_crc_disabled,
)

__all__ = [
    "ALIGN",
    "CRC_PIECE",
    "SERIALIZATION_ID",
    "TAIL_BYTES",
    "ArchiveLayout",
    "ChecksummingSink",
    "WriterSink",
    "byte_view",
    "contiguous_strides",
    "copy_framed_from",
    "expected_frame",
    "framed",
    "framed_layout",
    "pread_crc",
    "pread_exact",
    "pread_into",
    "read_archive_layout",
    "read_framed_crc",
    "read_framed_into",
    "save_to_sink",
    "tensor_archive_frame",
    "write_bytes_item",
    "write_tensor_item",
    "write_tensor_pieces",
    "zip_crc_disabled",
]
