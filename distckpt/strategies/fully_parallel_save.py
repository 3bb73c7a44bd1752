"""The fully parallel save: each replicated shard written by one rank of the group, balanced.

See :mod:`distckpt.strategies.fully_parallel` for the collectives and who calls them.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Dict, List

from distckpt import dist, storage
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_outplace
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.mapping import ReplicaId, ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from distckpt.strategies.base import AsyncSaveShardedStrategy, SaveShardedStrategy
from distckpt.strategies.shard_assignment import (
    ShardDistribution,
    ShardId,
    WrapperState,
    distribute_shards_to_ranks,
    local_shards,
    shard_id,
    shard_nbytes,
)


def _replica(original: ReplicaId, main: bool) -> ReplicaId:
    """A replica id of the same form as ``original`` that is (or is not) the main replica."""
    if isinstance(original, (tuple, list)) and len(original) > 0:
        return (0,) * len(original) if main else (1,) + (0,) * (len(original) - 1)
    return 0 if main else 1


class FullyParallelSaveStrategyWrapper(WrapperState, AsyncSaveShardedStrategy):
    """Save with ``strategy``, each replicated shard written by one rank of the group, balanced.

    Args:
        strategy: any sharded save strategy; ``backend``/``version`` are taken from it, so
            ``metadata.json`` names the inner backend.
        parallelization_group: the ranks that share the writing (group ranks); default: all.
        do_cache_distribution: keep the assignment and reuse it while the local shards keep
            their structure (one tiny all-reduce instead of an all-gather).

    Only shards whose main replica is inside the group are reassigned (a shard whose main
    replica sits in another group is written there). The caller's ShardedTensors are never
    changed: the inner strategy gets shallow copies with new replica ids.
    """

    reassigns_replicas = True

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: dist.ProcessGroup = None,
        do_cache_distribution: bool = False,
    ):
        super().__init__(strategy.backend, strategy.version)
        self._init_wrapper(strategy, parallelization_group, do_cache_distribution)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> None:
        self.base_strategy.save(self.apply_saving_parallelization(sharded_state_dict), checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location):
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"the wrapped strategy {type(self.base_strategy).__name__} (backend {self.backend!r}) "
                f"cannot save asynchronously"
            )
        return self.base_strategy.async_save(
            self.apply_saving_parallelization(sharded_state_dict), checkpoint_dir
        )

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
        """Return a copy of ``sharded_state_dict`` whose replica ids give each shard one writer.

        Every rank calls it (collectives: see the module docstring). Without a process group
        the input is returned as it is.
        """
        normalize_sharded_state_dict(sharded_state_dict)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return sharded_state_dict
        me = dist.get_rank(self.parallelization_group)
        group_size = dist.get_world_size(self.parallelization_group)
        exc, payload, shards = None, None, []
        try:
            shards = local_shards(sharded_state_dict)
            payload = tuple(
                sorted({(shard_id(sh), shard_nbytes(sh), is_main_replica(sh.replica_id)) for sh in shards})
            )
        except Exception as e:  # noqa: BLE001 - shared with every rank in the cache's all-reduce
            exc = e

        def compute(gathered) -> ShardDistribution:
            holders: Dict[ShardId, List[int]] = defaultdict(list)
            sizes: Dict[ShardId, int] = {}
            mains = set()
            for rank, rank_payload in enumerate(gathered):
                for sid, nbytes, main in rank_payload:
                    if not holders[sid] or holders[sid][-1] != rank:
                        holders[sid].append(rank)
                    sizes[sid] = max(sizes.get(sid, 0), nbytes)
                    if main:
                        mains.add(sid)
            in_group = {sid: tuple(holders[sid]) for sid in mains}
            return ShardDistribution(
                distribute_shards_to_ranks(in_group, sizes, group_size),
                in_group,
                {sid: sizes[sid] for sid in mains},
            )

        distribution = self._cache.get("fully parallel save", exc, payload, compute)
        self.last_distribution = distribution
        already_main = set()

        def reassign(leaf: Any) -> Any:
            if not isinstance(leaf, (ShardedTensor, ShardedObject)):
                return leaf
            sid = shard_id(leaf)
            writer = distribution.assignment.get(sid)
            if writer is None:
                return leaf
            main = writer == me and sid not in already_main
            if main:
                already_main.add(sid)
            out = copy.copy(leaf)
            out.replica_id = _replica(leaf.replica_id, main)
            return out

        return dict_list_map_outplace(reassign, sharded_state_dict)
