"""The sidecar index ``.distckpt_index`` (re-exports only: its old home).

The sidecar lives in three modules of :mod:`distckpt.formats`: :mod:`~distckpt.formats.index_format`
(the layout and its constants), :mod:`~distckpt.formats.index_write` (building it, and the template
that patches in new CRC32Cs) and :mod:`~distckpt.formats.index_read` (partial reads and queries).
Every name importable from here before the split still is.
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
from distckpt.formats.index_read import IndexReader
from distckpt.formats.index_write import (
    IndexTemplate,
    build_index,
    build_index_from_rows,
    index_from_metadata,
)

# The private names other modules and tests used before the split, until they switch.
_HEADER = HEADER
_dtype_name = dtype_name
_dtype_of = dtype_of

__all__ = [
    "FANOUT",
    "FORMAT",
    "HEADER",
    "INDEX_FNAME",
    "LEAF",
    "MAGIC",
    "VERSION",
    "Box",
    "IndexReader",
    "IndexTemplate",
    "build_index",
    "build_index_from_rows",
    "dtype_name",
    "dtype_of",
    "index_from_metadata",
]
