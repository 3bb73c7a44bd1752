"""Tensors saved as several sharded tensors: :class:`ShardedTensorFactory`, applying the factories
before a save or load and merging their loaded parts back (re-exported by :mod:`distckpt.mapping`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch

from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace
from distckpt.sharded_base import ReplicaId, ShardedBase, ShardedStateDict, StateDict

FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as the sharded sub-state-dict that ``build_fn`` makes of it.

    Before saving (and before loading) the factory is replaced by ``build_fn(key, data,
    replica_id, flattened_range)``; after loading, ``merge_fn`` turns the loaded sub-state-dict
    back into one tensor. This lets a model store e.g. a fused weight as separate tensors.
    """

    key: str
    data: Optional[torch.Tensor]
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        """Return the sharded sub-state-dict that stands for this tensor."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check: the built sharded tensors are validated themselves."""

    def without_data(self) -> ShardedTensorFactory:
        """Return a copy with the same functions and ``data=None``."""
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, every ShardedTensorFactory leaf by what it builds."""

    def _build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(_build, sharded_state_dict)


def _contains_factory(x: Any) -> bool:
    if isinstance(x, ShardedTensorFactory):
        return True
    if isinstance(x, dict):
        return any(_contains_factory(v) for v in x.values())
    if isinstance(x, list):
        return any(_contains_factory(v) for v in x)
    return False


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: Tuple[Any, ...] = ()) -> StateDict:
    """Merge loaded factory outputs back into single tensors.

    ``x1`` is the loaded state dict, in which each factory's place holds the loaded version of
    what the factory built; ``x2`` is a structure still holding the factories (the sharded state
    dict before :func:`apply_factories`, or only its factories as extracted with
    ``return_lists_as_dicts=True``). Wherever ``x2`` has a factory, ``x1``'s value is replaced by
    ``factory.merge_fn(value)``. Other parts of ``x2`` are ignored. ``x1`` is modified in place
    and returned.

    Raises:
        CheckpointingException: a factory has no counterpart in ``x1``, or lists differ in length.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)

    def _missing(sub_key: Tuple[Any, ...], what: str) -> CheckpointingException:
        return CheckpointingException(
            f"apply_factory_merges: the factory output at key path {sub_key} {what}"
        )

    if isinstance(x2, dict):
        if isinstance(x1, dict):
            for k, v2 in x2.items():
                if k in x1:
                    x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
                elif _contains_factory(v2):
                    raise _missing(key + (k,), "is missing from the loaded state dict")
        elif isinstance(x1, list):
            # x2 came from extract_matching_values(..., return_lists_as_dicts=True).
            for k, v2 in x2.items():
                if isinstance(k, int) and 0 <= k < len(x1):
                    x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
                elif _contains_factory(v2):
                    raise _missing(key + (k,), f"has no index in a loaded list of length {len(x1)}")
        elif _contains_factory(x2):
            raise _missing(key, f"is a {type(x1).__name__} in the loaded state dict, not a container")
    elif isinstance(x2, list):
        if isinstance(x1, list):
            if len(x1) != len(x2):
                raise CheckpointingException(
                    f"apply_factory_merges: lists of different lengths ({len(x1)} loaded vs "
                    f"{len(x2)} sharded) at key path {key}"
                )
            for i, v2 in enumerate(x2):
                x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
        elif _contains_factory(x2):
            raise _missing(key, f"is a {type(x1).__name__} in the loaded state dict, not a list")
    return x1
