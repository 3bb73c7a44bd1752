"""Stand-ins for Megatron-Core's sharded classes, for tests that run without megatron-core.

The classes have Megatron-Core 0.16's names, fields and class path
(``megatron.core.dist_checkpointing.mapping``), written here from its documented data model;
no code is taken from it. distckpt recognises Megatron's classes by class path and fields only,
so these exercise the same code as the real ones (tests/interop/test_megatron_gpt.py uses the real ones).

:func:`install` registers the module under Megatron's path in ``sys.modules`` unless a real
megatron-core is importable (then the real package stays untouched and only ``__module__``
names the path).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch

MEGATRON_MAPPING = ".".join(("megatron", "core", "dist_checkpointing", "mapping"))


@dataclass
class ShardedTensor:
    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: Any = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    @classmethod
    def split(cls, key: str, data: torch.Tensor, axis: int, rank: int, parts: int, replica_id: Any = 0):
        """``data`` is piece ``rank`` of ``parts`` equal pieces along ``axis`` of the global tensor."""
        shape = tuple(data.shape)
        global_shape = shape[:axis] + (shape[axis] * parts,) + shape[axis + 1 :]
        offset = tuple(rank * shape[axis] if a == axis else 0 for a in range(len(shape)))
        frags = tuple(parts if a == axis else 1 for a in range(len(shape)))
        return cls(key, data, data.dtype, shape, global_shape, offset, frags, replica_id)

    def without_data(self):
        return replace(self, data=None)


@dataclass
class ShardedObject:
    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: Any = 0


@dataclass
class ShardedTensorFactory:
    key: str
    data: torch.Tensor
    build_fn: Callable
    merge_fn: Callable
    replica_id: Any = 0
    flattened_range: Optional[slice] = None

    def build(self):
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


class LocalNonpersistentObject:
    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


for _cls in (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject):
    _cls.__module__ = MEGATRON_MAPPING


def install() -> None:
    """Make the class path importable (for pickling by reference) when megatron-core is absent."""
    if MEGATRON_MAPPING in sys.modules or importlib.util.find_spec("megatron") is not None:
        return
    parts = MEGATRON_MAPPING.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
    module = types.ModuleType(MEGATRON_MAPPING)
    for cls in (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject):
        setattr(module, cls.__name__, cls)
    sys.modules[MEGATRON_MAPPING] = module
