"""Who handles which replicated shard in a fully parallel save or load: shard ids, the balanced
assignment, and the distribution both wrappers find once per structure and cache.

The assignment is the same on every rank and follows Megatron-Core's order: shards held by the
fewest ranks first, then the largest, then by id, each given to the least-loaded rank among those
that hold it (ties to the lowest rank). Finding it
takes one all-gather of shard ids and sizes within the group; with ``do_cache_distribution`` it
is kept and reused as long as the local shards keep their structure, which costs one tiny
all-reduce per call (which also carries "did this rank fail?", see
:mod:`distckpt.strategies.fully_parallel`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from distckpt import dist
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor

logger = logging.getLogger(__name__)

ShardId = Tuple[Any, ...]

# ShardedObjects have no size before they are pickled; this nominal one only spreads them over
# ranks without weighing against tensors.
_OBJECT_NBYTES = 1


def shard_id(sh: ShardedBase) -> ShardId:
    """What makes two shards the same piece: equal ids mean replicas of the same bytes."""
    if isinstance(sh, ShardedTensor):
        fr = sh.flattened_range
        return (
            "tensor",
            sh.key,
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            tuple(sh.local_shape),
            sh.prepend_axis_num,
            () if fr is None else (fr.start, fr.stop),
            str(sh.dtype),
            bool(sh.allow_shape_mismatch),
        )
    if isinstance(sh, ShardedObject):
        return ("object", sh.unique_key)
    raise CheckpointingException(
        f"cannot distribute {type(sh).__name__} under key {getattr(sh, 'key', '?')!r}"
    )


def shard_nbytes(sh: ShardedBase) -> int:
    """The bytes of a shard (a nominal few for a ShardedObject)."""
    if isinstance(sh, ShardedTensor):
        fr = sh.flattened_range
        numel = fr.stop - fr.start if fr is not None else _prod(sh.local_shape)
        return numel * sh.dtype.itemsize
    return _OBJECT_NBYTES


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[ShardId, Sequence[int]],
    shard_to_size: Dict[ShardId, int],
    num_ranks: int,
    initial_loads: Optional[Sequence[int]] = None,
    cross_parallelization_group_loads: Iterable[ShardId] = frozenset(),
) -> Dict[ShardId, int]:
    """Give each shard to one of the ranks that hold it, balancing bytes; deterministic.

    The order is Megatron-Core's, so a fully parallel save or load splits the work as it does:
    shards not in ``cross_parallelization_group_loads`` first, then those held by the fewest
    ranks (they have the fewest choices), then the largest, then by id; each goes to its
    least-loaded holder (ties to the lowest rank). ``initial_loads`` are bytes each rank has to
    handle anyway.
    """
    cross = set(cross_parallelization_group_loads)
    loads = list(initial_loads) if initial_loads is not None else [0] * num_ranks
    assignment: Dict[ShardId, int] = {}

    def order(sid: ShardId) -> Tuple[Any, ...]:
        return (sid in cross, len(shard_to_ranks[sid]), -shard_to_size[sid], sid)

    for sid in sorted(shard_to_ranks, key=order):
        holders = shard_to_ranks[sid]
        if not holders:
            raise CheckpointingException(f"shard {sid!r} has no rank to assign it to")
        rank = min(holders, key=lambda r: (loads[r], r))
        assignment[sid] = rank
        loads[rank] += shard_to_size[sid]
    return assignment


# Megatron-Core's shard ids: (key, global offset, flattened range as (start, stop) or None).
MCoreShardId = Tuple[str, tuple, Optional[tuple]]


class MCoreShardDistribution(NamedTuple):
    """A distribution in Megatron-Core's form (``exchange_utils.ShardDistribution``).

    Fields, in Megatron-Core's order: ``main_rank_for_shard`` (shard id -> the group rank that
    saves or loads it), ``shards_in_this_group`` (ids whose main replica is in the group),
    ``shard_to_metadata`` (id -> a data-free ShardedTensor of it), ``all_ranks_for_shard`` (id ->
    the group ranks that hold or need it).
    """

    main_rank_for_shard: Dict[MCoreShardId, int]
    shards_in_this_group: Set[MCoreShardId]
    shard_to_metadata: Dict[MCoreShardId, ShardedTensor]
    all_ranks_for_shard: Dict[MCoreShardId, List[int]]


def mcore_shard_id(sid: ShardId) -> Any:
    """Megatron-Core's id of the shard distckpt calls ``sid``: ``(key, global offset, flat range
    or None)`` for a tensor (as ``utils.sharded_tensor_shard_id``), the unique key for an object."""
    if sid[0] == "tensor":
        return (sid[1], sid[3], sid[6] or None)
    return sid[1]


@dataclass(frozen=True)
class ShardDistribution:
    """Who handles which shard within the parallelization group (group ranks).

    Attributes:
        assignment: shard id -> the one group rank that writes (save) or reads (load) it.
        holders: shard id -> the group ranks that hold (save) or request (load) it, ascending.
        sizes: shard id -> bytes.
    """

    assignment: Dict[ShardId, int]
    holders: Dict[ShardId, Tuple[int, ...]]
    sizes: Dict[ShardId, int]

    def bytes_per_rank(self, num_ranks: int) -> List[int]:
        loads = [0] * num_ranks
        for sid, rank in self.assignment.items():
            loads[rank] += self.sizes[sid]
        return loads


def local_shards(sharded_state_dict: ShardedStateDict) -> List[ShardedBase]:
    """The ShardedTensors and ShardedObjects of a state dict, in its order."""
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, (ShardedTensor, ShardedObject))]


class DistributionCache:
    """Finds the distribution (one all-gather in the group), or reuses the last one.

    ``payload`` is this rank's hashable description of its shards; the cached distribution is
    reused when no rank's payload changed since it was computed (one tiny all-reduce). The
    all-reduce spans every rank and also carries preparation failures, so that they surface on
    every rank before anyone enters a group collective.
    """

    def __init__(self, group: dist.ProcessGroup, enabled: bool):
        self.group = group
        self.enabled = enabled
        self._cached: Optional[Tuple[Any, ShardDistribution]] = None
        self.last_was_cached = False

    def get(self, stage: str, exc: Optional[BaseException], payload: Any, compute) -> ShardDistribution:
        changed = not (self.enabled and self._cached is not None and self._cached[0] == payload)
        failed, any_changed = dist.all_reduce_max([int(exc is not None), int(changed)], stage=stage)
        if failed:
            dist.sync_errors(stage, exc)
        self.last_was_cached = not any_changed
        if not any_changed:
            return self._cached[1]
        gathered = dist.all_gather_object(payload, self.group, stage=f"{stage} (shard distribution)")
        distribution = compute(gathered)
        logger.debug("%s: bytes per group rank %s", stage, distribution.bytes_per_rank(len(gathered)))
        self._cached = (payload, distribution) if self.enabled else None
        return distribution


class WrapperState:
    """What both wrappers keep: the inner strategy, the group and the cached distribution."""

    def _init_wrapper(self, strategy, parallelization_group, do_cache_distribution: bool) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self._cache = DistributionCache(parallelization_group, do_cache_distribution)
        self.last_distribution: Optional[ShardDistribution] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    @property
    def cached_distribution(self) -> Optional[MCoreShardDistribution]:
        """The last call's distribution in Megatron-Core's form (None before the first call):
        who writes or reads each shard and which ranks hold it, by Megatron-Core's shard ids.
        ``shard_to_metadata`` is empty: distckpt keeps no data-free copies of the shards."""
        d = self.last_distribution
        if d is None:
            return None
        main = {mcore_shard_id(sid): rank for sid, rank in d.assignment.items()}
        holders = {mcore_shard_id(sid): list(ranks) for sid, ranks in d.holders.items()}
        return MCoreShardDistribution(main, set(main), {}, holders)

    @property
    def last_distribution_cached(self) -> bool:
        """Whether the last call reused the cached assignment (no all-gather)."""
        return self._cache.last_was_cached
