"""The claims of a ``.metadata`` checked before anything uses them, and against the manifest.

A ``.metadata`` is a claim about the files beside it: file names, offsets, lengths, shapes,
chunk boxes, dtypes. :func:`check_claims` parses it by schema (every field of every object the
reader uses has its class, type and range, or the file is refused naming the field) and refuses
the claims no reader may use (names outside the checkpoint, unbounded shapes, boxes outside
their tensor); :func:`cross_check` and :func:`check_declared` compare them with what the
integrity manifest says the writer wrote; :func:`extent_problem` words a record that points
past the end of its data file as what it is, a claim of the metadata. A load and ``distckpt
verify`` run these same functions, so the two agree on every ``.metadata``.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from distckpt import bounds, dist, storage
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import MANIFEST_FNAME, dtype_name, read_manifest_files
from distckpt.strategies.resharding import ORIG_SHAPE, Shape


def orig_shapes(md: Metadata) -> Dict[str, Shape]:
    """The original global shape of every flattened (N-D reformulated) key of ``md``."""
    mcore = getattr(md, "mcore_data", None) or {}
    if not isinstance(mcore, dict):
        return {}
    return {k: tuple(v[ORIG_SHAPE]) for k, v in mcore.items() if isinstance(v, dict) and ORIG_SHAPE in v}


def check_claims(md: Metadata, source: Any) -> None:
    """Check every claim of ``.metadata`` before anything uses them: each object is of the class
    DCP writes there and each field of the type and range a reader needs (a wrong one is named:
    ``key 'w': chunks is str, not a list``), file names stay inside the checkpoint, offsets and
    lengths are naturals, shapes bounded, chunk boxes inside their tensor, dtypes real
    (``source`` names the file in the error)."""
    try:
        _check_claims(md, source)
    except AttributeError as e:  # an object unpickled without the fields its class has
        raise CheckpointingException(f"{source}: malformed checkpoint metadata: {e}") from None


def _wrong(source: Any, what: str, value: Any, want: str) -> CheckpointingException:
    return CheckpointingException(
        f"{source}: {what} is {type(value).__name__} {value!r:.80}, not {want} (damaged metadata)"
    )


def _plain(values: Any) -> Optional[Tuple[int, ...]]:
    """:func:`bounds.plain_shape` of a ``torch.Size`` (a tuple subclass) too."""
    return bounds.plain_shape(tuple(values) if type(values) is torch.Size else values)


def _check_claims(md: Metadata, source: Any) -> None:
    # Every record and chunk passes a test that builds no message first (a .metadata has one
    # per chunk: 100,000s at scale); only one that fails it is checked again, with words.
    names = set()  # file names checked already (a checkpoint's records name a few files)
    fits = bounds.fits
    for index, info in md.storage_data.items():
        if (
            isinstance(index, MetadataIndex)
            and isinstance(info, _StorageInfo)
            and type(index.fqn) is str
            and info.relative_path in names
            and fits(info.offset)
            and fits(info.length)
            and not info.transform_descriptors
            and (index.offset is None or _plain(index.offset) is not None)
        ):
            continue
        _check_record(index, info, source)
        names.add(info.relative_path)
    mcore = getattr(md, "mcore_data", None) or {}
    if not isinstance(mcore, dict):
        raise CheckpointingException(f"{source}: mcore_data is {type(mcore).__name__}, not a dict")
    for fqn, meta in md.state_dict_metadata.items():
        check_key_name(fqn, source)
        if isinstance(meta, BytesStorageMetadata):
            entry = mcore.get(fqn)
            if isinstance(entry, dict) and ORIG_SHAPE in entry:
                raise CheckpointingException(
                    f"{source}: key {fqn!r}: mcore_data gives an original shape to a byte item"
                )
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise _wrong(
                source, f"the metadata of key {fqn!r}", meta, "TensorStorageMetadata or BytesStorageMetadata"
            )
        if not isinstance(meta.properties, TensorProperties):
            raise _wrong(source, f"key {fqn!r}: properties", meta.properties, "TensorProperties")
        if not isinstance(meta.properties.dtype, torch.dtype):
            raise CheckpointingException(
                f"{source}: key {fqn!r}: dtype {meta.properties.dtype!r:.100} is not a dtype"
            )
        size = bounds.shape(meta.size, source, f"key {fqn!r}: global shape")
        entry = mcore.get(fqn)
        if entry is not None and not isinstance(entry, dict):
            raise _wrong(source, f"mcore_data of key {fqn!r}", entry, "a dict")
        # A flattened key's chunk is one cell of its grid: of size 1 along every grid axis.
        cell = None
        if entry is not None and ORIG_SHAPE in entry:
            check_reformulated(fqn, size, entry[ORIG_SHAPE], source)
            cell = (1,) * (len(size) - 1)
        if not isinstance(meta.chunks, list):
            raise _wrong(source, f"key {fqn!r}: chunks", meta.chunks, "a list")
        ndim = len(size)
        for c in meta.chunks:
            if isinstance(c, ChunkStorageMetadata):
                offsets, sizes = _plain(c.offsets), _plain(c.sizes)
                if (
                    offsets is not None
                    and sizes is not None
                    and len(offsets) == ndim == len(sizes)
                    and all(map(operator.le, map(operator.add, offsets, sizes), size))
                    and (cell is None or sizes[:-1] == cell)
                ):
                    continue
            else:
                raise _wrong(source, f"a chunk of key {fqn!r}", c, "ChunkStorageMetadata")
            offsets = bounds.shape(c.offsets, source, f"key {fqn!r}: chunk offset")
            sizes = bounds.shape(c.sizes, source, f"key {fqn!r}: chunk size")
            bounds.box_inside(offsets, sizes, size, source, f"key {fqn!r}: chunk")
            if cell is not None and tuple(sizes[:-1]) != cell:
                raise CheckpointingException(
                    f"{source}: key {fqn!r}: chunk at {list(offsets)} of size {list(sizes)} is not one cell "
                    f"of the flattened key's grid {list(size[:-1])} (its size along the grid axes must be 1)"
                )
    for fqn, entry in mcore.items():
        # Entries of keys it does not declare are never used, but read by orig_shapes.
        if fqn not in md.state_dict_metadata and isinstance(entry, dict) and ORIG_SHAPE in entry:
            bounds.shape(entry[ORIG_SHAPE], source, f"mcore_data of {fqn!r}: original shape")


def _check_record(index: Any, info: Any, source: Any) -> None:
    """One storage record of ``.metadata``, each field checked with words (raises naming it)."""
    if not isinstance(index, MetadataIndex):
        raise _wrong(source, "a key of storage_data", index, "a MetadataIndex")
    if type(index.fqn) is not str:
        raise _wrong(source, "the key name of a storage record", index.fqn, "a string")
    what = f"storage record of {index.fqn!r}"
    if not isinstance(info, _StorageInfo):
        raise _wrong(source, what, info, "a storage record (_StorageInfo)")
    if index.offset is not None:
        bounds.shape(index.offset, source, f"{what}: chunk offset")
    bounds.relative_name(info.relative_path, source, f"{what}: file name")
    bounds.natural(info.offset, source, f"{what}: offset")
    bounds.natural(info.length, source, f"{what}: length")
    if info.transform_descriptors:
        # DCP's storage transforms (compression extensions): distckpt reads the bytes as stored,
        # so it would return the encoded bytes as values.
        raise CheckpointingException(
            f"{source}: {what}: stored with DCP storage transforms "
            f"{list(info.transform_descriptors)!r:.100}, which distckpt does not decode"
        )


def extent_problem(
    source: Any,
    record: str,
    name: Any,
    offset: int,
    length: int,
    size: int,
    written: Optional[int] = None,
    manifest_source: Any = None,
) -> Optional[str]:
    """Why ``record`` (``key 'w' chunk at [0, 0]``), which ``source`` (``.metadata`` or the
    sidecar) places at ``offset`` (``length`` bytes) of data file ``name``, cannot be read from
    that file of ``size`` bytes; None when it lies inside. ``written``: the size the integrity
    manifest ``manifest_source`` records for the data file, which says who is wrong: the same
    size, the metadata (the message names it first); another, the data file (named first).
    Without it the data file is named first (truncation is the common case) and the message
    says that either may be wrong. Loads and ``distckpt verify`` word it with this one function."""
    if offset + length <= size:
        return None
    claim = f"{record} at offset {offset} of {name} ({length} bytes, up to byte {offset + length})"
    if written is None:
        return (
            f"{name}: holds {size} bytes, {source} places {claim}: the data file is truncated or the "
            f"metadata damaged"
        )
    if written != size:
        return (
            f"{name}: truncated: holds {size} bytes, {manifest_source} records {written}; {source} "
            f"places {claim}"
        )
    return (
        f"{source}: claims {claim}, which holds {size} bytes, the size {manifest_source} records for "
        f"it: the metadata is damaged"
    )


def check_key_name(fqn: Any, source: Any) -> str:
    """A key ``.metadata`` or the sidecar declares: a string with something besides dots (a
    key of only dots, such as ``'.'``, names no value any state dict holds)."""
    if not isinstance(fqn, str) or not fqn.strip("."):
        raise CheckpointingException(f"{source}: key {fqn!r} is not a key name")
    return fqn


def check_reformulated(fqn: str, size: Shape, orig: Any, source: Any) -> Shape:
    """The original shape ``orig`` of flattened key ``fqn``, checked against its stored N-D
    reformulated shape ``size`` (``grid + (elements per chunk,)``): one grid axis per original
    axis, each cut into at most one chunk per element. A finer grid has chunks of no elements,
    which every box computation would divide by."""
    orig = bounds.shape(orig, source, f"key {fqn!r}: original shape")
    if len(size) != len(orig) + 1 or any(not 1 <= g <= max(o, 1) for g, o in zip(size, orig)):
        raise CheckpointingException(
            f"{source}: key {fqn!r}: stored shape {list(size)} is not an N-D reformulation of its "
            f"original shape {list(orig)} (a grid of 1 to n chunks along each axis of n elements, then "
            f"the elements of one chunk)"
        )
    return orig


def check_declared(
    fqn: str,
    dtype: torch.dtype,
    size: Shape,
    orig: Optional[Shape],
    declared: Dict[str, Tuple],
    source: Any,
    manifest_source: Any,
) -> None:
    """A tensor key a default load reads or returns, as ``source`` (``.metadata`` or the sidecar)
    declares it, against the integrity manifest's ``keys`` (``declared``, what the writer
    declared): the same name, dtype, stored shape and (``orig``, a flattened key's) original
    shape, else an error naming both files. A lie there (kept consistent with the checksums by
    a buggy writer or an edit) would return values under another name, converted to another
    dtype, or shaped into another tensor."""
    entry = declared.get(fqn)
    if entry is None:
        raise CheckpointingException(
            f"{source}: declares tensor key {fqn!r}, which {manifest_source} says the writer never wrote "
            f"(the metadata is damaged)"
        )
    if entry[0] != dtype_name(dtype) or entry[1] != size or (entry[2] if len(entry) > 2 else None) != orig:

        def shapes(stored, original):
            return f"shape {list(stored)}" + (
                "" if original is None else f" (flattened, of original shape {list(original)})"
            )

        raise CheckpointingException(
            f"{source}: key {fqn!r} is {dtype_name(dtype)} of {shapes(size, orig)}, "
            f"{manifest_source} says the "
            f"writer wrote {entry[0]} of {shapes(entry[1], entry[2] if len(entry) > 2 else None)}"
        )


def check_all_declared(md: Metadata, declared: Dict[str, Tuple], source: Any, manifest_source: Any) -> None:
    """Every tensor key of ``md`` against the manifest (:func:`check_declared`), and no key the
    manifest declares missing from ``md``'s tensors: a query returns every key, so a key renamed
    or turned into a byte item must not just drop out of it."""
    tensors = 0
    orig = orig_shapes(md)
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            check_declared(
                fqn, meta.properties.dtype, tuple(meta.size), orig.get(fqn), declared, source, manifest_source
            )
            tensors += 1
    if tensors != len(declared):
        tensor_keys = {k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        raise undeclared_error(declared, tensor_keys, source, manifest_source)


def undeclared_error(
    declared: Dict[str, Tuple], present: Any, source: Any, manifest_source: Any
) -> CheckpointingException:
    """The error for metadata ``source`` whose tensor keys ``present`` lack some of those the
    manifest ``declared`` (a query returns every key: one renamed or dropped must not vanish)."""
    missing = sorted(k for k in declared if k not in present)
    return CheckpointingException(
        f"{source}: does not declare tensor key(s) {missing[:3]}{' ...' if len(missing) > 3 else ''} "
        f"that {manifest_source} says the writer wrote (the metadata is damaged)"
    )


def cross_check(md: Metadata, manifest: Any, source: str, manifest_source: str) -> List[str]:
    """Where ``.metadata``'s claims disagree with what the integrity manifest says the writer
    wrote (one line per problem, naming both files; empty when they agree): every storage record
    must be a range the manifest lists, of the same length and key, holding the same chunk (when
    the manifest records chunks), and every tensor key's dtype and global shape (and a flattened
    key's original shape) must be the ones the manifest records (when it records them,
    :func:`check_declared`). Run by ``verify=True`` loads and ``distckpt verify``; call
    :func:`check_claims` first."""
    problems: List[str] = []
    ranges = manifest.range_index()
    chunk_sizes: Dict[Tuple[str, Shape], Shape] = {}
    orig = orig_shapes(md)
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        for c in meta.chunks:
            chunk_sizes[(fqn, tuple(c.offsets))] = tuple(c.sizes)
        if fqn not in manifest.keys:
            continue
        try:
            check_declared(
                fqn,
                meta.properties.dtype,
                tuple(meta.size),
                orig.get(fqn),
                manifest.keys,
                source,
                manifest_source,
            )
        except CheckpointingException as e:
            problems.append(str(e))
    for index, info in md.storage_data.items():
        where = f"{source}: {record_name(index.fqn, index.offset)}"
        r = ranges.get((info.relative_path, info.offset))
        if r is None:
            problems.append(
                f"{where}: record of {info.length} bytes at offset {info.offset} of "
                f"{info.relative_path}: {manifest_source} lists no range there"
            )
            continue
        if r.length != info.length or r.key != index.fqn:
            problems.append(
                f"{where}: record of {info.length} bytes at offset {info.offset} of "
                f"{info.relative_path}: {manifest_source} says the writer wrote {r.length} bytes of "
                f"key {r.key!r} there"
            )
            continue
        if r.chunk is not None and index.offset is not None:
            box = (tuple(index.offset), chunk_sizes.get((index.fqn, tuple(index.offset))))
            if box != (tuple(r.chunk[0]), tuple(r.chunk[1])):
                problems.append(
                    f"{where}: record at offset {info.offset} of {info.relative_path} holds chunk "
                    f"{list(box[0])} of size {list(box[1] or [])}, {manifest_source} says the writer "
                    f"wrote chunk {list(r.chunk[0])} of size {list(r.chunk[1])} there"
                )
    return problems


def extent_error(
    location: Any, source: Any, record: str, name: str, offset: int, length: int, size: int
) -> CheckpointingException:
    """:func:`extent_problem` as the error a load raises (the record lies past the end of data
    file ``name`` of checkpoint ``location``); the manifest, read here (an error path), says
    which file lies. The caller knows the record does not fit."""
    try:
        written = read_manifest_files(location)
    except CheckpointingException:
        written = None
    text = extent_problem(
        source,
        record,
        storage.join(location, name),
        offset,
        length,
        size,
        None if written is None else written.get(name),
        storage.join(location, MANIFEST_FNAME),
    )
    return CheckpointingException(f"{text} (rank {dist.get_rank()})")


def record_name(fqn: str, chunk: Optional[Any] = None) -> str:
    """How messages name a storage record: ``key 'w' chunk at [0, 0]`` (``chunk``: its offset)."""
    return f"key {fqn!r}" + (f" chunk at {list(chunk)}" if chunk else "")
