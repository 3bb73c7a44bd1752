"""Kept for old imports (re-exports only): DCP's ``.metadata`` pickled from arrays.

It now lives in :mod:`distckpt.formats.metadata_pickle`. On-disk formats have a floor of their own,
below the strategies (docs/architecture.md). Every public name importable from here before the move
still is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.metadata_pickle import pickle_metadata, respell

__all__ = ["pickle_metadata", "respell"]
