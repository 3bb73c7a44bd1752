"""Kept for old imports (re-exports only): the sidecar index's reader.

It now lives in :mod:`distckpt.formats.index_read`. On-disk formats have a floor of their own, below
the strategies (docs/architecture.md). Every public name importable from here before the move still
is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.index_read import IndexReader

__all__ = ["IndexReader"]
