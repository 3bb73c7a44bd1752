"""The sharded state dict data model: what each rank contributes to a global checkpoint.

A *sharded state dict* is a nested dict/list whose leaves may be:

* :class:`ShardedTensor` -- one rank's piece of a global tensor, with its place in that tensor;
* :class:`ShardedObject` -- one rank's piece of a grid of picklable objects;
* :class:`ShardedTensorFactory` -- a tensor that is saved as several sharded tensors and merged
  back after loading;
* :class:`LocalNonpersistentObject` -- a value that is never saved and is handed back on load;
* anything else -- "common" state, identical on all ranks.

This module only describes data; it knows nothing of files or of torch.distributed.
It is the documented (and Megatron-Core compatible) import path of the model; the classes live in
:mod:`distckpt.sharded_base`, :mod:`distckpt.sharded_tensor`, :mod:`distckpt.sharded_object` and
:mod:`distckpt.factories`, and this module only re-exports them.
"""

from __future__ import annotations

from distckpt.factories import (
    FactoryBuildFn,
    FactoryMergeFn,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from distckpt.sharded_base import ReplicaId, ShardedBase, ShardedStateDict, StateDict, is_main_replica
from distckpt.sharded_object import LocalNonpersistentObject, ShardedObject
from distckpt.sharded_tensor import ShardedTensor

__all__ = [
    "FactoryBuildFn",
    "FactoryMergeFn",
    "ReplicaId",
    "ShardedStateDict",
    "StateDict",
    "is_main_replica",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "apply_factories",
    "apply_factory_merges",
]
