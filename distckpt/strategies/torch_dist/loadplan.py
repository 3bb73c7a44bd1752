"""Planning a ``torch_dist`` load: every requested piece cut into copies out of stored chunks.

Each requested piece (a box, or a flattened slice cut into boxes) is intersected with the stored
chunks of its key (regular, or N-D reformulated for flattened keys); every intersection becomes
a :class:`~distckpt.io.copies.CopyOp` into a view of the destination, grouped by
stored chunk in a :class:`LoadPlan`, so each chunk is read at most once. The chunks a piece meets
must cover it exactly once (:func:`check_covered`).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any, Callable, Dict, List, Tuple

import torch

from distckpt import storage
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.formats.zip_archive import contiguous_strides
from distckpt.io.copies import CopyOp
from distckpt.mapping import ShardedStateDict, ShardedTensor
from distckpt.strategies import tiling
from distckpt.strategies.resharding import Shape, flat_range_boxes, intersect, ravel, rel_slices
from distckpt.strategies.torch_dist.claims import extent_error, record_name
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, Resolved
from distckpt.strategies.torch_dist.stored import Stored, StoredKey, stored_file_size


class LoadPlan:
    """Copy operations grouped by stored chunk, plus finalizers that run once all are read, and
    each key read as the metadata describes it (its items' own headers must agree on the dtype)."""

    def __init__(self) -> None:
        self.ops: Dict[Stored, List[CopyOp]] = defaultdict(list)
        self.finalizers: List[Callable[[], None]] = []
        self.keys: Dict[str, StoredKey] = {}

    def add(self, stored: Stored, op: CopyOp) -> None:
        self.ops[stored].append(op)


def _plan_flat_slices(
    plan: LoadPlan,
    key: str,
    stored: StoredKey,
    idx: Shape,
    f_lo: int,
    f_hi: int,
    target: torch.Tensor,
    origin: int,
) -> None:
    """Copy elements ``[f_lo, f_hi)`` of flattened chunk ``idx`` from the stored slices that hold
    them into the 1-D ``target``, whose element 0 is flat element ``origin``. The slices (disjoint,
    :meth:`StoredKey.flat_cell`) must hold each of those elements: a gap would load as whatever
    the target held."""
    covered = 0
    for ch in stored.flat_cell(idx).meeting(f_lo, f_hi):
        s = ch.offset[-1]
        a, b = max(s, f_lo), min(s + ch.size[-1], f_hi)
        covered += b - a
        plan.add(ch, CopyOp(key, a - s, (b - a,), (1,), target[a - origin : b - origin]))
    if covered != f_hi - f_lo:
        raise CheckpointingException(
            f"{stored.source}: key {key!r}: stored flattened ranges of chunk {list(idx)} hold {covered} of "
            f"elements [{f_lo}, {f_hi}) needed for this load (the rest is missing: damaged metadata)"
        )


def check_covered(stored: StoredKey, off: Shape, size: Shape, met: List[Tuple[Shape, Shape]]) -> None:
    """The stored chunks a requested piece meets (their boxes clipped to it: ``met``) must hold
    every element of its part inside the stored tensor exactly once (outside it, a load with
    ``allow_shape_mismatch`` zero-fills). Else the chunk boxes the metadata claims are damaged:
    what no chunk holds would load as whatever the destination held (uninitialized memory for
    tensors the load allocates), so it is refused, naming the key, the file and the region."""
    region = intersect(off, size, (0,) * len(size), stored.size)
    if region is None:
        if not met:
            return
        region = (off, (0,) * len(size))
    problem = tiling.region_problem(region[0], region[1], met)
    if problem:
        raise CheckpointingException(
            f"{stored.source}: key {stored.fqn!r}: the stored chunks do not hold the requested region at "
            f"{list(region[0])} of size {list(region[1])} exactly once: {problem} (the metadata is damaged)"
        )


def plan_tensor(plan: LoadPlan, sh: ShardedTensor, stored: StoredKey, dest: torch.Tensor) -> None:
    """Plan the copies that fill ``dest`` (the memory of ``sh``'s data) from ``stored``."""
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    logical = stored.logical_shape
    if tuple(sh.global_shape) != logical:
        if not sh.allow_shape_mismatch:
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r}: global shape {list(sh.global_shape)} was requested but "
                f"the checkpoint stores {list(logical)} (in {stored.source}; set allow_shape_mismatch=True "
                f"to load the overlap and zero the rest)"
            )
        dest.zero_()
    if sh.flattened_range is None:
        pieces = [(tuple(sh.global_offset), full_local, dest.view(full_local))]
    else:
        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        if (
            stored.orig_shape is not None
            and stored.chunk_local_shape == full_local
            and tuple(sh.global_shape) == logical
        ):
            _plan_flat_to_flat(plan, sh, stored, dest, full_local, start, stop)
            return
        pieces = [
            (
                tuple(g + o for g, o in zip(sh.global_offset, off)),
                size,
                dest[p : p + math.prod(size)].view(size),
            )
            for off, size, p in flat_range_boxes(full_local, start, stop)
        ]
    for off, size, view in pieces:
        if stored.orig_shape is None:
            _plan_box_from_regular(plan, sh.key, stored, off, size, view)
        else:
            _plan_box_from_flat(plan, sh.key, stored, off, size, view)


# Keys of at most this many stored chunks (most keys of most models: one, or a TP split) are
# searched by testing each chunk: cheaper than building an index (~8 us a key) that would answer
# in one step what a few comparisons answer too.
_SCAN_CHUNKS = 8


def _plan_box_from_regular(plan, key, stored: StoredKey, off, size, view) -> None:
    """Copies filling the box ``(off, size)`` from the stored chunks it meets: by testing each
    chunk of a small key, else through the key's
    :class:`~distckpt.strategies.chunk_index.ChunkIndex` (never by scanning a large key)."""
    if len(stored.chunks) <= _SCAN_CHUNKS:
        stored.scanned += len(stored.chunks)
        hits = []
        for ch in stored.chunks:
            if ch.offset == off and ch.size == size:
                hits.append((ch, off, size))
                continue
            inter = intersect(off, size, ch.offset, ch.size)
            if inter is not None:
                hits.append((ch, *inter))
    else:
        index = stored.index
        exact = index.exact(off, size)
        if exact is not None:
            hits = [(stored.chunks[exact], off, size)]
        else:
            hits = [(stored.chunks[i], lo, shape) for i, lo, shape in index.overlapping(off, size)]
    if len(hits) == 1 and hits[0][0].offset == off and hits[0][0].size == size:
        # The request is this chunk (a load in the layout it was saved in): all of it.
        plan.add(hits[0][0], CopyOp(key, 0, size, contiguous_strides(size), view))
        return
    met = []
    for ch, lo, shape in hits:
        met.append((lo, shape))
        rel = tuple(a - b for a, b in zip(lo, ch.offset))
        plan.add(
            ch,
            CopyOp(
                key,
                ravel(rel, ch.size),
                shape,
                contiguous_strides(ch.size),
                view[rel_slices(lo, shape, off)],
            ),
        )
    if len(met) != 1 or met[0] != (off, size):
        check_covered(stored, off, size, met)


def _plan_flat_to_flat(plan, sh, stored: StoredKey, dest, full_local, start, stop) -> None:
    grid_index = tuple(o // s for o, s in zip(sh.global_offset, full_local))
    _plan_flat_slices(plan, sh.key, stored, grid_index, start, stop, dest, start)


def _plan_box_from_flat(plan, key, stored: StoredKey, off, size, view) -> None:
    chunk = stored.chunk_local_shape
    grid = stored.size[:-1]
    strides = contiguous_strides(chunk)
    ranges = [range(o // c, min(g, -(-(o + s) // c))) for o, s, c, g in zip(off, size, chunk, grid)]
    for idx in itertools.product(*ranges):
        chunk_off = tuple(i * c for i, c in zip(idx, chunk))
        inter = intersect(off, size, chunk_off, chunk)
        if inter is None:
            continue
        lo = tuple(a - b for a, b in zip(inter[0], chunk_off))
        f_lo = ravel(lo, chunk)
        f_hi = ravel([a + b - 1 for a, b in zip(lo, inter[1])], chunk) + 1
        dst = view[rel_slices(*inter, off)]
        if f_hi - f_lo == math.prod(inter[1]) and dst.is_contiguous():
            # The box is one flat range of the stored chunk: read straight into place.
            _plan_flat_slices(plan, key, stored, idx, f_lo, f_hi, dst.reshape(-1), f_lo)
            continue
        holders = stored.flat_cell(idx).meeting(f_lo, f_hi)
        holder = holders[0] if len(holders) == 1 else None
        if holder is not None and holder.offset[-1] <= f_lo and f_hi <= holder.offset[-1] + holder.size[-1]:
            # One stored slice holds the whole box: copy it out strided, no staging.
            plan.add(holder, CopyOp(key, f_lo - holder.offset[-1], inter[1], strides, dst))
            continue
        # The box spans several stored slices: gather its flat span, then copy the box out.
        buf = torch.empty(f_hi - f_lo, dtype=stored.dtype)
        _plan_flat_slices(plan, key, stored, idx, f_lo, f_hi, buf, f_lo)

        def fin(dst=dst, buf=buf, box=inter[1]):
            dst.copy_(buf.as_strided(box, strides))

        plan.finalizers.append(fin)


def check_allocations(
    sharded_state_dict: ShardedStateDict, index: Dict[str, Any], checkpoint_dir: Resolved
) -> None:
    """Tensors this load allocates (requests without data, e.g. ``load_plain_tensors``, whose
    shape may come from the checkpoint's own claims) must be backed by stored bytes that
    exist: every record of the key inside its file, and together at least the request's
    bytes. So a claimed shape of 2^40 elements is refused before anything is allocated."""
    wanted = [
        sh
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedTensor) and sh.data is None and isinstance(index.get(sh.key), StoredKey)
    ]
    if not wanted:
        return
    source = storage.join(checkpoint_dir, METADATA_FNAME)
    sizes: Dict[str, int] = {}
    stored_bytes: Dict[str, int] = {}  # per key: every record checked once, whatever the requests
    for sh in wanted:
        have = stored_bytes.get(sh.key)
        if have is None:
            have = stored_bytes[sh.key] = _checked_stored_bytes(index[sh.key], checkpoint_dir, source, sizes)
        need = math.prod(sh.local_shape) * sh.dtype.itemsize
        if need > have:
            raise CheckpointingException(
                f"{source}: key {sh.key!r}: loading {list(sh.local_shape)} needs {need} bytes, the "
                f"checkpoint stores {have} for this key; refusing to allocate it"
            )


def _checked_stored_bytes(
    stored: StoredKey, checkpoint_dir: Resolved, source: str, sizes: Dict[str, int]
) -> int:
    """The bytes ``stored``'s records hold, each record checked to lie inside its file
    (``sizes``: the file sizes found so far)."""
    have = 0
    for c in stored.chunks:
        if c.relative_path not in sizes:
            try:
                sizes[c.relative_path] = stored_file_size(checkpoint_dir, c.relative_path, source)
            except FileNotFoundError:
                sizes[c.relative_path] = 0
        if c.file_offset + c.length > sizes[c.relative_path]:
            raise extent_error(
                checkpoint_dir,
                stored.source or source,
                record_name(stored.fqn, c.offset),
                c.relative_path,
                c.file_offset,
                c.length,
                sizes[c.relative_path],
            )
        have += c.length
    return have
