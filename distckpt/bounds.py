"""Checks on what a checkpoint's metadata claims: file names, offsets, lengths, shapes, counts.

A checkpoint is data from elsewhere. Before distckpt opens a file its metadata names, allocates a
buffer its metadata sizes, or loops over a count its metadata gives, the claim goes through one
of these checks, so a hostile or corrupted checkpoint can make distckpt neither read or write
outside the checkpoint (``..``, absolute paths, symlinks that lead out) nor allocate more than
the request needs (a claimed shape of 2^40 elements, a record of 2^50 bytes) nor loop for long.
Each failure is a CheckpointingException naming the file that made the claim.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence, Tuple

from distckpt.core import CheckpointingException, PathLike

# No real tensor has more elements or bytes than this; anything larger is a hostile claim.
MAX_NUMEL = 1 << 48
MAX_BYTES = 1 << 56


def relative_name(name: Any, source: PathLike, what: str = "file name") -> str:
    """``name`` if it is a plain relative path inside the checkpoint (no ``..``, not absolute,
    no empty or ``.`` segments, no NUL or backslash); else raise naming ``source``."""
    if not isinstance(name, str) or not name:
        raise CheckpointingException(f"{source}: {what} {name!r} is not a non-empty string")
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or "\x00" in name or os.path.isabs(name)
            or any(p in ("", ".", "..") for p in parts)):
        raise CheckpointingException(
            f"{source}: {what} {name!r} points outside the checkpoint (absolute, '..' or empty "
            f"segments); refusing to use it")
    return name


def inside(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> Path:
    """The path of ``name`` under ``root`` after :func:`relative_name`, refusing one that a
    symlink leads out of the checkpoint."""
    path = Path(root) / relative_name(name, source, what)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointingException(
            f"{path}: named by {source}, resolves to {real}, outside the checkpoint {root} (a symlink?); "
            f"refusing to read it")
    return path


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
        raise CheckpointingException(f"{source}: {what} {list(dims)} claims {numel} elements (more than 2^48)")
    return dims


def box_inside(offsets: Sequence[int], sizes: Sequence[int], whole: Sequence[int], source: PathLike,
               what: str) -> None:
    """Raise unless the box ``offsets`` / ``sizes`` lies inside the shape ``whole``."""
    if len(offsets) != len(whole) or len(sizes) != len(whole) or any(
            o + s > w for o, s, w in zip(offsets, sizes, whole)):
        raise CheckpointingException(
            f"{source}: {what} at {list(offsets)} of size {list(sizes)} lies outside the shape {list(whole)}")
