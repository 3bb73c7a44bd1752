"""Helpers over sharded state dicts: splitting them by leaf kind and renaming sharded keys."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, extract_matching_values
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

__all__ = [
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
    "zip_strict",
    "clean_metadata_for_serialization",
    "sharded_tensor_shard_id",
    "sharded_object_id",
]

# Identifies one stored piece: (key, global_offset, flat range or global shape).
_ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, ...]]]


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor leaves, everything else), keeping the nesting."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor and ShardedTensorFactory leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor, ShardedTensorFactory and LocalNonpersistentObject leaves, rest)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)),
    )


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (every ShardedBase leaf: tensors, objects, factories; everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf, in place."""

    def _add(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(_add, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf, in place.

    Raises:
        CheckpointingException: some sharded key does not start with ``old_prefix``. Leaves
            visited before the offending one have already been renamed.
    """

    def _replace(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            if not x.key.startswith(old_prefix):
                raise CheckpointingException(
                    f"Sharded key {x.key!r} does not start with the prefix {old_prefix!r} to replace"
                )
            x.key = new_prefix + x.key[len(old_prefix) :]
        return x

    dict_list_map_inplace(_replace, sharded_state_dict)


def _map_key(key: str, prefix_map: Dict[str, str]) -> Tuple[str, Optional[Tuple[str, str]]]:
    """Apply the first matching (old, new) prefix pair; also return the pair used, if any."""
    for old, new in prefix_map.items():
        if key.startswith(old):
            return new + key[len(old) :], (old, new)
    return key, None


def _mapped_build_fn(factory: ShardedTensorFactory, pair: Tuple[str, str], prefix_map: Dict[str, str]):
    """Wrap ``factory.build_fn`` so that the built sub-tensors are renamed by ``prefix_map``.

    The factory's own key has already been renamed by ``pair``. Applying the map both to that key
    and then to the built keys would rename key-derived sub-keys twice whenever a new prefix
    matches an old one (e.g. ``{"a.": "b.", "b.": "c."}``), so the wrapper builds from the
    pre-mapping key and maps every built key exactly once.
    """
    inner = factory.build_fn
    old, new = pair

    def build_fn(key: str, data: Any, replica_id: Any, flattened_range: Optional[slice]) -> Any:
        if not key.startswith(new):
            # The key was renamed again by something else since; build with it as it is.
            return inner(key, data, replica_id, flattened_range)
        built = inner(old + key[len(new) :], data, replica_id, flattened_range)
        return _rename_sharded(built, prefix_map, wrap_factories=False)

    return build_fn


def _rename_sharded(x: Any, prefix_map: Dict[str, str], wrap_factories: bool) -> Any:
    """Apply ``prefix_map`` to every sharded leaf of ``x`` (a nested dict/list or one leaf)."""

    def _rename(leaf: Any) -> Any:
        if not isinstance(leaf, ShardedBase):
            return leaf
        leaf.key, pair = _map_key(leaf.key, prefix_map)
        if pair is not None and wrap_factories and isinstance(leaf, ShardedTensorFactory):
            leaf.build_fn = _mapped_build_fn(leaf, pair, prefix_map)
        return leaf

    return dict_list_map_inplace(_rename, x)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename, in place, the keys of the sharded leaves that start with a prefix in ``prefix_map``.

    For each leaf the first matching old prefix (in ``prefix_map`` order) is replaced by its new
    prefix; leaves matching none are left alone. A renamed ShardedTensorFactory also gets its
    ``build_fn`` wrapped so that the tensors it builds are renamed the same way, even those whose
    keys do not derive from the factory's key.
    """
    _rename_sharded(sharded_state_dict, dict(prefix_map), wrap_factories=True)


def zip_strict(*args: Iterable[Any]) -> Iterable[Tuple[Any, ...]]:
    """``zip`` over iterables that must all have the same length (checked before iterating).

    Raises:
        CheckpointingException: the lengths differ.
    """
    materialized: List[List[Any]] = [list(a) for a in args]
    lengths = [len(a) for a in materialized]
    if len(set(lengths)) > 1:
        raise CheckpointingException(f"zip_strict: iterables have different lengths {lengths}")
    return zip(*materialized)


def sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """Identity of the stored piece a ShardedTensor describes: key, offset and flat range."""
    fr = sharded_tensor.flattened_range
    return (
        sharded_tensor.key,
        sharded_tensor.global_offset,
        None if fr is None else (fr.start, fr.stop),
    )


def sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """Identity of the stored piece a ShardedObject describes: key, offset and grid shape."""
    return (sharded_object.key, sharded_object.global_offset, sharded_object.global_shape)


# Megatron-Core's own modules import these two under private names (``exchange_utils``,
# ``strategies.fully_parallel``); the drop-in keeps them importable from here.
_sharded_tensor_shard_id = sharded_tensor_shard_id
_sharded_object_id = sharded_object_id

# Entries of a checkpoint's sharding metadata that are live runtime objects, not data: a process
# group handle cannot be pickled into a checkpoint and means nothing in another job.
RUNTIME_ONLY_METADATA_KEYS = ("dp_cp_group",)


def clean_metadata_for_serialization(metadata: Optional[dict]) -> Optional[dict]:
    """A shallow copy of ``metadata`` without its runtime-only entries (``dp_cp_group``), fit to
    be stored in a checkpoint; None stays None. The caller's dict is left as it was."""
    if metadata is None:
        return None
    return {k: v for k, v in metadata.items() if k not in RUNTIME_ONLY_METADATA_KEYS}


# Megatron-LM's training loop imports it under this private name.
_clean_metadata_for_serialization = clean_metadata_for_serialization
