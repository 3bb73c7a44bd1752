"""Megatron-Core's ``MCoreTensorAwareStateDict``: a sharded state dict split into its tensors and
everything else, the container Megatron-LM hands to a local (node-local, in-memory) checkpoint
manager such as NVIDIA Resiliency Extension's.

``from_state_dict`` turns a sharded state dict into the container (factories applied,
non-persistent objects dropped, the common state apart); a manager takes the tensors out
(``pop_tensors``), stores them its own way, and gives them back (``insert_tensors``);
``to_state_dict`` answers a load request from the container, with the same strict modes and the
same key reports as :func:`distckpt.load`. With ``algo="fully_parallel"`` each replicated shard is
kept by one rank of the parallelization group only (as a fully parallel save writes it) and
exchanged back on ``to_state_dict``.

distckpt's own local tier, :class:`distckpt.local.LocalCheckpointManager`, takes a sharded state
dict directly (``save(sharded_state_dict, iteration)`` / ``load(sharded_state_dict)``) and needs no
such container; this class is for code written against Megatron-Core's API and for NVRx's manager
(when ``nvidia_resiliency_ext`` is installed the class derives from its ``TensorAwareStateDict``;
unlike Megatron-Core's, it works without it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from distckpt import dist
from distckpt.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    extract_matching_values,
    merge,
    nested_values,
)
from distckpt.errors import CheckpointingException
from distckpt.exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
)
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from distckpt.process_group import RankErrors
from distckpt.strict import (
    StrictHandling,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
)
from distckpt.utils import sharded_object_id, sharded_tensor_shard_id
from distckpt.validation import shard_table, validate_global_integrity, validate_local_integrity

logger = logging.getLogger(__name__)

try:  # NVRx's manager accepts subclasses of its base class only
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
except ImportError:  # pragma: no cover - depends on the environment

    class TensorAwareStateDict:  # type: ignore[no-redef]
        """Stand-in base class when nvidia_resiliency_ext is not installed."""


__all__ = ["MCoreTensorAwareStateDict"]

ALGOS = ("atomic", "fully_parallel")


def _check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CheckpointingException(f"unknown algo {algo!r}; expected one of {ALGOS}")


def _split(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, StateDict]:
    """Factories applied, non-persistent objects unwrapped apart: (sharded, common, nonpersistent)."""
    normalize_sharded_state_dict(sharded_state_dict)
    apply_factories(sharded_state_dict)
    nonpersistent, rest = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    sharded, common = extract_matching_values(rest, lambda v: isinstance(v, ShardedBase))
    return sharded, common, nonpersistent


_NOT_HELD = "is not in rank"


class LocalShardMissingError(CheckpointingException, AssertionError):
    """A requested shard is not in the local checkpoint (under ``ASSUME_OK_UNEXPECTED``, which does
    not check the keys first). Also an ``AssertionError``: Megatron-Core's container fails an
    assertion there, and code written for it catches that type; this one is raised explicitly,
    naming key, offset and rank, on every rank of the group."""


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """The common state and the sharded part of a state dict, whose tensors can be taken out and
    put back. Fields as in Megatron-Core: ``common``, ``sharded_state_dict``, ``_is_hollow``."""

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    # ------------------------------------------------------------------ building

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group=None,
        cached_metadata: Optional[ShardDistribution] = None,
    ) -> Tuple[MCoreTensorAwareStateDict, Optional[ShardDistribution]]:
        """Build the container; every rank of ``parallelization_group`` calls it.

        Returns it and the shard distribution (``fully_parallel``; None otherwise or for one
        rank), which a later call may pass back as ``cached_metadata`` to skip finding it again.
        With ``fully_parallel`` a shard held by several group ranks keeps its data on the one rank
        the distribution names; the others drop theirs (it comes back on ``to_state_dict``).
        """
        _check_algo(algo)
        sharded, common, _ = _split(sharded_state_dict)
        validate_local_integrity(list(nested_values(sharded)))
        distribution = None
        if algo == "fully_parallel":
            distribution = cached_metadata
            if distribution is None:
                distribution = determine_main_replica_uniform_distribution(sharded, parallelization_group)
            if distribution is not None:
                me = dist.get_rank(parallelization_group)
                for sh in nested_values(sharded):
                    if isinstance(sh, ShardedTensor):
                        owner = distribution.main_rank_for_shard.get(sharded_tensor_shard_id(sh))
                        if owner is not None and owner != me:
                            sh.data = None
        return cls(common=common, sharded_state_dict=sharded), distribution

    # ------------------------------------------------------------------ the tensors

    @property
    def is_hollow(self) -> bool:
        """True after ``pop_tensors`` until ``insert_tensors`` or ``init_tensors``."""
        return self._is_hollow

    def _held(self) -> Iterator[ShardedTensor]:
        for sh in nested_values(self.sharded_state_dict):
            if not isinstance(sh, ShardedTensor):
                continue
            if (self._is_hollow and hasattr(sh, "orig_device")) or (
                not self._is_hollow and sh.data is not None
            ):
                yield sh

    def _require(self, hollow: bool, what: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (tensors popped)" if self._is_hollow else "holding its tensors"
            raise CheckpointingException(f"MCoreTensorAwareStateDict.{what}: the container is {state}")

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors this rank holds, in a fixed order."""
        self._require(False, "tensors")
        return (sh.data for sh in self._held())

    @property
    def common_state_dict(self) -> Dict:
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensors out (in ``tensors`` order); the container keeps their descriptions."""
        self._require(False, "pop_tensors")
        out = []
        for sh in list(self._held()):
            out.append(sh.data)
            sh.orig_device = sh.data.device.type
            sh.data = None
        self._is_hollow = True
        return out

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in the order ``pop_tensors`` returned them."""
        self._require(True, "insert_tensors")
        held, data = list(self._held()), list(tensor_data)
        if len(held) != len(data):
            raise CheckpointingException(
                f"insert_tensors: {len(data)} tensors given for {len(held)} popped ones"
            )
        for sh, tensor in zip(held, data):
            if sh.orig_device == tensor.device.type:
                del sh.orig_device
            sh.data = tensor
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocate empty tensors (shape, dtype and device of the popped ones) in their place."""
        self._require(True, "init_tensors")
        for sh in list(self._held()):
            sh.init_data(sh.orig_device)
            del sh.orig_device
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies (the originals are not touched); see
        ``restore_tensor_device``."""
        self._require(False, "copy_tensors_to_cpu")
        for sh in self._held():
            if sh.data.device.type == "cpu":
                if not hasattr(sh, "orig_device"):
                    sh.data = sh.data.clone()
            else:
                if not hasattr(sh, "orig_device"):
                    sh.orig_device = sh.data.device.type
                sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move tensors copied by ``copy_tensors_to_cpu`` back to their devices."""
        self._require(False, "restore_tensor_device")
        for sh in self._held():
            if hasattr(sh, "orig_device"):
                sh.data = sh.data.to(sh.orig_device, non_blocking=non_blocking)
                del sh.orig_device

    # ------------------------------------------------------------------ answering a load

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group=None,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ):
        """The state dict ``sharded_state_dict`` asks for, from this container; every rank of the
        group calls it. Strict modes as in :func:`distckpt.load` (a raising mode raises on every
        rank; the logging modes log), except that a requested key the container lacks
        ("unexpected") is never skipped: in every mode that does not raise first, the fill fails
        on every rank with :class:`LocalShardMissingError` (Megatron-Core's container fails its
        assertion there). ``return_mismatch_keys`` adds ``(missing, unexpected)`` to the result
        (then ``unexpected`` is always empty: otherwise the call raised)."""
        self._require(False, "to_state_dict")
        _check_algo(algo)
        strict = parse_strict_flag(strict)
        result = dict_list_map_outplace(lambda x: x, self.common)
        missing: set = set()
        unexpected: set = set()
        if not sharded_state_dict:
            return (result, missing, unexpected) if return_mismatch_keys else result
        factories, _ = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
        )
        sharded, _, nonpersistent = _split(sharded_state_dict)
        merge(result, nonpersistent)
        shards = list(nested_values(sharded))
        need_keys = StrictHandling.requires_global_app_metadata(strict)
        local_keys = {sh.key for sh in shards}
        payload = (
            local_keys if need_keys else None,
            shard_table(shards, dist.get_rank(parallelization_group)),
        )

        def check(payloads):
            if validate_access_integrity:
                validate_global_integrity([p[1] for p in payloads])
            return set().union(*(p[0] or () for p in payloads)) if need_keys else None

        global_keys = dist.gather_and_decide(
            "tensor-aware load", None, payload, check, group=parallelization_group
        )
        exc = None
        try:
            if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
                stored_keys = {sh.key for sh in nested_values(self.sharded_state_dict)}
                missing, unexpected = determine_missing_and_unexpected_keys(
                    stored_keys, local_keys, global_keys
                )
                handle_mismatched_keys(strict, missing, unexpected, "local checkpoint")
                # The non-raising modes have logged (or will return) them; the request is still
                # filled whole, as Megatron-Core's container fills it, so a key this local
                # checkpoint lacks fails below on every rank (LocalShardMissingError, also an
                # AssertionError) instead of leaving that tensor unloaded: the caller falls back
                # to a checkpoint that has it.
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            exc = e
        dist.sync_errors("tensor-aware load (keys)", exc, group=parallelization_group)
        self._fill(sharded, algo == "fully_parallel", parallelization_group, exchange_algo)
        merge(result, apply_factory_merges(sharded, factories))
        return (result, missing, unexpected) if return_mismatch_keys else result

    @staticmethod
    def _who_sends_what(sharded: ShardedStateDict, tensors: Dict, group) -> Tuple[Dict, ShardDistribution]:
        """For a fully parallel container: which group rank sends each requested shard (the
        lowest rank that kept it) to the ranks that asked for it. One all-gather in the group."""
        wanted = {
            sharded_tensor_shard_id(sh): sh.without_data()
            for sh in nested_values(sharded)
            if isinstance(sh, ShardedTensor)
        }
        gathered = dist.all_gather_object((list(tensors), wanted), group, stage="tensor-aware exchange plan")
        holder: Dict = {}
        askers: Dict = {}
        described: Dict = {}
        for rank, (held, asked) in enumerate(gathered):
            for sid in held:
                holder.setdefault(sid, rank)
            for sid, desc in asked.items():
                askers.setdefault(sid, []).append(rank)
                described.setdefault(sid, desc)
        lost = [described[sid].key for sid in askers if sid not in holder]
        if lost:  # the same verdict on every rank: all raise
            raise CheckpointingException(
                f"no rank of the group kept the requested key(s) {sorted(set(lost))}"
            )
        assignment = {sid: holder[sid] for sid in askers}
        ranks = {sid: sorted(set(askers[sid]) | {holder[sid]}) for sid in askers}
        unloaded = {sid: described[sid] for sid in wanted if sid not in tensors}
        return unloaded, ShardDistribution(assignment, set(assignment), described, ranks)

    def _fill(self, sharded: ShardedStateDict, fully_parallel: bool, group, exchange_algo: str) -> None:
        """Replace each requested leaf by the stored tensor or object with the same shard id."""
        tensors = {sharded_tensor_shard_id(sh): sh.data for sh in self._held()}
        if fully_parallel and dist.get_world_size(group) > 1:
            tensors = exchange_by_distribution(
                tensors, *self._who_sends_what(sharded, tensors, group), group, exchange_algo
            )
        objects = {
            sharded_object_id(sh): sh.data
            for sh in nested_values(self.sharded_state_dict)
            if isinstance(sh, ShardedObject)
        }
        rank = dist.get_rank()

        def take(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                sid = sharded_tensor_shard_id(x)
                if sid not in tensors:
                    raise LocalShardMissingError(
                        f"key {x.key!r} (offset {x.global_offset}) {_NOT_HELD} {rank}'s local checkpoint"
                    )
                return tensors[sid]
            if isinstance(x, ShardedObject):
                oid = sharded_object_id(x)
                if oid not in objects:
                    raise LocalShardMissingError(f"object {x.key!r} {_NOT_HELD} {rank}'s local checkpoint")
                return objects[oid]
            return x

        exc = None
        try:
            dict_list_map_inplace(take, sharded)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            exc = e
        try:
            dist.sync_errors("tensor-aware load", exc, group=group)
        except RankErrors as failed:
            # Every rank holds the same report: all of them raise the same type.
            if _NOT_HELD in str(failed):
                raise LocalShardMissingError(str(failed)) from failed
            raise
