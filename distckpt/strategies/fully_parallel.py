"""Fully parallel save and load: spread the I/O of replicated shards over a data-parallel group.

With data parallelism every DP rank holds the same shards, and with plain ``replica_id``s the
main replicas (DP rank 0) do all the writing and every rank reads everything. The wrappers here
share that work within a *parallelization group* (usually the DP group; default: every rank):

* :class:`FullyParallelSaveStrategyWrapper` assigns each shard that several group ranks hold to
  exactly one of them, balanced by bytes, and hands the inner strategy a copy of the state dict
  whose replica ids say so. The checkpoint is the same as a plain save's; only who writes what
  changes.
* :class:`FullyParallelLoadStrategyWrapper` reads each piece that several group ranks request
  identically once per group, by one of them, and sends it to the others (``broadcast`` of each
  piece from its loader, or ``gather_rounds``: all-gathers of one piece per rank per round).

Both work with any sharded strategy: they only rewrite requests and move bytes. They live in
:mod:`~distckpt.strategies.fully_parallel_save` and :mod:`~distckpt.strategies.fully_parallel_load`,
on :mod:`~distckpt.strategies.shard_assignment`; this module re-exports them (its old home), and
``_sharded_tensor_shard_id`` (:func:`distckpt.utils.sharded_tensor_shard_id`), which code written
for Megatron-Core imports from here. Megatron-Core's ``exchange_utils`` names (its assignment
order and exchange functions) are in :mod:`distckpt.exchange_utils`.

The assignment is the same on every rank, in Megatron-Core's order: shards held by the fewest
ranks first, then the largest, then by id, each given to the least-loaded rank among those that
hold it (ties to the lowest rank). Finding it
takes one all-gather of shard ids and sizes within the group; with ``do_cache_distribution`` it
is kept and reused as long as the local shards keep their structure, which costs one tiny
all-reduce per call.

Collectives and who calls them: every rank calls ``save``/``load`` (as for any strategy). Each
call first runs one tiny all-reduce over *all* ranks that carries "did this rank fail?" (and
"did my structure change?"), so an error on one rank is raised on every rank before any rank
enters a group collective; then the group collectives (the all-gather, the exchange) follow in
the same order on every group rank.
"""

from __future__ import annotations

# Megatron-Core's tests patch ``<this module>.torch.distributed.broadcast`` to count exchanges.
import torch  # noqa: F401

from distckpt.strategies.fully_parallel_load import (
    EXCHANGE_ALGOS,
    FullyParallelLoadStrategyWrapper,
    load_waves,
)
from distckpt.strategies.fully_parallel_save import FullyParallelSaveStrategyWrapper
from distckpt.strategies.shard_assignment import (
    ShardDistribution,
    ShardId,
    distribute_shards_to_ranks,
    shard_id,
)

# Megatron-Core's module imports this private name (from its utils) and its tests import it from
# here: the identity of a ShardedTensor's stored piece (key, global offset, flat range).
from distckpt.utils import sharded_tensor_shard_id as _sharded_tensor_shard_id

__all__ = [
    "EXCHANGE_ALGOS",
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "ShardDistribution",
    "ShardId",
    "distribute_shards_to_ranks",
    "load_waves",
    "shard_id",
    "_sharded_tensor_shard_id",
]
