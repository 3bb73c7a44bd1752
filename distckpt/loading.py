"""``load``: every rank reads the pieces its sharded state dict asks for, checked on rank 0 first.

Each stage ends in a collective that every rank reaches whether its own work failed or not, so
a failure anywhere raises the same CheckpointingException everywhere instead of a hang.
(:mod:`distckpt.serialization` re-exports :func:`load`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Set, Tuple, Union

import torch

from distckpt import commit as commit_protocol
from distckpt import dist, storage, timings
from distckpt.core import (
    CheckpointingException,
    with_gc_paused,
)
from distckpt.dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from distckpt.queries import (
    Location,
    StorageOptions,
    load_strategies,
    read_common_state,
)
from distckpt.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
)
from distckpt.strict import UnexpectedKeysError, mismatch_message
from distckpt.validation import (
    StrictHandling,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
    shard_table,
    validate_global_integrity,
    validate_local_integrity,
)


@with_gc_paused
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Location,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    common_strategy: Optional[LoadCommonStrategy] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify: Optional[bool] = None,
    trusted: bool = False,
    storage_options: StorageOptions = None,
    *,
    verify_integrity: bool = False,
    process_group: Optional[Any] = None,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load the pieces described by ``sharded_state_dict``; every rank calls it.

    ShardedTensors with data are filled in place; those without get new CPU tensors. The result
    is the common state merged with the loaded sharded part, factories merged back and
    LocalNonpersistentObjects unwrapped.

    Args:
        validate_access_integrity: check on rank 0 that the requests of all ranks tile every
            tensor (one gather of each rank's shard table to rank 0; the others get the verdict).
        verify: by default (None) every byte a load copies out of a checkpoint with an integrity
            manifest is checked against its CRC32C as it is read: an item read whole against the
            item's checksum, an item read in part (resharding) block by block against its file's
            block CRC table, ``common.pt`` whole; and each storage record's file, offset, length
            and key must be a range the manifest lists. ``True`` adds: every needed item is read
            whole, ``.metadata`` (or the sidecar index) and ``common.pt`` must be listed and
            match, and the metadata's claims (each record's key, chunk offset and length, each
            key's dtype and shape, a zarr array's ``zarr.json``) are cross-checked against what
            the manifest says the writer wrote. ``False`` checks no checksum at all (an explicit
            opt-out). Checkpoints without a manifest (Megatron-Core's, plain DCP) are checked
            structurally only, whatever ``verify`` says.
        trusted: unpickle common state, objects and metadata without the allowlist. Only for
            checkpoints whose origin you trust.
        storage_options: options of an object store URL (see ``save``).
        verify_integrity: Megatron-Core 0.19's name for ``verify``.
        process_group: every collective of this call runs on this group (Megatron-Core 0.19);
            only its members call ``load``, ranks outside it are not involved. Default: the
            whole world.

    Returns:
        the state dict, or ``(state_dict, missing_keys, unexpected_keys)`` for the
        ``return_unexpected`` and ``return_all`` strict modes.
    """
    with timings.recording("load", "common state"):
        dist.reset_failures()
        strict_mode = StrictHandling.ASSUME_OK_UNEXPECTED
        if verify_integrity:
            verify = True
        group = process_group
        missing: Set[str] = set()
        unexpected: Set[str] = set()
        exc: Optional[BaseException] = None
        payload = None
        identity = None
        need_keys = False
        try:
            checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
            strict_mode = parse_strict_flag(strict)
            need_keys = StrictHandling.requires_global_app_metadata(strict_mode)
            commit_protocol.recover(checkpoint_dir)
            identity = commit_protocol.tree_identity(checkpoint_dir)
            sharded_strategy, common_strategy = load_strategies(
                checkpoint_dir, sharded_strategy, common_strategy
            )
            _configure(sharded_strategy, verify, trusted)
            _configure(common_strategy, verify, trusted)
            # The group's first rank alone compares common.pt with the manifest (which lists every
            # range of the checkpoint: at scale far more than a rank's share); its verdict reaches
            # every rank at the stage below, and every rank reads the same file.
            common_state_dict = read_common_state(
                checkpoint_dir,
                sharded_strategy,
                common_strategy,
                check=verify is True or dist.get_rank(group) == 0,
            )
            timings.begin("local checks")

            normalize_sharded_state_dict(sharded_state_dict)
            factories, _ = extract_matching_values(
                sharded_state_dict, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
            )
            apply_factories(sharded_state_dict)
            nonpersistent, sharded_state_dict = extract_matching_values(
                sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
            )
            dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
            merge(common_state_dict, nonpersistent)
            sharded_part, _ = extract_matching_values(
                sharded_state_dict, lambda v: isinstance(v, ShardedBase)
            )
            shards = list(nested_values(sharded_part))
            validate_local_integrity(shards)
            _drop_meta_data(shards)

            ckpt_keys: Optional[Set[str]] = None
            if StrictHandling.requires_explicit_ckpt_mismatch_check(strict_mode):
                ckpt_meta = dict(sharded_strategy.load_sharded_metadata(checkpoint_dir))
                if not sharded_strategy.can_handle_sharded_objects:
                    ckpt_meta.update(common_strategy.load_sharded_metadata(checkpoint_dir))
                ckpt_keys = {v.key for v in ckpt_meta.values()}
            local_keys = {s.key for s in shards}
            payload = (
                local_keys if need_keys else None,
                shard_table(shards, dist.get_rank(group)) if validate_access_integrity else None,
            )
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = _replaced_or(e, checkpoint_dir, identity)
        timings.begin("global validation")

        def check(payloads):
            # Rank 0 alone sees every rank's request, as on a save: the other ranks receive the
            # verdict (and the union of requested keys when the strict mode reports missing ones),
            # not every rank's shard table (which at 16k ranks is gigabytes per rank).
            if validate_access_integrity:
                validate_global_integrity([p[1] for p in payloads])
            return set().union(*(p[0] or () for p in payloads)) if need_keys else None

        global_keys = dist.gather_and_decide("load preparation", exc, payload, check, group=group)

        exc = None
        try:
            if StrictHandling.requires_explicit_ckpt_mismatch_check(strict_mode):
                missing, unexpected = determine_missing_and_unexpected_keys(
                    ckpt_keys, local_keys, global_keys
                )
                handle_mismatched_keys(strict_mode, missing, unexpected, str(checkpoint_dir))
                if unexpected:
                    sharded_part, _ = extract_matching_values(
                        sharded_part, lambda v: isinstance(v, ShardedBase) and v.key not in unexpected
                    )
            if not sharded_strategy.can_handle_sharded_objects:
                objects, sharded_part = extract_matching_values(
                    sharded_part, lambda v: isinstance(v, ShardedObject)
                )
                merge(common_state_dict, common_strategy.load_sharded_objects(objects, checkpoint_dir))
            timings.begin_unless_timed(sharded_strategy, "reading")
            loaded = sharded_strategy.load(sharded_part, checkpoint_dir)
            timings.begin("merge")
            # Another job may have swapped a new checkpoint in while this one was read.
            commit_protocol.check_unchanged(checkpoint_dir, identity)
            merge(common_state_dict, loaded)
            common_state_dict = apply_factory_merges(common_state_dict, factories)
        except Exception as e:  # noqa: BLE001
            exc = _replaced_or(e, checkpoint_dir, identity)
            if exc is e and strict_mode == StrictHandling.ASSUME_OK_UNEXPECTED:
                exc = _named_unexpected(e, sharded_strategy, common_strategy, checkpoint_dir, local_keys)
        timings.begin("closing check")
        try:
            dist.sync_errors("load", exc, group=group)
        except CheckpointingException as failed:
            if isinstance(failed, UnexpectedKeysError) or _UNEXPECTED_MARK not in str(failed):
                raise
            raise UnexpectedKeysError(str(failed), getattr(failed, "errors", None)) from failed

        if StrictHandling.requires_returning_mismatch_keys(strict_mode):
            return common_state_dict, missing, unexpected
        return common_state_dict


# What a rank's error says when it asked for keys the checkpoint lacks (Megatron-Core's words).
_UNEXPECTED_MARK = "Unexpected keys (for this rank)"


def _drop_meta_data(shards) -> None:
    """A request built from ``load_tensors_metadata`` holds ``meta`` tensors, which have no storage
    to fill: as Megatron-Core does, such a ShardedTensor gets a real tensor (the strategy allocates
    one on the CPU, as for a request without data)."""
    for sh in shards:
        data = getattr(sh, "data", None)
        if isinstance(data, torch.Tensor) and data.is_meta:
            sh.data = None


def _named_unexpected(exc: Exception, sharded_strategy, common_strategy, checkpoint_dir, local_keys):
    """Under ``ASSUME_OK_UNEXPECTED`` no key check runs before the read. When the read failed, say
    which requested keys the checkpoint lacks, if that was the cause (only on this failure path is
    the checkpoint's key list read); otherwise keep the strategy's error."""
    try:
        ckpt_meta = dict(sharded_strategy.load_sharded_metadata(checkpoint_dir))
        if not sharded_strategy.can_handle_sharded_objects:
            ckpt_meta.update(common_strategy.load_sharded_metadata(checkpoint_dir))
    except Exception:  # noqa: BLE001 - the original error says more than this one would
        return exc
    _, unexpected = determine_missing_and_unexpected_keys({v.key for v in ckpt_meta.values()}, local_keys)
    if not unexpected:
        return exc
    text = (
        f"{mismatch_message(set(), unexpected, str(checkpoint_dir))} on rank {dist.get_rank()} "
        f"(strict={StrictHandling.ASSUME_OK_UNEXPECTED.value}: no key check before the read; "
        f"the read failed with: {exc})"
    )
    err = UnexpectedKeysError(text, {dist.get_rank(): text})
    err.__cause__ = exc
    return err


def _replaced_or(exc: Exception, checkpoint_dir: Union[Path, storage.Store], identity) -> Exception:
    """``exc``, or the clearer error that the checkpoint was swapped during the load (which is
    what usually makes a file vanish mid-load)."""
    try:
        commit_protocol.check_unchanged(checkpoint_dir, identity)
    except CheckpointingException as replaced:
        replaced.__cause__ = exc
        return replaced
    return exc


def _configure(strategy, verify: Optional[bool], trusted: bool) -> None:
    if verify is False and hasattr(strategy, "checksums"):
        strategy.checksums = False  # the explicit opt-out of the default checks
    for name, value in (("verify", verify), ("trusted", trusted)):
        if not value:
            continue
        if not hasattr(strategy, name):
            raise CheckpointingException(
                f"{type(strategy).__name__} (backend {strategy.backend!r}) does not support {name}=True"
            )
        setattr(strategy, name, value)
