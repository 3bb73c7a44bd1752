"""Entry points: ``save``, ``load`` and the ``load_*`` queries. Orchestration only.

Every rank calls ``save`` and ``load`` (a single process without a process group works too).
Each stage ends in a collective that every rank reaches whether its own work failed or not, so a
failure anywhere raises the same CheckpointingException everywhere instead of a hang.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import pickle
import socket
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from distckpt import budget, dist, storage, timings
from distckpt import commit as commit_protocol
from distckpt.core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    with_gc_paused,
)
from distckpt.core import check_is_distributed_checkpoint as _check_is_distributed_checkpoint
from distckpt.dcp_native import checkpoint_config, describe_missing_config, is_dcp_native
from distckpt.dict_utils import dict_list_map_inplace, diff, extract_matching_values, merge, nested_values
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.manifest import add_whole_files
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from distckpt.megatron_api import check_save_options
from distckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from distckpt.strategies.common import MissingFileError
from distckpt.validation import (
    StrictHandling,
    check_common_state,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
    shard_table,
    validate_global_integrity,
    validate_local_integrity,
)

logger = logging.getLogger(__name__)

CONTENT_METADATA_KEY = "content_metadata"

# A checkpoint location: a local path, a URL (s3://, gs://, az://, memory://, file://) or a Store.
Location = storage.Location
StorageOptions = Optional[dict]


def check_is_distributed_checkpoint(checkpoint_dir: Location, storage_options: StorageOptions = None) -> bool:
    """True iff ``checkpoint_dir`` holds a checkpoint ``load`` reads: a committed one (valid
    ``metadata.json``) or, on a local file system, a plain PyTorch DCP one (``.metadata`` only;
    see distckpt.dcp_native). False for an interrupted save."""
    location = storage.resolve(checkpoint_dir, storage_options)
    if isinstance(location, Path):
        return _check_is_distributed_checkpoint(location) or is_dcp_native(location)
    try:
        return checkpoint_config(location) is not None
    except CheckpointingException:
        return False


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(
    checkpoint_dir: Optional[Location] = None, storage_options: StorageOptions = None
) -> LoadShardedStrategy:
    """A fresh load strategy: the one for ``checkpoint_dir``'s backend, or ``torch_dist``'s when
    no directory is given (Megatron-Core 0.19's form)."""
    if checkpoint_dir is None:
        return get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    config = _require_config(storage.resolve(checkpoint_dir, storage_options))
    return get_default_strategy(
        StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
    )


def _require_config(checkpoint_dir) -> CheckpointingConfig:
    if isinstance(checkpoint_dir, Path):
        if not checkpoint_dir.exists():
            commit_protocol.recover(checkpoint_dir)
        if not checkpoint_dir.exists():
            raise CheckpointingException(
                f"checkpoint directory {checkpoint_dir} does not exist (rank {dist.get_rank()})"
            )
        if not checkpoint_dir.is_dir():
            raise CheckpointingException(
                f"checkpoint path {checkpoint_dir} is not a directory (rank {dist.get_rank()})"
            )
    config = checkpoint_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(f"{describe_missing_config(checkpoint_dir)} (rank {dist.get_rank()})")
    return config


def _load_strategies(
    checkpoint_dir,
    sharded_strategy: Optional[LoadShardedStrategy],
    common_strategy: Optional[LoadCommonStrategy],
):
    config = _require_config(checkpoint_dir)
    try:
        if sharded_strategy is None:
            sharded_strategy = get_default_strategy(
                StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
            )
        else:
            sharded_strategy.check_backend_compatibility(config.sharded_backend)
            sharded_strategy.check_version_compatibility(config.sharded_backend_version)
        if common_strategy is None:
            common_strategy = get_default_strategy(
                StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version
            )
    except CheckpointingException as e:
        raise CheckpointingException(f"{storage.join(checkpoint_dir, CONFIG_FNAME)}: {e}") from None
    return sharded_strategy, common_strategy


# --------------------------------------------------------------------------- save


@with_gc_paused
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Location,
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    *,
    max_common_tensor_bytes: Union[int, None, str] = "default",
    storage_options: StorageOptions = None,
    overwrite: Optional[bool] = None,
    async_strategy: Optional[str] = None,
    verify_integrity: bool = False,
) -> Any:
    """Save a sharded state dict; every rank calls it with its own local pieces.

    Returns:
        None, or the ``AsyncRequest`` when ``async_sharded_save`` is set.

    Steps:
      1. Take Megatron-Core's sharded classes as distckpt's, apply factories, drop
         LocalNonpersistentObjects, split sharded and common parts.
      2. Validate: local metadata and the common state (nothing sharded, no large tensor), then
         global integrity on rank 0 (same error on every rank); rank 0 then begins the save with
         the location's commit protocol (``distckpt.commit``): on a file system it removes
         leftovers of interrupted saves and creates a staging directory beside
         ``checkpoint_dir``, which the broadcast hands to every rank; on an object store it
         refuses to replace a committed checkpoint unless ``overwrite``.
      3. Write (into the staging directory, or the object-store prefix): common state (rank 0),
         ShardedObjects, main replicas of every ShardedTensor.
      4. Commit: rank 0 writes ``metadata.json`` last. File system: inside the staging
         directory, which is then swapped into place atomically, so until then
         ``checkpoint_dir`` holds the previous checkpoint. Object store: a conditional put that
         fails if another save committed first.

    Args:
        sharded_strategy: a strategy, a ``(backend, version)`` tuple or None (``torch_dist``).
        common_strategy: likewise; default ``("torch", 1)``.
        validate_access_integrity: run the global integrity check (one gather).
        async_sharded_save: stage the local bytes and return an ``AsyncRequest`` instead of
            writing: schedule it on an ``AsyncCallsQueue`` (or call ``execute_sync()``); the
            checkpoint is committed when the request is finalized on every rank.
        preprocess_common_before_consistancy_check: if given, the common state of every rank
            is passed through it and compared with rank 0's; differences are logged.
        content_metadata: a small dict stored with the common state (``load_content_metadata``).
        max_common_tensor_bytes: largest torch tensor allowed in the common state (written by
            rank 0 alone); None allows any size. Default: 1 MiB, or the environment variable
            ``DISTCKPT_MAX_COMMON_TENSOR_BYTES`` (bytes, or ``none``).
        storage_options: options of an object store URL (endpoint, credentials, part size ...;
            see docs/storage.md). The environment (``AWS_ENDPOINT_URL`` ...) is read too.
        overwrite: replace a committed checkpoint at ``checkpoint_dir``. None: the store's
            default (a local directory is replaced, as always; an object store refuses).
            False: refuse everywhere. True: replace.
        async_strategy: Megatron-Core 0.19's choice of async engine (``"nvrx"``, ``"mcore"``);
            distckpt has one engine, so any of them (or ``"distckpt"``) selects it; another value
            is an error (distckpt.megatron_api).
        verify_integrity: Megatron-Core 0.19's request for an integrity manifest; distckpt writes
            one (CRC32C of every item and file) on every save, so True changes nothing.

    Raises:
        CheckpointingException: on every rank, for any rank's invalid sharding, or a common state
            that holds a sharded object distckpt does not understand or a tensor above the limit.
    """
    with timings.recording("async save" if async_sharded_save else "save", "local checks"):
        check_save_options(async_strategy, verify_integrity)
        dist.reset_failures()
        target = protocol = None
        rank = dist.get_rank()

        exc: Optional[BaseException] = None
        payload = None
        prestaged = False
        try:
            # A bad location raises here and reaches every rank with the validation below.
            checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
            if isinstance(sharded_strategy, tuple) or sharded_strategy is None:
                sharded_strategy = get_default_save_sharded_strategy(*(sharded_strategy or ("torch_dist", 1)))
            if isinstance(common_strategy, tuple) or common_strategy is None:
                common_strategy = get_default_save_common_strategy(*(common_strategy or ("torch", 1)))
            target = commit_protocol.resolve_target(checkpoint_dir)
            protocol = commit_protocol.protocol_for(target)
            if isinstance(target, Path) and target.exists() and not target.is_dir():
                raise CheckpointingException(
                    f"checkpoint path {checkpoint_dir} exists and is not a directory"
                )
            normalize_sharded_state_dict(sharded_state_dict)
            apply_factories(sharded_state_dict)
            _, sharded_state_dict = extract_matching_values(
                sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
            )
            sharded_part, common_part = extract_matching_values(
                sharded_state_dict, lambda v: isinstance(v, ShardedBase)
            )
            if async_sharded_save and isinstance(sharded_strategy, AsyncSaveShardedStrategy):
                # Device-to-host copies first: they run while the checks and the planning below do.
                prestaged = sharded_strategy.prestage(sharded_part)
            if content_metadata is not None:
                common_part[CONTENT_METADATA_KEY] = content_metadata
            shards = list(nested_values(sharded_part))
            validate_local_integrity(shards)
            check_common_state(common_part, max_common_tensor_bytes)
            common_view = None
            if preprocess_common_before_consistancy_check is not None:
                common_view = preprocess_common_before_consistancy_check(common_part)
            payload = (
                shard_table(shards, rank) if validate_access_integrity else None,
                common_view,
                _io_mark(shards, sharded_strategy),
            )
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        timings.begin("global validation")

        def begin():
            # Only a save that passed validation touches the location; the broadcast of the staging
            # directory is what lets the other ranks start writing.
            protocol.cleanup_leftovers(target)
            return protocol.begin(target, commit_protocol.new_save_id(), overwrite)

        def check(payloads):
            if validate_access_integrity:
                validate_global_integrity([p[0] for p in payloads])
            if preprocess_common_before_consistancy_check is not None:
                _log_common_differences([p[1] for p in payloads])
            return begin(), _writers_by_host([p[2] for p in payloads])

        staging = None
        try:
            if validate_access_integrity and preprocess_common_before_consistancy_check is None:
                staging, writers = _validate_with_cache(exc, payload, check, begin)
            else:
                staging, writers = dist.gather_and_decide("validation", exc, payload, check)
            timings.begin("common state")
            # Where only some ranks of a host write (data-parallel replicas), they share its cores.
            with budget.ranks_doing_io(writers.get(_host_key())):
                return _write_and_commit(
                    staging,
                    protocol,
                    sharded_part,
                    common_part,
                    sharded_strategy,
                    common_strategy,
                    async_sharded_save,
                )
        except BaseException:
            if prestaged:
                sharded_strategy.discard_prestaged()
            if rank == 0 and staging is not None:
                protocol.abort(staging)
            raise


@functools.lru_cache(maxsize=1)
def _host_key() -> int:
    return zlib.crc32(socket.gethostname().encode())


def _io_mark(shards: List[ShardedBase], strategy: Any) -> Tuple[int, bool]:
    """(a key of this host, whether this rank writes sharded bytes): rank 0 counts the writing
    ranks of each host from these. A strategy that moves replicas between ranks (the fully
    parallel wrapper, ``reassigns_replicas``) may make any rank a writer."""
    writes = bool(getattr(strategy, "reassigns_replicas", False)) or any(
        is_main_replica(sh.replica_id) for sh in shards
    )
    return _host_key(), writes


def _writers_by_host(marks: List[Tuple[int, bool]]) -> Dict[int, int]:
    """How many ranks write on each host, from every rank's :func:`_io_mark`."""
    return dict(collections.Counter(host for host, writes in marks if writes))


def _write_and_commit(
    staging: commit_protocol.Staging,
    protocol,
    sharded_part,
    common_part,
    sharded_strategy,
    common_strategy,
    async_sharded_save: bool,
) -> Any:
    """Every rank writes into the staging directory; rank 0 commits it (after ``metadata.json``)."""
    ckpt = protocol.where(staging)
    # A strategy with ``save_and_commit`` writes, reports and commits in one stage; a failure of
    # the common state write then reaches every rank in that stage (the others' writes into the
    # staging directory are dropped with it).
    merged = None if async_sharded_save else getattr(sharded_strategy, "save_and_commit", None)
    exc = None
    try:
        common_strategy.save_common(common_part, ckpt)
        if not sharded_strategy.can_handle_sharded_objects:
            objects, sharded_part = extract_matching_values(
                sharded_part, lambda v: isinstance(v, ShardedObject)
            )
            common_strategy.save_sharded_objects(objects, ckpt)
    except Exception as e:  # noqa: BLE001
        exc = e
    if merged is None:
        dist.sync_errors("common state write", exc)

    config = CheckpointingConfig(
        sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
    )
    written = dict(getattr(common_strategy, "written_files", {}))

    def decide(payloads):
        entries = {name: v for p in payloads for name, v in p.items()}
        if entries:
            add_whole_files(ckpt, entries, config.sharded_backend, save_id=staging.save_id)
        protocol.commit(staging, config)

    if merged is not None:
        # ``written`` goes into the strategy's manifest; then only the commit itself is left.
        timings.begin_unless_timed(sharded_strategy, "writing")
        merged(sharded_part, ckpt, exc, written, lambda: protocol.commit(staging, config))
        return None

    def commit(exc: Optional[BaseException] = None) -> None:
        dist.gather_and_decide("commit", exc, written, decide)

    if async_sharded_save:
        if not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"{type(sharded_strategy).__name__} cannot save asynchronously (not an AsyncSaveShardedStrategy)"
            )
        request, exc = None, None
        timings.begin_unless_timed(sharded_strategy, "staging")
        try:
            request = sharded_strategy.async_save(sharded_part, ckpt)
        except Exception as e:  # noqa: BLE001 - staging failed somewhere: every rank raises
            exc = e
        dist.sync_errors("async staging", exc)

        def finalize() -> None:
            try:
                commit()
            except BaseException:
                if dist.get_rank() == 0:
                    protocol.abort(staging)
                raise

        request.add_finalize_fn(finalize)
        return request

    exc = None
    timings.begin_unless_timed(sharded_strategy, "writing")
    try:
        sharded_strategy.save(sharded_part, ckpt)
    except Exception as e:  # noqa: BLE001 - a strategy may fail on one rank only
        exc = e
    timings.begin("commit")
    commit(exc)
    return None


# Digests of global sharding structures that passed validation (most recent last).
_VALIDATED_STRUCTURES: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_VALIDATED_CAPACITY = 8


def _validate_with_cache(
    exc: Optional[BaseException], payload: Any, check: Callable, begin: Callable
) -> Tuple[commit_protocol.Staging, Dict[int, int]]:
    """Validate the global sharding unless this exact structure passed before; returns the
    staging ``check`` / ``begin`` created on rank 0 and the writing ranks of each host.

    Each rank hashes its own shard descriptions; rank 0 gathers the 16-byte digests (with each
    rank's host mark) and, for a structure it validated before, begins the save and answers at
    once. Only a new structure pays for gathering every rank's shard descriptions.
    """
    local = None
    if exc is None:
        local = (hashlib.blake2b(pickle.dumps(payload[0], protocol=4), digest_size=16).digest(), payload[2])

    def known(marked):
        key = hashlib.blake2b(b"".join(digest for digest, _ in marked), digest_size=16).digest()
        if key not in _VALIDATED_STRUCTURES:
            return ("new", key)
        _VALIDATED_STRUCTURES.move_to_end(key)
        return ("known", (begin(), _writers_by_host([mark for _, mark in marked])))

    kind, value = dist.gather_and_decide("validation", exc, local, known)
    if kind == "known":
        return value
    verdict = dist.gather_and_decide("validation", None, payload, check)
    if dist.get_rank() == 0:
        _VALIDATED_STRUCTURES[value] = None
        while len(_VALIDATED_STRUCTURES) > _VALIDATED_CAPACITY:
            _VALIDATED_STRUCTURES.popitem(last=False)
    return verdict


def _log_common_differences(views) -> None:
    reference = views[0]
    for r, view in enumerate(views[1:], start=1):
        only_0, only_r, mismatch = diff(reference, view)
        if only_0 or only_r or mismatch:
            logger.warning(
                "common state of rank %d differs from rank 0: only on rank 0 %s, only on "
                "rank %d %s, different %s",
                r,
                only_0,
                r,
                only_r,
                mismatch,
            )


# --------------------------------------------------------------------------- load


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
            sharded_strategy, common_strategy = _load_strategies(
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
            common_state_dict.pop(CONTENT_METADATA_KEY, None)
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
        timings.begin("closing check")
        dist.sync_errors("load", exc, group=group)

        if StrictHandling.requires_returning_mismatch_keys(strict_mode):
            return common_state_dict, missing, unexpected
        return common_state_dict


def _replaced_or(exc: Exception, checkpoint_dir: Path, identity) -> Exception:
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


# --------------------------------------------------------------------------- queries


def read_common_state(
    checkpoint_dir: Location,
    sharded_strategy: LoadShardedStrategy,
    common_strategy: LoadCommonStrategy,
    check: bool = True,
) -> StateDict:
    """The stored common state, content metadata included: ``common.pt`` merged with the common
    values the sharded format holds itself (the non-tensor values of a ``dcp.save``, which
    writes no ``common.pt``). Runs on any rank, alone; ``checkpoint_dir`` is resolved. ``check``
    False: ``common.pt`` is not compared with the manifest here (another rank does it)."""
    items = sharded_strategy.load_common_items(checkpoint_dir)
    skip = (
        not check
        and getattr(common_strategy, "checksums", False)
        and not getattr(common_strategy, "verify", False)
    )
    if skip:
        common_strategy.checksums = False
    try:
        state = common_strategy.load_common(checkpoint_dir)
    except MissingFileError:
        if not items and not is_dcp_native(checkpoint_dir):
            raise
        state = {}
    finally:
        if skip:
            common_strategy.checksums = True
    merge(state, items)
    return state


def load_common_state_dict(
    checkpoint_dir: Location,
    common_strategy: Optional[LoadCommonStrategy] = None,
    storage_options: StorageOptions = None,
) -> StateDict:
    """Load only the common (non-sharded) state (with a ``dcp.save``'s non-tensor values)."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, common_strategy = _load_strategies(checkpoint_dir, None, common_strategy)
    state = read_common_state(checkpoint_dir, sharded_strategy, common_strategy)
    state.pop(CONTENT_METADATA_KEY, None)
    return state


def load_content_metadata(
    checkpoint_dir: Location,
    preloaded_state_dict: Optional[StateDict] = None,
    storage_options: StorageOptions = None,
) -> Optional[dict]:
    """The ``content_metadata`` passed to ``save``, or None."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    if preloaded_state_dict is None:
        sharded_strategy, common_strategy = _load_strategies(checkpoint_dir, None, None)
        preloaded_state_dict = read_common_state(checkpoint_dir, sharded_strategy, common_strategy)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def load_tensors_metadata(
    checkpoint_dir: Location,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    storage_options: StorageOptions = None,
) -> ShardedStateDict:
    """Describe every stored tensor: key -> data-free ShardedTensor of the whole global tensor
    (data is a ``meta`` tensor with the global shape and dtype)."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, _ = _load_strategies(checkpoint_dir, sharded_strategy, None)
    return sharded_strategy.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: Location,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    common_strategy: Optional[LoadCommonStrategy] = None,
    storage_options: StorageOptions = None,
) -> ShardedStateDict:
    """Like load_tensors_metadata, plus the stored ShardedObjects keyed by their unique key."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, common_strategy = _load_strategies(checkpoint_dir, sharded_strategy, common_strategy)
    out = dict(sharded_strategy.load_sharded_metadata(checkpoint_dir))
    if not sharded_strategy.can_handle_sharded_objects:
        out.update(common_strategy.load_sharded_metadata(checkpoint_dir))
    return out


def load_plain_tensors(
    checkpoint_dir: Location,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    storage_options: StorageOptions = None,
) -> StateDict:
    """Load every stored tensor whole, on this rank alone (no collectives)."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, _ = _load_strategies(checkpoint_dir, sharded_strategy, None)
    request = sharded_strategy.load_tensors_metadata(checkpoint_dir)
    for sh in request.values():
        sh.data = None
    return sharded_strategy.load(request, checkpoint_dir)


def remove_sharded_tensors(
    checkpoint_dir: Location, key_prefix: str, storage_options: StorageOptions = None
) -> None:
    """Remove every tensor whose key starts with ``key_prefix`` from a checkpoint (not from a
    plain PyTorch DCP directory: those are read-only)."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    if is_dcp_native(checkpoint_dir):
        raise CheckpointingException(
            f"{checkpoint_dir}: a plain PyTorch DCP checkpoint (no metadata.json) is read-only to distckpt; "
            f"convert it to torch_dist first"
        )
    sharded_strategy, _ = _load_strategies(checkpoint_dir, None, None)
    sharded_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)
