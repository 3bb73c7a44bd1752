"""Entry points: ``save``, ``load`` and the ``load_*`` queries. Orchestration only.

Every rank calls ``save`` and ``load`` (a single process without a process group works too).
Each stage ends in a collective that every rank reaches whether its own work failed or not, so a
failure anywhere raises the same CheckpointingException everywhere instead of a hang.

The documented import path of the entry points: ``save`` lives in :mod:`distckpt.saving`,
``load`` in :mod:`distckpt.loading`, the configuration and the ``load_*`` queries in
:mod:`distckpt.queries`; this module only re-exports them.
"""

from __future__ import annotations

from distckpt import budget, dist, storage, timings
from distckpt import commit as commit_protocol
from distckpt.core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException, with_gc_paused
from distckpt.dcp_native import checkpoint_config, describe_missing_config, is_dcp_native
from distckpt.dict_utils import dict_list_map_inplace, diff, extract_matching_values, merge, nested_values
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.formats.manifest import add_whole_files
from distckpt.loading import load
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
from distckpt.queries import (
    CONTENT_METADATA_KEY,
    Location,
    StorageOptions,
    check_is_distributed_checkpoint,
    get_default_load_sharded_strategy,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_strategies,
    load_tensors_metadata,
    read_common_state,
    remove_sharded_tensors,
    require_config,
)
from distckpt.saving import save
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

# Besides the entry points: the names the old module imported stay importable from here.
__all__ = [
    "CONTENT_METADATA_KEY",
    "Location",
    "StorageOptions",
    "check_is_distributed_checkpoint",
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_strategies",
    "load_tensors_metadata",
    "read_common_state",
    "remove_sharded_tensors",
    "require_config",
    "save",
    "AsyncSaveShardedStrategy",
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "LocalNonpersistentObject",
    "MissingFileError",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensorFactory",
    "StateDict",
    "StrategyAction",
    "StrictHandling",
    "add_whole_files",
    "apply_factories",
    "apply_factory_merges",
    "check_common_state",
    "check_save_options",
    "checkpoint_config",
    "describe_missing_config",
    "determine_missing_and_unexpected_keys",
    "dict_list_map_inplace",
    "diff",
    "extract_matching_values",
    "get_default_strategy",
    "handle_mismatched_keys",
    "is_dcp_native",
    "is_main_replica",
    "merge",
    "nested_values",
    "normalize_sharded_state_dict",
    "parse_strict_flag",
    "shard_table",
    "validate_global_integrity",
    "validate_local_integrity",
    "with_gc_paused",
    "budget",
    "commit_protocol",
    "dist",
    "storage",
    "timings",
]
