"""Checks on what a checkpoint's metadata claims: file names, offsets, lengths, shapes, counts.

A checkpoint is data from elsewhere. Before distckpt opens a file its metadata names, allocates a
buffer its metadata sizes, or loops over a count its metadata gives, the claim goes through one
of these checks, so a hostile or corrupted checkpoint can make distckpt neither read or write
outside the checkpoint (``..``, absolute paths, symlinks that lead out) nor allocate more than
the request needs (a claimed shape of 2^40 elements, a record of 2^50 bytes) nor loop for long.
Each failure is a CheckpointingException naming the file that made the claim. The rule for
names lives in :mod:`distckpt.containment`; :func:`relative_name` and :func:`inside` delegate to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence, Tuple

from distckpt import containment
from distckpt.errors import CheckpointingException, PathLike

# No real tensor has more elements or bytes than this; anything larger is a hostile claim.
MAX_NUMEL = 1 << 48
MAX_BYTES = 1 << 56

# Nesting deeper than this in a checkpoint's unpickled common state and objects is hostile:
# distckpt and the caller's code walk these structures recursively, and Python's stack ends near
# 1000 frames. Real ones nest a few levels.
MAX_NESTING = 100


def relative_name(name: Any, source: PathLike, what: str = "file name") -> str:
    """``name`` if it is a plain relative path inside the checkpoint; else raise naming ``source``.
    The rule is :func:`distckpt.containment.check_name`'s."""
    return containment.check_name(name, source, what)


def inside(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> Path:
    """The path of ``name`` under ``root``, refusing a name or symlink that leads out of the
    checkpoint: :func:`distckpt.containment.path_beneath`."""
    return containment.path_beneath(root, name, source, what)


def fits(value: Any, limit: int = MAX_BYTES) -> bool:
    """Whether ``value`` is a plain int in ``[0, limit]``: the test :func:`natural` makes first,
    without building a message (callers that check millions of records test this and call
    :func:`natural` only to word the error)."""
    return type(value) is int and 0 <= value <= limit


def natural(value: Any, source: PathLike, what: str, limit: int = MAX_BYTES) -> int:
    """``value`` as an int in ``[0, limit]``; else raise naming ``source``."""
    if fits(value, limit):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise CheckpointingException(f"{source}: {what} {value!r} is not an integer in [0, {limit}]")
    return value


def plain_shape(values: Any) -> Any:
    """``values`` as a tuple when it is already a tuple or list (as JSON gives) of at most 64
    plain ints in ``[0, MAX_NUMEL]`` with at most :data:`MAX_NUMEL` elements, else None: the test
    :func:`shape` makes first, without building a message (on None, :func:`shape` words the error
    or accepts other sequences)."""
    if type(values) is list:
        values = tuple(values)
    if type(values) is not tuple or len(values) > 64:
        return None
    numel = 1
    for d in values:
        if not fits(d, MAX_NUMEL):
            return None
        numel *= d
    return values if numel <= MAX_NUMEL else None


def shape(values: Any, source: PathLike, what: str) -> Tuple[int, ...]:
    """A shape (sequence of naturals) whose element count is at most :data:`MAX_NUMEL`."""
    plain = plain_shape(values)
    if plain is not None:
        return plain
    try:
        dims = tuple(values)
    except TypeError:
        raise CheckpointingException(f"{source}: {what} {values!r} is not a shape") from None
    if len(dims) > 64:
        raise CheckpointingException(f"{source}: {what} has {len(dims)} dimensions")
    numel = 1
    for d in dims:
        numel *= natural(d, source, what, MAX_NUMEL)
    if numel > MAX_NUMEL:
        raise CheckpointingException(
            f"{source}: {what} {list(dims)} claims {numel} elements (more than 2^48)"
        )
    return dims


def box_inside(
    offsets: Sequence[int], sizes: Sequence[int], whole: Sequence[int], source: PathLike, what: str
) -> None:
    """Raise unless the box ``offsets`` / ``sizes`` lies inside the shape ``whole``."""
    if (
        len(offsets) != len(whole)
        or len(sizes) != len(whole)
        or any(o + s > w for o, s, w in zip(offsets, sizes, whole))
    ):
        raise CheckpointingException(
            f"{source}: {what} at {list(offsets)} of size {list(sizes)} lies outside the shape {list(whole)}"
        )


def parse_json(data: Any, source: PathLike, what: str) -> Any:
    """``data`` (bytes or str) parsed as JSON; else raise naming ``source``: not UTF-8, not
    JSON, or nested deeper than Python's parser can follow (it raises RecursionError near the
    interpreter's recursion limit, about 1000 levels, before using more stack). Every JSON file
    of a checkpoint is parsed here. Walking the result for :data:`MAX_NESTING` would cost more
    than the parse on a large manifest, and no reader of these files recurses into them."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointingException(
            f"{source}: {what} is nested too deeply to parse (damaged or hostile)"
        ) from None
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointingException(f"{source}: {what} is not valid JSON: {e}") from None


def check_nesting(obj: Any, source: PathLike, what: str, limit: int = MAX_NESTING) -> None:
    """Raise naming ``source`` if the containers of ``obj`` (dicts, lists, tuples, sets,
    namespaces) nest more than ``limit`` deep. Iterative, so any depth is measured safely; each
    container is visited once (shared ones too)."""
    stack = [(obj, 1)]
    seen = set()
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if depth > limit:
            raise CheckpointingException(
                f"{source}: {what} nests containers more than {limit} deep (damaged or hostile); refusing it"
            )
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = node
        elif isinstance(node, argparse.Namespace):
            children = vars(node).values()
        else:
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, _CONTAINERS))


_CONTAINERS = (dict, list, tuple, set, frozenset, argparse.Namespace)
