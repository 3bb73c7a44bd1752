"""What a save of a sharded state dict will stage (:func:`prepare_staging`), and the old home of the
staging pool.

:func:`prepare_staging` reads a sharded state dict the way a save does (Megatron-Core classes
normalized, factories applied, a fully parallel wrapper's choice of shards, main replicas only)
and reserves in the process-wide pool the buffers that save will take, so that its blocking
part is only the copies. It is the one piece of staging that knows sharded state dicts and
strategies; the pool itself (:mod:`distckpt.io.staging`) and one save's view of it
(:mod:`distckpt.io.staging_buffers`) are how bytes move, and live in :mod:`distckpt.io`. Every
name importable from here before the split still is, as the same object.
"""

from __future__ import annotations

from typing import Any, List

import torch

from distckpt.dict_utils import dict_list_map_outplace, nested_values
from distckpt.factories import apply_factories
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.io.device_io import is_plain
from distckpt.io.staging import (
    EXACT_PIN_BYTES,
    PinnedRegistration,
    PoolKey,
    StagingPool,
    key_of,
    pinned_empty,
    pool,
    release_staging_memory,
)
from distckpt.io.staging_buffers import StagedBatch, StagingBuffers, identity
from distckpt.mapping import ShardedStateDict, ShardedTensor, is_main_replica

__all__ = [
    "EXACT_PIN_BYTES",
    "PinnedRegistration",
    "PoolKey",
    "StagedBatch",
    "StagingBuffers",
    "StagingPool",
    "identity",
    "key_of",
    "pinned_empty",
    "pool",
    "prepare_staging",
    "release_staging_memory",
    "staged_keys",
]


def staged_keys(sharded_state_dict: ShardedStateDict, stage_cpu_tensors: bool = True) -> List[PoolKey]:
    """The pool keys a ``torch_dist`` async save of ``sharded_state_dict`` (factories applied,
    main replicas only) takes: one per tensor with data (CPU ones with ``stage_cpu_tensors``)."""
    keys = []
    for sh in nested_values(sharded_state_dict):
        if not (isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id)):
            continue
        data = sh.data
        if not isinstance(data, torch.Tensor) or data.numel() == 0:
            continue
        on_cuda = data.device.type == "cuda"
        if not on_cuda and not stage_cpu_tensors:
            continue
        dtype = data.dtype if is_plain(data) else sh.dtype  # a subclass is saved in its nominal dtype
        keys.append((data.numel() * dtype.itemsize, dtype, on_cuda))
    return keys


def prepare_staging(sharded_state_dict: ShardedStateDict, sharded_strategy: Any = None) -> int:
    """Allocate now (pinned where the tensors are on CUDA) the staging buffers that the next async
    save of ``sharded_state_dict`` will take, so that its blocking part is only the copies.

    ``sharded_strategy``: the save strategy the save will use; a fully parallel wrapper decides
    here which shards this rank writes (a collective: every rank calls it then), and a
    ``torch_dist`` strategy with ``stage_cpu_tensors=False`` stages no CPU tensor. The state dict
    is not changed. At most the host memory budget is reserved (largest buffers first); free
    buffers the state does not need are dropped. Returns the bytes reserved.
    """
    state = dict_list_map_outplace(lambda leaf: leaf, sharded_state_dict)
    normalize_sharded_state_dict(state)
    apply_factories(state)
    inner = sharded_strategy
    if hasattr(sharded_strategy, "apply_saving_parallelization"):
        state = sharded_strategy.apply_saving_parallelization(state)
        inner = getattr(sharded_strategy, "base_strategy", sharded_strategy)
    return pool().reserve(staged_keys(state, getattr(inner, "stage_cpu_tensors", True)))
