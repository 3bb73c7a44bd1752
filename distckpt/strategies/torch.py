"""The ``torch_dist`` strategy: PyTorch DCP's on-disk format, file-compatible with Megatron-Core.

On disk (see docs/formats.md):
  ``__R_B.distcp``  rank R's bucket B: a sequence of items, each a complete ``torch.save``
                    archive of one chunk (tensors) or ``torch.save([obj])`` (ShardedObjects)
  ``.metadata``     a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key the
                    global size, dtype and chunk boxes; per chunk its (file, offset, length)

Flattened ranges are stored in the N-D reformulated shape ``grid + (prod(local_shape),)``: each
chunk of the regular grid becomes one row of a flat last axis and each DP slice a piece of that
row. The original global shape is recorded as ``Metadata.mcore_data[key]
['nd_reformulated_orig_global_shape']`` (the attribute Megatron-Core 0.15 reads).

Saving: each rank writes its main replicas into ``thread_count`` files in parallel, then the
(file, offset, length) records are gathered to rank 0, which writes ``.metadata``.
Loading needs no collective: every requested piece is cut into boxes, each box is intersected
with the stored chunks, and each stored chunk is read at most once per rank.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import pickle
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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

from distckpt import dist
from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from distckpt.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from distckpt.strategies.common import safe_torch_load

logger = logging.getLogger(__name__)

METADATA_FNAME = ".metadata"
DATA_SUFFIX = ".distcp"
_ORIG_SHAPE = "nd_reformulated_orig_global_shape"

Shape = Tuple[int, ...]


# --------------------------------------------------------------------------- .metadata I/O


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes a DCP ``.metadata`` needs; Megatron's names map to DCP's."""

    _DCP = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.distributed.checkpoint.planner": {
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
        },
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
        "builtins": {"slice", "set", "frozenset"},
    }
    _MEGATRON = {
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"):
            ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"):
            ("torch.distributed.checkpoint.planner", "SavePlan"),
    }

    def find_class(self, module: str, name: str) -> Any:
        module, name = self._MEGATRON.get((module, name), (module, name))
        if name in self._DCP.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"class {module}.{name} is not allowed in checkpoint metadata")


def read_metadata(checkpoint_dir: Path, trusted: bool = False) -> Metadata:
    """Read ``.metadata`` with a restricted unpickler (any class if ``trusted``)."""
    path = Path(checkpoint_dir) / METADATA_FNAME
    try:
        with open(path, "rb") as f:
            md = pickle.load(f) if trusted else _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointingException(
            f"{path}: DCP metadata file is missing; not a torch_dist checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise CheckpointingException(f"{path}: unreadable checkpoint metadata: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointingException(f"{path}: holds {type(md).__name__}, not DCP Metadata")
    return md


def _orig_shapes(md: Metadata) -> Dict[str, Shape]:
    mcore = getattr(md, "mcore_data", None) or {}
    return {k: tuple(v[_ORIG_SHAPE]) for k, v in mcore.items() if isinstance(v, dict) and _ORIG_SHAPE in v}


# --------------------------------------------------------------------------- box geometry


def _intersect(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
               b_size: Sequence[int]) -> Optional[Tuple[Shape, Shape]]:
    off, size = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def _rel_slices(off: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(off, size, origin))


def flat_range_boxes(shape: Shape, start: int, stop: int, pos: int = 0):
    """Split elements ``[start, stop)`` of a row-major ``shape`` into boxes.

    Yields ``(offset, size, position)``: every box is contiguous in row-major order, and
    ``position`` is where its first element sits in the flat range (``pos`` + elements before it).
    """
    if start >= stop:
        return
    if not shape:
        yield (), (), pos
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        for off, size, p in flat_range_boxes(shape[1:], c0, c1, pos):
            yield (r0,) + off, (1,) + size, p
        return
    if c0:
        for off, size, p in flat_range_boxes(shape[1:], c0, inner, pos):
            yield (r0,) + off, (1,) + size, p
        pos += inner - c0
        r0 += 1
    if r1 > r0:
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), pos
        pos += (r1 - r0) * inner
    if c1:
        for off, size, p in flat_range_boxes(shape[1:], 0, c1, pos):
            yield (r1,) + off, (1,) + size, p


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


# --------------------------------------------------------------------------- save


@dataclass
class _WriteItem:
    fqn: str
    chunk_offset: Shape          # () for byte items
    chunk_size: Shape
    payload: Any                 # a CPU tensor of shape chunk_size, or bytes
    nbytes: int


@dataclass
class _KeyDecl:
    """What rank 0 needs to describe a key in ``.metadata`` even if it holds no chunk of it."""

    is_bytes: bool
    dtype: Optional[torch.dtype] = None
    size: Shape = ()
    orig_shape: Optional[Shape] = None


def _standalone_cpu(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A CPU tensor of ``shape`` owning exactly its bytes (torch.save writes whole storages)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.reshape(shape)
    if (not t.is_contiguous() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _tensor_item(sh: ShardedTensor) -> Tuple[Optional[_WriteItem], _KeyDecl]:
    if sh.data is None:
        raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
    ndim = len(sh.global_shape)
    if sh.flattened_range is None:
        size = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        decl = _KeyDecl(False, sh.dtype, tuple(sh.global_shape))
        offset = tuple(sh.global_offset)
    else:
        grid = tuple(sh.max_allowed_chunks())
        numel = math.prod(sh.local_shape)
        decl = _KeyDecl(False, sh.dtype, grid + (numel,), tuple(sh.global_shape))
        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        offset = tuple(sh.local_chunk_offset_in_global()) + (start,)
        size = (1,) * ndim + (stop - start,)
    if math.prod(size) == 0:
        return None, decl
    tensor = _standalone_cpu(sh.data, size)
    return _WriteItem(sh.key, offset, size, tensor, tensor.numel() * tensor.element_size()), decl


def _object_item(obj: ShardedObject) -> Tuple[_WriteItem, _KeyDecl]:
    buf = io.BytesIO()
    torch.save([obj.data], buf)
    data = buf.getvalue()
    return _WriteItem(obj.unique_key, (), (), data, len(data)), _KeyDecl(True)


def _buckets(items: List[_WriteItem], count: int) -> List[List[_WriteItem]]:
    """Greedy balance by bytes, largest first; deterministic."""
    count = max(1, min(count, len(items)))
    bins: List[List[_WriteItem]] = [[] for _ in range(count)]
    loads = [0] * count
    for it in sorted(items, key=lambda i: (-i.nbytes, i.fqn, i.chunk_offset)):
        b = loads.index(min(loads))
        bins[b].append(it)
        loads[b] += it.nbytes
    return [b for b in bins if b]


def _write_file(path: Path, items: List[_WriteItem]) -> List[Tuple[_WriteItem, int, int]]:
    records = []
    with open(path, "wb") as f:
        for it in items:
            start = f.tell()
            if isinstance(it.payload, torch.Tensor):
                torch.save(it.payload, f)
            else:
                f.write(it.payload)
            records.append((it, start, f.tell() - start))
        f.flush()
        os.fsync(f.fileno())
    return records


@dataclass
class _Record:
    fqn: str
    chunk_offset: Shape
    chunk_size: Shape
    relative_path: str
    offset: int
    length: int


class TorchDistSaveShardedStrategy(SaveShardedStrategy):
    """Writes main replicas in DCP format (``torch_dist``, version 1).

    Args:
        thread_count: files (and writer threads) per rank.
        separation_hint: keys starting with this prefix go to separate files named
            ``<hint>__R_B.distcp`` so they can later be dropped without rewriting the rest.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, thread_count: int = 2,
                 separation_hint: Optional[str] = None, cached_metadata: bool = False):
        super().__init__(backend, version)
        if thread_count < 1:
            raise CheckpointingException(f"thread_count must be >= 1, got {thread_count}")
        self.thread_count = thread_count
        self.separation_hint = separation_hint
        self.cached_metadata = cached_metadata
        # (this rank's declarations and records, rank 0's Metadata) of the last save. Reused only
        # when every rank's records are identical, so nothing of a different structure leaks in.
        self._cache: Optional[Tuple[Any, Optional[Metadata]]] = None
        self.last_save_reused_metadata = False

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _local_items(self, sharded_state_dict: ShardedStateDict):
        items: List[_WriteItem] = []
        decls: Dict[str, _KeyDecl] = {}
        for sh in nested_values(sharded_state_dict):
            if not is_main_replica(sh.replica_id):
                continue
            if isinstance(sh, ShardedTensor):
                item, decl = _tensor_item(sh)
                decls[sh.key] = decl
            elif isinstance(sh, ShardedObject):
                item, decl = _object_item(sh)
                decls[sh.unique_key] = decl
            else:
                raise CheckpointingException(f"cannot save {type(sh).__name__} under key {sh.key!r}")
            if item is not None:
                items.append(item)
        return items, decls

    def _write_local(self, items: List[_WriteItem], checkpoint_dir: Path, rank: int) -> List[_Record]:
        groups: Dict[str, List[_WriteItem]] = defaultdict(list)
        for it in items:
            hint = self.separation_hint
            groups[hint if hint and it.fqn.startswith(hint) else ""].append(it)
        jobs = []
        for prefix, group in sorted(groups.items()):
            for b, bucket in enumerate(_buckets(group, self.thread_count)):
                jobs.append((f"{prefix}__{rank}_{b}{DATA_SUFFIX}", bucket))
        records: List[_Record] = []
        with ThreadPoolExecutor(max_workers=max(1, min(self.thread_count, len(jobs)))) as pool:
            futures = [(name, pool.submit(_write_file, checkpoint_dir / name, bucket)) for name, bucket in jobs]
            for name, fut in futures:
                for it, start, length in fut.result():
                    records.append(_Record(it.fqn, it.chunk_offset, it.chunk_size, name, start, length))
        return records

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        rank = dist.get_rank()
        exc, payload = None, None
        try:
            items, decls = self._local_items(sharded_state_dict)
            payload = (decls, self._write_local(items, checkpoint_dir, rank))
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e

        self.last_save_reused_metadata = False
        if self.cached_metadata and self._reuse_cached_metadata(exc, payload, checkpoint_dir):
            self.last_save_reused_metadata = True
            return

        def write_metadata(payloads):
            md = build_metadata(payloads, str(checkpoint_dir))
            atomic_write_bytes(checkpoint_dir / METADATA_FNAME, pickle.dumps(md))
            return md if self.cached_metadata else None

        md = dist.gather_and_decide("torch_dist write", exc, payload, write_metadata)
        if self.cached_metadata:
            self._cache = (payload, md if rank == 0 else None)

    def _reuse_cached_metadata(self, exc, payload, checkpoint_dir: Path) -> bool:
        """Fast path: if no rank failed and every rank wrote exactly what it wrote last time (same
        keys, chunks, files, offsets, lengths), one tiny all-reduce replaces the gather of all
        records and rank 0 rewrites the cached Metadata with a new save id."""
        unchanged = exc is None and self._cache is not None and self._cache[0] == payload
        failed, changed = dist.all_reduce_max([int(exc is not None), int(not unchanged)])
        if failed or changed:
            return False
        if dist.get_rank() == 0:
            md = self._cache[1]
            md.storage_meta = StorageMeta(checkpoint_id=str(checkpoint_dir), save_id=str(uuid.uuid4()))
            atomic_write_bytes(checkpoint_dir / METADATA_FNAME, pickle.dumps(md))
        return True


def build_metadata(payloads: List[Tuple[Dict[str, _KeyDecl], List[_Record]]], checkpoint_id: str) -> Metadata:
    """Assemble DCP Metadata from every rank's key declarations and written records."""
    decls: Dict[str, _KeyDecl] = {}
    for rank_decls, _ in payloads:
        decls.update(rank_decls)
    chunks: Dict[str, List[ChunkStorageMetadata]] = defaultdict(list)
    storage_data: Dict[MetadataIndex, _StorageInfo] = {}
    for _, records in payloads:
        for r in records:
            if decls[r.fqn].is_bytes:
                index = MetadataIndex(r.fqn)
            else:
                index = MetadataIndex(r.fqn, torch.Size(r.chunk_offset))
                chunks[r.fqn].append(ChunkStorageMetadata(torch.Size(r.chunk_offset), torch.Size(r.chunk_size)))
            storage_data[index] = _StorageInfo(r.relative_path, r.offset, r.length)
    state_dict_metadata: Dict[str, Any] = {}
    mcore_data: Dict[str, Dict[str, Shape]] = {}
    for fqn, d in decls.items():
        if d.is_bytes:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=d.dtype), size=torch.Size(d.size),
            chunks=sorted(chunks.get(fqn, []), key=lambda c: tuple(c.offsets)))
        if d.orig_shape is not None:
            mcore_data[fqn] = {_ORIG_SHAPE: tuple(d.orig_shape)}
    md = Metadata(state_dict_metadata=state_dict_metadata, planner_data=None, storage_data=storage_data,
                  storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())))
    md.mcore_data = mcore_data
    return md


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class _Stored:
    """One stored chunk: its box in stored coordinates and where its bytes are."""

    offset: Shape
    size: Shape
    relative_path: str
    file_offset: int
    length: int


@dataclass
class _StoredKey:
    fqn: str
    dtype: torch.dtype
    size: Shape                          # stored (possibly N-D reformulated) shape
    chunks: List[_Stored]
    orig_shape: Optional[Shape] = None   # set for flattened (N-D reformulated) keys
    flat_index: Dict[Shape, List[_Stored]] = field(default_factory=dict)

    @property
    def logical_shape(self) -> Shape:
        return self.orig_shape if self.orig_shape is not None else self.size

    @property
    def chunk_local_shape(self) -> Shape:
        """For a flattened key: the shape of one chunk of the original tensor's grid."""
        return tuple(o // g for o, g in zip(self.orig_shape, self.size[:-1]))


class _Plan:
    """Copy operations grouped by stored chunk, plus finalizers that run once all are read."""

    def __init__(self) -> None:
        self.ops: Dict[_Stored, List[Tuple[str, Callable[[torch.Tensor], None]]]] = defaultdict(list)
        self.finalizers: List[Callable[[], None]] = []

    def add(self, stored: _Stored, fqn: str, op: Callable[[torch.Tensor], None]) -> None:
        self.ops[stored].append((fqn, op))


def _index(md: Metadata) -> Dict[str, Any]:
    orig = _orig_shapes(md)
    per_key: Dict[str, List[_Stored]] = defaultdict(list)
    objects: Dict[str, _Stored] = {}
    for index, info in md.storage_data.items():
        st = _Stored(tuple(index.offset) if index.offset is not None else (),
                     (), info.relative_path, info.offset, info.length)
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
        chunks = []
        for c in meta.chunks:
            st = by_offset.get(tuple(c.offsets))
            if st is None:
                raise CheckpointingException(
                    f"key {fqn!r}: chunk at {list(c.offsets)} has no storage record in .metadata")
            chunks.append(_Stored(tuple(c.offsets), tuple(c.sizes), st.relative_path, st.file_offset, st.length))
        key = _StoredKey(fqn, meta.properties.dtype, tuple(meta.size), chunks, orig.get(fqn))
        if key.orig_shape is not None:
            for c in chunks:
                key.flat_index.setdefault(c.offset[:-1], []).append(c)
            for lst in key.flat_index.values():
                lst.sort(key=lambda c: c.offset[-1])
        out[fqn] = key
    return out


def _fresh_name(checkpoint_dir: Path, name: str) -> str:
    stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
    n = 1
    while (checkpoint_dir / f"{stem}.r{n}{DATA_SUFFIX}").exists():
        n += 1
    return f"{stem}.r{n}{DATA_SUFFIX}"


def _needs_staging(t: torch.Tensor) -> bool:
    """True if copies cannot go into ``t`` directly (subclass, e.g. FP8 wrappers, or non-contiguous)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_contiguous()


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``torch_dist`` checkpoints (distckpt's and Megatron-Core's), resharding on the fly.

    Args:
        trusted: unpickle ``.metadata`` and object payloads without the allowlist.
        thread_count: files read in parallel.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, trusted: bool = False,
                 thread_count: int = 4):
        super().__init__(backend, version)
        self.trusted = trusted
        self.thread_count = thread_count

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    # ----------------------------------------------------------------- metadata queries

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        md = read_metadata(checkpoint_dir, self.trusted)
        orig = _orig_shapes(md)
        out = {}
        for fqn, meta in md.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                shape = orig.get(fqn, tuple(meta.size))
                out[fqn] = ShardedTensor.from_rank_offsets(
                    fqn, torch.empty(shape, dtype=meta.properties.dtype, device="meta"))
        return out

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        md = read_metadata(checkpoint_dir, self.trusted)
        out = self.load_tensors_metadata(checkpoint_dir)
        for fqn, meta in md.state_dict_metadata.items():
            if isinstance(meta, BytesStorageMetadata):
                try:
                    out[fqn] = ShardedObject.empty_from_unique_key(fqn)
                except CheckpointingException:
                    logger.warning("%s: byte item %r is not a ShardedObject key; skipped", checkpoint_dir, fqn)
        return out

    # ----------------------------------------------------------------- surgery

    def remove_sharded_tensors(self, checkpoint_dir: Path, key_prefix: str) -> None:
        """Drop every key starting with ``key_prefix`` (tensors and objects) from the checkpoint.

        Crash-safe order: data files that mix kept and removed items are first rewritten under new
        names, then ``.metadata`` is replaced atomically, and only then are the old files deleted.
        Saving with ``separation_hint=key_prefix`` puts such keys in files of their own, so no
        byte has to be rewritten.
        """
        checkpoint_dir = Path(checkpoint_dir)
        md = read_metadata(checkpoint_dir, self.trusted)
        doomed = {k for k in md.state_dict_metadata if k.startswith(key_prefix)}
        if not doomed:
            raise CheckpointingException(f"{checkpoint_dir}: no key starts with {key_prefix!r}")
        by_file: Dict[str, List[Tuple[MetadataIndex, _StorageInfo]]] = defaultdict(list)
        for index, info in md.storage_data.items():
            by_file[info.relative_path].append((index, info))
        to_delete, rewritten_bytes = [], 0
        new_storage = {i: info for i, info in md.storage_data.items() if i.fqn not in doomed}
        for name, entries in sorted(by_file.items()):
            kept = [(i, info) for i, info in entries if i.fqn not in doomed]
            if len(kept) == len(entries):
                continue
            to_delete.append(name)
            if not kept:
                continue
            new_name = _fresh_name(checkpoint_dir, name)
            with open(checkpoint_dir / name, "rb") as src, open(checkpoint_dir / new_name, "wb") as dst:
                for index, info in sorted(kept, key=lambda e: e[1].offset):
                    src.seek(info.offset)
                    data = src.read(info.length)
                    if len(data) != info.length:
                        raise CheckpointingException(f"{checkpoint_dir / name}: truncated at item {index.fqn!r}")
                    new_storage[index] = _StorageInfo(new_name, dst.tell(), info.length)
                    dst.write(data)
                    rewritten_bytes += info.length
                dst.flush()
                os.fsync(dst.fileno())
        if rewritten_bytes:
            logger.warning("%s: rewrote %d bytes of kept tensors that shared files with keys under %r; "
                           "save with separation_hint=%r to make removal free", checkpoint_dir,
                           rewritten_bytes, key_prefix, key_prefix)
        md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k not in doomed}
        md.storage_data = new_storage
        mcore = getattr(md, "mcore_data", None)
        if mcore:
            md.mcore_data = {k: v for k, v in mcore.items() if k not in doomed}
        atomic_write_bytes(checkpoint_dir / METADATA_FNAME, pickle.dumps(md))
        for name in to_delete:
            os.remove(checkpoint_dir / name)

    # ----------------------------------------------------------------- planning

    def _plan_tensor(self, plan: _Plan, sh: ShardedTensor, stored: _StoredKey, dest: torch.Tensor) -> None:
        full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        logical = stored.logical_shape
        if tuple(sh.global_shape) != logical:
            if not sh.allow_shape_mismatch:
                raise CheckpointingException(
                    f"ShardedTensor {sh.key!r}: global shape {list(sh.global_shape)} was requested but "
                    f"the checkpoint stores {list(logical)} (set allow_shape_mismatch=True to load "
                    f"the overlap and zero the rest)")
            dest.zero_()
        if sh.flattened_range is None:
            pieces = [(tuple(sh.global_offset), full_local, dest.view(full_local))]
        else:
            start, stop = sh.flattened_range.start, sh.flattened_range.stop
            if stored.orig_shape is not None and stored.chunk_local_shape == full_local \
                    and tuple(sh.global_shape) == logical:
                self._plan_flat_to_flat(plan, sh, stored, dest, full_local, start, stop)
                return
            pieces = [
                (tuple(g + o for g, o in zip(sh.global_offset, off)), size, dest[p:p + math.prod(size)].view(size))
                for off, size, p in flat_range_boxes(full_local, start, stop)
            ]
        for off, size, view in pieces:
            if stored.orig_shape is None:
                self._plan_box_from_regular(plan, sh.key, stored, off, size, view)
            else:
                self._plan_box_from_flat(plan, sh.key, stored, off, size, view)

    @staticmethod
    def _plan_box_from_regular(plan, key, stored: _StoredKey, off, size, view) -> None:
        for ch in stored.chunks:
            inter = _intersect(off, size, ch.offset, ch.size)
            if inter is None:
                continue
            src_sl = _rel_slices(*inter, ch.offset)
            dst = view[_rel_slices(*inter, off)]

            def op(src, dst=dst, src_sl=src_sl, shape=ch.size):
                dst.copy_(src.reshape(shape)[src_sl])

            plan.add(ch, key, op)

    @staticmethod
    def _plan_flat_to_flat(plan, sh, stored: _StoredKey, dest, full_local, start, stop) -> None:
        grid_index = tuple(o // s for o, s in zip(sh.global_offset, full_local))
        for ch in stored.flat_index.get(grid_index, []):
            s = ch.offset[-1]
            e = s + ch.size[-1]
            lo, hi = max(s, start), min(e, stop)
            if hi <= lo:
                continue

            def op(src, lo=lo, hi=hi, s=s):
                dest[lo - start:hi - start].copy_(src.reshape(-1)[lo - s:hi - s])

            plan.add(ch, sh.key, op)

    @staticmethod
    def _plan_box_from_flat(plan, key, stored: _StoredKey, off, size, view) -> None:
        chunk = stored.chunk_local_shape
        grid = stored.size[:-1]
        ranges = [range(o // c, min(g, -(-(o + s) // c))) for o, s, c, g in zip(off, size, chunk, grid)]
        row = math.prod(chunk[1:])
        for idx in itertools.product(*ranges):
            chunk_off = tuple(i * c for i, c in zip(idx, chunk))
            inter = _intersect(off, size, chunk_off, chunk)
            if inter is None:
                continue
            lo = tuple(a - b for a, b in zip(inter[0], chunk_off))
            hi = tuple(a + b for a, b in zip(lo, inter[1]))
            f_lo = _ravel(lo, chunk)
            f_hi = _ravel([h - 1 for h in hi], chunk) + 1
            base = lo[0] * row
            rows = hi[0] - lo[0]
            buf = torch.empty(rows * row, dtype=stored.dtype)
            covered = 0
            for ch in stored.flat_index.get(idx, []):
                s = ch.offset[-1]
                e = s + ch.size[-1]
                a, b = max(s, f_lo), min(e, f_hi)
                if b <= a:
                    continue
                covered += b - a

                def op(src, a=a, b=b, s=s, buf=buf, base=base):
                    buf[a - base:b - base].copy_(src.reshape(-1)[a - s:b - s])

                plan.add(ch, key, op)
            if covered != f_hi - f_lo:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: stored flattened ranges of chunk {list(idx)} do not cover "
                    f"elements [{f_lo}, {f_hi}) needed for this load")
            sub = (slice(0, rows),) + tuple(slice(a, b) for a, b in zip(lo[1:], hi[1:]))
            dst = view[_rel_slices(*inter, off)]

            def fin(dst=dst, buf=buf, sub=sub, rows=rows):
                dst.copy_(buf.view((rows,) + tuple(chunk[1:]))[sub])

            plan.finalizers.append(fin)

    # ----------------------------------------------------------------- execution

    def _execute(self, plan: _Plan, checkpoint_dir: Path) -> None:
        by_file: Dict[str, List[_Stored]] = defaultdict(list)
        for st in plan.ops:
            by_file[st.relative_path].append(st)

        def read_file(name: str) -> None:
            path = checkpoint_dir / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                keys = sorted({k for st in by_file[name] for k, _ in plan.ops[st]})
                raise CheckpointingException(
                    f"{path}: data file is missing (needed for keys {keys}, rank {dist.get_rank()})") from None
            try:
                for st in sorted(by_file[name], key=lambda s: s.file_offset):
                    ops = plan.ops[st]
                    raw = os.pread(fd, st.length, st.file_offset)
                    what = f"key {ops[0][0]!r} in {path} at offset {st.file_offset} (rank {dist.get_rank()})"
                    if len(raw) != st.length:
                        raise CheckpointingException(
                            f"{what}: file is truncated ({len(raw)} of {st.length} bytes readable)")
                    tensor = safe_torch_load(raw, what=what)
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointingException(f"{what}: stored item is not a tensor")
                    for _, op in ops:
                        op(tensor)
            finally:
                os.close(fd)

        names = sorted(by_file)
        if len(names) <= 1 or self.thread_count <= 1:
            for n in names:
                read_file(n)
        else:
            with ThreadPoolExecutor(max_workers=min(self.thread_count, len(names))) as pool:
                for fut in [pool.submit(read_file, n) for n in names]:
                    fut.result()
        for fin in plan.finalizers:
            fin()

    def _load_object(self, obj: ShardedObject, stored: Optional[_Stored], checkpoint_dir: Path) -> Any:
        if stored is None:
            raise CheckpointingException(
                f"ShardedObject {obj.unique_key!r} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})")
        path = checkpoint_dir / stored.relative_path
        what = f"ShardedObject {obj.unique_key!r} in {path} (rank {dist.get_rank()})"
        try:
            with open(path, "rb") as f:
                f.seek(stored.file_offset)
                raw = f.read(stored.length)
        except FileNotFoundError:
            raise CheckpointingException(f"{what}: data file is missing") from None
        if len(raw) != stored.length:
            raise CheckpointingException(f"{what}: file is truncated")
        value = safe_torch_load(raw, what=what, trusted=self.trusted)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        md = read_metadata(checkpoint_dir, self.trusted)
        index = _index(md)
        plan = _Plan()
        commits: List[Callable[[], None]] = []

        def prepare(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                return sh
            if not isinstance(sh, ShardedTensor):
                return sh
            stored = index.get(sh.key)
            if not isinstance(stored, _StoredKey):
                raise CheckpointingException(
                    f"ShardedTensor {sh.key!r} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})")
            if sh.data is None:
                sh.init_data("cpu")
            target = sh.data
            if _needs_staging(target):
                dest = torch.empty(tuple(target.shape), dtype=target.dtype, device=target.device)
                commits.append(lambda t=target, d=dest: t.copy_(d))
            else:
                dest = target
            self._plan_tensor(plan, sh, stored, dest)
            return sh

        dict_list_map_inplace(prepare, sharded_state_dict)
        self._execute(plan, checkpoint_dir)
        for commit in commits:
            commit()

        def result(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return sh.data
            if isinstance(sh, ShardedObject):
                return self._load_object(sh, index.get(sh.unique_key), checkpoint_dir)
            return sh

        return dict_list_map_inplace(result, sharded_state_dict)


register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy)
register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy)
