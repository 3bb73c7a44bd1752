"""Kept for old imports (re-exports only): checked reads of part of an item, block by block.

It now lives in :mod:`distckpt.io.blockread`. How bytes move has a floor of its own, below the
strategies (docs/architecture.md). Every public name importable from here before the move still is,
as the same object.
"""

from __future__ import annotations

from distckpt.io.blockread import BlockReader

__all__ = ["BlockReader"]
