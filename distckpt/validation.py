"""Sharding integrity checks (local and global) and the strict-mode handling of key mismatches.

Global integrity means: for every key, all ranks agree on global shape and dtype, and the main
replicas (replica_id == 0) cover every element of the global tensor exactly once. Flattened
ranges must tile each chunk of the regular grid exactly once. ShardedObjects must fill their
grid exactly once. The check runs on one rank over gathered, data-free shard descriptions
(:class:`ShardTable`) and its verdict is broadcast, so every rank raises the same error.

The checks live in :mod:`distckpt.strict`, :mod:`distckpt.shard_tables`,
:mod:`distckpt.global_integrity` and :mod:`distckpt.common_guard`; this module, their documented
import path, only re-exports them (and the names the old module imported).
"""

from __future__ import annotations

from distckpt.common_guard import (
    DEFAULT_MAX_COMMON_TENSOR_BYTES,
    MAX_COMMON_TENSOR_BYTES_ENV,
    check_common_state,
    common_tensor_limit,
)
from distckpt.core import CheckpointingException
from distckpt.foreign import sharded_lookalike
from distckpt.global_integrity import (
    check_exact_cover,
    validate_global_integrity,
)
from distckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from distckpt.shard_tables import (
    ShardDesc,
    ShardTable,
    layout_digest,
    shard_desc,
    shard_table,
    validate_local_integrity,
)
from distckpt.strict import (
    StrictHandling,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
)

__all__ = [
    "CheckpointingException",
    "ShardDesc",
    "ShardedBase",
    "ShardedObject",
    "ShardedTensor",
    "is_main_replica",
    "sharded_lookalike",
    "DEFAULT_MAX_COMMON_TENSOR_BYTES",
    "MAX_COMMON_TENSOR_BYTES_ENV",
    "ShardTable",
    "StrictHandling",
    "check_common_state",
    "check_exact_cover",
    "common_tensor_limit",
    "determine_missing_and_unexpected_keys",
    "handle_mismatched_keys",
    "layout_digest",
    "parse_strict_flag",
    "shard_desc",
    "shard_table",
    "validate_global_integrity",
    "validate_local_integrity",
]
