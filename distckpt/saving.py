"""``save``: every rank writes its pieces of a sharded state dict and rank 0 commits the checkpoint.

Each stage ends in a collective that every rank reaches whether its own work failed or not, so
a failure anywhere raises the same CheckpointingException everywhere instead of a hang.
(:mod:`distckpt.serialization` re-exports :func:`save`.)
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import pickle
import socket
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from distckpt import budget, dist, storage, timings
from distckpt import commit as commit_protocol
from distckpt.core import (
    CheckpointingConfig,
    CheckpointingException,
    with_gc_paused,
)
from distckpt.dict_utils import diff, extract_matching_values, nested_values
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.formats.manifest import add_whole_files
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    StateDict,
    apply_factories,
    is_main_replica,
)
from distckpt.megatron_api import check_save_options
from distckpt.queries import (
    CONTENT_METADATA_KEY,
    Location,
    StorageOptions,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
)
from distckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
)
from distckpt.validation import (
    check_common_state,
    shard_table,
    validate_global_integrity,
    validate_local_integrity,
)

# The name the messages have always been logged under.
logger = logging.getLogger("distckpt.serialization")


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
            if storage.local_root(target) is not None and target.exists() and not target.is_dir():
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
            differences = {}
            if preprocess_common_before_consistancy_check is not None:
                differences = _common_differences([p[1] for p in payloads])
            return begin(), _writers_by_host([p[2] for p in payloads]), differences

        staging = None
        try:
            if validate_access_integrity and preprocess_common_before_consistancy_check is None:
                staging, writers, _ = _validate_with_cache(exc, payload, check, begin)
            else:
                staging, writers, differences = dist.gather_and_decide("validation", exc, payload, check)
                if rank in differences:
                    # Logged by the rank whose common state differs, as Megatron-Core does; rank 0
                    # found it in the validation gather and its verdict carried it here.
                    logger.warning(differences[rank])
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
        _after_commit(protocol, staging)
        return None

    def commit(exc: Optional[BaseException] = None) -> None:
        dist.gather_and_decide("commit", exc, written, decide)
        _after_commit(protocol, staging)

    if async_sharded_save:
        if not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"{type(sharded_strategy).__name__} cannot save asynchronously "
                f"(not an AsyncSaveShardedStrategy)"
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


def _after_commit(protocol, staging) -> None:
    """rank 0, once every rank knows the save committed: the protocol's follow-up (an object
    store's publication and clean-up; best effort, it never fails the committed save)."""
    if dist.get_rank() == 0:
        protocol.after_commit(staging)


# Digests of global sharding structures that passed validation (most recent last).
_VALIDATED_STRUCTURES: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_VALIDATED_CAPACITY = 8


def _validate_with_cache(
    exc: Optional[BaseException], payload: Any, check: Callable, begin: Callable
) -> Tuple[commit_protocol.Staging, Dict[int, int], Dict[int, str]]:
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
        return ("known", (begin(), _writers_by_host([mark for _, mark in marked]), {}))

    kind, value = dist.gather_and_decide("validation", exc, local, known)
    if kind == "known":
        return value
    verdict = dist.gather_and_decide("validation", None, payload, check)
    if dist.get_rank() == 0:
        _VALIDATED_STRUCTURES[value] = None
        while len(_VALIDATED_STRUCTURES) > _VALIDATED_CAPACITY:
            _VALIDATED_STRUCTURES.popitem(last=False)
    return verdict


def _common_differences(views) -> Dict[int, str]:
    """Rank -> the warning for each rank whose (preprocessed) common state differs from rank 0's,
    in Megatron-Core's words. Built on rank 0 from the views the validation gather brought."""
    reference = views[0]
    found = {}
    for r, view in enumerate(views[1:], start=1):
        only_0, only_r, mismatch = diff(reference, view)
        if only_0 or only_r or mismatch:
            found[r] = (
                f"Rank {r} common state dict differs from rank 0 common state dict. "
                f"Keys only on rank 0: {only_0}, "
                f"Keys only on {r}: {only_r}, "
                f"Mismatched keys: {mismatch}"
            )
    return found
