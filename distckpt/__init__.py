"""distckpt: save and load tensor/pipeline/data-parallel model state, Megatron-Core style.

The public names match Megatron-Core's ``dist_checkpointing`` package, and Megatron-Core's own
sharded objects are accepted as they are (docs/megatron-compat.md): model code need not change.
"""

from distckpt.budget import host_memory_budget, set_host_memory_budget
from distckpt.core import CheckpointingConfig, CheckpointingException
from distckpt.dist import (
    CollectiveTimeout,
    collective_timeout,
    heartbeat_grace,
    set_collective_timeout,
    set_heartbeat_grace,
)
from distckpt.io.staging import release_staging_memory
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from distckpt.serialization import (
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from distckpt.strategies import builtin as _builtin  # noqa: F401  (registers the built-in strategies)
from distckpt.strategies.common import add_safe_globals
from distckpt.strategies.staging import prepare_staging
from distckpt.strategies.torch_dcp import to_torch_state_dict
from distckpt.timings import Timings, last_timings
from distckpt.validation import StrictHandling

__version__ = "0.1.0"

__all__ = [
    "CheckpointingConfig",
    "CheckpointingException",
    "CollectiveTimeout",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "Timings",
    "add_safe_globals",
    "check_is_distributed_checkpoint",
    "collective_timeout",
    "heartbeat_grace",
    "host_memory_budget",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "last_timings",
    "prepare_staging",
    "release_staging_memory",
    "remove_sharded_tensors",
    "save",
    "set_collective_timeout",
    "set_heartbeat_grace",
    "set_host_memory_budget",
    "to_torch_state_dict",
]
