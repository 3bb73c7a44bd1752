"""The fully parallel load: each piece several group ranks request read once, by one of them, and
sent to the others (``broadcast`` of each piece from its reader, or ``gather_rounds``), in waves
that keep every reader within the host memory budget.

See :mod:`distckpt.strategies.fully_parallel` for the collectives and who calls them.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt import dist, storage
from distckpt.budget import host_memory_budget
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_outplace
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.mapping import ShardedBase, ShardedStateDict, ShardedTensor, StateDict
from distckpt.strategies.base import LoadShardedStrategy
from distckpt.strategies.shard_assignment import (
    ShardDistribution,
    ShardId,
    WrapperState,
    distribute_shards_to_ranks,
    local_shards,
    shard_id,
    shard_nbytes,
)

EXCHANGE_ALGOS = ("broadcast", "gather_rounds")


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class _Piece:
    """This rank's requests for one shard id, and where the bytes go."""

    sid: ShardId
    leaves: List[ShardedBase]
    nbytes: int


class FullyParallelLoadStrategyWrapper(WrapperState, LoadShardedStrategy):
    """Load with ``strategy``, each piece requested by several group ranks read once per group.

    Args:
        strategy: any sharded load strategy (metadata queries, compatibility checks and key
            removal are passed to it).
        parallelization_group: the ranks that share the reading (group ranks); default: all.
        do_cache_distribution: keep the assignment of readers and reuse it while the local
            requests keep their structure (one tiny all-reduce instead of an all-gather).
        exchange_algo: how read pieces reach the other requesters:
            ``"broadcast"``: one broadcast per piece from its reader; extra memory: one
            buffer of the largest piece on the collective device.
            ``"gather_rounds"``: in round k every rank contributes the k-th piece it read
            (largest first) to one all-gather; extra memory: group size x the largest piece.
            ShardedObjects always go by ``broadcast_object``.

    A piece requested by one rank only is read by that rank. Requests with data are filled in
    place wherever they are (CPU, CUDA, tensor subclasses through ``copy_``); requests without
    data get CPU tensors, as with the inner strategy. Exchange buffers live on
    ``dist.collective_device(group)``.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: dist.ProcessGroup = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ):
        super().__init__(strategy.backend, strategy.version)
        if exchange_algo not in EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"unknown exchange_algo {exchange_algo!r}; expected one of {', '.join(EXCHANGE_ALGOS)}"
            )
        self._init_wrapper(strategy, parallelization_group, do_cache_distribution)
        self.exchange_algo = exchange_algo
        self.last_waves = 1  # how many read-and-exchange waves the last load took

    # ----------------------------------------------------------------- delegation

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def load_common_items(self, checkpoint_dir: storage.Location) -> StateDict:
        return self.base_strategy.load_common_items(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: storage.Location, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    # ----------------------------------------------------------------- load

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> StateDict:
        """Every rank calls it; collectives as in the module docstring, then the exchange."""
        normalize_sharded_state_dict(sharded_state_dict)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        group = self.parallelization_group
        me = dist.get_rank(group)
        group_size = dist.get_world_size(group)

        exc, payload = None, None
        pieces: Dict[ShardId, _Piece] = {}
        try:
            for leaf in local_shards(sharded_state_dict):
                sid = shard_id(leaf)
                piece = pieces.get(sid)
                if piece is None:
                    pieces[sid] = _Piece(sid, [leaf], shard_nbytes(leaf))
                else:
                    piece.leaves.append(leaf)
            payload = tuple(sorted((sid, p.nbytes) for sid, p in pieces.items()))
        except Exception as e:  # noqa: BLE001 - shared with every rank in the cache's all-reduce
            exc = e

        def compute(gathered) -> ShardDistribution:
            holders: Dict[ShardId, List[int]] = defaultdict(list)
            sizes: Dict[ShardId, int] = {}
            for rank, rank_payload in enumerate(gathered):
                for sid, nbytes in rank_payload:
                    holders[sid].append(rank)
                    sizes[sid] = nbytes
            # Pieces one rank alone asks for, and empty ones, are read by their requesters; they
            # still count towards that rank's load when the shared ones are assigned.
            unique_loads = [0] * group_size
            shared: Dict[ShardId, Tuple[int, ...]] = {}
            for sid, ranks in holders.items():
                if len(ranks) > 1 and sizes[sid] > 0:
                    shared[sid] = tuple(ranks)
                else:
                    for r in ranks:
                        unique_loads[r] += sizes[sid]
            assignment = distribute_shards_to_ranks(shared, sizes, group_size, unique_loads)
            return ShardDistribution(assignment, shared, {sid: sizes[sid] for sid in shared})

        distribution = self._cache.get("fully parallel load", exc, payload, compute)
        self.last_distribution = distribution

        # Read and exchange in waves: in each, every rank reads at most the host memory budget
        # of pieces for others. The smallest budget of all ranks, so that a group's ranks cut
        # the same waves, and as many waves everywhere (each has a check-in over all ranks).
        (neg_budget,) = dist.all_reduce_max([-host_memory_budget()], stage="fully parallel load budget")
        waves = load_waves(distribution, -neg_budget, group_size)
        (count,) = dist.all_reduce_max([len(waves)], stage="fully parallel load budget")
        waves += [ShardDistribution({}, {}, {})] * (count - len(waves))
        self.last_waves = count
        results: Dict[int, Any] = {}
        for w, wave in enumerate(waves):
            wave_pieces = {
                sid: p
                for sid, p in pieces.items()
                if sid in wave.assignment or (w == 0 and sid not in distribution.assignment)
            }
            results.update(self._load_wave(wave, wave_pieces, me, group, group_size, checkpoint_dir))
        return dict_list_map_outplace(lambda leaf: results.get(id(leaf), leaf), sharded_state_dict)

    def _load_wave(
        self,
        distribution: ShardDistribution,
        pieces: Dict[ShardId, _Piece],
        me: int,
        group: dist.ProcessGroup,
        group_size: int,
        checkpoint_dir: storage.Location,
    ) -> Dict[int, Any]:
        """Read this rank's pieces of one wave, then exchange them (collectives as for a load)."""
        exc = None
        results: Dict[int, Any] = {}
        exchange: Optional[_Exchange] = None
        try:
            exchange = _Exchange(distribution, pieces, me, group, dist.collective_device(group))
            request = exchange.inner_request()
            loaded = self.base_strategy.load(request, checkpoint_dir) if request else {}
            results = exchange.collect_loaded(loaded)
            exchange.allocate_buffers(self.exchange_algo, group_size)
        except Exception as e:  # noqa: BLE001 - shared with every rank below, before any exchange
            exc = e
        # Also the one check-in that guards the whole exchange (its per-piece broadcasts have none).
        (failed,) = dist.all_reduce_max([int(exc is not None)], stage="fully parallel exchange")
        if failed:
            dist.sync_errors("fully parallel load", exc)

        with torch.no_grad():
            if self.exchange_algo == "broadcast":
                exchange.run_broadcast()
            else:
                exchange.run_gather_rounds()
        exchange.exchange_objects()
        results.update(exchange.received)
        return results


def load_waves(distribution: ShardDistribution, budget: int, group_size: int) -> List[ShardDistribution]:
    """Cut the shared pieces into waves in which no rank reads more than ``budget`` bytes for
    others (a larger piece alone); objects go in the first wave. Same on every rank."""
    loads = distribution.bytes_per_rank(group_size)
    if max(loads, default=0) <= budget:
        return [distribution]
    cut: List[Dict[ShardId, int]] = [{}]
    used = [0] * group_size
    for sid in sorted(distribution.assignment, key=lambda s: (s[0] != "object", s)):
        rank, size = distribution.assignment[sid], distribution.sizes[sid]
        if sid[0] != "object" and used[rank] and used[rank] + size > budget:
            cut.append({})
            used = [0] * group_size
        cut[-1][sid] = rank
        used[rank] += size
    return [
        ShardDistribution(a, {s: distribution.holders[s] for s in a}, {s: distribution.sizes[s] for s in a})
        for a in cut
    ]


class _Exchange:
    """Moves the pieces read by one group rank to the others that requested them.

    Every group rank builds the same sequence of collectives from the shared distribution; only
    what each rank does with the bytes differs (send, keep, or drop when it did not ask).
    """

    def __init__(
        self,
        distribution: ShardDistribution,
        pieces: Dict[ShardId, _Piece],
        me: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        self.distribution = distribution
        self.pieces = pieces
        self.me = me
        self.group = group
        self.device = device
        self.received: Dict[int, Any] = {}
        # Pieces this rank reads: those it was assigned, and those nobody else asked for.
        self._reads = [p for sid, p in pieces.items() if distribution.assignment.get(sid, me) == me]
        self._read_sids = {p.sid for p in self._reads}
        # Loader-side tensors to send, by shard id (on whatever device the inner strategy used).
        self._sources: Dict[ShardId, torch.Tensor] = {}
        # Loader-side plain tensors read for subclass targets: what is sent for those pieces.
        self._staged: Dict[ShardId, torch.Tensor] = {}
        self._objects: Dict[ShardId, Any] = {}
        # Exchange buffers and order (allocate_buffers).
        self._order: List[ShardId] = []
        self._scratch: Optional[torch.Tensor] = None
        self._per_rank: List[List[ShardId]] = []
        self._send: Optional[torch.Tensor] = None
        self._gathered: Optional[torch.Tensor] = None

    # ----------------------------------------------------------------- reading

    def inner_request(self) -> Dict[str, ShardedBase]:
        """The flat request for the inner strategy: every leaf of the pieces this rank reads."""
        request: Dict[str, ShardedBase] = {}
        for piece in self._reads:
            shared = piece.sid in self.distribution.assignment
            for i, leaf in enumerate(piece.leaves):
                if (
                    shared
                    and i == 0
                    and isinstance(leaf, ShardedTensor)
                    and leaf.data is not None
                    and not _is_plain(leaf.data)
                ):
                    # A subclass target (e.g. FP8) cannot show its bytes: read into a plain tensor,
                    # send that, then fill the target through its copy_.
                    staged = copy.copy(leaf)
                    staged.data = torch.empty(tuple(leaf.data.shape), dtype=leaf.dtype, device=self.device)
                    self._staged[piece.sid] = staged.data
                    leaf = staged
                request[f"{len(request)}"] = leaf
        for piece in self.pieces.values():
            if piece.sid in self._read_sids:
                continue
            for leaf in piece.leaves:
                if isinstance(leaf, ShardedTensor):
                    leaf.init_data("cpu")
        return request

    def collect_loaded(self, loaded: Dict[str, Any]) -> Dict[int, Any]:
        """Map the inner strategy's results back to the caller's leaves (by ``id``)."""
        out: Dict[int, Any] = {}
        n = 0
        for piece in self._reads:
            shared = piece.sid in self.distribution.assignment
            for i, leaf in enumerate(piece.leaves):
                value = loaded[f"{n}"]
                n += 1
                if isinstance(leaf, ShardedTensor):
                    if piece.sid in self._staged and i == 0:
                        leaf.data.detach().copy_(value)
                        value = leaf.data
                    elif leaf.data is None:
                        leaf.data = value
                    if shared and i == 0:
                        self._sources[piece.sid] = self._staged.get(piece.sid, value)
                elif shared and i == 0:
                    self._objects[piece.sid] = value
                out[id(leaf)] = value
        return out

    # ----------------------------------------------------------------- tensors

    def allocate_buffers(self, algo: str, group_size: int) -> None:
        """Allocate every exchange buffer now, while a failure can still be shared with all ranks."""
        tensor_sids = sorted(sid for sid in self.distribution.assignment if sid[0] == "tensor")
        sizes = self.distribution.sizes
        if algo == "broadcast":
            self._order = tensor_sids
            if tensor_sids:
                self._scratch = torch.empty(
                    max(sizes[s] for s in tensor_sids), dtype=torch.uint8, device=self.device
                )
            return
        self._per_rank = [[] for _ in range(group_size)]
        for sid in sorted(tensor_sids, key=lambda s: (-sizes[s], s)):
            self._per_rank[self.distribution.assignment[sid]].append(sid)
        if tensor_sids:
            # Each rank's largest piece comes first, so round 0 needs the largest slot; a multiple
            # of 16 keeps every row aligned for typed views of any dtype.
            slot = -(-max(sizes[lst[0]] for lst in self._per_rank if lst) // 16) * 16
            self._gathered = torch.empty(group_size, slot, dtype=torch.uint8, device=self.device)
            self._send = torch.empty(slot, dtype=torch.uint8, device=self.device)

    def _send_view(self, sid: ShardId, out: torch.Tensor) -> torch.Tensor:
        """The loaded tensor's bytes on the collective device: itself, or copied into ``out``."""
        src = self._sources[sid]
        if src.device == self.device and src.is_contiguous():
            return _byte_view(src)
        out.view(src.dtype).view(src.shape).copy_(src)
        return out

    def _deliver(self, sid: ShardId, data: torch.Tensor) -> None:
        """Copy received bytes into every local leaf that asked for ``sid``."""
        piece = self.pieces.get(sid)
        if piece is None:
            return
        for leaf in piece.leaves:
            target = leaf.data
            typed = data.view(leaf.dtype).view(target.shape)
            if target.data_ptr() != typed.data_ptr():
                target.detach().copy_(typed)
            self.received[id(leaf)] = target

    def _direct_target(self, sid: ShardId) -> Optional[torch.Tensor]:
        """The first requesting leaf's tensor when bytes can be received straight into it."""
        piece = self.pieces.get(sid)
        if piece is None:
            return None
        target = piece.leaves[0].data
        if _is_plain(target) and target.device == self.device and target.is_contiguous():
            return _byte_view(target)
        return None

    def run_broadcast(self) -> None:
        for sid in self._order:
            src = self.distribution.assignment[sid]
            scratch = self._scratch[: self.distribution.sizes[sid]]
            if src == self.me:
                dist.broadcast(self._send_view(sid, scratch), src, self.group)
                continue
            buf = self._direct_target(sid)
            if buf is None:
                buf = scratch
            dist.broadcast(buf, src, self.group)
            self._deliver(sid, buf)

    def run_gather_rounds(self) -> None:
        per_rank = self._per_rank
        send, gathered = self._send, self._gathered
        for k in range(max((len(lst) for lst in per_rank), default=0)):
            mine = per_rank[self.me][k] if k < len(per_rank[self.me]) else None
            if mine is not None:
                nbytes = self.distribution.sizes[mine]
                view = self._send_view(mine, send[:nbytes])
                if view.data_ptr() != send.data_ptr():
                    send[:nbytes].copy_(view)
            dist.all_gather(list(gathered.unbind(0)), send, self.group)
            for rank, sids in enumerate(per_rank):
                if rank != self.me and k < len(sids):
                    self._deliver(sids[k], gathered[rank, : self.distribution.sizes[sids[k]]])

    # ----------------------------------------------------------------- objects

    def exchange_objects(self) -> None:
        for sid in sorted(s for s in self.distribution.assignment if s[0] == "object"):
            src = self.distribution.assignment[sid]
            value = dist.broadcast_object(
                self._objects.get(sid) if src == self.me else None,
                src,
                self.group,
                stage="fully parallel exchange",
                checked=False,
            )
            piece = self.pieces.get(sid)
            if piece is None or src == self.me:
                continue
            for i, leaf in enumerate(piece.leaves):
                self.received[id(leaf)] = value if i == 0 else copy.deepcopy(value)
