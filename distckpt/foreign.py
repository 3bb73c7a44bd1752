"""Sharded leaves of other libraries: Megatron-Core's accepted as they are, the rest refused.

Model code written for Megatron-Core returns ``sharded_state_dict()``s whose leaves are
Megatron's own ``ShardedTensor``, ``ShardedObject``, ``ShardedTensorFactory`` and
``LocalNonpersistentObject``. They carry the same fields as distckpt's classes, so
:func:`normalize_sharded_state_dict` replaces each of them, in place, by the distckpt object with
the same fields (sharing the data tensor, so a load still fills the caller's tensors in place).
Factories keep working: their ``build_fn`` output is normalised in turn, and ``merge_fn`` runs
on loaded plain values, which are the same for both libraries. Every entry point that takes a
sharded state dict calls it once, first; nothing downstream knows about Megatron.

Megatron's classes are recognised by class path and fields; megatron-core is never imported
(distckpt does not depend on it). Its module path is built from parts on purpose.

:func:`sharded_lookalike` tells whether an object describes sharded data in a way distckpt does
not understand (a sharded class of an unknown library, a DTensor, ...): such an object in the
common state would be pickled whole, on rank 0 only, and the other ranks' pieces lost.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

__all__ = [
    "MEGATRON_MAPPING_MODULE",
    "from_foreign",
    "megatron_class_name",
    "normalize_sharded_state_dict",
    "sharded_lookalike",
]

# Where Megatron-Core defines its sharded classes (a class path, never imported).
MEGATRON_MAPPING_MODULE = ".".join(("megatron", "core", "dist_checkpointing", "mapping"))

# Megatron class name -> (distckpt class, fields copied over). The fields are the same in
# Megatron-Core 0.15 and 0.16; a required field that is missing means an unknown version.
_FIELDS: Dict[str, Tuple[type, Tuple[str, ...], Tuple[str, ...]]] = {
    # name: (distckpt class, required fields, optional fields)
    "ShardedTensor": (
        ShardedTensor,
        (
            "key",
            "data",
            "dtype",
            "local_shape",
            "global_shape",
            "global_offset",
            "axis_fragmentations",
            "replica_id",
        ),
        ("prepend_axis_num", "allow_shape_mismatch", "flattened_range"),
    ),
    "ShardedObject": (ShardedObject, ("key", "data", "global_shape", "global_offset", "replica_id"), ()),
    "ShardedTensorFactory": (
        ShardedTensorFactory,
        ("key", "data", "build_fn", "merge_fn", "replica_id"),
        ("flattened_range",),
    ),
    "LocalNonpersistentObject": (LocalNonpersistentObject, ("obj",), ()),
}


# type -> Megatron class name or None: every leaf of every save and load is looked up here.
_NAME_BY_TYPE: Dict[type, Optional[str]] = {}


def megatron_class_name(obj: Any) -> Optional[str]:
    """The name of the Megatron-Core sharded class ``obj`` is an instance of (subclasses
    included), or None. Only the class path is compared: nothing is imported."""
    cls = type(obj)
    try:
        return _NAME_BY_TYPE[cls]
    except KeyError:
        pass
    name = next(
        (
            c.__name__
            for c in cls.__mro__
            if c.__module__ == MEGATRON_MAPPING_MODULE and c.__name__ in _FIELDS
        ),
        None,
    )
    if len(_NAME_BY_TYPE) < 4096:  # bounded: classes made on the fly must not grow it forever
        _NAME_BY_TYPE[cls] = name
    return name


def from_foreign(obj: Any, where: str = "") -> Any:
    """The distckpt equivalent of a Megatron-Core sharded leaf, or ``obj`` itself.

    ``where`` prefixes error messages (e.g. ``"factory 'k': "``).

    The data tensor is shared, not copied. A factory's ``build_fn`` (Megatron's or distckpt's)
    is wrapped so that what it builds is normalised too.

    Raises:
        CheckpointingException: ``obj`` has Megatron's class path but lacks one of its fields
            (a Megatron version distckpt does not know), or its fields are invalid.
    """
    name = megatron_class_name(obj)
    if name is None:
        if isinstance(obj, ShardedTensorFactory) and not getattr(obj.build_fn, _NORMALIZING, False):
            # distckpt's own factory may build Megatron objects (model code mixing both). Wrapped
            # in place: callers keep the very factory they passed (e.g. in optimizer maps).
            obj.build_fn = _normalizing_build(obj.build_fn, obj.key)
        return obj
    cls, required, optional = _FIELDS[name]
    missing = [f for f in required if not hasattr(obj, f)]
    if missing:
        key = getattr(obj, "key", None)
        raise CheckpointingException(
            f"{where}{'leaf' if where else 'Leaf'} {key if isinstance(key, str) else '?'!r}: Megatron-Core "
            f"{name} without field(s) {missing}; this version of Megatron-Core's sharded classes is not "
            f"supported"
        )
    if cls is LocalNonpersistentObject:
        return LocalNonpersistentObject(obj.obj)
    fields = {f: getattr(obj, f) for f in required}
    fields.update({f: getattr(obj, f) for f in optional if hasattr(obj, f)})
    if cls is ShardedTensorFactory:
        fields["build_fn"] = _normalizing_build(fields["build_fn"], fields["key"])
    return cls(**fields)


_NORMALIZING = "_distckpt_normalizes_output"


def _normalizing_build(build_fn: Callable, key: str) -> Callable:
    def build(*args: Any) -> Any:
        built = build_fn(*args)
        if isinstance(built, (dict, list)):
            return normalize_sharded_state_dict(built, f"factory {key!r}")
        return from_foreign(built, f"factory {key!r}: ")

    build.__wrapped__ = build_fn  # type: ignore[attr-defined]
    setattr(build, _NORMALIZING, True)
    return build


def normalize_sharded_state_dict(sharded_state_dict: ShardedStateDict, where: str = "") -> ShardedStateDict:
    """Replace, in place, every Megatron-Core sharded leaf by distckpt's equivalent; returns the
    same dict. Leaves of any other kind are left alone (cheap when there is nothing to do)."""
    prefix = f"{where}: " if where else ""
    dict_list_map_inplace(lambda x: from_foreign(x, prefix), sharded_state_dict)
    return sharded_state_dict


# --------------------------------------------------------------------------- lookalikes

_DISTCKPT_MODULE = "distckpt."


def sharded_lookalike(obj: Any) -> Optional[str]:
    """Why ``obj`` looks like a sharded description that distckpt cannot save as common state
    (it would be pickled whole), or None.

    Recognised: distckpt's and Megatron-Core's sharded classes (left in a place the sharded part
    does not reach, e.g. a tuple); a DTensor or torch ShardedTensor; any object with a ``key``
    and a ``replica_id`` plus a ``global_shape`` or ``global_offset``; any class named
    ``Sharded*`` or ``*Factory`` from another library.
    """
    if isinstance(obj, (ShardedBase, LocalNonpersistentObject)):
        return f"a distckpt {type(obj).__name__}"
    name = megatron_class_name(obj)
    if name is not None:
        return f"a Megatron-Core {name}"
    cls = type(obj)
    if isinstance(obj, torch.Tensor):
        # Tensor subclasses that describe a distributed tensor; plain tensors are size-checked
        # by the caller.
        if cls.__name__ == "DTensor" or cls.__name__.startswith("Sharded"):
            return f"a {cls.__module__}.{cls.__name__} (a distributed tensor)"
        return None
    if cls.__module__.startswith(_DISTCKPT_MODULE) or cls.__module__ in ("builtins", "collections"):
        return None
    if isinstance(obj, type):
        return None
    if cls.__name__.startswith("Sharded") or cls.__name__.endswith("Factory"):
        return f"an instance of {cls.__module__}.{cls.__name__}, a sharded class distckpt does not know"
    if (
        _has(obj, "key")
        and _has(obj, "replica_id")
        and (_has(obj, "global_shape") or _has(obj, "global_offset"))
    ):
        return (
            f"an instance of {cls.__module__}.{cls.__name__} with key, replica_id and global "
            f"shape/offset fields: a sharded description distckpt does not know"
        )
    return None


def _has(obj: Any, name: str) -> bool:
    try:
        return hasattr(obj, name)
    except Exception:  # noqa: BLE001 - a property that raises is not a field
        return False
