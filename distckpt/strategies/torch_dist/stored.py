"""A load's view of what is stored where: the index of stored chunks, and their checksums.

:func:`index_metadata` turns a checked ``.metadata`` into, per key, its stored chunks
(:class:`Stored`: a box and where its bytes lie) as a :class:`StoredKey`;
:func:`index_from_sidecar` reads the same for only the requested keys and boxes from the sidecar
index. :func:`expected_checksum` and :func:`check_item` hold each item read to the integrity
manifest's CRC32C of its range (:class:`DefaultChecks`: what a default load checks).
"""

from __future__ import annotations

import bisect
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from distckpt import bounds, containment, storage
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.formats.index_format import INDEX_FNAME, dtype_of
from distckpt.formats.index_read import IndexReader
from distckpt.formats.manifest import MANIFEST_FNAME, RangeChecksum, read_manifest
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from distckpt.strategies.chunk_index import ChunkIndex
from distckpt.strategies.resharding import Shape
from distckpt.strategies.torch_dist.claims import (
    check_claims,
    check_declared,
    check_key_name,
    check_reformulated,
    cross_check,
    orig_shapes,
    undeclared_error,
)
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, Resolved, is_object_key, read_metadata


@dataclass(frozen=True)
class Stored:
    """One stored chunk: its box in stored coordinates and where its bytes are."""

    offset: Shape
    size: Shape
    relative_path: str
    file_offset: int
    length: int


@dataclass
class StoredKey:
    """A tensor key as the metadata describes it: dtype, stored shape and stored chunks."""

    fqn: str
    dtype: torch.dtype
    size: Shape  # stored (possibly N-D reformulated) shape
    chunks: List[Stored]
    orig_shape: Optional[Shape] = None  # set for flattened (N-D reformulated) keys
    flat_index: Dict[Shape, List[Stored]] = field(default_factory=dict)
    source: str = ""  # the file that describes it (.metadata or the sidecar)
    _index: Optional[ChunkIndex] = field(default=None, repr=False, compare=False)
    _flat_cells: Dict[Shape, FlatCell] = field(default_factory=dict, repr=False, compare=False)
    scanned: int = field(default=0, repr=False, compare=False)  # chunks tested without the index

    @property
    def examined(self) -> int:
        """Chunks a load's planning has tested so far (through :attr:`index` or by scanning a
        small key)."""
        return self.scanned + (0 if self._index is None else self._index.examined)

    @property
    def index(self) -> ChunkIndex:
        """The chunks indexed for box queries (built on first use: a load may never ask)."""
        if self._index is None:
            self._index = ChunkIndex([c.offset for c in self.chunks], [c.size for c in self.chunks])
        return self._index

    def flat_cell(self, idx: Shape) -> FlatCell:
        """The stored slices of chunk ``idx`` of a flattened key's grid, checked disjoint on
        first use (overlapping slices would claim the same elements twice: damaged metadata)."""
        cell = self._flat_cells.get(idx)
        if cell is None:
            cell = self._flat_cells[idx] = FlatCell(self.flat_index.get(idx, []))
            overlap = cell.overlap()
            if overlap is not None:
                raise CheckpointingException(
                    f"{self.source}: key {self.fqn!r}: stored flattened ranges of chunk {list(idx)} "
                    f"overlap at elements [{overlap[0]}, {overlap[1]}) (the metadata is damaged)"
                )
        return cell

    @property
    def logical_shape(self) -> Shape:
        return self.orig_shape if self.orig_shape is not None else self.size

    @property
    def chunk_local_shape(self) -> Shape:
        """For a flattened key: the shape of one chunk of the original tensor's grid."""
        return tuple(o // g for o, g in zip(self.orig_shape, self.size[:-1]))


class FlatCell:
    """The stored slices of one chunk of a flattened key (sorted by start), found by bisection:
    a distributed optimizer cuts each chunk into a slice per data-parallel rank, and a request
    of one slice must not walk all of them."""

    __slots__ = ("slices", "starts", "ends")

    def __init__(self, slices: List[Stored]):
        slices = [c for c in slices if c.size[-1] > 0]  # an empty slice holds nothing to find
        self.slices = slices
        self.starts = [c.offset[-1] for c in slices]
        self.ends = [c.offset[-1] + c.size[-1] for c in slices]

    def overlap(self) -> Optional[Tuple[int, int]]:
        """The first elements two slices both claim, or None."""
        for k in range(1, len(self.slices)):
            if self.starts[k] < self.ends[k - 1]:
                return self.starts[k], min(self.ends[k - 1], self.ends[k])
        return None

    def meeting(self, lo: int, hi: int) -> List[Stored]:
        """The slices holding any of elements ``[lo, hi)``, in order (the slices are disjoint,
        so their ends are sorted too)."""
        first = bisect.bisect_right(self.ends, lo)
        end = bisect.bisect_left(self.starts, hi, first)
        return self.slices[first:end]


def stored_file_size(checkpoint_dir: Resolved, relative_path: str, source: Any) -> int:
    """Size of a data file a checkpoint's metadata names, refusing names (and, locally, symlinks)
    that lead outside the checkpoint. Raises FileNotFoundError for a missing file."""
    root = storage.local_root(checkpoint_dir)
    if root is None:
        return checkpoint_dir.size(bounds.relative_name(relative_path, source))
    return containment.size_beneath(root, relative_path, source)


def checked_metadata(checkpoint_dir: storage.Location, trusted: bool = False) -> Metadata:
    """``.metadata`` for a tool that writes a new checkpoint from it (``remove_sharded_tensors``,
    ``distckpt rename``): its claims checked as a load checks them (:func:`index_metadata`) and, where
    the checkpoint has an integrity manifest, the file against its CRC32C and every claim
    against what the manifest says the writer wrote (:func:`cross_check`). Such a tool writes a
    fresh manifest describing what it wrote: damage it carried over would be laundered into a
    checkpoint that verifies, so it is refused here, naming the files, before anything changes."""
    checkpoint_dir = storage.resolve(checkpoint_dir)
    md = read_metadata(checkpoint_dir, trusted, verify=True)
    index_metadata(md, storage.join(checkpoint_dir, METADATA_FNAME))
    cross_check_manifest(md, checkpoint_dir)
    root = storage.local_root(checkpoint_dir)
    if root is not None:
        # The files such a tool replaces: what is there must be a file (or a link) to replace.
        for name in (INDEX_FNAME, MANIFEST_FNAME):
            path = root / name
            if os.path.lexists(path) and not (path.is_symlink() or path.is_file()):
                raise CheckpointingException(
                    f"{path}: not a regular file; refusing to replace it (nothing was changed)"
                )
    return md


def cross_check_manifest(md: Metadata, checkpoint_dir: Resolved) -> None:
    """``verify=True``: ``.metadata`` against the manifest (:func:`cross_check`)."""
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        return
    problems = cross_check(
        md,
        manifest,
        storage.join(checkpoint_dir, METADATA_FNAME),
        storage.join(checkpoint_dir, MANIFEST_FNAME),
    )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointingException("; ".join(problems[:3]) + more)


def index_metadata(md: Metadata, source: Any) -> Dict[str, Any]:
    """Per key, its stored chunks and where their bytes are (claims checked first)."""
    check_claims(md, source)
    orig = orig_shapes(md)
    per_key: Dict[str, List[Stored]] = defaultdict(list)
    objects: Dict[str, Stored] = {}
    for index, info in md.storage_data.items():
        st = Stored(
            tuple(index.offset) if index.offset is not None else (),
            (),
            info.relative_path,
            info.offset,
            info.length,
        )
        if index.fqn not in md.state_dict_metadata:
            raise CheckpointingException(
                f"{source}: storage record of {index.fqn!r}, a key it does not declare"
            )
        if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            objects[index.fqn] = st
        else:
            per_key[index.fqn].append(st)
    out: Dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            out[fqn] = objects.get(fqn)
            continue
        by_offset = {s.offset: s for s in per_key.get(fqn, [])}
        itemsize = meta.properties.dtype.itemsize
        chunks = []
        for c in meta.chunks:
            st = by_offset.get(tuple(c.offsets))
            if st is None:
                raise CheckpointingException(
                    f"{source}: key {fqn!r}: chunk at {list(c.offsets)} has no storage record"
                )
            sizes = tuple(c.sizes)
            if math.prod(sizes) * itemsize > st.length:
                raise CheckpointingException(
                    f"{source}: key {fqn!r}: chunk at {list(st.offset)} of {list(sizes)} elements needs "
                    f"{math.prod(sizes) * itemsize} bytes, its record holds {st.length}"
                )
            chunks.append(Stored(st.offset, sizes, st.relative_path, st.file_offset, st.length))
        if len(by_offset) != len(chunks) or len(per_key.get(fqn, ())) != len(chunks):
            raise CheckpointingException(
                f"{source}: key {fqn!r}: {len(per_key.get(fqn, ()))} storage records for its {len(chunks)} "
                f"chunks (records at offsets that are none of its chunks, or several at one)"
            )
        out[fqn] = stored_key(fqn, meta.properties.dtype, tuple(meta.size), chunks, orig.get(fqn), source)
    return out


def stored_key(
    fqn: str, dtype: torch.dtype, size: Shape, chunks: List[Stored], orig_shape: Optional[Shape], source: Any
) -> StoredKey:
    key = StoredKey(fqn, dtype, size, chunks, orig_shape, source=str(source))
    if key.orig_shape is not None:
        for c in chunks:
            key.flat_index.setdefault(c.offset[:-1], []).append(c)
        for lst in key.flat_index.values():
            lst.sort(key=lambda c: c.offset[-1])
    return key


def _request_box(sh: ShardedTensor, size: Shape, orig_shape: Optional[Shape]) -> Tuple[Shape, Shape]:
    """The box of stored coordinates (``size``: the stored shape) that a load of ``sh`` may read."""
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    off = tuple(sh.global_offset)
    if orig_shape is None:
        return off, full_local
    grid = size[:-1]
    chunk = tuple(max(1, o // g) for o, g in zip(orig_shape, grid))
    lo = tuple(o // c for o, c in zip(off, chunk))
    hi = tuple(-(-(o + s) // c) for o, s, c in zip(off, full_local, chunk))
    f_lo, f_hi = 0, size[-1]
    if sh.flattened_range is not None and chunk == full_local and tuple(sh.global_shape) == tuple(orig_shape):
        f_lo, f_hi = sh.flattened_range.start, sh.flattened_range.stop
    return lo + (f_lo,), tuple(h - a for h, a in zip(hi, lo)) + (f_hi - f_lo,)


def _checked_sidecar_chunk(source: str, fqn: str, dtype: torch.dtype, row, names: Set[str]) -> Stored:
    """One chunk record of the sidecar, with the claims checks ``index_metadata`` applies to ``.metadata``:
    a file name inside the checkpoint, natural offsets and lengths, a chunk its record can hold.
    ``names``: the file names checked already (a load's records name a few files)."""
    off, size, path, foff, length, _crc = row
    if path not in names:
        bounds.relative_name(path, source, f"key {fqn!r}: file name")
        names.add(path)
    # The message-free tests first: the checks that word an error run only when they fail.
    if not (bounds.fits(foff) and bounds.fits(length)):
        bounds.natural(foff, source, f"key {fqn!r}: offset")
        bounds.natural(length, source, f"key {fqn!r}: length")
    plain = bounds.plain_shape(size)
    size = plain if plain is not None else bounds.shape(size, source, f"key {fqn!r}: chunk size")
    if math.prod(size) * dtype.itemsize > length:
        raise CheckpointingException(
            f"{source}: key {fqn!r}: chunk at {list(off)} of {list(size)} elements needs "
            f"{math.prod(size) * dtype.itemsize} bytes, its record holds {length}"
        )
    return Stored(tuple(off), size, path, foff, length)


def index_from_sidecar(
    reader: IndexReader, sharded_state_dict: ShardedStateDict, checksums: Optional[Dict]
) -> Dict[str, Any]:
    """The stored keys a load of ``sharded_state_dict`` needs, with only the chunks that meet its
    requests, read from the sidecar index; fills ``checksums`` (if given) from its records."""
    boxes: Dict[str, List[Tuple[Shape, Shape]]] = defaultdict(list)
    objects: List[str] = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            e = reader.entry(sh.key)
            if e is not None and not e.get("bytes"):
                size, orig = tuple(e["size"]), e.get("orig_shape")
                if orig:
                    orig = check_reformulated(sh.key, size, orig, reader.where)
                box = _request_box(sh, size, orig or None)
                if len(box[0]) != len(size):
                    raise CheckpointingException(
                        f"{reader.where}: key {sh.key!r} is stored in {len(size)} axes ({list(size)}"
                        f"{', flattened' if orig else ''}), the request {list(sh.global_shape)} "
                        f"needs {len(box[0])}"
                    )
                boxes[sh.key].append(box)
        elif isinstance(sh, ShardedObject):
            objects.append(sh.unique_key)
    found = reader.query(boxes)
    out: Dict[str, Any] = {}
    names: Set[str] = set()
    for fqn, rows in found.items():
        e = reader.entry(fqn)
        dtype = dtype_of(e["dtype"])  # a real dtype's name: reader.entry checked it
        chunks = [_checked_sidecar_chunk(reader.where, fqn, dtype, row, names) for row in rows]
        orig = e.get("orig_shape")
        size = bounds.plain_shape(e["size"])
        if size is None:
            size = bounds.shape(e["size"], reader.where, f"key {fqn!r}: global shape")
        out[fqn] = stored_key(fqn, dtype, size, chunks, tuple(orig) if orig else None, reader.where)
        if checksums is not None:
            for _o, _s, path, foff, length, crc in rows:
                checksums[(path, foff)] = RangeChecksum(foff, length, crc, fqn)
    for key in objects:
        e = reader.entry(key)
        if e is None or not e.get("bytes"):
            continue
        item = e.get("item")
        if item is None:
            out[key] = None
            continue
        path, foff, length, crc = item
        bounds.relative_name(path, reader.where, f"object {key!r}: file name")
        out[key] = Stored(
            (),
            (),
            path,
            bounds.natural(foff, reader.where, f"object {key!r}: offset"),
            bounds.natural(length, reader.where, f"object {key!r}: length"),
        )
        if checksums is not None:
            checksums[(path, foff)] = RangeChecksum(foff, length, crc, key)
    return out


@dataclass(frozen=True)
class DirectoryKey:
    """A tensor key as the sidecar's directory declares it, checked (name, dtype, shapes)."""

    fqn: str
    dtype: torch.dtype
    size: Shape  # stored (possibly N-D reformulated) shape
    orig_shape: Optional[Shape]
    entry: Dict[str, Any]

    @property
    def shape(self) -> Shape:
        return self.orig_shape if self.orig_shape is not None else self.size


def directory_keys(reader: IndexReader) -> List[DirectoryKey]:
    """Every tensor key of the sidecar's directory, checked as ``.metadata``'s claims are."""
    out = []
    for fqn in reader.keys:
        e = reader.entry(fqn)
        if e.get("bytes"):
            continue
        check_key_name(fqn, reader.where)
        dtype = dtype_of(e["dtype"])  # a real dtype's name: reader.entry checked it
        size = tuple(e["size"])
        orig = check_reformulated(fqn, size, e["orig_shape"], reader.where) if e.get("orig_shape") else None
        out.append(DirectoryKey(fqn, dtype, size, orig, e))
    return out


def directory_tensors(
    reader: IndexReader, declared: Optional[Dict[str, Tuple]] = None
) -> Dict[str, ShardedTensor]:
    """key -> data-free ShardedTensor of the whole tensor (original shape for flattened keys),
    from the sidecar's directory alone (what ``load_tensors_metadata`` returns). ``declared``
    (the integrity manifest's key declarations): every key the directory declares must be one
    the writer declared, with the same dtype and shapes, and none of those may be missing, as
    for ``.metadata`` (:func:`check_all_declared`)."""
    out = {}
    manifest_source = storage.join(reader.location, MANIFEST_FNAME)
    for k in directory_keys(reader):
        if declared:
            check_declared(k.fqn, k.dtype, k.size, k.orig_shape, declared, reader.where, manifest_source)
        out[k.fqn] = ShardedTensor.from_rank_offsets(
            k.fqn, torch.empty(k.shape, dtype=k.dtype, device="meta")
        )
    if declared and len(out) != len(declared):
        raise undeclared_error(declared, out, reader.where, manifest_source)
    return out


def directory_objects(reader: IndexReader) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """``(key, entry)`` of every ShardedObject piece the sidecar's directory lists (byte items
    named otherwise are a ``dcp.save``'s common values)."""
    for fqn in reader.keys:
        e = reader.entry(fqn)
        if e.get("bytes") and is_object_key(fqn):
            yield fqn, e


class DefaultChecks(dict):
    """The manifest's checksums by (file, offset) for a default load (not ``verify=True``): an
    item of a file the manifest lists no range of at all is read unchecked, as a checkpoint with
    no manifest is (e.g. one whose data files a foreign DCP ``StorageWriter`` wrote); an item
    missing from a file the manifest does list is an error, as under ``verify=True``."""

    def __init__(self, ranges: Dict):
        super().__init__(ranges)
        self.listed = {name for name, _offset in ranges}


def manifest_checks(manifest: Any, verify: bool) -> Dict:
    """``manifest``'s checksums by (file, offset) as a load applies them: every item under
    ``verify=True``, else :class:`DefaultChecks`."""
    ranges = manifest.range_index()
    return ranges if verify else DefaultChecks(ranges)


def check_keys_declared(keys: Any, declared: Dict[str, Tuple], location: Any) -> None:
    """Each ``(key, StoredKey)`` a load reads, as ``.metadata`` declares it, against the keys the
    manifest says the writer wrote (``declared``)."""
    source, where = storage.join(location, METADATA_FNAME), storage.join(location, MANIFEST_FNAME)
    for fqn, stored in keys:
        if isinstance(stored, StoredKey):
            check_declared(fqn, stored.dtype, stored.size, stored.orig_shape, declared, source, where)


def expected_checksum(st: Stored, checksums: Dict, key: Optional[str], what: str) -> Optional[RangeChecksum]:
    """The manifest's checksum of item ``st``, after the cross-check every checked read does: the
    manifest lists a range at that offset, of the record's length, holding ``key`` (when given).
    So storage records swapped in ``.metadata`` are an error, not the other key's values. None:
    the item is not to be checked (see :class:`DefaultChecks`)."""
    expected = checksums.get((st.relative_path, st.file_offset))
    if expected is None:
        if isinstance(checksums, DefaultChecks) and st.relative_path not in checksums.listed:
            return None
        raise CheckpointingException(f"{what}: no checksum for this item in the manifest; cannot verify it")
    if (
        expected.length != st.length
        or (key is not None and expected.key != key)
        or (key is not None and expected.chunk is not None and expected.chunk != (st.offset, st.size))
    ):
        chunk = (
            f" chunk {list(expected.chunk[0])} of size {list(expected.chunk[1])}" if expected.chunk else ""
        )
        raise CheckpointingException(
            f"{what}: {METADATA_FNAME} records {st.length} bytes of key {key!r} "
            f"chunk {list(st.offset)} of size "
            f"{list(st.size)} there, {MANIFEST_FNAME} says the writer wrote {expected.length} bytes of key "
            f"{expected.key!r}{chunk}: the metadata or the manifest is damaged"
        )
    return expected


def compare_crc(crc: int, expected: RangeChecksum, what: str) -> None:
    if crc != expected.crc32c:
        raise CheckpointingException(f"{what}: CRC32C mismatch against the manifest (corrupted data)")


def check_item(
    raw: bytes, st: Stored, checksums: Optional[Dict], what: str, key: Optional[str] = None
) -> None:
    """Compare an item's bytes with the manifest (``checksums`` is None without a manifest)."""
    expected = None if checksums is None else expected_checksum(st, checksums, key, what)
    if expected is not None:
        compare_crc(crc32c(raw), expected, what)
