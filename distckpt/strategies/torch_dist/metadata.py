"""``.metadata``, the file every ``torch_dist`` reader starts from: read, unpickled safely, built.

``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key the global
size, dtype and chunk boxes; per chunk its (file, offset, length). It is read with
:class:`MetadataUnpickler`, which admits only the classes such a file needs (Megatron-Core's
names mapped to DCP's), and built from a save's gathered records by :func:`metadata_bytes_and_head`
(the bytes, written straight from the record arrays) or :func:`build_metadata` (the objects).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from distckpt import storage
from distckpt.core import CheckpointingException, gc_paused
from distckpt.formats.manifest import MANIFEST_FNAME, check_whole_file, read_manifest
from distckpt.formats.metadata_pickle import pickle_metadata
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from distckpt.strategies.resharding import ORIG_SHAPE, Shape
from distckpt.strategies.torch_dist.claims import check_claims, cross_check, orig_shapes
from distckpt.strategies.torch_dist.records import GatheredRecords, KeyDecl, Record, RecordTable

METADATA_FNAME = ".metadata"
DATA_SUFFIX = ".distcp"

# A checkpoint location inside the strategies: a local directory, or a store without one.
Resolved = Union[Path, storage.Store]


# The module path under which Megatron-Core 0.15 pickles its metadata classes into `.metadata`.
_MCORE_TORCH_STRATEGY = "megatron" + ".core.dist_checkpointing.strategies.torch"


class MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes a DCP ``.metadata`` needs; Megatron's names map to DCP's."""

    _DCP = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.distributed.checkpoint.planner": {
            "SavePlan",
            "WriteItem",
            "WriteItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        },
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
        "builtins": {"slice", "set", "frozenset"},
        # dcp.save records its checkpoint_id, a path, in StorageMeta.
        "pathlib": {"PosixPath", "PurePosixPath", "PureWindowsPath"},
    }
    # A path of the other OS cannot be instantiated here (WindowsPath on Linux raises): pure paths
    # carry the same text. Python 3.13 moved the classes to pathlib._local.
    _RENAMED = {
        ("pathlib", "WindowsPath"): ("pathlib", "PureWindowsPath"),
        ("pathlib", "PosixPath"): ("pathlib", "PurePosixPath" if os.name == "nt" else "PosixPath"),
    }
    # Class paths pickled by Megatron-Core 0.15 (data in its files; nothing is imported from it).
    _MEGATRON = {
        (_MCORE_TORCH_STRATEGY, "MCoreMetadata"): ("torch.distributed.checkpoint.metadata", "Metadata"),
        (_MCORE_TORCH_STRATEGY, "MCoreSavePlan"): ("torch.distributed.checkpoint.planner", "SavePlan"),
    }

    def find_class(self, module: str, name: str) -> Any:
        module, name = self._MEGATRON.get((module, name), (module, name))
        if module == "pathlib._local":
            module = "pathlib"
        module, name = self._RENAMED.get((module, name), (module, name))
        if name in self._DCP.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"class {module}.{name} is not allowed in checkpoint metadata")


def read_metadata(checkpoint_dir: storage.Location, trusted: bool = False, verify: bool = False) -> Metadata:
    """Read ``.metadata`` with a restricted unpickler (any class if ``trusted``); with ``verify``
    check it against the manifest first."""
    checkpoint_dir = storage.resolve(checkpoint_dir)
    raw = read_metadata_bytes(checkpoint_dir, trusted, verify)
    return unpickle_metadata(raw, storage.join(checkpoint_dir, METADATA_FNAME), trusted)


def read_metadata_bytes(checkpoint_dir: Resolved, trusted: bool, verify: bool) -> bytes:
    """The bytes of ``.metadata``; with ``verify`` checked against the manifest first."""
    path = storage.join(checkpoint_dir, METADATA_FNAME)
    try:
        raw = storage.read_bytes(checkpoint_dir, METADATA_FNAME)
    except FileNotFoundError:
        raise CheckpointingException(
            f"{path}: DCP metadata file is missing; not a torch_dist checkpoint"
        ) from None
    if verify:
        try:
            check_whole_file(checkpoint_dir, METADATA_FNAME, raw)
        except CheckpointingException as e:
            raise CheckpointingException(str(e) + _what_differs(raw, checkpoint_dir, trusted)) from None
    return raw


def unpickle_metadata(raw: bytes, path: Any, trusted: bool) -> Metadata:
    """``raw`` unpickled as DCP Metadata (``path`` names it in errors), its top-level fields
    checked to be what every reader iterates."""
    try:
        md = pickle.loads(raw) if trusted else MetadataUnpickler(io.BytesIO(raw)).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        UnicodeDecodeError,
        OverflowError,
        MemoryError,
    ) as e:
        raise CheckpointingException(
            f"{path}: unreadable checkpoint metadata: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointingException(f"{path}: holds {type(md).__name__}, not DCP Metadata")
    for name in ("state_dict_metadata", "storage_data"):  # what every reader iterates
        if not isinstance(getattr(md, name, None), dict):
            raise CheckpointingException(
                f"{path}: {name} is {type(getattr(md, name, None)).__name__}, not a dict"
            )
    return md


def _what_differs(raw: bytes, checkpoint_dir: Resolved, trusted: bool) -> str:
    """For a ``.metadata`` that fails its manifest checksum: the claims in which it disagrees
    with the manifest (:func:`cross_check`), as text to add to the error; empty when it cannot
    be read or its claims agree (the damage is elsewhere in the file)."""
    path = storage.join(checkpoint_dir, METADATA_FNAME)
    try:
        md = unpickle_metadata(raw, path, trusted)
        check_claims(md, path)
        manifest = read_manifest(checkpoint_dir)
    except CheckpointingException:
        return ""
    problems = (
        cross_check(md, manifest, path, storage.join(checkpoint_dir, MANIFEST_FNAME)) if manifest else []
    )
    return "".join(f"; {p}" for p in problems[:3])


def tensors_metadata(md: Metadata) -> ShardedStateDict:
    """key -> data-free ShardedTensor of the whole tensor (original shape for flattened keys)."""
    orig = orig_shapes(md)
    return {
        fqn: ShardedTensor.from_rank_offsets(
            fqn, torch.empty(orig.get(fqn, tuple(meta.size)), dtype=meta.properties.dtype, device="meta")
        )
        for fqn, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def plain_byte_items(md: Metadata) -> Dict[str, Tuple[Any, ...]]:
    """DCP byte items that are not ShardedObject pieces, each with its place in the nested state dict.

    ``dcp.save`` stores every non-tensor value (``step``, the leaves of nested dicts) as a byte
    item under its flattened name (``extra.lr``); ``Metadata.planner_data`` maps that name back
    to its key path (``("extra", "lr")``). They are common state, returned by
    :meth:`TorchDistLoadShardedStrategy.load_common_items`. Byte items named like a ShardedObject
    piece (``<key>/shard_<offset>_<shape>``, what distckpt and Megatron-Core write) are not
    among them.
    """
    planner_data = getattr(md, "planner_data", None)
    planner_data = planner_data if isinstance(planner_data, dict) else {}
    out = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata) or is_object_key(fqn):
            continue
        path = planner_data.get(fqn)
        out[fqn] = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
    return out


def is_object_key(fqn: str) -> bool:
    """Whether ``fqn`` is named like a ShardedObject piece (``<key>/shard_<offset>_<shape>``)."""
    try:
        ShardedObject.empty_from_unique_key(fqn)
    except CheckpointingException:
        return False
    return True


def set_at_path(root: Dict[Any, Any], path: Tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts/lists, creating them as PyTorch's
    ``unflatten_state_dict`` does (an int key makes a list, padded with None)."""
    node: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = fresh
        else:
            node.setdefault(key, fresh)
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def build_metadata(records: GatheredRecords, checkpoint_id: str) -> Metadata:
    """Assemble DCP Metadata from every rank's key declarations and written records (the
    objects; a save writes :func:`metadata_bytes_and_head`, which unpickle to the same)."""
    with gc_paused():
        md = _skeleton(records, checkpoint_id, str(uuid.uuid4()))
        size, chunk_meta, info = torch.Size, ChunkStorageMetadata, _StorageInfo
        files = records.files
        chunks, byte_items = _sorted_chunks(records)
        for fqn, (offs, sizes, items) in chunks.items():
            out = md.state_dict_metadata[fqn].chunks
            shapes, shape_of = np.unique(sizes, axis=0, return_inverse=True)
            shapes = [size(s) for s in shapes.tolist()]
            for o, s, (f, foff, length) in zip(offs.tolist(), shape_of.reshape(-1).tolist(), items.tolist()):
                o = size(o)
                out.append(chunk_meta(o, shapes[s]))
                md.storage_data[_metadata_index(fqn, o)] = info(files[f], foff, length)
        for fqn, f, foff, length in byte_items:
            md.storage_data[_metadata_index(fqn, None)] = info(files[f], foff, length)
        return md


def metadata_bytes_and_head(records: GatheredRecords, checkpoint_id: str, save_id: str) -> Tuple[bytes, int]:
    """The pickled ``.metadata`` of every rank's records, written from the arrays without
    building a Python object per chunk (distckpt.formats.metadata_pickle; unpickles to what
    :func:`build_metadata` builds), and the length of its head (where :func:`respell` finds
    the ids)."""
    with gc_paused():
        chunks, byte_items = _sorted_chunks(records)
        return pickle_metadata(_skeleton(records, checkpoint_id, save_id), chunks, byte_items, records.files)


def metadata_file(
    decls: Dict[str, KeyDecl], records: Sequence[Record], checkpoint_id: str, save_id: Optional[str] = None
) -> bytes:
    """The ``.metadata`` bytes of one writer's key declarations and records (a tool that writes a
    ``torch_dist`` checkpoint itself, such as ``distckpt convert``): the same builder a save
    uses, so the file unpickles to what :func:`build_metadata` builds."""
    records_of = GatheredRecords.of([RecordTable.of(decls, records)])
    data, _head = metadata_bytes_and_head(records_of, checkpoint_id, save_id or str(uuid.uuid4()))
    return data


def _metadata_index(fqn: str, offset: Optional[torch.Size]) -> MetadataIndex:
    """``MetadataIndex(fqn, offset)`` holding ``offset`` itself (its ``__init__`` copies it into
    a new torch.Size): the chunk and its index share one object, so ``.metadata`` pickles it once."""
    index = object.__new__(MetadataIndex)
    d = index.__dict__
    d["fqn"] = fqn
    d["index"] = None
    if offset is not None:
        d["offset"] = offset
    return index


_FEW_ROWS = 64  # keys with at most this many records are sorted together in _sorted_chunks


def _sorted_chunks(records: GatheredRecords):
    """Per tensor key ``(offsets, sizes, (file, file offset, length))`` arrays in chunk-offset
    order (DCP lists chunks sorted); byte keys' ``(fqn, file, file offset, length)``."""
    ndim = records.ndim
    chunks: Dict[str, Tuple[Any, Any, Any]] = {}
    byte_items: List[Tuple[str, int, int, int]] = []
    # Sorted by chunk offset (stable: equal offsets stay in rank order). The rows of keys with a
    # few records (most keys of most models) in one sort, by key and then offset (padded axes
    # are 0); a key of many records (large worlds) on its own, which is faster than one sort of
    # everything.
    rows = records.rows
    counts = np.bincount(rows[:, 0], minlength=len(records.fqns))
    few = counts <= _FEW_ROWS
    grouped = rows[few[rows[:, 0]]]
    grouped = grouped[np.lexsort([grouped[:, 5 + d] for d in reversed(range(ndim))] + [grouped[:, 0]])]
    ends, few_ends = np.cumsum(counts).tolist(), np.cumsum(np.where(few, counts, 0)).tolist()
    counts, few = counts.tolist(), few.tolist()
    for k, fqn in enumerate(records.fqns):
        if not counts[k]:
            continue
        decl = records.decls.get(fqn)
        if decl is None:
            raise CheckpointingException(f"record for undeclared key {fqn!r}")
        n = len(decl[2]) if not decl[0] else 0
        if few[k]:
            mine = grouped[few_ends[k] - counts[k] : few_ends[k]]
        else:
            mine = rows[ends[k] - counts[k] : ends[k]]
            if n:
                mine = mine[np.lexsort(mine[:, 5 : 5 + n].T[::-1])]
        if decl[0]:
            byte_items.extend((fqn, f, off, length) for f, off, length in mine[:, 1:4].tolist())
            continue
        chunks[fqn] = (mine[:, 5 : 5 + n], mine[:, 5 + ndim : 5 + ndim + n], mine[:, 1:4])
    return chunks, byte_items


def _skeleton(records: GatheredRecords, checkpoint_id: str, save_id: str) -> Metadata:
    """The Metadata without chunks: every key's properties, an empty chunk list per tensor key
    and an empty ``storage_data``."""
    state_dict_metadata: Dict[str, Any] = {}
    mcore_data: Dict[str, Dict[str, Shape]] = {}
    for fqn, (is_bytes, dtype, shape, orig_shape) in records.decls.items():
        if is_bytes:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=[]
        )
        if orig_shape is not None:
            mcore_data[fqn] = {ORIG_SHAPE: tuple(orig_shape)}
    md = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=None,
        storage_data={},
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
    )
    md.mcore_data = mcore_data
    return md


# --------------------------------------------------------------------------- load
