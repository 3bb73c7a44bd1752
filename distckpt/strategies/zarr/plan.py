"""Chunk geometry: the chunk grid of a save, which rank writes which chunk, and what a load reads.

The grid of an array is the gcd, per axis, of every cut point of every main replica's piece, so
each chunk lies inside one piece and has one writer (see the package docstring for the
coarsening of flattened ranges). A save cuts this rank's pieces into whole-chunk writes and
fragments of chunks shared with other ranks; a load cuts each requested box into the regions of
the chunks it overlaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from distckpt import dist
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from distckpt.strategies.resharding import flat_range_boxes
from distckpt.strategies.zarr.jobs import ChunkRead, ChunkWrite
from distckpt.strategies.zarr.meta import ArrayMeta, Shape

# The smallest chunk worth having where flattened ranges cut the grid finer (a save's default).
DEFAULT_MIN_FLAT_CHUNK_BYTES = 1 << 20

# --------------------------------------------------------------------------- chunk grid


def _gcd_of_cuts(cuts: Iterable[int], size: int) -> int:
    """The gcd of the cut points that lie strictly inside ``(0, size)``; 0 if there are none."""
    g = 0
    for c in cuts:
        if 0 < c < size:
            g = math.gcd(g, c)
    return g


def _smallest_multiple_dividing(base: int, limit: int, need: int) -> int:
    """The smallest ``d`` that is a multiple of ``base``, divides ``limit`` and is at least
    ``need``; ``limit`` when there is none."""
    if limit % base:
        return base
    q = limit // base
    small, large = [], []
    i = 1
    while i * i <= q:
        if q % i == 0:
            small.append(i)
            large.append(q // i)
        i += 1
    for m in small + large[::-1]:
        if base * m >= need:
            return base * m
    return limit


def choose_chunk_shape(
    shape: Shape, piece_gcd: Sequence[int], shard_gcd: Sequence[int], itemsize: int, min_flat_chunk_bytes: int
) -> Shape:
    """The chunk shape of one array.

    ``piece_gcd[a]`` is the gcd of all interior cut points, along axis ``a``, of all main-replica
    pieces (0 when there are none); ``shard_gcd[a]`` the same for whole shards (a flattened
    shard counts as the chunk of the regular grid it belongs to). The chunks are ``piece_gcd``,
    which keeps each inside one piece; where flattened pieces make them smaller than
    ``min_flat_chunk_bytes`` they grow, innermost axis first, to divisors of ``shard_gcd``, which
    keeps each inside one shard.
    """
    chunks = [g if g else max(s, 1) for g, s in zip(piece_gcd, shape)]
    if list(piece_gcd) == list(shard_gcd):
        return tuple(chunks)
    for a in reversed(range(len(shape))):
        nbytes = math.prod(chunks) * itemsize
        if nbytes >= min_flat_chunk_bytes:
            break
        limit = shard_gcd[a] or max(shape[a], 1)
        need = -(-min_flat_chunk_bytes // (nbytes // chunks[a]))
        chunks[a] = _smallest_multiple_dividing(chunks[a], limit, need)
    return tuple(chunks)


# --------------------------------------------------------------------------- save planning


@dataclass
class Piece:
    """A box of a global tensor that this rank holds, with its data (a tensor of that shape)."""

    key: str
    offset: Shape
    size: Shape
    data: torch.Tensor


@dataclass
class KeyDecl:
    """What one rank says about a key: everything the choice of its chunk grid needs."""

    shape: Shape
    dtype: torch.dtype
    piece_gcd: List[int]
    shard_gcd: List[int]

    def merge(self, other: KeyDecl, key: str) -> None:
        if other.shape != self.shape or other.dtype != self.dtype:
            raise CheckpointingException(
                f"key {key!r}: ranks disagree on the global shape or dtype "
                f"({list(self.shape)} {self.dtype} vs {list(other.shape)} {other.dtype})"
            )
        self.piece_gcd = [math.gcd(a, b) for a, b in zip(self.piece_gcd, other.piece_gcd)]
        self.shard_gcd = [math.gcd(a, b) for a, b in zip(self.shard_gcd, other.shard_gcd)]


DEFER = object()  # as ``staging``: keep the caller's tensors (views), copy them later


def shard_pieces(sh: ShardedTensor, staging: Optional[Any] = None) -> Tuple[List[Piece], Shape, Shape]:
    """The boxes of ``sh`` with their data, and the box of the whole shard (its grid chunk).

    Given ``staging`` (a StagingBuffers pool), the data is copied into a pooled host buffer
    first, so that the caller may change its tensors while a background write runs.
    """
    if sh.data is None:
        raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save (rank {dist.get_rank()})")
    data = sh.data.detach()
    if staging is DEFER:
        pass  # views of the caller's tensors, staged chunk by chunk later (async save waves)
    elif staging is not None:
        data = staging.acquire(data)
    elif data.device.type != "cpu":
        data = data.to("cpu")
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    origin = tuple(sh.global_offset)
    if sh.flattened_range is None:
        pieces = [Piece(sh.key, origin, full_local, data.reshape(full_local))] if data.numel() else []
        return pieces, origin, full_local
    start = sh.flattened_range.start
    flat = data.reshape(-1)
    pieces = [
        Piece(
            sh.key,
            tuple(o + b for o, b in zip(origin, off)),
            size,
            flat[pos - start : pos - start + math.prod(size)].reshape(size),
        )
        for off, size, pos in flat_range_boxes(full_local, start, sh.flattened_range.stop, start)
    ]
    return pieces, origin, full_local


def local_plan(
    sharded_state_dict: ShardedStateDict, staging: Optional[Any] = None
) -> Tuple[List[Piece], Dict[str, KeyDecl]]:
    """This rank's pieces of main replicas and its declaration of each key they belong to."""
    pieces: List[Piece] = []
    decls: Dict[str, KeyDecl] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            raise CheckpointingException(
                f"ShardedObject {sh.unique_key!r} reached the zarr strategy; objects are stored by "
                f"the common strategy"
            )
        if not isinstance(sh, ShardedTensor) or not is_main_replica(sh.replica_id):
            continue
        shape = tuple(sh.global_shape)
        held, origin, full_local = shard_pieces(sh, staging)
        shard_cuts: List[List[int]] = [[] for _ in shape]
        piece_cuts: List[List[int]] = [[] for _ in shape]
        if math.prod(full_local):
            for a, (o, n) in enumerate(zip(origin, full_local)):
                shard_cuts[a] += [o, o + n]
        for p in held:
            for a, (o, n) in enumerate(zip(p.offset, p.size)):
                piece_cuts[a] += [o, o + n]
        shard_gcd = [_gcd_of_cuts(c, s) for c, s in zip(shard_cuts, shape)]
        piece_gcd = [math.gcd(_gcd_of_cuts(c, s), h) for c, s, h in zip(piece_cuts, shape, shard_gcd)]
        decl = KeyDecl(shape, sh.dtype, piece_gcd, shard_gcd)
        if sh.key in decls:
            decls[sh.key].merge(decl, sh.key)
        else:
            decls[sh.key] = decl
        pieces += held
    return pieces, decls


def merge_decls(gathered: Sequence[Dict[str, KeyDecl]]) -> Dict[str, KeyDecl]:
    """Every rank's declarations merged into one per key, in key order."""
    merged: Dict[str, KeyDecl] = {}
    for rank_decls in gathered:
        for key, decl in rank_decls.items():
            if key in merged:
                merged[key].merge(decl, key)
            else:
                merged[key] = KeyDecl(decl.shape, decl.dtype, list(decl.piece_gcd), list(decl.shard_gcd))
    return dict(sorted(merged.items()))


@dataclass
class Fragment:
    """A part of a chunk that this rank cannot write by itself: its box (array coordinates) and data."""

    key: str
    index: Shape
    offset: Shape
    data: torch.Tensor


def split_into_chunks(
    pieces: Sequence[Piece], metas: Dict[str, ArrayMeta]
) -> Tuple[List[ChunkWrite], List[Fragment]]:
    """The whole chunks this rank writes, and the fragments of chunks it shares with other pieces."""
    writes: List[ChunkWrite] = []
    partial: Dict[Tuple[str, Shape], List[Fragment]] = {}
    for p in pieces:
        meta = metas[p.key]
        for index in meta.chunks_overlapping(p.offset, p.size):
            c_off, c_size = meta.chunk_box(index)
            lo = tuple(max(a, b) for a, b in zip(p.offset, c_off))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.offset, p.size, c_off, c_size))
            view = p.data[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offset))]
            if lo == c_off and hi == tuple(o + n for o, n in zip(c_off, c_size)):
                writes.append(ChunkWrite(meta, tuple(index), view))
            else:
                partial.setdefault((p.key, tuple(index)), []).append(Fragment(p.key, tuple(index), lo, view))
    shared: List[Fragment] = []
    for (key, index), frags in partial.items():
        meta = metas[key]
        if sum(f.data.numel() for f in frags) == math.prod(meta.chunk_box(index)[1]):
            writes.append(ChunkWrite(meta, index, assemble(meta, index, frags), owned=True))
        else:
            # Copied: pickling a view would send its whole storage (and it may be on a device).
            shared += [
                Fragment(
                    f.key, f.index, f.offset, torch.empty(f.data.shape, dtype=f.data.dtype).copy_(f.data)
                )
                for f in frags
            ]
    return writes, shared


def assemble(meta: ArrayMeta, index: Shape, frags: Sequence[Fragment]) -> torch.Tensor:
    """Chunk ``index`` put together from ``frags``, which must cover all of it."""
    c_off, c_size = meta.chunk_box(index)
    buf = torch.zeros(c_size, dtype=meta.dtype)
    covered = 0
    for f in frags:
        buf[tuple(slice(o - c, o - c + n) for o, c, n in zip(f.offset, c_off, f.data.shape))] = f.data
        covered += f.data.numel()
    if covered != buf.numel():
        raise CheckpointingException(
            f"key {meta.key!r}: the main replicas cover {covered} of the {buf.numel()} elements of "
            f"chunk {list(index)}; the sharding does not tile the tensor"
        )
    return buf


# --------------------------------------------------------------------------- load planning


def request_boxes(sh: ShardedTensor, dest: torch.Tensor) -> List[Tuple[Shape, Shape, torch.Tensor]]:
    """For each box that ``sh`` requests: its global offset, its size and the view of ``dest`` it
    fills."""
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    if sh.flattened_range is None:
        return [(tuple(sh.global_offset), full_local, dest.view(full_local))]
    start, stop = sh.flattened_range.start, sh.flattened_range.stop
    return [
        (
            tuple(g + o for g, o in zip(sh.global_offset, off)),
            size,
            dest[p - start : p - start + math.prod(size)].view(size),
        )
        for off, size, p in flat_range_boxes(full_local, start, stop, start)
    ]


def plan_reads(meta: ArrayMeta, offset: Shape, size: Shape, view: torch.Tensor) -> List[ChunkRead]:
    """The reads that fill ``view`` with box ``(offset, size)`` (cut at the array's edge), one per
    chunk it overlaps."""
    hi = tuple(min(o + n, s) for o, n, s in zip(offset, size, meta.shape))
    if any(h <= o for h, o in zip(hi, offset)):
        return []
    clipped = tuple(h - o for h, o in zip(hi, offset))
    ops = []
    for index in meta.chunks_overlapping(offset, clipped):
        c_off, c_size = meta.chunk_box(index)
        lo = tuple(max(a, b) for a, b in zip(offset, c_off))
        top = tuple(min(a, b + n) for a, b, n in zip(hi, c_off, c_size))
        dest = view[tuple(slice(a - o, b - o) for a, b, o in zip(lo, top, offset))]
        ops.append(
            ChunkRead(
                meta,
                tuple(index),
                tuple(a - c for a, c in zip(lo, c_off)),
                tuple(h - c for h, c in zip(top, c_off)),
                dest,
            )
        )
    return ops
