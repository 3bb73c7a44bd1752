"""The blocking part of ``dcp.async_save`` through :class:`distckpt.dcp.StorageWriter`: staging.

``dcp.async_save`` first asks a stager for a "training-safe" copy of the state dict (DCP's
``AsyncStager`` protocol; a writer that implements it is its own stager), returns, and saves the
copy in a background thread. :class:`PoolStager` makes that copy in the buffers of distckpt's
process-wide staging pool (:mod:`distckpt.io.staging`), the pool every async save of
distckpt shares: buffers are kept and reused from one save to the next (pinned for CUDA tensors,
the device-to-host copies asynchronous and synchronized once), so after the first save no
staging memory is allocated. A tensor the pool cannot hold without going over the host memory
budget (``DISTCKPT_HOST_MEMORY_BUDGET``) while another save's buffers are out is copied into
fresh memory instead, as DCP's own stager does for everything: DCP's protocol wants the whole
copy before it returns, so it cannot stage in waves as ``distckpt.save`` does.

The copy keeps the state dict's structure: nested dicts, lists and tuples; a ``DTensor`` becomes
a DTensor of the same mesh, placements, shape and stride over its staged local tensor; other
non-tensor values are deep-copied (DCP pickles them in the background, after training went on).
Values of any other tensor kind (torch's legacy ``ShardedTensor``) are staged by DCP's
``DefaultStager``. The buffers return to the pool when the staged copy is dropped: DCP drops it
when the background save returns (success or failure).

Which rank calls what: every rank, on the thread that calls ``dcp.async_save``.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from distckpt.io import staging
from distckpt.io.staging_buffers import StagedBatch, StagingBuffers

__all__ = ["PoolStager", "StagedStateDict"]

# Values passed on as they are: nothing can change them in place.
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)


class StagedStateDict(dict):
    """A staged copy of a state dict; it holds its staging batch, which gives its buffers back to
    the pool when the copy is collected."""

    batch: Optional[StagedBatch] = None


class PoolStager(AsyncStager):
    """DCP's ``AsyncStager`` over distckpt's staging pool (see the module docstring)."""

    # The copies are complete (CUDA ones synchronized) when ``stage`` returns.
    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> StagedStateDict:
        """A copy of ``state_dict`` that later changes to it do not reach (every rank)."""
        buffers = StagingBuffers(staging.pool())
        fallback: List[Any] = []
        try:
            staged = StagedStateDict(
                (key, _staged(value, buffers, fallback)) for key, value in state_dict.items()
            )
        except BaseException:
            buffers.discard_unsealed()
            raise
        staged.batch = buffers.seal()
        for stager in fallback:
            stager.close()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns complete copies."""

    def close(self) -> None:
        """The pool is process-wide (``distckpt.release_staging_memory()`` frees it)."""


def _staged(value: Any, buffers: StagingBuffers, fallback: List[Any]) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = _staged_tensor(value.to_local(), buffers)
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
        return _staged_tensor(value, buffers)
    if isinstance(value, torch.Tensor):  # torch's ShardedTensor and other kinds: DCP's own stager
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))
        fallback.append(stager)
        return stager.stage({"value": value})["value"]
    if isinstance(value, dict):
        return {k: _staged(v, buffers, fallback) for k, v in value.items()}
    if isinstance(value, list):
        return [_staged(v, buffers, fallback) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_staged(v, buffers, fallback) for v in value)
    if isinstance(value, _IMMUTABLE):
        return value
    return copy.deepcopy(value)


def _staged_tensor(tensor: torch.Tensor, buffers: StagingBuffers) -> torch.Tensor:
    """A host copy of ``tensor`` in a pool buffer, or in fresh memory when the budget is taken
    by another save's buffers."""
    tensor = tensor.detach()
    if tensor.device.type not in ("cpu", "cuda"):
        return tensor.to("cpu", copy=True)
    copied = buffers.acquire(tensor, wait=False)
    if copied is None:
        copied = torch.empty(tensor.shape, dtype=tensor.dtype)
        copied.copy_(tensor)
    return copied
