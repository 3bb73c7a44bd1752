"""Sharding integrity checks (local and global) and the strict-mode handling of key mismatches.

Global integrity means: for every key, all ranks agree on global shape and dtype, and the main
replicas (replica_id == 0) cover every element of the global tensor exactly once. Flattened
ranges must tile each chunk of the regular grid exactly once. ShardedObjects must fill their
grid exactly once. The check runs on one rank over gathered, data-free shard descriptions
(:class:`ShardMeta`) and its verdict is broadcast, so every rank raises the same error.
"""

from __future__ import annotations

import logging
import math
import os
import types
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from distckpt.core import CheckpointingException
from distckpt.foreign import sharded_lookalike
from distckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What to do when the requested keys and the checkpoint's keys differ.

    *Unexpected* keys are requested by the caller but absent from the checkpoint. *Missing* keys
    are in the checkpoint but requested by no rank (finding them needs a gather of every rank's
    requests, so only the ``*_ALL`` modes pay for it).

    - ASSUME_OK_UNEXPECTED: no check; an absent key fails later, inside the strategy.
    - LOG_UNEXPECTED / LOG_ALL: log, skip the unexpected keys, load the rest.
    - RAISE_UNEXPECTED / RAISE_ALL: raise CheckpointingException on every rank.
    - RETURN_UNEXPECTED / RETURN_ALL: skip them and return them from ``load``.
    - IGNORE_ALL: skip unexpected keys silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        allowed = ", ".join(s.value for s in StrictHandling)
        raise CheckpointingException(f"unknown strict mode {strict!r}; expected one of: {allowed}") from None


# --------------------------------------------------------------------------- shard descriptions


@dataclass(frozen=True)
class ShardMeta:
    """Data-free description of one rank's shard, cheap to gather.

    ``local_shape`` has the full rank of the global tensor (prepended axes have size 1), so the
    shard is the box ``[global_offset, global_offset + local_shape)``. For flattened ranges the
    box is the whole (un-flattened) chunk and ``flat`` is the ``(start, stop)`` slice of it.
    """

    key: str
    is_object: bool
    dtype: Optional[str]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]
    main: bool
    rank: int


def shard_meta(sh: ShardedBase, rank: int) -> ShardMeta:
    if isinstance(sh, ShardedObject):
        ones = (1,) * len(sh.global_shape)
        return ShardMeta(sh.key, True, None, tuple(sh.global_shape), tuple(sh.global_offset), ones,
                         None, is_main_replica(sh.replica_id), rank)
    assert isinstance(sh, ShardedTensor)
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    flat = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
    return ShardMeta(sh.key, False, str(sh.dtype), tuple(sh.global_shape), tuple(sh.global_offset),
                     full_local, flat, is_main_replica(sh.replica_id), rank)


def validate_local_integrity(shards: Iterable[ShardedBase]) -> None:
    """Re-check each shard's own metadata (it may have been mutated since construction)."""
    for sh in shards:
        sh.validate_metadata_integrity()


# --------------------------------------------------------------------------- global integrity


def validate_global_integrity(all_ranks: Sequence[Sequence[ShardMeta]]) -> None:
    """Check that the gathered shards of all ranks describe a consistent, complete checkpoint.

    Raises:
        CheckpointingException: naming the key, the ranks involved and the problem.
    """
    by_key: Dict[str, List[ShardMeta]] = defaultdict(list)
    for rank_shards in all_ranks:
        for m in rank_shards:
            by_key[m.key].append(m)
    for key, shards in by_key.items():
        _check_key(key, shards)


def _ranks(shards: Iterable[ShardMeta]) -> str:
    return ",".join(str(r) for r in sorted({s.rank for s in shards}))


_is_object = attrgetter("is_object")
_global_shape = attrgetter("global_shape")
_dtype = attrgetter("dtype")
_is_main = attrgetter("main")
_flat = attrgetter("flat")


_kind = attrgetter("is_object", "global_shape", "dtype")


def _check_key(key: str, shards: List[ShardMeta]) -> None:
    # Fast path: one C-level pass over the three properties that must agree; the detailed
    # diagnosis (one pass per property) runs only on a mismatch.
    if len(set(map(_kind, shards))) > 1:
        _diagnose_disagreement(key, shards)
    global_shape = shards[0].global_shape
    main = list(filter(_is_main, shards))
    if shards[0].is_object:
        _check_object_grid(key, global_shape, main)
        return
    flat_count = len(shards) - list(map(_flat, shards)).count(None)
    if 0 < flat_count < len(shards):
        flat = [s for s in shards if s.flat is not None]
        raise CheckpointingException(
            f"key {key!r}: flattened on rank(s) {_ranks(flat)} but not on the others")
    if flat_count:
        _check_flat_tiling(key, global_shape, main)
    else:
        check_exact_cover(key, global_shape, [(s.global_offset, s.local_shape, s.rank) for s in main])


def _diagnose_disagreement(key: str, shards: List[ShardMeta]) -> None:
    if len(set(map(_is_object, shards))) > 1:
        tensors = [s for s in shards if not s.is_object]
        objects = [s for s in shards if s.is_object]
        raise CheckpointingException(
            f"key {key!r} is a ShardedTensor on rank(s) {_ranks(tensors)} and a ShardedObject "
            f"on rank(s) {_ranks(objects)}")
    if len(set(map(_global_shape, shards))) > 1:
        shapes = defaultdict(list)
        for s in shards:
            shapes[s.global_shape].append(s)
        desc = "; ".join(f"{list(shape)} on rank(s) {_ranks(v)}" for shape, v in shapes.items())
        raise CheckpointingException(f"key {key!r}: ranks disagree on the global shape: {desc}")
    if len(set(map(_dtype, shards))) > 1:
        dtypes = defaultdict(list)
        for s in shards:
            dtypes[s.dtype].append(s)
        desc = "; ".join(f"{d} on rank(s) {_ranks(v)}" for d, v in dtypes.items())
        raise CheckpointingException(f"key {key!r}: ranks disagree on the dtype: {desc}")


def _check_object_grid(key: str, global_shape: Tuple[int, ...], main: List[ShardMeta]) -> None:
    seen: Dict[Tuple[int, ...], int] = {}
    for s in main:
        if s.global_offset in seen:
            raise CheckpointingException(
                f"ShardedObject {key!r}: offset {list(s.global_offset)} is written by more than one "
                f"main replica (ranks {seen[s.global_offset]} and {s.rank})")
        seen[s.global_offset] = s.rank
    expected = math.prod(global_shape)
    if len(seen) != expected:
        missing = next(o for o in np.ndindex(*global_shape) if tuple(o) not in seen)
        raise CheckpointingException(
            f"ShardedObject {key!r}: {expected - len(seen)} of {expected} shards have no main "
            f"replica (e.g. offset {list(missing)}); set replica_id=0 on exactly one rank per shard")


def _check_flat_tiling(key: str, global_shape: Tuple[int, ...], main: List[ShardMeta]) -> None:
    """Flattened slices of each chunk must tile ``[0, numel)`` exactly once; the chunks (boxes
    of a regular grid) must then cover the tensor exactly once. Vectorized over all slices."""
    if not main:
        check_exact_cover(key, global_shape, [])
        return
    offsets = np.array([s.global_offset for s in main], dtype=np.int64).reshape(len(main), -1)
    locals_ = np.array([s.local_shape for s in main], dtype=np.int64).reshape(len(main), -1)
    bounds = np.array([s.flat for s in main], dtype=np.int64)
    boxes = np.concatenate([offsets, locals_], axis=1)
    uniq, chunk_id = np.unique(boxes, axis=0, return_inverse=True)
    chunk_id = chunk_id.reshape(-1)
    numel = np.prod(uniq[:, offsets.shape[1]:], axis=1) if offsets.shape[1] else np.ones(len(uniq), np.int64)
    keep = bounds[:, 1] > bounds[:, 0]
    order = np.lexsort((bounds[keep, 0], chunk_id[keep]))
    cid, start, stop = chunk_id[keep][order], bounds[keep, 0][order], bounds[keep, 1][order]
    idx = np.flatnonzero(keep)[order]
    first = np.ones(len(cid), dtype=bool)
    first[1:] = cid[1:] != cid[:-1]
    last = np.ones(len(cid), dtype=bool)
    last[:-1] = cid[1:] != cid[:-1]
    expected_start = np.where(first, 0, np.concatenate([[0], stop[:-1]]))
    bad = np.flatnonzero(start != expected_start)
    if len(bad):
        i = bad[0]
        m = main[idx[i]]
        if start[i] < expected_start[i]:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flattened ranges overlap in the chunk at offset "
                f"{list(m.global_offset)}: [{start[i]}, {stop[i]}) on rank {m.rank} starts before {expected_start[i]}")
        raise CheckpointingException(
            f"ShardedTensor {key!r}: flattened range [{expected_start[i]}, {start[i]}) of the chunk at offset "
            f"{list(m.global_offset)} is not written by any main replica")
    ends = np.zeros(len(uniq), dtype=np.int64)
    ends[cid[last]] = stop[last]
    short = np.flatnonzero(ends != numel)
    if len(short):
        c = short[0]
        raise CheckpointingException(
            f"ShardedTensor {key!r}: flattened range [{ends[c]}, {numel[c]}) of the chunk at offset "
            f"{list(uniq[c, :offsets.shape[1]])} is not written by any main replica")
    n = offsets.shape[1]
    _, first_of = np.unique(chunk_id, return_index=True)   # the first shard of each chunk
    check_exact_cover(key, global_shape, [(tuple(u[:n]), tuple(u[n:]), main[i].rank)
                                          for u, i in zip(uniq.tolist(), first_of.tolist())])


def _small_exact_cover(global_shape: Sequence[int], boxes) -> bool:
    """True if a handful of boxes certainly cover ``global_shape`` exactly once: each inside
    the tensor, pairwise disjoint, volumes adding up. False means "check the long way" (which
    also describes the problem)."""
    total = 0
    for off, size, _ in boxes:
        if any(o < 0 or o + s > g for o, s, g in zip(off, size, global_shape)):
            return False
        total += math.prod(size)
    for i, (a_off, a_size, _) in enumerate(boxes):
        for b_off, b_size, _ in boxes[i + 1:]:
            if all(ao < bo + bs and bo < ao + az for ao, az, bo, bs in zip(a_off, a_size, b_off, b_size)):
                return False
    return total == math.prod(global_shape)


# Above this many cells of the compressed grid the cover check falls back to volume + sweep.
_MAX_GRID_CELLS = 50_000_000


def check_exact_cover(key: str, global_shape: Sequence[int],
                      boxes: Sequence[Tuple[Sequence[int], Sequence[int], int]]) -> None:
    """Check that boxes ``(offset, size, rank)`` cover ``global_shape`` exactly once.

    Uses coordinate compression: the cut points of all boxes along each axis split the tensor
    into a grid of cells, each of which is either fully inside or fully outside any box.
    """
    ndim = len(global_shape)
    boxes = [b for b in boxes if all(s > 0 for s in b[1])]
    if math.prod(global_shape) == 0:
        return
    if ndim == 0:
        if len(boxes) != 1:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: a scalar needs exactly one main replica, got {len(boxes)} "
                f"(ranks {sorted(b[2] for b in boxes)})")
        return
    if len(boxes) <= 4 and _small_exact_cover(global_shape, boxes):
        return  # a few boxes (most keys of most models): plain Python, no numpy overhead
    offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    gshape = np.array(global_shape, dtype=np.int64)
    if len(boxes) and (sizes == sizes[0]).all() and not (offs % sizes[0]).any() and not (gshape % sizes[0]).any():
        # Regular grid (the common case): exact cover <=> every grid cell held exactly once.
        cells = offs // sizes[0]
        grid_shape = gshape // sizes[0]
        flat = np.ravel_multi_index(cells.T, grid_shape) if ndim else np.zeros(len(boxes), np.int64)
        counts = np.bincount(flat, minlength=int(np.prod(grid_shape)))
        if counts.max() <= 1 and counts.min() == 1:
            return
    cuts = [np.unique(np.concatenate([[0, global_shape[a]], offs[:, a], offs[:, a] + sizes[:, a]]))
            for a in range(ndim)]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > _MAX_GRID_CELLS:
        _check_cover_by_volume(key, global_shape, boxes)
        return
    lo = np.stack([np.searchsorted(cuts[a], offs[:, a]) for a in range(ndim)], axis=1)
    hi = np.stack([np.searchsorted(cuts[a], offs[:, a] + sizes[:, a]) for a in range(ndim)], axis=1)
    counts = np.zeros(grid, dtype=np.int32)
    cell_slices = []
    for b in range(len(boxes)):
        sl = tuple(slice(int(lo[b, a]), int(hi[b, a])) for a in range(ndim))
        cell_slices.append(sl)
        counts[sl] += 1
    if (counts > 1).any():
        cell = tuple(int(i) for i in np.argwhere(counts > 1)[0])
        owners = [b[2] for b, sl in zip(boxes, cell_slices)
                  if all(s.start <= c < s.stop for s, c in zip(sl, cell))]
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main replicas overlap at global region {_region(cuts, cell)} "
            f"(written by ranks {owners}); give all but one of them replica_id != 0")
    if (counts == 0).any():
        cell = tuple(int(i) for i in np.argwhere(counts == 0)[0])
        raise CheckpointingException(
            f"ShardedTensor {key!r}: global region {_region(cuts, cell)} of shape "
            f"{list(global_shape)} is not covered by any main replica")


def _region(cuts: List[np.ndarray], cell: Tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{int(c[i])}:{int(c[i + 1])}" for c, i in zip(cuts, cell)) + "]"


def _check_cover_by_volume(key, global_shape, boxes) -> None:
    total = sum(math.prod(size) for _, size, _ in boxes)
    expected = math.prod(global_shape)
    order = sorted(boxes, key=lambda b: b[0][0])
    active: List[Tuple] = []
    for b in order:
        active = [a for a in active if a[0][0] + a[1][0] > b[0][0]]
        for a in active:
            if all(a[0][i] < b[0][i] + b[1][i] and b[0][i] < a[0][i] + a[1][i] for i in range(len(global_shape))):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: main replicas of ranks {a[2]} and {b[2]} overlap "
                    f"(offsets {list(a[0])} and {list(b[0])})")
        active.append(b)
    if total != expected:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main replicas cover {total} of {expected} elements")


# --------------------------------------------------------------------------- strict load checks


def determine_missing_and_unexpected_keys(
    ckpt_keys: Set[str],
    local_keys: Set[str],
    global_keys: Optional[Set[str]] = None,
) -> Tuple[Set[str], Set[str]]:
    """Unexpected: requested here, absent from the checkpoint. Missing: in the checkpoint,
    requested by no rank (only known when ``global_keys`` is given)."""
    unexpected = local_keys - ckpt_keys
    missing = ckpt_keys - global_keys if global_keys is not None else set()
    return missing, unexpected


def handle_mismatched_keys(strict: StrictHandling, missing: Set[str], unexpected: Set[str],
                           checkpoint_dir: str) -> None:
    """Log or raise according to ``strict``; returning and skipping is the caller's job."""
    if not missing and not unexpected:
        return
    msg = []
    if unexpected:
        msg.append(f"keys requested but not in the checkpoint: {sorted(unexpected)}")
    if missing:
        msg.append(f"keys in the checkpoint but not requested by any rank: {sorted(missing)}")
    text = f"{checkpoint_dir}: " + "; ".join(msg)
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        raise CheckpointingException(text)
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        logger.warning(text)


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
            f"{source}={value!r}: expected a number of bytes >= 0, or None (no limit)")
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
                f"Megatron-Core sharded objects directly in dicts or lists of the sharded state dict")
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            if max_tensor_bytes is not None and nbytes > max_tensor_bytes and value.device.type != "meta":
                raise CheckpointingException(
                    f"common state {where} is a torch tensor of {nbytes} bytes (shape "
                    f"{list(value.shape)}), above the {max_tensor_bytes}-byte limit for "
                    f"common tensors: common state is saved by rank 0 alone. Wrap it in a ShardedTensor, "
                    f"or allow it with save(..., max_common_tensor_bytes=None)")
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
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType, str, bytes, int, float, complex, bool)):
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
