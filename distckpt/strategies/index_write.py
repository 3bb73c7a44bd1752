"""Kept for old imports (re-exports only): the sidecar index's builder.

It now lives in :mod:`distckpt.formats.index_write`. On-disk formats have a floor of their own,
below the strategies (docs/architecture.md). Every public name importable from here before the move
still is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.index_write import (
    IndexTemplate,
    build_index,
    build_index_from_rows,
    index_from_metadata,
)

__all__ = ["IndexTemplate", "build_index", "build_index_from_rows", "index_from_metadata"]
