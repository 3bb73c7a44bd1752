"""Kept for old imports (re-exports only): a committed checkpoint read as a tensor source.

It now lives in :mod:`distckpt.tools.sources.checkpoint`. The tools' tensor sources are together in
:mod:`distckpt.tools.sources` (docs/architecture.md). Every public name importable from here before
the move still is, as the same object.
"""

from __future__ import annotations

from distckpt.tools.sources.checkpoint import CheckpointSource

__all__ = ["CheckpointSource"]
