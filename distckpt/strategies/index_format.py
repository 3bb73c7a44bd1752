"""Kept for old imports (re-exports only): the sidecar index's file layout and constants.

It now lives in :mod:`distckpt.formats.index_format`. On-disk formats have a floor of their own,
below the strategies (docs/architecture.md). Every public name importable from here before the move
still is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.index_format import (
    FANOUT,
    FORMAT,
    HEADER,
    INDEX_FNAME,
    LEAF,
    MAGIC,
    VERSION,
    Box,
    dtype_name,
    dtype_of,
)

__all__ = [
    "Box",
    "FANOUT",
    "FORMAT",
    "HEADER",
    "INDEX_FNAME",
    "LEAF",
    "MAGIC",
    "VERSION",
    "dtype_name",
    "dtype_of",
]
