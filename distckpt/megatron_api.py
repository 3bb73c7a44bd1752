"""Megatron-Core 0.19's extra arguments to ``save`` and ``load``, and what they mean here.

Megatron-Core 0.19 added to ``dist_checkpointing.save``: ``async_strategy`` (which async engine
runs an ``async_sharded_save``: NVIDIA Resiliency Extension's ``"nvrx"`` or Megatron's own
``"mcore"``) and ``verify_integrity`` (write a file-integrity manifest); and to ``load``:
``verify_integrity`` (check that manifest) and ``process_group`` (the group every collective of
the call runs on). distckpt accepts them with that meaning:

- ``async_strategy``: distckpt has one async engine (distckpt.strategies.async_utils); each of
  Megatron's names selects it. Any other value is refused rather than ignored.
- ``verify_integrity`` on save: distckpt writes its integrity manifest (CRC32C of every item and
  file) on every save already; on load it is ``verify=True``.
- ``process_group`` on load: threaded into every collective of ``load``.

The 0.16 forms (without these arguments) keep working unchanged.
"""

from __future__ import annotations

from typing import Optional

from distckpt.core import CheckpointingException

__all__ = ["ASYNC_STRATEGIES", "check_save_options"]

# Megatron-Core 0.19's async engines, plus distckpt's own name; all run distckpt's engine.
ASYNC_STRATEGIES = ("nvrx", "mcore", "distckpt")


def check_save_options(async_strategy: Optional[str], verify_integrity: object) -> None:
    """Refuse values of Megatron-Core 0.19's save arguments that distckpt cannot honour."""
    if async_strategy is not None and async_strategy not in ASYNC_STRATEGIES:
        raise CheckpointingException(
            f"save(async_strategy={async_strategy!r}): unknown async engine; Megatron-Core's are "
            f"'nvrx' and 'mcore' (each runs distckpt's async engine here), or None"
        )
    if not isinstance(verify_integrity, bool):
        raise CheckpointingException(f"save(verify_integrity={verify_integrity!r}): must be True or False")
