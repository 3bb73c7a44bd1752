"""Kept for old imports (re-exports only): device tensors filled and emptied through pinned host slots.

It now lives in :mod:`distckpt.io.device_io`. How bytes move has a floor of its own, below the
strategies (docs/architecture.md). Every public name importable from here before the move still is,
as the same object.
"""

from __future__ import annotations

from distckpt.io.device_io import (
    PIECE_ALIGN,
    POOL_SLOTS,
    SLOT_BYTES,
    SLOTS,
    Box,
    DeviceToHost,
    HostBounce,
    caller_streams,
    is_plain,
    needs_staging,
    release_slots,
    save_slot_bytes,
    side_stream,
)

__all__ = [
    "Box",
    "DeviceToHost",
    "HostBounce",
    "PIECE_ALIGN",
    "POOL_SLOTS",
    "SLOTS",
    "SLOT_BYTES",
    "caller_streams",
    "is_plain",
    "needs_staging",
    "release_slots",
    "save_slot_bytes",
    "side_stream",
]
