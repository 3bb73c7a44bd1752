"""What a checkpoint is made with, and the queries that read parts of one on a single rank.

Its configuration (``metadata.json``) names the strategies that read it (:func:`load_strategies`);
the ``load_*`` queries read the common state, the tensors' descriptions or whole tensors without
any collective. :mod:`distckpt.saving` and :mod:`distckpt.loading` build on it;
:mod:`distckpt.serialization` re-exports every public name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from distckpt import commit as commit_protocol
from distckpt import dist, storage
from distckpt.core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
)
from distckpt.core import check_is_distributed_checkpoint as _check_is_distributed_checkpoint
from distckpt.dcp_native import checkpoint_config, describe_missing_config, is_dcp_native
from distckpt.dict_utils import merge
from distckpt.mapping import (
    ShardedStateDict,
    StateDict,
)
from distckpt.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from distckpt.strategies.common import MissingFileError

CONTENT_METADATA_KEY = "content_metadata"

# A checkpoint location: a local path, a URL (s3://, gs://, az://, memory://, file://) or a Store.
Location = storage.Location
StorageOptions = Optional[dict]


def check_is_distributed_checkpoint(checkpoint_dir: Location, storage_options: StorageOptions = None) -> bool:
    """True iff ``checkpoint_dir`` holds a checkpoint ``load`` reads: a committed one (valid
    ``metadata.json``) or, on a local file system, a plain PyTorch DCP one (``.metadata`` only;
    see distckpt.dcp_native). False for an interrupted save."""
    location = storage.resolve(checkpoint_dir, storage_options)
    root = storage.local_root(location)
    if root is not None:
        return _check_is_distributed_checkpoint(root) or is_dcp_native(root)
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
    config = require_config(storage.resolve(checkpoint_dir, storage_options))
    return get_default_strategy(
        StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
    )


def require_config(checkpoint_dir: Union[Path, storage.Store]) -> CheckpointingConfig:
    """The config of a resolved location that must hold a checkpoint (a local directory whose
    swap a crash interrupted is recovered first); raises naming what is missing."""
    root = storage.local_root(checkpoint_dir)
    if root is not None:
        if not root.exists():
            commit_protocol.recover(root)
        if not root.exists():
            raise CheckpointingException(
                f"checkpoint directory {root} does not exist (rank {dist.get_rank()})"
            )
        if not root.is_dir():
            raise CheckpointingException(
                f"checkpoint path {root} is not a directory (rank {dist.get_rank()})"
            )
    config = checkpoint_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(f"{describe_missing_config(checkpoint_dir)} (rank {dist.get_rank()})")
    return config


def load_strategies(
    checkpoint_dir: Union[Path, storage.Store],
    sharded_strategy: Optional[LoadShardedStrategy],
    common_strategy: Optional[LoadCommonStrategy],
):
    config = require_config(checkpoint_dir)
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
    """Load only the common (non-sharded) state (with a ``dcp.save``'s non-tensor values).

    As in Megatron-Core, a ``content_metadata`` given to ``save`` is part of it, under
    ``CONTENT_METADATA_KEY``: Megatron-LM's training loop reads it back with
    ``load_content_metadata(preloaded_state_dict=load_common_state_dict(dir))``.
    """
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, common_strategy = load_strategies(checkpoint_dir, None, common_strategy)
    return read_common_state(checkpoint_dir, sharded_strategy, common_strategy)


def load_content_metadata(
    checkpoint_dir: Optional[Location] = None,
    preloaded_state_dict: Optional[StateDict] = None,
    storage_options: StorageOptions = None,
) -> Optional[dict]:
    """The ``content_metadata`` passed to ``save``, or None.

    Either ``checkpoint_dir`` (its common state is read) or ``preloaded_state_dict`` (a common
    state already read with :func:`load_common_state_dict`: nothing is read again) must be given;
    as in Megatron-Core, ``load_content_metadata(preloaded_state_dict=common)`` needs no directory.
    """
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise CheckpointingException(
            "load_content_metadata needs a checkpoint_dir or a preloaded_state_dict; both are None"
        )
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    if preloaded_state_dict is None:
        sharded_strategy, common_strategy = load_strategies(checkpoint_dir, None, None)
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
    sharded_strategy, _ = load_strategies(checkpoint_dir, sharded_strategy, None)
    return sharded_strategy.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: Location,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    common_strategy: Optional[LoadCommonStrategy] = None,
    storage_options: StorageOptions = None,
) -> ShardedStateDict:
    """Like load_tensors_metadata, plus the stored ShardedObjects keyed by their unique key."""
    checkpoint_dir = storage.resolve(checkpoint_dir, storage_options)
    sharded_strategy, common_strategy = load_strategies(checkpoint_dir, sharded_strategy, common_strategy)
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
    sharded_strategy, _ = load_strategies(checkpoint_dir, sharded_strategy, None)
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
    sharded_strategy, _ = load_strategies(checkpoint_dir, None, None)
    sharded_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)
