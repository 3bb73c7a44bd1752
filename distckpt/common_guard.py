"""The guard on the common state: no sharded description and no large tensor in what rank 0
saves alone (re-exported by :mod:`distckpt.validation`)."""

from __future__ import annotations

import os
import types
from typing import List, Optional, Set, Tuple, Union

import torch

from distckpt.core import CheckpointingException
from distckpt.foreign import sharded_lookalike

# --------------------------------------------------------------------------- common state guard

DEFAULT_MAX_COMMON_TENSOR_BYTES = 1 << 20
"""Largest torch tensor (1 MiB) accepted in the common state unless ``save`` is told otherwise.

Common state is written by rank 0 alone; a large tensor there is almost always a model or
optimizer tensor that should have been a ShardedTensor (and whose other ranks' pieces would be
lost). ``save(..., max_common_tensor_bytes=None)`` or the environment variable
``DISTCKPT_MAX_COMMON_TENSOR_BYTES`` (a number of bytes, or ``none``) allows larger ones."""

MAX_COMMON_TENSOR_BYTES_ENV = "DISTCKPT_MAX_COMMON_TENSOR_BYTES"

# How deep the guard looks into the attributes of plain objects of the common state.
_MAX_OBJECT_DEPTH = 6


def common_tensor_limit(value: Union[int, None, str] = "default") -> Optional[int]:
    """The byte limit for common tensors that ``save(max_common_tensor_bytes=value)`` means.

    ``"default"``: ``DISTCKPT_MAX_COMMON_TENSOR_BYTES`` if set (bytes, or ``none``), else 1 MiB.
    None: no limit. An int: that many bytes.

    Raises:
        CheckpointingException: an invalid value or environment variable.
    """
    source = "max_common_tensor_bytes"
    if isinstance(value, str) and value == "default":
        raw = os.environ.get(MAX_COMMON_TENSOR_BYTES_ENV, "").strip()
        if not raw:
            return DEFAULT_MAX_COMMON_TENSOR_BYTES
        if raw.lower() == "none":
            return None
        source, value = MAX_COMMON_TENSOR_BYTES_ENV, raw
        try:
            value = int(raw)
        except ValueError:
            pass
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointingException(
            f"{source}={value!r}: expected a number of bytes >= 0, or None (no limit)"
        )
    return value


def check_common_state(common_state: object, max_tensor_bytes: Union[int, None, str] = "default") -> None:
    """Refuse common state that would silently lose sharded data.

    Every value is visited: containers (dict, list, tuple, set), and the attributes of plain
    objects down to a small depth. Refused: anything that is, or carries, a sharded description
    (see :func:`distckpt.foreign.sharded_lookalike`), and torch tensors of more than
    ``max_tensor_bytes`` bytes (see :func:`common_tensor_limit`).

    Raises:
        CheckpointingException: naming the key path of the first offending value (``save``
            runs it on every rank and shares the error, which then names the ranks).
    """
    max_tensor_bytes = common_tensor_limit(max_tensor_bytes)
    seen: Set[int] = set()
    stack: List[Tuple[object, Tuple[object, ...], int]] = [(common_state, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if type(value) in _ATOMS:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        where = _key_path(path)
        problem = sharded_lookalike(value)
        if problem is not None:
            raise CheckpointingException(
                f"common state {where} is {problem}; it would be pickled whole into the "
                f"common state, from rank 0 only, and the other ranks' pieces lost. Put distckpt or "
                f"Megatron-Core sharded objects directly in dicts or lists of the sharded state dict"
            )
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            if max_tensor_bytes is not None and nbytes > max_tensor_bytes and value.device.type != "meta":
                raise CheckpointingException(
                    f"common state {where} is a torch tensor of {nbytes} bytes (shape "
                    f"{list(value.shape)}), above the {max_tensor_bytes}-byte limit for "
                    f"common tensors: common state is saved by rank 0 alone. Wrap it in a ShardedTensor, "
                    f"or allow it with save(..., max_common_tensor_bytes=None)"
                )
            continue
        if isinstance(value, dict):
            stack.extend((v, path + (k,), depth) for k, v in value.items() if type(v) not in _ATOMS)
        elif isinstance(value, (list, tuple)):
            stack.extend((v, path + (i,), depth) for i, v in enumerate(value) if type(v) not in _ATOMS)
        elif isinstance(value, (set, frozenset)):
            stack.extend((v, path + ("{}",), depth) for v in value)
        elif depth < _MAX_OBJECT_DEPTH and _is_plain_object(value):
            stack.extend((v, path + (f".{k}",), depth + 1) for k, v in vars(value).items())


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _is_plain_object(value: object) -> bool:
    """An instance of a user class whose attributes live in ``__dict__`` (dataclasses,
    argparse namespaces, config objects), not a module, class or function."""
    if isinstance(
        value,
        (
            type,
            types.ModuleType,
            types.FunctionType,
            types.MethodType,
            types.BuiltinFunctionType,
            str,
            bytes,
            int,
            float,
            complex,
            bool,
        ),
    ):
        return False
    try:
        return isinstance(vars(value), dict)
    except TypeError:
        return False


def _key_path(path: Tuple[object, ...]) -> str:
    if not path:
        return "(the whole common state)"
    text = ""
    for p in path:
        text += p if isinstance(p, str) and p.startswith(".") else f"[{p!r}]"
    return f"key {text}"
