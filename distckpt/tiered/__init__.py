"""Two-tier checkpoints: node-local first, a remote store (S3, GCS, Azure, a shared file system)
in the background, restart from the nearest copy. See :mod:`distckpt.tiered.manager` and
docs/tiered.md."""

from distckpt.tiered.manager import (
    NoCheckpointError,
    TieredCheckpointManager,
    TierLoadReport,
    UploadFailedError,
    read_tier,
)
from distckpt.tiered.markers import iteration_name

__all__ = [
    "NoCheckpointError",
    "TieredCheckpointManager",
    "TierLoadReport",
    "UploadFailedError",
    "iteration_name",
    "read_tier",
]
