"""The local tier: frequent node-local checkpoints replicated to peers, for fast recovery.

See docs/local-recovery.md. ``LocalCheckpointManager`` is the entry point.
"""

from distckpt.local.manager import LoadReport, LocalCheckpointManager, NoLocalCheckpointError
from distckpt.local.piece import CorruptPieceError
from distckpt.local.replication import CliqueReplication

__all__ = [
    "CliqueReplication",
    "CorruptPieceError",
    "LoadReport",
    "LocalCheckpointManager",
    "NoLocalCheckpointError",
]
