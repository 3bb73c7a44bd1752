"""Kept for old imports (re-exports only): the per-file block CRC32C tables.

It now lives in :mod:`distckpt.formats.blockcrc`. On-disk formats have a floor of their own, below
the strategies (docs/architecture.md). Every public name importable from here before the move still
is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.blockcrc import (
    BLOCK_SIZE,
    MAGIC,
    MIN_PAYLOAD,
    SUFFIX,
    VERSION,
    Entry,
    Table,
    block_runs,
    combine,
    crc32c,
    decode,
    dtype_code,
    encode,
    extend,
    shift,
    shift_tables,
    spans,
    table_name,
)

__all__ = [
    "BLOCK_SIZE",
    "Entry",
    "MAGIC",
    "MIN_PAYLOAD",
    "SUFFIX",
    "Table",
    "VERSION",
    "block_runs",
    "combine",
    "crc32c",
    "decode",
    "dtype_code",
    "encode",
    "extend",
    "shift",
    "shift_tables",
    "spans",
    "table_name",
]
