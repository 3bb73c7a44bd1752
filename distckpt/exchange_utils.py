"""Megatron-Core's ``dist_checkpointing.exchange_utils`` API: who handles which replicated shard,
and moving loaded shards to the ranks that need them.

distckpt's own fully parallel wrappers (:mod:`distckpt.strategies.fully_parallel`) plan and
exchange with :mod:`distckpt.strategies.shard_assignment` and
:mod:`distckpt.strategies.fully_parallel_load`. This module keeps the names and data shapes that
Megatron-Core code (``MCoreTensorAwareStateDict``, its tests, user code) calls, with the same
results:

* :func:`distribute_shards_to_ranks` - the deterministic balanced assignment in Megatron-Core's
  order: shards whose main replica is in the group first (cross-group loads last), then those held
  by fewest ranks, then the largest, then by id; each to the least loaded rank that holds it;
* :func:`determine_main_replica_uniform_distribution` - one all-gather of shard descriptions in the
  group, then that assignment (None for a group of one rank);
* :func:`exchange_by_distribution` - every shard loaded by one rank reaches the others that need it
  (one broadcast per shard, on the group's collective device: CPU for gloo, CUDA for NCCL);
* :func:`_get_empty_tensor_for_exchange` - the receive buffer of one shard (a private name that
  Megatron-Core's tests patch to count allocations; :func:`exchange_by_distribution` calls it
  through this module, so a patch here is seen).
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Set, Tuple, TypeVar

import torch

from distckpt import dist
from distckpt.dict_utils import nested_values
from distckpt.errors import CheckpointingException
from distckpt.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from distckpt.process_group import collective_device
from distckpt.strategies import shard_assignment
from distckpt.utils import sharded_tensor_shard_id

logger = logging.getLogger(__name__)

__all__ = [
    "ShardDistribution",
    "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_tensors_broadcast",
]

T = TypeVar("T")
ShardId = shard_assignment.MCoreShardId
# Megatron-Core's distribution record; distckpt's wrappers give theirs in this form too
# (``wrapper.cached_distribution``).
ShardDistribution = shard_assignment.MCoreShardDistribution


def _nbytes(sh: ShardedTensor) -> int:
    fr = sh.flattened_range
    numel = fr.stop - fr.start if fr is not None else int(torch.Size(sh.local_shape).numel())
    return numel * sh.dtype.itemsize


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Iterable[T] = frozenset(),
) -> Dict[T, int]:
    """Assign each shard to one of the ranks that hold it, balancing bytes; the same on every rank.

    The assignment distckpt's own wrappers use (:func:`shard_assignment.distribute_shards_to_ranks
    <distckpt.strategies.shard_assignment.distribute_shards_to_ranks>`), in Megatron-Core's order:
    shards not in ``cross_parallelization_group_loads`` first, then fewest holders, then largest,
    then by id; each goes to its least loaded holder (ties: lowest rank).
    """
    assignment = shard_assignment.distribute_shards_to_ranks(
        shard_to_ranks, shard_to_size, num_ranks, None, cross_parallelization_group_loads
    )
    if logger.isEnabledFor(logging.DEBUG):
        loads = [0] * num_ranks
        for sid, rank in assignment.items():
            loads[rank] += shard_to_size[sid]
        logger.debug("distribute_shards_to_ranks: bytes per rank %s", loads)
    return assignment


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group=None,
    ignore_groups: bool = False,
) -> Optional[ShardDistribution]:
    """Find who saves (or, with ``ignore_groups``, loads) each ShardedTensor in the group.

    Every group rank calls it (one all-gather of data-free shard descriptions). Without
    ``ignore_groups`` only shards with a main replica in the group take part; with it, every shard
    a group rank holds does, those whose main replica is elsewhere assigned last. Returns None for
    a group of one rank (nothing to distribute).
    """
    size = dist.get_world_size(parallelization_group)
    if size <= 1:
        return None
    mine = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    gathered = dist.all_gather_object(mine, parallelization_group, stage="shard distribution")
    holders: Dict[ShardId, List[int]] = defaultdict(list)
    sizes: Dict[ShardId, int] = {}
    described: Dict[ShardId, ShardedTensor] = {}
    with_main: Set[ShardId] = set()
    without_main: Set[ShardId] = set()
    for rank, shards in enumerate(gathered):
        for sh in shards:
            sid = sharded_tensor_shard_id(sh)
            holders[sid].append(rank)
            sizes.setdefault(sid, _nbytes(sh))
            described.setdefault(sid, sh)
            (with_main if is_main_replica(sh.replica_id) else without_main).add(sid)
    in_group = with_main | without_main if ignore_groups else set(with_main)
    holders = {sid: ranks for sid, ranks in holders.items() if sid in in_group}
    assignment = distribute_shards_to_ranks(holders, sizes, size, in_group - with_main)
    return ShardDistribution(assignment, in_group, described, holders)


def _get_empty_tensor_for_exchange(
    shard_id: ShardId,
    needed_shards: Dict[ShardId, ShardedTensor],
    unneeded_shards: Dict[ShardId, ShardedTensor],
    loaded_tensors: Dict[ShardId, torch.Tensor],
    device: Optional[torch.device] = None,
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """The buffer this rank receives ``shard_id`` into, and where the result must end up.

    A shard this rank needs (in ``needed_shards``) is received into a tensor of its shape and
    dtype that is also recorded in ``loaded_tensors``; the second value is the device of the
    request's own data (None when the request had none). A shard this rank only takes part in
    exchanging (``unneeded_shards``) gets a scratch buffer, and None.
    """
    device = torch.device(device) if device is not None else collective_device()
    needed = needed_shards.get(shard_id)
    meta = needed if needed is not None else unneeded_shards[shard_id]
    fr = meta.flattened_range
    shape = (fr.stop - fr.start,) if fr is not None else tuple(meta.local_shape)
    buffer = torch.empty(shape, dtype=meta.dtype, device=device)
    if needed is None:
        return buffer, None
    orig = needed.data.device if isinstance(needed.data, torch.Tensor) and not needed.data.is_meta else None
    loaded_tensors[shard_id] = buffer
    return buffer, orig


@torch.no_grad()
def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group=None,
) -> Dict[ShardId, torch.Tensor]:
    """One broadcast per shard that more than one group rank needs, from the rank that has it.

    Returns ``loaded_tensors`` extended by every shard this rank needs (on the device of the
    request's data where it had some, else the collective device).
    """
    assignment, _, described, needers = shard_distribution
    me = dist.get_rank(parallelization_group)
    device = collective_device(parallelization_group)
    out = dict(loaded_tensors)
    empty_for = sys.modules[__name__]._get_empty_tensor_for_exchange  # patchable, as in Megatron-Core
    for sid, src in assignment.items():  # the same order on every rank
        if len(needers[sid]) <= 1:
            continue  # only its loader needs it: nothing to send
        if src == me:
            if sid not in out:
                raise CheckpointingException(f"rank {me} was to load shard {sid!r} but has not")
            orig = out[sid].device
            buffer = out[sid].to(device)
        else:
            buffer, orig = empty_for(sid, unloaded_shards, described, out, device)
        dist.broadcast(buffer, src=src, group=parallelization_group)
        if sid in out or src == me:
            out[sid] = buffer.to(orig) if orig is not None else buffer
    return out


def exchange_by_distribution(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group=None,
    exchange_algo: str = "broadcast",
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded shards by ``shard_distribution``. ``exchange_algo`` takes Megatron-Core's
    names (``broadcast``, ``gather_rounds``, ``gather_object``); all run the broadcast exchange,
    whose result is the same (it holds one shard's buffer at a time)."""
    if shard_distribution is None:
        raise CheckpointingException("exchange_by_distribution needs a shard distribution")
    if exchange_algo not in ("broadcast", "gather_rounds", "gather_object"):
        raise CheckpointingException(f"unknown exchange algorithm {exchange_algo!r}")
    return exchange_loaded_tensors_broadcast(
        loaded_tensors, unloaded_shards, shard_distribution, parallelization_group
    )
