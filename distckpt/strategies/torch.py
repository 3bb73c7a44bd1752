"""The ``torch_dist`` strategy: PyTorch DCP's on-disk format, file-compatible with Megatron-Core.

On disk (see docs/formats.md):
  ``__R_B.distcp``  rank R's bucket B: a sequence of items, each a complete ``torch.save``
                    archive of one chunk (tensors) or ``torch.save([obj])`` (ShardedObjects)
  ``__R_B.distcp.crc``  the CRC32C of every 256 KiB block of the file's large tensor items, so a
                    partial (resharded) read from an object store is checked (see blockcrc.py)
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

import dataclasses
import hashlib
import io
import itertools
import logging
import math
import mmap
import os
import pickle
import threading
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

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

from distckpt import bounds, containment, dist, storage, timings
from distckpt.budget import cores_per_rank, host_memory_budget
from distckpt.core import CheckpointingException, atomic_write_bytes, gc_paused
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.manifest import (
    MANIFEST_FNAME,
    Manifest,
    RangeChecksum,
    build_manifest,
    check_whole_file,
    crc32c,
    dtype_name,
    read_declared_keys,
    read_manifest,
    write_manifest,
)
from distckpt.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from distckpt.strategies import blockcrc, device_io, tiling
from distckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from distckpt.strategies.common import safe_torch_load
from distckpt.strategies.device_io import HostBounce
from distckpt.strategies.filesystem import (
    CRC_PIECE,
    ChecksummingSink,
    WriterSink,
    byte_view,
    contiguous_strides,
    copy_framed_from,
    framed_layout,
    pread_exact,
    pread_into,
    read_archive_layout,
    read_framed_crc,
    read_framed_into,
    write_bytes_item,
    write_tensor_item,
    zip_crc_disabled,
)
from distckpt.strategies.index import (
    INDEX_FNAME,
    IndexReader,
    IndexTemplate,
    build_index_from_rows,
    index_from_metadata,
)
from distckpt.strategies.index import _dtype_of as _sidecar_dtype
from distckpt.strategies.metadata_pickle import pickle_metadata, respell

logger = logging.getLogger(__name__)

METADATA_FNAME = ".metadata"
DATA_SUFFIX = ".distcp"
# Bytes one reader thread fetches from an object store at a time (ranged GETs).
REMOTE_READ_BATCH = 256 << 20
_ORIG_SHAPE = "nd_reformulated_orig_global_shape"

Shape = Tuple[int, ...]


# --------------------------------------------------------------------------- .metadata I/O


# The module path under which Megatron-Core 0.15 pickles its metadata classes into `.metadata`.
_MCORE_TORCH_STRATEGY = "megatron" + ".core.dist_checkpointing.strategies.torch"


class _MetadataUnpickler(pickle.Unpickler):
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


def _location(checkpoint_dir):
    """A local directory as a Path, a store as itself."""
    return checkpoint_dir if isinstance(checkpoint_dir, storage.Store) else Path(checkpoint_dir)


def _surgery_file_size(location, name: str, source) -> Optional[int]:
    """Size of a data file surgery reads or deletes, None when it is missing; refuses (naming it)
    what is not a regular file beneath the checkpoint, as a read would."""
    if isinstance(location, storage.Store):
        try:
            return location.size(bounds.relative_name(name, source))
        except FileNotFoundError:
            return None
    try:
        fd = containment.open_beneath(location, name, source)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _stored_file_size(checkpoint_dir, relative_path: str, source) -> int:
    """Size of a data file a checkpoint's metadata names, refusing names (and, locally, symlinks)
    that lead outside the checkpoint. Raises FileNotFoundError for a missing file."""
    if isinstance(checkpoint_dir, storage.Store):
        return checkpoint_dir.size(bounds.relative_name(relative_path, source))
    return containment.size_beneath(checkpoint_dir, relative_path, source)


def read_metadata(checkpoint_dir, trusted: bool = False, verify: bool = False) -> Metadata:
    """Read ``.metadata`` with a restricted unpickler (any class if ``trusted``); with ``verify``
    check it against the manifest first."""
    checkpoint_dir = _location(checkpoint_dir)
    raw = _metadata_bytes(checkpoint_dir, trusted, verify)
    return _unpickled(raw, storage.join(checkpoint_dir, METADATA_FNAME), trusted)


def _metadata_bytes(checkpoint_dir, trusted: bool, verify: bool) -> bytes:
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


def _unpickled(raw: bytes, path: Any, trusted: bool) -> Metadata:
    try:
        md = pickle.loads(raw) if trusted else _MetadataUnpickler(io.BytesIO(raw)).load()
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


def _what_differs(raw: bytes, checkpoint_dir, trusted: bool) -> str:
    """For a ``.metadata`` that fails its manifest checksum: the claims in which it disagrees
    with the manifest (:func:`cross_check`), as text to add to the error; empty when it cannot
    be read or its claims agree (the damage is elsewhere in the file)."""
    path = storage.join(checkpoint_dir, METADATA_FNAME)
    try:
        md = _unpickled(raw, path, trusted)
        check_claims(md, path)
        manifest = read_manifest(checkpoint_dir)
    except CheckpointingException:
        return ""
    problems = (
        cross_check(md, manifest, path, storage.join(checkpoint_dir, MANIFEST_FNAME)) if manifest else []
    )
    return "".join(f"; {p}" for p in problems[:3])


def checked_metadata(checkpoint_dir, trusted: bool = False) -> Metadata:
    """``.metadata`` for a tool that writes a new checkpoint from it (``remove_sharded_tensors``,
    ``distckpt rename``): its claims checked as a load checks them (:func:`_index`) and, where
    the checkpoint has an integrity manifest, the file against its CRC32C and every claim
    against what the manifest says the writer wrote (:func:`cross_check`). Such a tool writes a
    fresh manifest describing what it wrote: damage it carried over would be laundered into a
    checkpoint that verifies, so it is refused here, naming the files, before anything changes."""
    checkpoint_dir = _location(checkpoint_dir)
    md = read_metadata(checkpoint_dir, trusted, verify=True)
    _index(md, storage.join(checkpoint_dir, METADATA_FNAME))
    TorchDistLoadShardedStrategy._cross_check(md, checkpoint_dir)
    if isinstance(checkpoint_dir, Path):
        # The files such a tool replaces: what is there must be a file (or a link) to replace.
        for name in (INDEX_FNAME, MANIFEST_FNAME):
            path = checkpoint_dir / name
            if os.path.lexists(path) and not (path.is_symlink() or path.is_file()):
                raise CheckpointingException(
                    f"{path}: not a regular file; refusing to replace it (nothing was changed)"
                )
    return md


def _tensors_metadata(md: Metadata) -> ShardedStateDict:
    """key -> data-free ShardedTensor of the whole tensor (original shape for flattened keys)."""
    orig = _orig_shapes(md)
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
        if not isinstance(meta, BytesStorageMetadata) or _is_object_key(fqn):
            continue
        path = planner_data.get(fqn)
        out[fqn] = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
    return out


def _is_object_key(fqn: str) -> bool:
    try:
        ShardedObject.empty_from_unique_key(fqn)
    except CheckpointingException:
        return False
    return True


def _set_at_path(root: Dict[Any, Any], path: Tuple[Any, ...], value: Any) -> None:
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


def _orig_shapes(md: Metadata) -> Dict[str, Shape]:
    mcore = getattr(md, "mcore_data", None) or {}
    if not isinstance(mcore, dict):
        return {}
    return {k: tuple(v[_ORIG_SHAPE]) for k, v in mcore.items() if isinstance(v, dict) and _ORIG_SHAPE in v}


# --------------------------------------------------------------------------- box geometry


def _intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> Optional[Tuple[Shape, Shape]]:
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
    chunk_offset: Shape  # () for byte items
    chunk_size: Shape
    payload: Any  # a CPU tensor of shape chunk_size, or bytes; None until staged
    nbytes: int
    source: Optional[torch.Tensor] = None  # what to copy into ``payload`` when its wave comes
    copies: bool = False  # materializing ``source`` copies nbytes into host memory


@dataclass
class _KeyDecl:
    """What rank 0 needs to describe a key in ``.metadata`` even if it holds no chunk of it."""

    is_bytes: bool
    dtype: Optional[torch.dtype] = None
    size: Shape = ()
    orig_shape: Optional[Shape] = None


@dataclass(frozen=True)
class _Record:
    """Where one item landed. Everything but ``crc32c`` is the save's *structure*."""

    fqn: str
    chunk_offset: Shape
    chunk_size: Shape
    relative_path: str
    offset: int
    length: int
    crc32c: int = 0

    def structure(self) -> Tuple:
        return (self.fqn, self.chunk_offset, self.chunk_size, self.relative_path, self.offset, self.length)


Wave = List[Tuple[str, List[_WriteItem]]]


@dataclass
class SavePlan:
    """One rank's part of a save: what to write where. Built by ``prepare``, filled by
    :func:`write_plan` (no collectives; may run in a background thread), committed by
    ``finalize`` (collective).

    Items are copied to host memory (staged) wave by wave, at most ``budget`` bytes of copies
    at once (one item larger than the budget makes a wave of its own): every wave but the last
    is written by :func:`write_waves` (the blocking part of an async save); ``write_plan`` writes
    the ``pending`` wave and closes the files. The files' bytes do not depend on the waves.
    """

    checkpoint_dir: Path
    rank: int
    jobs: List[Tuple[str, List[_WriteItem]]]
    decls: Dict[str, _KeyDecl]
    records: List[_Record] = field(default_factory=list)
    file_sizes: Dict[str, int] = field(default_factory=dict)  # data files and block tables
    table_crcs: Dict[str, int] = field(default_factory=dict)  # block table name -> its CRC32C
    written: bool = False
    staged: Optional[Any] = None  # the StagedBatch holding the pending wave's staged copies
    staging: Optional[Any] = None  # the StagingBuffers pool (async saves), None: plain copies
    pending: Optional[Wave] = None  # the wave write_plan writes (None: every job, all of it)
    outputs: Dict[str, Any] = field(default_factory=dict)  # file name -> open _Output
    error: Optional[BaseException] = None  # a failure of the blocking waves, raised by write_plan
    waves: int = 1  # how many waves the save was cut into


def _standalone_cpu(t: torch.Tensor, shape: Shape, staging: Optional[Any]) -> torch.Tensor:
    """A CPU tensor of ``shape`` owning exactly its bytes (torch.save writes whole storages).

    ``staging``: a StagingBuffers pool; when given, the bytes are always copied into one of its
    buffers (an async save must not see later mutations of the caller's tensors).
    """
    t = t.detach()
    if staging is not None:
        return staging.acquire(t).reshape(shape)
    if t.device.type != "cpu":
        return t.to("cpu").reshape(shape)
    t = t.reshape(shape)
    if not _owns_its_bytes(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _is_plain(t: torch.Tensor) -> bool:
    """A plain tensor or parameter, not a subclass (e.g. an FP8 wrapper with a scale)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _owns_its_bytes(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _tensor_item(sh: ShardedTensor, stage: bool) -> Tuple[Optional[_WriteItem], _KeyDecl]:
    """The item of ``sh``, its bytes not yet copied (``source``); ``stage``: always copy them."""
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
    data = sh.data.detach()
    if not _is_plain(data):
        # A tensor subclass (e.g. FP8 with a scale): store its values in the nominal dtype
        # without touching the caller's object.
        data = data.reshape(-1).to(sh.dtype)
    copies = stage or data.device.type != "cpu" or not _owns_its_bytes(data)
    nbytes = math.prod(size) * data.element_size()
    return _WriteItem(sh.key, offset, size, None, nbytes, source=data, copies=copies), decl


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


def plan_waves(jobs: List[Tuple[str, List[_WriteItem]]], budget: Optional[int]) -> List[Wave]:
    """Cut the jobs into waves of at most ``budget`` bytes of copies; each file's items keep
    their order (a wave takes the next items of every file in turn, so its files are written in
    parallel). ``budget`` None: one wave."""
    if budget is None or sum(it.nbytes for _, b in jobs for it in b if it.copies) <= budget:
        return [[(name, list(bucket)) for name, bucket in jobs]]
    queues = [(name, list(bucket)) for name, bucket in jobs]
    positions = [0] * len(queues)
    waves: List[Wave] = []
    current: Dict[str, List[_WriteItem]] = {}
    used = 0
    while any(p < len(q) for p, (_, q) in zip(positions, queues)):
        for j, (name, queue) in enumerate(queues):
            if positions[j] >= len(queue):
                continue
            it = queue[positions[j]]
            cost = it.nbytes if it.copies else 0
            if used and used + cost > budget:
                waves.append([(n, items) for n, items in current.items()])
                current, used = {}, 0
            current.setdefault(name, []).append(it)
            used += cost
            positions[j] += 1
    if current:
        waves.append([(n, items) for n, items in current.items()])
    return waves


class _Output:
    """One ``.distcp`` file being written across waves: a raw fd (local) or a store's streaming
    writer; the sink keeps the position and checksum between waves."""

    def __init__(self, location, name: str):
        self.name = name
        self.location = location
        self.written: List[Tuple[_WriteItem, int, int, int]] = []
        self.blocks: List[blockcrc.Entry] = []  # per-block CRC32Cs of the large tensor items
        self.table: Optional[Tuple[str, int, int]] = None  # the block table written: name, size, CRC
        self.fd = -1
        self.writer = None
        if isinstance(location, storage.Store):
            self.writer = location.open_writer(name)
            self.sink: ChecksummingSink = WriterSink(self.writer)
        else:
            self.fd = os.open(location / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self.sink = ChecksummingSink(self.fd)

    def write(self, items: List[_WriteItem]) -> None:
        for it in items:
            if isinstance(it.payload, torch.Tensor):
                self.written.append((it, *write_tensor_item(self.sink, it.payload, self.blocks)))
            else:
                self.written.append((it, *write_bytes_item(self.sink, it.payload)))

    def close(self) -> int:
        """Make the file (and its block table, if it has large items) complete and durable;
        returns the file's size."""
        if self.writer is not None:
            self.sink.drain()
            self.writer.close()
        else:
            try:
                self.sink.fsync()
            finally:
                os.close(self.fd)
                self.fd = -1
        if self.blocks:
            data = blockcrc.encode(self.blocks)
            name = blockcrc.table_name(self.name)
            storage.write_bytes(self.location, name, data)
            self.table = (name, len(data), crc32c(data))
        return self.sink.position

    def abort(self) -> None:
        try:
            if self.writer is not None:
                self.writer.abort()
            elif self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        except Exception:  # noqa: BLE001 - the first error is the one reported
            logger.debug("closing %s after a failure", self.name, exc_info=True)


def _stage_wave(plan: SavePlan, wave: Wave) -> Optional[Any]:
    """Copy the wave's items to host memory (into the pool when there is one); returns the
    pool's batch to release once written."""
    if plan.staging is not None:
        needed: Dict[Any, int] = defaultdict(int)
        for _, items in wave:
            for it in items:
                if it.source is not None and it.copies:
                    needed[plan.staging.key_of(it.source)] += 1
        plan.staging.keep_only(needed)
    for _, items in wave:
        for it in items:
            if it.source is not None:
                src = it.source
                it.payload = _standalone_cpu(src, it.chunk_size, plan.staging if it.copies else None)
                it.source = None
    return plan.staging.seal() if plan.staging is not None else None


def _write_wave(plan: SavePlan, wave: Wave, pool: Optional[ThreadPoolExecutor], last: bool) -> None:
    def one(name: str, items: List[_WriteItem]) -> None:
        out = plan.outputs.get(name)
        if out is None:
            out = plan.outputs[name] = _Output(plan.checkpoint_dir, name)
        out.write(items)
        for it in items:
            it.payload = None
        if last:
            plan.file_sizes[name] = out.close()
            if out.table is not None:
                table, size, crc = out.table
                plan.file_sizes[table] = size
                plan.table_crcs[table] = crc

    names = dict(wave)
    if last:  # every file closes in the last wave, also those it adds nothing to
        names = {name: names.get(name, []) for name, _ in plan.jobs}
    if pool is None:
        for name, items in names.items():
            one(name, items)
        return
    for fut in [pool.submit(one, name, items) for name, items in names.items()]:
        fut.result()


def _abort_outputs(plan: SavePlan) -> None:
    for out in plan.outputs.values():
        out.abort()
    plan.outputs.clear()


# Files per rank of a save that does not say (Megatron-Core's default thread_count).
DEFAULT_FILES_PER_RANK = 2
# Files a load reads at once when it does not say (at most; see reader_threads).
DEFAULT_READERS_PER_RANK = 4


def _thread_count(thread_count: Optional[int], default: int) -> Tuple[int, bool]:
    """A strategy's ``thread_count`` argument checked: (the count, whether it was given)."""
    if thread_count is None:
        return default, False
    if not isinstance(thread_count, int) or thread_count < 1:
        raise CheckpointingException(f"thread_count must be an integer >= 1 or None, got {thread_count!r}")
    return thread_count, True


def _io_threads(count: int, given: bool, checkpoint_dir) -> int:
    """Threads that write or read ``count`` files at once: all of them if the count was given
    or the location is an object store (each request waits on the network); by default on a
    file system at most :func:`distckpt.budget.cores_per_rank` (page-cache I/O is memory
    copies, which more threads than cores only interleave)."""
    if given or isinstance(checkpoint_dir, storage.Store):
        return count
    return max(1, min(count, cores_per_rank()))


# A plan with at most this many bytes is written by the calling thread, file after file: for a few
# MB, starting and feeding writer threads costs more than the writes themselves.
INLINE_WRITE_BYTES = 4 << 20


@contextmanager
def _writer_pool(plan: SavePlan, thread_count: int) -> Iterator[Optional[ThreadPoolExecutor]]:
    """The writer threads of ``plan`` (one per file up to ``thread_count``), or None: write
    inline (a single file, one thread, or a small plan)."""
    workers = max(1, min(thread_count, len(plan.jobs)))
    if workers == 1 or sum(it.nbytes for _, items in plan.jobs for it in items) <= INLINE_WRITE_BYTES:
        yield None
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield pool


def write_waves(plan: SavePlan, waves: List[Wave], thread_count: int) -> None:
    """The blocking part of a bounded async save: stage and write every wave but the last, then
    stage the last one, which ``write_plan`` writes. A failure is kept in the plan and raised by
    ``write_plan`` (so every rank learns of it at finalization)."""
    plan.waves = len(waves)
    try:
        with zip_crc_disabled(), _writer_pool(plan, thread_count) as pool:
            for wave in waves[:-1]:
                staged = _stage_wave(plan, wave)
                try:
                    _write_wave(plan, wave, pool, last=False)
                finally:
                    if staged is not None:
                        staged.release()
        plan.pending = waves[-1]
        plan.staged = _stage_wave(plan, plan.pending)
    except Exception as e:  # noqa: BLE001 - raised by write_plan, shared at finalization
        plan.error = e
        _abort_outputs(plan)
        if plan.staged is not None:
            plan.staged.release()
            plan.staged = None
        if plan.staging is not None:
            plan.staging.seal().release()  # this save's unsealed copies (another save's stay out)


def write_plan(plan: SavePlan, thread_count: int = 2, budget: Optional[int] = None) -> SavePlan:
    """Write the files of ``plan`` (threads, one per file up to ``thread_count``); no collectives.

    Writes what is left: the pending wave of an async save, or (a plain save) every item, in
    waves of at most ``budget`` bytes of host copies (None: :func:`distckpt.budget.host_memory_budget`).
    """
    try:
        if plan.error is not None:
            raise plan.error
        with zip_crc_disabled(), _writer_pool(plan, thread_count) as pool:
            if plan.pending is not None:
                _write_wave(plan, plan.pending, pool, last=True)
            else:
                if budget is None:
                    budget = host_memory_budget()
                waves = plan_waves(plan.jobs, budget)
                plan.waves = len(waves)
                for i, wave in enumerate(waves):
                    staged = _stage_wave(plan, wave)
                    try:
                        _write_wave(plan, wave, pool, last=i == len(waves) - 1)
                    finally:
                        if staged is not None:
                            staged.release()
    except BaseException:
        _abort_outputs(plan)
        raise
    finally:
        if plan.staged is not None:
            plan.staged.release()  # the next save may reuse the buffers now
            plan.staged = None
    records: List[_Record] = []
    for name, _ in plan.jobs:
        for it, start, length, crc in plan.outputs[name].written:
            records.append(_Record(it.fqn, it.chunk_offset, it.chunk_size, name, start, length, crc))
    plan.outputs.clear()
    plan.records = records
    plan.written = True
    return plan


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas in DCP format (``torch_dist``, version 1).

    Args:
        thread_count: files per rank, each written by its own thread. Default (None): 2 files,
            written by at most as many threads as this rank has cores
            (:func:`distckpt.budget.cores_per_rank`): writes to a page cache are memory copies,
            and on 2 cores shared by 2 ranks a second writer per rank slowed the writes by up to
            16% (docs/performance.md). A number given here is used as it is, threads included:
            more threads than cores pay off where writes wait on the storage, not on the CPU.
        separation_hint: keys starting with this prefix go to separate files named
            ``<hint>__R_B.distcp`` so they can later be dropped without rewriting the rest.
        cached_metadata: remember this save's structure; a later save through the same strategy
            object whose ranks wrote exactly the same items sends only checksums to rank 0,
            which reuses their cached records and the last ``.metadata`` (its two ids changed).
        stage_cpu_tensors: for async saves, copy CPU tensors into reused staging buffers (the
            blocking part of the save). False writes them from the caller's memory: the caller
            then promises not to change them until the save is finalized. CUDA tensors are
            always staged (into pinned host buffers).
        write_index: rank 0 also writes the sidecar index ``.distckpt_index`` (the chunk
            records in a layout a loading rank reads partially; see docs/formats.md).
    """

    records_phases = True  # distckpt.timings: it begins its own phases (planning, writing, commit)

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        thread_count: Optional[int] = None,
        separation_hint: Optional[str] = None,
        cached_metadata: bool = False,
        stage_cpu_tensors: bool = True,
        write_index: bool = True,
    ):
        super().__init__(backend, version)
        self.write_index = write_index
        self.stage_cpu_tensors = stage_cpu_tensors
        self._staging = None
        self.thread_count, self._threads_given = _thread_count(thread_count, DEFAULT_FILES_PER_RANK)
        self.separation_hint = separation_hint
        self.cached_metadata = cached_metadata
        # This rank's last structure, and on rank 0 every rank's record table.
        self._local_structure: Optional[Tuple] = None
        self._global_cache: Optional[List[Tuple[RecordTable, Dict[str, int]]]] = None
        # Rank 0: the last ``.metadata`` written (respelled in place by the next save of the
        # same items), its head's length, its checkpoint id and save id.
        self._metadata_cache: Optional[Tuple[bytearray, int, str, str]] = None
        self._index_template: Optional[IndexTemplate] = None  # the last sidecar, for cached_metadata
        self.last_save_reused_metadata = False
        self._commit: Optional[Tuple[Dict[str, Tuple[int, int]], Callable[[], None]]] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def prepare(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, stage: bool = False
    ) -> SavePlan:
        """Collect this rank's main replicas into files; ``stage``: their bytes will be copied into
        staging buffers (an async save). Nothing is copied yet: that happens wave by wave."""
        checkpoint_dir = _location(checkpoint_dir)
        rank = dist.get_rank()
        staging = None
        if stage:
            from distckpt.strategies.async_utils import StagingBuffers

            if self._staging is None:
                self._staging = StagingBuffers()
            staging = self._staging
        items: List[_WriteItem] = []
        decls: Dict[str, _KeyDecl] = {}
        for sh in nested_values(sharded_state_dict):
            if not is_main_replica(sh.replica_id):
                continue
            if isinstance(sh, ShardedTensor):
                on_cpu = sh.data is not None and sh.data.device.type == "cpu"
                item, decl = _tensor_item(sh, stage and not (on_cpu and not self.stage_cpu_tensors))
                decls[sh.key] = decl
            elif isinstance(sh, ShardedObject):
                item, decl = _object_item(sh)
                decls[sh.unique_key] = decl
            else:
                raise CheckpointingException(f"cannot save {type(sh).__name__} under key {sh.key!r}")
            if item is not None:
                items.append(item)
        groups: Dict[str, List[_WriteItem]] = defaultdict(list)
        for it in items:
            hint = self.separation_hint
            groups[hint if hint and it.fqn.startswith(hint) else ""].append(it)
        jobs = []
        for prefix, group in sorted(groups.items()):
            for b, bucket in enumerate(_buckets(group, self.thread_count)):
                jobs.append((f"{prefix}__{rank}_{b}{DATA_SUFFIX}", bucket))
        return SavePlan(checkpoint_dir, rank, jobs, decls, staging=staging)

    def writer_threads(self, checkpoint_dir=None) -> int:
        """Threads that write this rank's ``thread_count`` files (see :func:`_io_threads`)."""
        return _io_threads(self.thread_count, self._threads_given, checkpoint_dir)

    def _plan_and_write(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path
    ) -> Tuple[Optional[SavePlan], Optional[BaseException]]:
        """Plan and write this rank's files; a failure is returned, to be shared in finalize."""
        timings.begin("planning")
        try:
            plan = self.prepare(sharded_state_dict, checkpoint_dir)
            timings.begin("writing")
            return write_plan(plan, self.writer_threads(plan.checkpoint_dir)), None
        except Exception as e:  # noqa: BLE001 - shared with every rank in finalize
            return None, e

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        plan, exc = self._plan_and_write(sharded_state_dict, checkpoint_dir)
        timings.begin("commit")
        self.finalize(plan, _location(checkpoint_dir), exc)

    def save_and_commit(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Path,
        exc: Optional[BaseException],
        whole_files: Dict[str, Tuple[int, int]],
        commit: Callable[[], None],
    ) -> None:
        """``save``, and the caller's commit in the same collective: rank 0 enters every rank's
        ``whole_files`` (files the caller wrote, ``{name: (size, crc32c)}``, e.g. ``common.pt``)
        into the manifest with the strategy's items, and runs ``commit()`` right after it wrote
        ``.metadata`` and the manifest, only if every rank wrote its part. ``exc``: this rank
        already failed (it writes nothing and reports the error). One stage instead of two
        (``serialization.save`` calls it; the stage is named "torch_dist write and commit")."""
        plan = None
        if exc is None:
            plan, exc = self._plan_and_write(sharded_state_dict, checkpoint_dir)
        timings.begin("commit")
        self._commit = (whole_files, commit)
        try:
            self.finalize(plan, _location(checkpoint_dir), exc)
        finally:
            self._commit = None

    def prestage(self, sharded_state_dict: ShardedStateDict) -> bool:
        """Start the device-to-host copies of this rank's CUDA main replicas now, before the
        save validates and plans (``serialization.save`` calls it first for an async save), so
        the copies run while the CPU works; :meth:`async_save` takes them up. Not done when a
        host memory budget smaller than the save's staged bytes makes it stage in waves. Returns
        whether anything was started (then :meth:`discard_prestaged` undoes it on failure)."""
        sources, staged = [], 0
        for sh in nested_values(sharded_state_dict):
            if not (isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id) and sh.data is not None):
                continue
            on_cuda = sh.data.device.type == "cuda"
            if on_cuda or self.stage_cpu_tensors:
                staged += sh.data.numel() * sh.data.element_size()
            if on_cuda and _is_plain(sh.data) and sh.data.numel():
                sources.append(sh.data.detach())
        if not sources or staged > host_memory_budget():
            return False  # nothing to copy, or the save stages in waves: prestaging would hold more
        from distckpt.strategies.async_utils import StagingBuffers

        if self._staging is None:
            self._staging = StagingBuffers()
        try:
            for t in sources:
                self._staging.prestage(t)
        except BaseException:
            self._staging.discard_unsealed()
            raise
        return True

    def discard_prestaged(self) -> None:
        if self._staging is not None:
            self._staging.discard_unsealed()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path):
        """Stage the local bytes now; return an AsyncRequest that writes them in the background
        and, at finalize (every rank, main thread), writes ``.metadata`` and the manifest.

        With a host memory budget (:mod:`distckpt.budget`) smaller than this rank's staged bytes,
        the blocking part stages and writes waves of at most the budget, reusing the same
        buffers; only the last wave is left to the background."""
        from distckpt.strategies.async_utils import AsyncRequest

        timings.begin("planning")
        plan = self.prepare(sharded_state_dict, checkpoint_dir, stage=True)
        timings.begin("staging")
        budget = host_memory_budget()
        if plan.staging is not None:
            plan.staging.reset_peak()
        threads = self.writer_threads(plan.checkpoint_dir)
        write_waves(plan, plan_waves(plan.jobs, budget), threads)
        return AsyncRequest(
            write_plan, (plan, threads), [lambda: self.finalize(plan, _location(checkpoint_dir), None)]
        )

    def finalize(self, plan: Optional[SavePlan], checkpoint_dir: Path, exc: Optional[BaseException]) -> None:
        """Gather every rank's records to rank 0, which writes ``.metadata`` and the manifest.

        Collective; raises the same error on every rank if any rank failed to write.
        """
        payload = None
        if exc is None:
            structure = (plan.decls, [r.structure() for r in plan.records], plan.file_sizes)
            if self.cached_metadata and structure == self._local_structure:
                payload = (
                    "same",
                    np.array([r.crc32c for r in plan.records], dtype=np.int64),
                    plan.table_crcs,
                )
            else:
                payload = ("full", RecordTable.of(plan.decls, plan.records), plan.file_sizes, plan.table_crcs)
        commit, stage = getattr(self, "_commit", None), "torch_dist write"
        if commit is not None:
            payload, stage = (payload, commit[0]), "torch_dist write and commit"

        def decide_and_commit(payloads):
            reused = decide([p[0] for p in payloads], {name: v for p in payloads for name, v in p[1].items()})
            commit[1]()
            return reused

        def decide(payloads, whole_files=None):
            cache = self._global_cache
            per_rank, reused, tables = [], cache is not None, {}
            for r, p in enumerate(payloads):
                if p[0] == "same" and cache is not None:
                    table, rank_sizes = cache[r]
                    table = table.with_crcs(p[1])
                else:
                    _, table, rank_sizes, _ = p
                    reused = False
                tables.update(p[-1])
                per_rank.append((table, rank_sizes))
            records = GatheredRecords.of([t for t, _ in per_rank])
            save_id, checkpoint_id = str(uuid.uuid4()), str(checkpoint_dir)
            md_bytes, head, index_bytes, template = None, None, None, None
            if reused and self._metadata_cache is not None:
                # Same items as the last save: its .metadata, the two ids respelled in place.
                md_bytes, head, old_checkpoint_id, old_save_id = self._metadata_cache
                head = respell(md_bytes, head, [(old_checkpoint_id, checkpoint_id), (old_save_id, save_id)])
            again = None
            if not self.cached_metadata:
                # The same records as the last save rank 0 committed, whatever saved it.
                again = LAST_SAVE.reuse(records, checkpoint_id, save_id, self.write_index)
                if again is not None:
                    md_bytes, head, index_bytes = again
                    reused = True
            if head is None:
                md_bytes, head = metadata_bytes_and_head(records, checkpoint_id, save_id)
                if self.cached_metadata:
                    md_bytes = bytearray(md_bytes)
            self._metadata_cache = (md_bytes, head, checkpoint_id, save_id) if self.cached_metadata else None
            if self.write_index and index_bytes is None:
                # Same items: the last sidecar with the new CRC32Cs patched in.
                if reused and self._index_template is not None:
                    index_bytes = patched_sidecar_index(self._index_template, records, len(md_bytes))
                remember = not self.cached_metadata and len(records.rows) <= LastSave.MAX_RECORDS
                if index_bytes is None and self.cached_metadata:
                    index_bytes, self._index_template = sidecar_index(records, len(md_bytes), template=True)
                elif index_bytes is None and remember:
                    index_bytes, template = sidecar_index(records, len(md_bytes), template=True)
                elif index_bytes is None:
                    index_bytes = sidecar_index(records, len(md_bytes))
            if index_bytes is not None:
                storage.write_bytes(checkpoint_dir, INDEX_FNAME, index_bytes)
            if isinstance(checkpoint_dir, storage.Store):
                checkpoint_dir.put(METADATA_FNAME, md_bytes)
            else:
                atomic_write_bytes(checkpoint_dir / METADATA_FNAME, md_bytes)
            ranges = records.ranges()
            keys, boxes = records.layout()
            sizes = {name: size for _, sz in per_rank for name, size in sz.items()}
            ranges.extend((name, 0, sizes[name], crc, name) for name, crc in tables.items())
            ranges.append((METADATA_FNAME, 0, len(md_bytes), crc32c(md_bytes), METADATA_FNAME))
            sizes[METADATA_FNAME] = len(md_bytes)
            if index_bytes is not None:
                ranges.append((INDEX_FNAME, 0, len(index_bytes), crc32c(index_bytes), INDEX_FNAME))
                sizes[INDEX_FNAME] = len(index_bytes)
            boxes += [None] * (len(ranges) - len(boxes))
            manifest = build_manifest(save_id, "torch_dist", ranges, sizes, keys, boxes)
            for name, (size, crc) in (whole_files or {}).items():
                manifest.set_whole(name, size, crc)
            write_manifest(checkpoint_dir, manifest)
            if self.cached_metadata:
                self._global_cache = per_rank
            else:
                LAST_SAVE.remember(
                    records, md_bytes, head, checkpoint_id, save_id, template, again is not None
                )
            return reused

        self.last_save_reused_metadata = bool(
            dist.gather_and_decide(stage, exc, payload, decide if commit is None else decide_and_commit)
        )
        if self.cached_metadata:
            self._local_structure = (plan.decls, [r.structure() for r in plan.records], plan.file_sizes)


@dataclass
class RecordTable:
    """One rank's key declarations and written records, compact: what ``finalize`` gathers.

    - ``keys``: ``(fqn, is_bytes, dtype, size, orig_shape)`` of every key this rank declared
      (its :class:`_KeyDecl`\\ s);
    - ``files``: the names of the files the rows point into;
    - ``rows``: int64 ``[n, 5 + 2 * ndim]``, one per record: key index, file index, file offset,
      length, crc32c, chunk offset, chunk size (``ndim`` the most axes of this rank's keys; a
      key with fewer has its columns padded with 0 / 1).

    A few objects per key and file instead of one per record, so rank 0 unpickles
    ``world`` small payloads and builds ``.metadata`` and the sidecar from arrays. ``layout``:
    a digest of ``keys`` (ranks that declare the same keys are recognized by it).
    """

    keys: Tuple[Tuple[str, bool, Optional[torch.dtype], Shape, Optional[Shape]], ...]
    files: Tuple[str, ...]
    rows: Any  # np.ndarray
    layout: bytes = b""

    @property
    def ndim(self) -> int:
        return (self.rows.shape[1] - 5) // 2

    @classmethod
    def of(cls, decls: Dict[str, _KeyDecl], records: Sequence[_Record]) -> RecordTable:
        keys = tuple(
            (fqn, d.is_bytes, d.dtype, tuple(d.size), None if d.orig_shape is None else tuple(d.orig_shape))
            for fqn, d in decls.items()
        )
        key_ids = {k[0]: i for i, k in enumerate(keys)}
        file_ids: Dict[str, int] = {}
        ndim = max((len(k[3]) for k in keys), default=0)
        flat: List[int] = []
        for r in records:
            kid = key_ids.get(r.fqn)
            if kid is None:
                raise CheckpointingException(f"record for undeclared key {r.fqn!r}")
            pad = ndim - len(r.chunk_offset)
            flat += (kid, file_ids.setdefault(r.relative_path, len(file_ids)), r.offset, r.length, r.crc32c)
            flat += r.chunk_offset
            flat += (0,) * pad
            flat += r.chunk_size
            flat += (1,) * pad
        rows = np.array(flat, dtype=np.int64).reshape(len(records), 5 + 2 * ndim)
        return cls(keys, tuple(file_ids), rows, hashlib.blake2b(repr(keys).encode(), digest_size=16).digest())

    def with_crcs(self, crcs: Any) -> RecordTable:
        rows = self.rows.copy()
        rows[:, 4] = crcs
        return RecordTable(self.keys, self.files, rows, self.layout)

    def decls(self) -> Dict[str, _KeyDecl]:
        return {fqn: _KeyDecl(is_bytes, dtype, size, orig) for fqn, is_bytes, dtype, size, orig in self.keys}

    def ranges(self) -> List[Tuple[str, int, int, int, str]]:
        """``(file, offset, length, crc32c, key)`` of every record (what the manifest takes)."""
        keys, files = self.keys, self.files
        return [
            (files[f], off, length, crc, keys[k][0]) for k, f, off, length, crc in self.rows[:, :5].tolist()
        ]


@dataclass
class GatheredRecords:
    """Every rank's :class:`RecordTable` in one array (rank 0, at commit).

    ``decls``: fqn -> (is_bytes, dtype, size, orig_shape), every rank's declarations merged in
    rank order; ``fqns``: key index -> fqn; ``files``: file index -> name; ``rows``: int64
    ``[n, 5 + 2 * ndim]`` as in a RecordTable, with global key and file indices, grouped by key
    (in rank order within a key).
    """

    decls: Dict[str, Tuple[bool, Optional[torch.dtype], Shape, Optional[Shape]]]
    fqns: List[str]
    files: List[str]
    rows: Any

    @property
    def ndim(self) -> int:
        return (self.rows.shape[1] - 5) // 2

    @classmethod
    def of(cls, tables: Sequence[RecordTable]) -> GatheredRecords:
        decls: Dict[str, Tuple] = {}
        fqns: List[str] = []
        key_ids: Dict[str, int] = {}
        key_maps: Dict[object, Any] = {}  # a rank's layout -> its keys' global indices (DP ranks share it)
        files: List[str] = []
        ndim = max((t.ndim for t in tables), default=0)
        parts = []
        for t in tables:
            kmap = key_maps.get(t.layout)
            if kmap is None:
                ids = []
                for fqn, *decl in t.keys:
                    decls[fqn] = tuple(decl)
                    kid = key_ids.get(fqn)
                    if kid is None:
                        kid = key_ids[fqn] = len(fqns)
                        fqns.append(fqn)
                    ids.append(kid)
                kmap = key_maps[t.layout or object()] = np.array(ids, dtype=np.int64)
            rows = t.rows
            if not len(rows):
                continue
            fmap = np.arange(len(files), len(files) + len(t.files), dtype=np.int64)
            files.extend(t.files)
            if t.ndim < ndim:
                pad, n = ndim - t.ndim, len(rows)
                rows = np.concatenate(
                    [
                        rows[:, : 5 + t.ndim],
                        np.zeros((n, pad), np.int64),
                        rows[:, 5 + t.ndim :],
                        np.ones((n, pad), np.int64),
                    ],
                    axis=1,
                )
            else:
                rows = rows.copy()
            rows[:, 0] = kmap[rows[:, 0]]
            rows[:, 1] = fmap[rows[:, 1]]
            parts.append(rows)
        rows = np.concatenate(parts) if parts else np.zeros((0, 5 + 2 * ndim), np.int64)
        # Grouped by key (stable: each key's rows stay in rank order).
        kid = rows[:, 0]
        rows = rows[np.argsort(kid.astype(np.int16) if len(fqns) < 2**15 else kid, kind="stable")]
        return cls(decls, fqns, files, rows)

    def by_key(self):
        """``(fqn, rows)`` of every key with records; rows in rank order."""
        bounds = np.concatenate(
            [[0], np.cumsum(np.bincount(self.rows[:, 0], minlength=len(self.fqns)))]
        ).tolist()
        for k, fqn in enumerate(self.fqns):
            if bounds[k + 1] > bounds[k]:
                yield fqn, self.rows[bounds[k] : bounds[k + 1]]

    def ranges(self) -> List[Tuple[str, int, int, int, str]]:
        """``(file, offset, length, crc32c, key)`` of every record (what the manifest takes)."""
        fqns, files = self.fqns, self.files
        return [(files[f], off, length, crc, fqns[k]) for k, f, off, length, crc in self.rows[:, :5].tolist()]

    def layout(self) -> Tuple[Dict[str, Tuple[Any, ...]], List[Optional[Tuple[Shape, Shape]]]]:
        """What the manifest records of the writer's intent besides checksums: each tensor key's
        (dtype name, stored shape[, original shape of a flattened key]), and the (chunk offset,
        chunk size) of every record, aligned with :meth:`ranges` (None for byte items)."""
        keys = {
            fqn: (dtype_name(d[1]), tuple(d[2])) + (() if d[3] is None else (tuple(d[3]),))
            for fqn, d in self.decls.items()
            if not d[0] and d[1] is not None
        }
        ndim, fqns = self.ndim, self.fqns
        boxes: List[Optional[Tuple[Shape, Shape]]] = []
        for row in self.rows.tolist():
            decl = keys.get(fqns[row[0]])
            n = len(decl[1]) if decl is not None else 0
            boxes.append(
                None if decl is None else (tuple(row[5 : 5 + n]), tuple(row[5 + ndim : 5 + ndim + n]))
            )
        return keys, boxes


def sidecar_index(records: GatheredRecords, metadata_bytes: int, template: bool = False) -> Any:
    """The sidecar index (see distckpt/strategies/index.py) of every rank's declarations and
    records; with ``template``, ``(bytes, IndexTemplate)`` (see :func:`patched_sidecar_index`)."""
    keys: Dict[str, Dict[str, Any]] = {}
    for fqn, (is_bytes, dtype, size, orig_shape) in records.decls.items():
        keys[fqn] = {"bytes": True} if is_bytes else {"dtype": dtype, "size": size, "orig_shape": orig_shape}
    rows: Dict[str, Any] = {}
    for fqn, r in records.by_key():
        if fqn not in keys:
            raise CheckpointingException(f"index: record for undeclared key {fqn!r}")
        n = 0 if keys[fqn].get("bytes") else len(keys[fqn]["size"])
        d = records.ndim
        # index rows: offset[n], size[n], file index, file offset, length, crc32c
        rows[fqn] = np.concatenate([r[:, 5 : 5 + n], r[:, 5 + d : 5 + d + n], r[:, 1:5]], axis=1)
    with gc_paused():
        return build_index_from_rows(keys, rows, records.files, metadata_bytes, template=template)


class LastSave:
    """Rank 0's memory of the last save it committed: its gathered records, its ``.metadata`` and
    a template of its sidecar. A training job saves the same structure again and again with new
    values; when a save's records equal the remembered ones in everything but their CRC32Cs, its
    ``.metadata`` is the remembered one with the two ids respelled and its sidecar the template
    with the new CRC32Cs patched in: the same bytes a rebuild gives, at a fraction of its cost.

    The records are compared whole (keys, declarations, files, offsets, lengths, chunks), so the
    memory is never trusted blindly, whichever strategy object or process group saved last.
    Unlike ``cached_metadata`` (where ranks that wrote the same items send only their CRC32Cs),
    it needs nothing from the other ranks. Saves of more than :attr:`MAX_RECORDS` records are
    not remembered (rank 0 would hold their tables between saves)."""

    MAX_RECORDS = 1 << 18

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: Optional[Tuple[GatheredRecords, bytes, int, str, str, Optional[IndexTemplate]]] = None

    def clear(self) -> None:
        with self._lock:
            self._last = None

    def _matching(self, records: GatheredRecords):
        last = self._last
        if last is None:
            return None
        old = last[0]
        a, b = old.rows, records.rows
        if (
            a.shape != b.shape
            or old.fqns != records.fqns
            or old.files != records.files
            or old.decls != records.decls
        ):
            return None
        if not (np.array_equal(a[:, :4], b[:, :4]) and np.array_equal(a[:, 5:], b[:, 5:])):
            return None
        return last

    def reuse(
        self, records: GatheredRecords, checkpoint_id: str, save_id: str, with_index: bool
    ) -> Optional[Tuple[bytes, int, Optional[bytes]]]:
        """``(.metadata, its head's length, sidecar or None)`` of ``records`` under the new ids,
        from the last save if ``records`` differ from its records only in CRC32Cs; else None."""
        with self._lock:
            last = self._matching(records)
            if last is None:
                return None
            _, md, head, old_checkpoint_id, old_save_id, template = last
            md_bytes = bytearray(md)
            head = respell(md_bytes, head, [(old_checkpoint_id, checkpoint_id), (old_save_id, save_id)])
            if head is None:
                return None
            index = None
            if with_index:
                if template is None:
                    return None
                index = patched_sidecar_index(template, records, len(md_bytes))
                if index is None:
                    return None
            return bytes(md_bytes), head, index

    def remember(
        self,
        records: GatheredRecords,
        md_bytes: bytes,
        head: int,
        checkpoint_id: str,
        save_id: str,
        template: Optional[IndexTemplate],
        reused: bool,
    ) -> None:
        """Keep this save; ``reused``: :meth:`reuse` just gave its ``.metadata`` (the records are
        the last ones, so a sidecar template of theirs, just patched, stays)."""
        with self._lock:
            if len(records.rows) > self.MAX_RECORDS:
                self._last = None
                return
            if template is None and reused and self._last is not None:
                template = self._last[5]
            self._last = (records, bytes(md_bytes), head, checkpoint_id, save_id, template)


LAST_SAVE = LastSave()


def patched_sidecar_index(
    template: IndexTemplate, records: GatheredRecords, metadata_bytes: int
) -> Optional[bytes]:
    """The sidecar of ``records`` from the template of an earlier save's records that differed
    only in their CRC32Cs (None if they do not fit it)."""
    return template.patch({fqn: r[:, 4] for fqn, r in records.by_key()}, metadata_bytes)


def _reindex(md: Metadata, md_bytes: bytes, manifest: Optional[Any]) -> Optional[bytes]:
    """After surgery on ``.metadata``: the new sidecar index, entered into ``manifest``; None
    (the sidecar is dropped and loads read ``.metadata``) when there is no manifest to take the
    items' checksums from."""
    if manifest is None:
        return None
    manifest.drop(INDEX_FNAME)
    try:
        data = index_from_metadata(md, manifest.range_index(), len(md_bytes))
    except CheckpointingException as e:
        logger.info("not rebuilding the sidecar index: %s", e)
        return None
    manifest.set_bytes(INDEX_FNAME, data)
    return data


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
    building a Python object per chunk (distckpt.strategies.metadata_pickle; unpickles to what
    :func:`build_metadata` builds), and the length of its head (where :func:`respell` finds
    the ids)."""
    with gc_paused():
        chunks, byte_items = _sorted_chunks(records)
        return pickle_metadata(_skeleton(records, checkpoint_id, save_id), chunks, byte_items, records.files)


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
            mcore_data[fqn] = {_ORIG_SHAPE: tuple(orig_shape)}
    md = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=None,
        storage_data={},
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
    )
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
    size: Shape  # stored (possibly N-D reformulated) shape
    chunks: List[_Stored]
    orig_shape: Optional[Shape] = None  # set for flattened (N-D reformulated) keys
    flat_index: Dict[Shape, List[_Stored]] = field(default_factory=dict)
    source: str = ""  # the file that describes it (.metadata or the sidecar)

    @property
    def logical_shape(self) -> Shape:
        return self.orig_shape if self.orig_shape is not None else self.size

    @property
    def chunk_local_shape(self) -> Shape:
        """For a flattened key: the shape of one chunk of the original tensor's grid."""
        return tuple(o // g for o, g in zip(self.orig_shape, self.size[:-1]))


@dataclass
class CopyOp:
    """Copy elements of a stored item into ``dst`` (a view of shape ``size``): element ``i`` of
    the box is item element ``start + sum(i[d] * strides[d])`` (row-major item order)."""

    key: str
    start: int
    size: Shape
    strides: Shape
    dst: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def end(self) -> int:
        """One past the last item element the box touches."""
        if self.numel == 0:
            return self.start
        return self.start + sum((n - 1) * st for n, st in zip(self.size, self.strides)) + 1

    @property
    def is_range(self) -> bool:
        """True if the box is the plain element range ``[start, start + numel)``."""
        return self.end - self.start == self.numel


class _Plan:
    """Copy operations grouped by stored chunk, plus finalizers that run once all are read, and
    each key read as the metadata describes it (its items' own headers must agree on the dtype)."""

    def __init__(self) -> None:
        self.ops: Dict[_Stored, List[CopyOp]] = defaultdict(list)
        self.finalizers: List[Callable[[], None]] = []
        self.keys: Dict[str, _StoredKey] = {}

    def add(self, stored: _Stored, op: CopyOp) -> None:
        self.ops[stored].append(op)


def _plan_flat_slices(
    plan: _Plan,
    key: str,
    stored: _StoredKey,
    idx: Shape,
    f_lo: int,
    f_hi: int,
    target: torch.Tensor,
    origin: int,
) -> None:
    """Copy elements ``[f_lo, f_hi)`` of flattened chunk ``idx`` from the stored slices that hold
    them into the 1-D ``target``, whose element 0 is flat element ``origin``. The slices (sorted
    by start) must hold each of those elements exactly once: a gap would load as whatever the
    target held, an overlap is damaged metadata."""
    covered = 0
    end = f_lo
    for ch in stored.flat_index.get(idx, []):
        s = ch.offset[-1]
        a, b = max(s, f_lo), min(s + ch.size[-1], f_hi)
        if b > a:
            if a < end:
                raise CheckpointingException(
                    f"{stored.source}: key {key!r}: stored flattened ranges of chunk {list(idx)} overlap at "
                    f"elements [{a}, {min(b, end)}) (the metadata is damaged)"
                )
            covered += b - a
            end = b
            plan.add(ch, CopyOp(key, a - s, (b - a,), (1,), target[a - origin : b - origin]))
    if covered != f_hi - f_lo:
        raise CheckpointingException(
            f"{stored.source}: key {key!r}: stored flattened ranges of chunk {list(idx)} hold {covered} of "
            f"elements [{f_lo}, {f_hi}) needed for this load (the rest is missing: damaged metadata)"
        )


def check_claims(md: Metadata, source: Path) -> None:
    """Check every claim of ``.metadata`` before anything uses it: file names stay inside the
    checkpoint, offsets and lengths are naturals, shapes bounded, chunk boxes inside their
    tensor, dtypes real (``source`` names the file in the error)."""
    try:
        _check_claims(md, source)
    except AttributeError as e:  # an object unpickled without the fields its class has
        raise CheckpointingException(f"{source}: malformed checkpoint metadata: {e}") from None


def _check_claims(md: Metadata, source: Path) -> None:
    for index, info in md.storage_data.items():
        what = f"storage record of {getattr(index, 'fqn', '?')!r}"
        if index.offset is not None:
            bounds.shape(index.offset, source, f"{what}: chunk offset")
        bounds.relative_name(info.relative_path, source, f"{what}: file name")
        bounds.natural(info.offset, source, f"{what}: offset")
        bounds.natural(info.length, source, f"{what}: length")
    mcore = getattr(md, "mcore_data", None) or {}
    if not isinstance(mcore, dict):
        raise CheckpointingException(f"{source}: mcore_data is {type(mcore).__name__}, not a dict")
    for fqn, meta in md.state_dict_metadata.items():
        check_key_name(fqn, source)
        if not isinstance(meta, TensorStorageMetadata):
            continue
        if not isinstance(meta.properties.dtype, torch.dtype):
            raise CheckpointingException(
                f"{source}: key {fqn!r}: dtype {meta.properties.dtype!r:.100} is not a dtype"
            )
        size = bounds.shape(meta.size, source, f"key {fqn!r}: global shape")
        entry = mcore.get(fqn)
        if isinstance(entry, dict) and _ORIG_SHAPE in entry:
            check_reformulated(fqn, size, entry[_ORIG_SHAPE], source)
        for c in meta.chunks:
            offsets = bounds.shape(c.offsets, source, f"key {fqn!r}: chunk offset")
            sizes = bounds.shape(c.sizes, source, f"key {fqn!r}: chunk size")
            bounds.box_inside(offsets, sizes, size, source, f"key {fqn!r}: chunk")


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
            f"{source}: key {fqn!r} is {dtype_name(dtype)} of {shapes(size, orig)}, {manifest_source} says the "
            f"writer wrote {entry[0]} of {shapes(entry[1], entry[2] if len(entry) > 2 else None)}"
        )


def _check_all_declared(md: Metadata, declared: Dict[str, Tuple], source: Any, manifest_source: Any) -> None:
    """Every tensor key of ``md`` against the manifest (:func:`check_declared`), and no key the
    manifest declares missing from ``md``'s tensors: a query returns every key, so a key renamed
    or turned into a byte item must not just drop out of it."""
    tensors = 0
    orig = _orig_shapes(md)
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            check_declared(
                fqn, meta.properties.dtype, tuple(meta.size), orig.get(fqn), declared, source, manifest_source
            )
            tensors += 1
    if tensors != len(declared):
        missing = sorted(
            k for k in declared if not isinstance(md.state_dict_metadata.get(k), TensorStorageMetadata)
        )
        raise CheckpointingException(
            f"{source}: does not declare tensor key(s) {missing[:3]}{' ...' if len(missing) > 3 else ''} that "
            f"{manifest_source} says the writer wrote (the metadata is damaged)"
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
    orig = _orig_shapes(md)
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
        where = f"{source}: key {index.fqn!r}" + (
            f" chunk at {list(index.offset)}" if index.offset is not None else ""
        )
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


def _index(md: Metadata, source: Path) -> Dict[str, Any]:
    """Per key, its stored chunks and where their bytes are (claims checked first)."""
    check_claims(md, source)
    orig = _orig_shapes(md)
    per_key: Dict[str, List[_Stored]] = defaultdict(list)
    objects: Dict[str, _Stored] = {}
    for index, info in md.storage_data.items():
        st = _Stored(
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
                    f"key {fqn!r}: chunk at {list(c.offsets)} has no storage record in .metadata"
                )
            sizes = tuple(c.sizes)
            if math.prod(sizes) * itemsize > st.length:
                raise CheckpointingException(
                    f"{source}: key {fqn!r}: chunk at {list(st.offset)} of {list(sizes)} elements needs "
                    f"{math.prod(sizes) * itemsize} bytes, its record holds {st.length}"
                )
            chunks.append(_Stored(st.offset, sizes, st.relative_path, st.file_offset, st.length))
        if len(by_offset) != len(chunks) or len(per_key.get(fqn, ())) != len(chunks):
            raise CheckpointingException(
                f"{source}: key {fqn!r}: {len(per_key.get(fqn, ()))} storage records for its {len(chunks)} "
                f"chunks (records at offsets that are none of its chunks, or several at one)"
            )
        out[fqn] = _stored_key(fqn, meta.properties.dtype, tuple(meta.size), chunks, orig.get(fqn), source)
    return out


def _stored_key(
    fqn: str, dtype: torch.dtype, size: Shape, chunks: List[_Stored], orig_shape: Optional[Shape], source: Any
) -> _StoredKey:
    key = _StoredKey(fqn, dtype, size, chunks, orig_shape, source=str(source))
    if key.orig_shape is not None:
        for c in chunks:
            key.flat_index.setdefault(c.offset[:-1], []).append(c)
        for lst in key.flat_index.values():
            lst.sort(key=lambda c: c.offset[-1])
    return key


def _check_covered(stored: _StoredKey, off: Shape, size: Shape, met: List[Tuple[Shape, Shape]]) -> None:
    """The stored chunks a requested piece meets (their boxes clipped to it: ``met``) must hold
    every element of its part inside the stored tensor exactly once (outside it, a load with
    ``allow_shape_mismatch`` zero-fills). Else the chunk boxes the metadata claims are damaged:
    what no chunk holds would load as whatever the destination held (uninitialized memory for
    tensors the load allocates), so it is refused, naming the key, the file and the region."""
    region = _intersect(off, size, (0,) * len(size), stored.size)
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


def _checked_sidecar_chunk(source: str, fqn: str, dtype: torch.dtype, row, names: Set[str]) -> _Stored:
    """One chunk record of the sidecar, with the claims checks ``_index`` applies to ``.metadata``:
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
    return _Stored(tuple(off), size, path, foff, length)


def _index_from_sidecar(
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
                        f"{', flattened' if orig else ''}), the request {list(sh.global_shape)} needs {len(box[0])}"
                    )
                boxes[sh.key].append(box)
        elif isinstance(sh, ShardedObject):
            objects.append(sh.unique_key)
    found = reader.query(boxes)
    out: Dict[str, Any] = {}
    names: Set[str] = set()
    for fqn, rows in found.items():
        e = reader.entry(fqn)
        try:
            dtype = _sidecar_dtype(e["dtype"])
        except ValueError as err:
            raise CheckpointingException(f"{reader.where}: key {fqn!r}: {err}") from None
        chunks = [_checked_sidecar_chunk(reader.where, fqn, dtype, row, names) for row in rows]
        orig = e.get("orig_shape")
        size = bounds.plain_shape(e["size"])
        if size is None:
            size = bounds.shape(e["size"], reader.where, f"key {fqn!r}: global shape")
        out[fqn] = _stored_key(fqn, dtype, size, chunks, tuple(orig) if orig else None, reader.where)
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
        out[key] = _Stored(
            (),
            (),
            path,
            bounds.natural(foff, reader.where, f"object {key!r}: offset"),
            bounds.natural(length, reader.where, f"object {key!r}: length"),
        )
        if checksums is not None:
            checksums[(path, foff)] = RangeChecksum(foff, length, crc, key)
    return out


class _DefaultChecks(dict):
    """The manifest's checksums by (file, offset) for a default load (not ``verify=True``): an
    item of a file the manifest lists no range of at all is read unchecked, as a checkpoint with
    no manifest is (e.g. one whose data files a foreign DCP ``StorageWriter`` wrote); an item
    missing from a file the manifest does list is an error, as under ``verify=True``."""

    def __init__(self, ranges: Dict):
        super().__init__(ranges)
        self.listed = {name for name, _offset in ranges}


def _expected(st: _Stored, checksums: Dict, key: Optional[str], what: str) -> Optional[RangeChecksum]:
    """The manifest's checksum of item ``st``, after the cross-check every checked read does: the
    manifest lists a range at that offset, of the record's length, holding ``key`` (when given).
    So storage records swapped in ``.metadata`` are an error, not the other key's values. None:
    the item is not to be checked (see :class:`_DefaultChecks`)."""
    expected = checksums.get((st.relative_path, st.file_offset))
    if expected is None:
        if isinstance(checksums, _DefaultChecks) and st.relative_path not in checksums.listed:
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
            f"{what}: {METADATA_FNAME} records {st.length} bytes of key {key!r} chunk {list(st.offset)} of size "
            f"{list(st.size)} there, {MANIFEST_FNAME} says the writer wrote {expected.length} bytes of key "
            f"{expected.key!r}{chunk}: the metadata or the manifest is damaged"
        )
    return expected


def _compare(crc: int, expected: RangeChecksum, what: str) -> None:
    if crc != expected.crc32c:
        raise CheckpointingException(f"{what}: CRC32C mismatch against the manifest (corrupted data)")


def _check_item(
    raw: bytes, st: _Stored, checksums: Optional[Dict], what: str, key: Optional[str] = None
) -> None:
    """Compare an item's bytes with the manifest (``checksums`` is None without a manifest)."""
    expected = None if checksums is None else _expected(st, checksums, key, what)
    if expected is not None:
        _compare(crc32c(raw), expected, what)


def _copy_boxes(src: torch.Tensor, first: int, ops: List[CopyOp]) -> None:
    """Copy each op's box out of ``src``, the 1-D run of item elements starting at ``first``."""
    for op in ops:
        op.dst.copy_(src.as_strided(op.size, op.strides, src.storage_offset() + op.start - first))


def copy_from_mapping(
    fd: int, offset: int, count: int, dtype: torch.dtype, ops: List[CopyOp], first: int, what: str
) -> None:
    """Copy the ops' boxes out of ``count`` elements of the file at byte ``offset``, mapped
    rather than read: only the pages and cache lines the boxes touch are visited, so a box
    that takes every other run of a chunk does not pull the runs between them through memory."""
    nbytes = count * dtype.itemsize
    if os.fstat(fd).st_size < offset + nbytes:  # touching a page past EOF would be SIGBUS
        raise CheckpointingException(f"{what}: file is truncated (needs {offset + nbytes} bytes)")
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Private and writable only so torch accepts the buffer; nothing writes, so no page is copied.
    mapping = mmap.mmap(
        fd,
        nbytes + offset - aligned,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=aligned,
    )
    try:
        _copy_boxes(torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset - aligned), first, ops)
    finally:
        try:
            mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


def _whole_into_cpu(st: _Stored, ops: List[CopyOp]) -> bool:
    """Whether ``ops`` is one copy of the whole item into a contiguous CPU tensor (a load in the
    layout the item was saved in)."""
    if len(ops) != 1:
        return False
    op = ops[0]
    return (
        op.start == 0
        and op.numel == math.prod(st.size)
        and op.is_range
        and op.dst.device.type == "cpu"
        and op.dst.is_contiguous()
    )


def _read_chunk(
    fd: int,
    path: Path,
    st: _Stored,
    ops: List[CopyOp],
    checksums: Optional[Dict],
    rank: int,
    verify: bool,
    raw: Optional[Union[bytes, memoryview]] = None,
    bounce: Optional[HostBounce] = None,
    blocks: Optional[BlockReader] = None,
    claimed: Optional[_StoredKey] = None,
) -> int:
    """Serve every copy of one stored item; returns the bytes taken from storage.

    ``claimed``: the key as the metadata describes it. An item whose own header says another dtype
    (a frame that matches the destination's dtype proves it agrees) is refused: the metadata is
    damaged, and a load that allocates from its claims would get converted values.

    With ``checksums`` (the manifest's, by (file, offset)) every byte copied is checked: a
    whole item in the saved layout as it is read into place, other copies through ``blocks``
    (the item's block CRCs) block by block, an item without block CRCs read whole first.

    A box that is a plain element range lands in a contiguous destination of the same dtype
    with one ``preadv`` (a CUDA destination: through ``bounce``'s pinned slots, its copies
    overlapping the next reads). Other boxes (column blocks, strided flat slices, other dtypes or
    layouts) are copied out of a read-only mapping of the bytes they span. The common case of a
    load in the saved layout, one copy of the whole item into a contiguous CPU tensor, reads
    frame and bytes in one call (:func:`read_framed_into`), or, when the item is ``raw`` already
    (a file of small items read at once), moves its bytes with one ``memmove``
    (:func:`copy_framed_from`).
    """
    numel = math.prod(st.size)
    what = f"key {ops[0].key!r} in {path} at offset {st.file_offset} (rank {rank})"
    checked = False
    if checksums is not None and not verify:
        # The default checks: every byte copied is checked against a CRC32C as it is read.
        if raw is not None:
            _check_item(raw, st, checksums, what, ops[0].key)  # a small item, in memory already
            checked = True
        elif (expected := _expected(st, checksums, ops[0].key, what)) is None:
            checksums = None  # a file the manifest says nothing of: read as without one
        else:
            if _whole_into_cpu(st, ops):
                crc = read_framed_crc(fd, st.file_offset, st.length, tuple(st.size), ops[0].dst, what)
                if crc is not None:
                    _compare(crc, expected, what)
                    return st.length
            if blocks is not None:
                return blocks.copy(ops, bounce)
    if not verify and _whole_into_cpu(st, ops):
        # In the saved layout: the tensor bytes straight into place, the frame compared, not parsed
        # (from the file in one call, or out of the span already read and checked).
        if (
            raw is None
            and checksums is None
            and read_framed_into(fd, st.file_offset, st.length, tuple(st.size), ops[0].dst)
        ):
            return st.length
        if (
            raw is not None
            and (checked or checksums is None)
            and copy_framed_from(memoryview(raw), st.file_offset, tuple(st.size), ops[0].dst)
        ):
            return st.length
    if isinstance(raw, memoryview):
        raw = bytearray(raw)
    if raw is not None or verify or checksums is not None:
        if raw is None:
            raw = os.pread(fd, st.length, st.file_offset)
        if len(raw) != st.length:
            raise CheckpointingException(f"{what}: file is truncated ({len(raw)} of {st.length} bytes)")
        if not checked:
            _check_item(raw, st, checksums, what, ops[0].key)

        def read(offset: int, n: int) -> bytes:
            return raw[offset : offset + n]
    else:

        def read(offset: int, n: int) -> bytes:
            n = max(0, min(n, st.length - offset))
            return os.pread(fd, n, st.file_offset + offset)

    layout = None
    if st.length:  # distckpt's own frame: compared with the expected one, not parsed
        layout = framed_layout(raw, tuple(st.size), ops[0].dst.dtype, st.length, read, st.file_offset)
    if layout is None and st.length:
        layout = read_archive_layout(read, st.length)
    if layout is None or not layout.is_contiguous or math.prod(layout.size) != numel:
        whole = raw if raw is not None else read(0, st.length)
        if len(whole) != st.length:
            raise CheckpointingException(f"{what}: file is truncated ({len(whole)} of {st.length} bytes)")
        tensor = safe_torch_load(whole, what=what)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != numel:
            raise CheckpointingException(f"{what}: stored item is not a tensor of the recorded size")
        _check_claimed_dtype(tensor.dtype, claimed, what)
        _copy_boxes(tensor.reshape(-1).contiguous(), 0, ops)
        return st.length
    _check_claimed_dtype(layout.dtype, claimed, what)
    itemsize = layout.dtype.itemsize
    base = layout.data_offset + layout.storage_offset * itemsize
    if base + numel * itemsize > layout.data_offset + layout.data_length:
        raise CheckpointingException(f"{what}: tensor bytes extend past the item")
    if raw is not None:
        if not numel:
            return st.length
        # A byte offset, not a view of a uint8 tensor: the data is aligned in the file, not
        # necessarily within the item, and viewing uint8 as the dtype needs the latter.
        src = torch.frombuffer(
            raw if isinstance(raw, bytearray) else bytearray(raw),
            dtype=layout.dtype,
            count=numel,
            offset=base,
        )
        _copy_boxes(src, 0, [op for op in ops if op.numel])
        return st.length
    nbytes = 0
    strided = []
    for op in ops:
        if op.numel == 0:
            continue
        if op.is_range and op.dst.dtype == layout.dtype and op.dst.is_contiguous():
            if op.dst.device.type == "cpu":
                pread_into(fd, op.dst, st.file_offset + base + op.start * itemsize, what)
            elif bounce is not None and op.dst.device.type == "cuda":
                bounce.fill(fd, st.file_offset + base + op.start * itemsize, op.dst, what)
            else:
                strided.append(op)
        else:
            strided.append(op)
        nbytes += op.numel * itemsize
    if strided and bounce is not None and all(op.dst.device.type == "cuda" for op in strided):
        strided = bounce.fill_boxes(fd, st.file_offset + base, layout.dtype, strided, what)
    if strided:
        first = min(op.start for op in strided)
        last = max(op.end for op in strided)
        copy_from_mapping(
            fd, st.file_offset + base + first * itemsize, last - first, layout.dtype, strided, first, what
        )
    return nbytes


def _check_claimed_dtype(actual: torch.dtype, claimed: Optional[_StoredKey], what: str) -> None:
    if claimed is not None and actual != claimed.dtype:
        raise CheckpointingException(
            f"{what}: the item holds {dtype_name(actual)} values, {claimed.source} says the key is "
            f"{dtype_name(claimed.dtype)} (the metadata is damaged)"
        )


# An item is read in part only if its copies need less than this share of its elements ...
_PARTIAL_SHARE = 0.75


def _partial_candidate(st: _Stored, ops: List[CopyOp]) -> bool:
    """Whether a partial read of ``st`` may pay (then its file's block table is fetched)."""
    numel = math.prod(st.size)
    return (
        st.length >= blockcrc.MIN_PAYLOAD
        and numel > 0
        and sum(op.numel for op in ops) < _PARTIAL_SHARE * numel
    )


def _block_table(store, name: str) -> Tuple[Optional[blockcrc.Table], int]:
    """The block table of data object ``name`` (None when it has none, or an unusable one: its
    items are then read whole) and the bytes fetched for it."""
    table = blockcrc.table_name(name)
    try:
        raw = store.get(table)
    except FileNotFoundError:
        return None, 0
    try:
        return blockcrc.decode(raw, store.where(table)), len(raw)
    except CheckpointingException as e:
        logger.warning("%s; the items of %s are read whole", e, name)
        return None, len(raw)


@dataclass
class _PartialRead:
    """The blocks of one item a load fetches: runs ``[first, last)`` of block indices."""

    st: _Stored
    entry: blockcrc.Entry
    block: int
    runs: List[Tuple[int, int]]
    where: str

    def _span(self, a: int, b: int) -> Tuple[int, int]:
        """Payload bytes of blocks ``[a, b)``."""
        return a * self.block, min(b * self.block, self.entry.payload_length)

    def ranges(self) -> List[Tuple[int, int]]:
        base = self.st.file_offset + self.entry.payload_offset
        out = []
        for a, b in self.runs:
            lo, hi = self._span(a, b)
            out.append((base + lo, hi - lo))
        return out

    def copy(self, views: List[memoryview], ops: List[CopyOp], rank: int) -> None:
        """Check every fetched block against its CRC32C, then copy the ops' boxes out."""
        e, block = self.entry, self.block
        lo, hi = self._span(self.runs[0][0], self.runs[-1][1])
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        out = buf.numpy()
        for (a, b), view in zip(self.runs, views):
            for i in range(a, b):
                piece = view[(i - a) * block : (i - a) * block + block]
                if crc32c(piece) != e.blocks[i]:
                    start = e.payload_offset + i * block
                    raise CheckpointingException(
                        f"key {ops[0].key!r} in {self.where} at offset {self.st.file_offset} (rank {rank}): "
                        f"CRC32C mismatch in block {i} (bytes [{start}, {start + len(piece)}) of the item) "
                        f"against its block table {blockcrc.table_name(self.st.relative_path)}: the data is "
                        f"corrupted"
                    )
            s, t = self._span(a, b)
            out[s - lo : t - lo] = np.frombuffer(view, dtype=np.uint8)
        itemsize = e.dtype.itemsize
        _copy_boxes(buf.view(e.dtype), lo // itemsize, [op for op in ops if op.numel])


def _partial_read(
    st: _Stored, ops: List[CopyOp], table: blockcrc.Table, checksums: Dict, gap: int, where: str
) -> Optional[_PartialRead]:
    """The blocks of ``st`` its copies need, or None to read it whole: no block CRCs for it, a
    table entry that does not match the item's checksum (a stale or damaged table), or so much
    of the item needed that one whole read is cheaper."""
    e = table.entries.get(st.file_offset)
    expected = checksums.get((st.relative_path, st.file_offset))
    if e is None or expected is None or not _partial_candidate(st, ops):
        return None
    itemsize = e.dtype.itemsize
    if expected.length != st.length or e.payload_length != math.prod(st.size) * itemsize:
        logger.info(
            "%s: the block table entry of the item at offset %d does not match it; reading it whole",
            where,
            st.file_offset,
        )
        return None
    block = table.block
    intervals = []
    for op in ops:
        for a, b in blockcrc.spans(op.start, op.size, op.strides, block // itemsize):
            intervals.append((a * itemsize, b * itemsize))
    runs = blockcrc.block_runs(intervals, block, len(e.blocks), max(0, gap // block))
    fetched = sum(min(b * block, e.payload_length) - a * block for a, b in runs)
    if not runs or fetched > _PARTIAL_SHARE * st.length:
        return None
    problem = e.problem(block, expected.length, expected.crc32c)
    if problem is not None:
        logger.warning(
            "%s: block table entry of the item at offset %d: %s; reading it whole",
            where,
            st.file_offset,
            problem,
        )
        return None
    return _PartialRead(st, e, block, runs, where)


# A checked read of part of an item from a local file takes the blocks its copies need at most
# this many bytes at a time into a scratch buffer, checks each block while it is in cache, then
# copies the window's elements out.
_WINDOW_BYTES = 512 << 10


def _local_block_table(
    checkpoint_dir: Path, name: str, checksums: Dict
) -> Tuple[Optional[blockcrc.Table], bool]:
    """The block table of local data file ``name`` (None: it has none, or an unusable one) and
    whether the manifest vouches for it (its bytes match the manifest's checksum of the table
    file: then its entries need not be summed up against their items' CRC32Cs)."""
    table = blockcrc.table_name(name)
    path = bounds.inside(checkpoint_dir, table, checkpoint_dir / METADATA_FNAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, False
    listed = checksums.get((table, 0))
    vouched = listed is not None and listed.length == len(raw) and listed.crc32c == crc32c(raw)
    try:
        return blockcrc.decode(raw, str(path)), vouched
    except CheckpointingException as e:
        logger.warning("%s; the items of %s are read whole", e, name)
        return None, False


def _table_entry(
    st: _Stored, table: blockcrc.Table, expected: RangeChecksum, vouched: bool, where: str
) -> Optional[blockcrc.Entry]:
    """The block table's entry for item ``st`` when it describes the item the manifest checksums
    (else None: the item is read whole and checked against its own CRC32C)."""
    e = table.entries.get(st.file_offset)
    if e is None:
        return None
    if e.payload_length != math.prod(st.size) * e.dtype.itemsize:
        logger.info(
            "%s: the block table entry of the item at offset %d does not match it; reading it whole",
            where,
            st.file_offset,
        )
        return None
    if vouched:
        stale = e.item_length != expected.length or e.item_crc != expected.crc32c
        problem = "stale: it describes another item" if stale else None
    else:
        problem = e.problem(table.block, expected.length, expected.crc32c)
    if problem is not None:
        logger.warning(
            "%s: block table entry of the item at offset %d: %s; reading it whole",
            where,
            st.file_offset,
            problem,
        )
        return None
    return e


class BlockReader:
    """Checked reads of one item's tensor bytes from a local file: every block (of the item's
    block table entry) that a copy takes bytes from is read and its CRC32C compared before any
    of its bytes is copied, as an object-store load checks a partial read, without reading the
    rest of the item. A box that is one element range lands in place (its whole blocks read
    straight into the destination, through the pinned slots for a CUDA one); other boxes are cut
    out of the checked blocks a window at a time. Also the zarr backend's reader of part of a
    chunk file (its block CRC32Cs from the manifest).

    Args:
        base: file offset of the tensor's byte 0.
        table: where the block CRC32Cs come from, for errors (the block table's name).
    """

    def __init__(self, fd: int, base: int, entry: blockcrc.Entry, block: int, what: str, table: str):
        self.fd, self.entry, self.block, self.what = fd, entry, block, what
        self.table = table
        self.base = base
        self.scratch: Optional[torch.Tensor] = None

    def _check(self, first: int, view: memoryview) -> None:
        """Compare blocks ``first, first + 1, ...`` (their bytes in ``view``) with the table."""
        block, blocks = self.block, self.entry.blocks
        for p in range(0, len(view), block):
            i = first + p // block
            piece = view[p : p + block]
            if crc32c(piece) != blocks[i]:
                start = self.entry.payload_offset + i * block
                raise CheckpointingException(
                    f"{self.what}: CRC32C mismatch in block {i} (bytes [{start}, {start + len(piece)}) of the "
                    f"item) against {self.table}: the data is corrupted"
                )

    def _blocks(self, a: int, b: int) -> torch.Tensor:
        """Blocks ``[a, b)`` read into the scratch buffer and checked: a uint8 tensor of their bytes."""
        lo, hi = a * self.block, min(b * self.block, self.entry.payload_length)
        if self.scratch is None or self.scratch.numel() < hi - lo:
            self.scratch = torch.empty(max(hi - lo, _WINDOW_BYTES + 2 * self.block), dtype=torch.uint8)
        out = self.scratch[: hi - lo]
        view = byte_view(out)
        for p in range(0, hi - lo, CRC_PIECE):
            piece = view[p : p + CRC_PIECE]
            pread_exact(self.fd, piece, self.base + lo + p, self.what)
            self._check(a + p // self.block, piece)
        return out

    def _range(self, lo: int, hi: int, dst: torch.Tensor, bounce: Optional[HostBounce]) -> None:
        """Tensor bytes ``[lo, hi)`` into the contiguous 1-D ``dst`` of the item's dtype."""
        block, size, isz = self.block, self.entry.payload_length, self.entry.dtype.itemsize
        first = -(-lo // block)  # whole blocks inside [lo, hi)
        last = hi // block if hi < size else len(self.entry.blocks)
        if first >= last:
            a = lo // block
            dst.copy_(
                self._blocks(a, -(-hi // block))[lo - a * block : hi - a * block].view(self.entry.dtype)
            )
            return
        if lo < first * block:
            a = first - 1
            dst[: (first * block - lo) // isz].copy_(
                self._blocks(a, first)[lo - a * block :].view(self.entry.dtype)
            )
        end = min(last * block, size)
        if hi > end:
            dst[(end - lo) // isz :].copy_(self._blocks(last, last + 1)[: hi - end].view(self.entry.dtype))
        middle = dst[(first * block - lo) // isz : (end - lo) // isz]
        if middle.device.type == "cpu":
            view = byte_view(middle)
            for p in range(0, len(view), CRC_PIECE):
                piece = view[p : p + CRC_PIECE]
                pread_exact(self.fd, piece, self.base + first * block + p, self.what)
                self._check(first + p // block, piece)
        else:
            bounce.fill(
                self.fd,
                self.base + first * block,
                middle,
                self.what,
                lambda pos, piece: self._check(first + pos // block, piece),
            )

    def _box(self, start: int, size: Shape, strides: Shape, dst: torch.Tensor) -> None:
        """The box of ``size`` elements at ``strides`` from element ``start`` into ``dst``,
        window by window."""
        isz, dtype = self.entry.dtype.itemsize, self.entry.dtype
        limit = max(1, _WINDOW_BYTES // isz)
        span = sum((n - 1) * t for n, t in zip(size, strides)) + 1
        if span > limit and size:
            inner = sum((n - 1) * t for n, t in zip(size[1:], strides[1:])) + 1
            if inner <= limit:
                per = max(1, (limit - inner) // strides[0] + 1) if strides[0] else size[0]
                for i in range(0, size[0], per):
                    k = min(per, size[0] - i)
                    self._box(start + i * strides[0], (k,) + tuple(size[1:]), strides, dst[i : i + k])
            else:
                for i in range(size[0]):
                    self._box(start + i * strides[0], tuple(size[1:]), tuple(strides[1:]), dst[i])
            return
        a, b = start * isz // self.block, -(-(start + span) * isz // self.block)
        src = self._blocks(a, b).view(dtype)
        dst.copy_(src.as_strided(size, strides, src.storage_offset() + start - a * self.block // isz))

    def copy(self, ops: List[CopyOp], bounce: Optional[HostBounce]) -> int:
        """Serve ``ops``; returns the tensor bytes they take."""
        isz, nbytes = self.entry.dtype.itemsize, 0
        for op in ops:
            if not op.numel:
                continue
            dst = op.dst
            if (
                op.is_range
                and dst.is_contiguous()
                and dst.dtype == self.entry.dtype
                and (dst.device.type == "cpu" or (bounce is not None and dst.device.type == "cuda"))
            ):
                self._range(op.start * isz, op.end * isz, dst.reshape(-1), bounce)
            else:
                self._box(op.start, tuple(op.size), tuple(op.strides), dst)
            nbytes += op.numel * isz
        return nbytes


def _carried_table(store, name: str, offsets: List[Tuple[int, int]]) -> Optional[bytes]:
    """The block table of a file rewritten by surgery, whose items moved from the first to the
    second offset of each pair of ``offsets``: the old table's entries of those items, moved (the
    bytes of an item, so its block CRCs, do not change). None when the old file had no usable
    table, or none of the moved items had an entry."""
    table, _ = _block_table(store, name)
    if table is None:
        return None
    entries = []
    for old_offset, new_offset in offsets:
        e = table.entries.get(old_offset)
        if e is not None:
            entries.append(dataclasses.replace(e, item_offset=new_offset))
    return blockcrc.encode(entries, table.block) if entries else None


# Loads of at most this many item bytes read in the calling thread, file after file; a file whose
# items are each at most SMALL_ITEM_BYTES and lie within a span of at most INLINE_READ_BYTES is
# read with one pread of that span (a few syscalls per file instead of a few per item).
INLINE_READ_BYTES = 4 << 20
SMALL_ITEM_BYTES = 64 << 10


def _small_span(items: List[_Stored]) -> Optional[int]:
    """The length of the span ``items`` (sorted by offset) cover, when one read of it serves them."""
    if not items or any(st.length > SMALL_ITEM_BYTES for st in items):
        return None
    span = max(st.file_offset + st.length for st in items) - items[0].file_offset
    needed = sum(st.length for st in items)
    return span if span <= INLINE_READ_BYTES and span <= 2 * needed else None


def _fresh_name(checkpoint_dir: Path, name: str) -> str:
    stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
    n = 1
    while os.path.lexists(checkpoint_dir / f"{stem}.r{n}{DATA_SUFFIX}"):
        n += 1
    return f"{stem}.r{n}{DATA_SUFFIX}"


def _needs_staging(t: torch.Tensor) -> bool:
    """True if copies cannot go into ``t`` directly (subclass, e.g. FP8 wrappers, or non-contiguous)."""
    return not _is_plain(t) or not t.is_contiguous()


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``torch_dist`` checkpoints (distckpt's and Megatron-Core's), resharding on the fly.

    Args:
        trusted: unpickle ``.metadata`` and object payloads without the allowlist.
        thread_count: files read in parallel. Default (None): 4 on an object store; on a file
            system at most :func:`distckpt.budget.cores_per_rank` (reads from a page cache are
            memory copies, which more threads than cores only interleave). A number is used as
            given.
        checksums: (default) check every byte copied against the integrity manifest's CRC32C as
            it is read (an item read whole against its checksum, a part of one block by block
            against its file's block CRC table) and that each record read is the range the
            manifest lists (key, offset, length); a load that reads ``.metadata`` (no sidecar)
            also checks each tensor key it reads, and the metadata queries every key they
            return, against the dtype and shape the manifest says the writer declared
            (:func:`check_declared`). A sidecar load asks no manifest (reading it would cost
            what the sidecar saves): its records are CRC-checked, and the items' own headers
            must agree with its dtypes. False: no checks on local files (object stores are
            always checked). Whatever ``checksums`` says, the chunks met by each requested
            piece must cover it exactly once (:func:`_check_covered`).
        verify: in addition, read every needed item whole, check ``.metadata`` and the sidecar
            against the manifest, and cross-check every storage record and key declaration of
            ``.metadata`` (key, chunk offset and size, offset, length, dtype, shape) against
            what the manifest says the writer wrote (:func:`cross_check`).
        use_index: read the sidecar index ``.distckpt_index`` when the checkpoint has one (only
            the records of the requested keys and boxes); False always reads ``.metadata``.
        pinned_slot_bytes: CUDA targets are filled through two pinned host slots of this size
            per reader thread, each slot's copy to the device overlapping the read into the
            other; 0 copies into them from pageable memory instead.
    """

    records_phases = True  # distckpt.timings: it begins its own phases (index, planning, reading)

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        trusted: bool = False,
        thread_count: Optional[int] = None,
        verify: bool = False,
        use_index: bool = True,
        pinned_slot_bytes: int = device_io.SLOT_BYTES,
        checksums: bool = True,
    ):
        super().__init__(backend, version)
        if pinned_slot_bytes < 0:
            raise CheckpointingException(f"pinned_slot_bytes must be >= 0, got {pinned_slot_bytes}")
        self.pinned_slot_bytes = pinned_slot_bytes
        self.trusted = trusted
        self.thread_count, self._threads_given = _thread_count(thread_count, DEFAULT_READERS_PER_RANK)
        self.verify = verify
        self.checksums = checksums
        self.bytes_read = 0  # bytes read from storage by this strategy object (all loads)
        self.requests = 0  # object stores: data GET requests (ranged, after coalescing) and block tables
        self.use_index = use_index
        self.index_bytes_read = 0  # bytes of the sidecar index read (all loads)
        self.index_node_bytes_read = 0  # of which chunk-record tree nodes
        self.last_load_used_index = False
        # The sidecar reader ``load_common_items`` opened, for the ``load`` that follows it: its
        # directory is parsed once per load. Kept with the tree's identity, and taken only while
        # the checkpoint at that path is still the same tree.
        self._opened: Optional[Tuple[Any, Any, IndexReader]] = None
        # ``.metadata`` as this object last read it: location, bytes, parsed, what was derived.
        self._parsed: Optional[Tuple[Any, bytes, Metadata, Dict[str, Any]]] = None

    def _metadata(self, checkpoint_dir, verify: bool, derive: str = "claims") -> Tuple[Metadata, Any]:
        """``.metadata`` (``verify``: the file checked against the manifest first) and, per
        ``derive``, its claims checked (:func:`check_claims`, None) or its index (:func:`_index`),
        for this object's own reads, which never modify them. Unpickled and checked once while the
        file holds the same bytes: a tool reads a checkpoint key by key through one strategy
        (diff, convert, verify --deep), and 20,000 chunks take about a second each time."""
        raw = _metadata_bytes(checkpoint_dir, self.trusted, verify)
        source = storage.join(checkpoint_dir, METADATA_FNAME)
        parsed = self._parsed
        if parsed is None or parsed[0] != checkpoint_dir or parsed[1] != raw:
            parsed = self._parsed = (checkpoint_dir, raw, _unpickled(raw, source, self.trusted), {})
        md, derived = parsed[2], parsed[3]
        if derive == "index" and "index" not in derived:
            derived["index"] = _index(md, source)
            derived["claims"] = None  # _index checks them first
        elif "claims" not in derived:
            derived["claims"] = check_claims(md, source)
        return md, derived[derive]

    def _parsed_metadata(self, checkpoint_dir) -> Tuple[Metadata, Dict[str, Any]]:
        """``.metadata`` and its index for a load (with ``verify``, cross-checked too)."""
        md, index = self._metadata(checkpoint_dir, self.verify, "index")
        if self.verify:
            self._cross_check(md, checkpoint_dir)
        return md, index

    def _open_index(self, checkpoint_dir, keep: bool = False) -> Optional[IndexReader]:
        """The sidecar reader of ``checkpoint_dir`` (None: no usable sidecar); ``keep``: leave it
        for the next call (the ``load`` after ``load_common_items``)."""
        from distckpt.commit import tree_identity

        opened, self._opened = self._opened, None
        identity = tree_identity(checkpoint_dir) if isinstance(checkpoint_dir, Path) else None
        if opened is not None and identity is not None and opened[:2] == (checkpoint_dir, identity):
            reader = opened[2]
        else:
            reader = IndexReader.open(checkpoint_dir)
        if keep and reader is not None and identity is not None:
            self._opened = (checkpoint_dir, identity, reader)
        return reader

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    # ----------------------------------------------------------------- metadata queries

    def _queried_metadata(self, checkpoint_dir) -> Metadata:
        """``.metadata`` for the metadata queries: its claims checked and, with checksums on (the
        default) and a manifest, the file against its CRC32C and its tensor keys against the
        manifest's declarations (:func:`_check_all_declared`): what was damaged since the save, or
        written wrong, is refused rather than reported (reading the manifest costs about what the
        unpickling does)."""
        checkpoint_dir = _location(checkpoint_dir)
        md = self._metadata(checkpoint_dir, self.checksums or self.verify)[0]
        declared = read_declared_keys(checkpoint_dir) if self.checksums or self.verify else None
        if declared:
            _check_all_declared(
                md,
                declared,
                storage.join(checkpoint_dir, METADATA_FNAME),
                storage.join(checkpoint_dir, MANIFEST_FNAME),
            )
        return md

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return _tensors_metadata(self._queried_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        md = self._queried_metadata(checkpoint_dir)
        out = _tensors_metadata(md)
        for fqn, meta in md.state_dict_metadata.items():
            # Byte items of other names are common values (load_common_items), not sharded.
            if isinstance(meta, BytesStorageMetadata) and _is_object_key(fqn):
                out[fqn] = ShardedObject.empty_from_unique_key(fqn)
        return out

    def load_common_items(self, checkpoint_dir: Path) -> StateDict:
        """The non-tensor values of a ``dcp.save`` (see :func:`plain_byte_items`), nested as saved."""
        checkpoint_dir = _location(checkpoint_dir)
        out: StateDict = {}
        reader = self._open_index(checkpoint_dir, keep=True) if self.use_index else None
        if reader is not None and not any(
            isinstance(e, dict) and e.get("bytes") and not _is_object_key(fqn)
            for fqn, e in reader.keys.items()
        ):
            return out  # the sidecar's directory says there is none: .metadata is not read
        md, index = self._parsed_metadata(checkpoint_dir)
        items = plain_byte_items(md)
        if not items:
            return out
        checksums = self._checksums(checkpoint_dir)
        for fqn, path in items.items():
            value = self._load_bytes(f"value {fqn!r}", index.get(fqn), checkpoint_dir, checksums, fqn)
            _set_at_path(out, path, value)
        return out

    # ----------------------------------------------------------------- surgery

    def remove_sharded_tensors(self, checkpoint_dir: Path, key_prefix: str) -> None:
        """Drop every key starting with ``key_prefix`` (tensors and objects) from the checkpoint.

        Crash-safe order: data files that mix kept and removed items are first rewritten under new
        names, then ``.metadata`` is replaced atomically, and only then are the old files deleted.
        Saving with ``separation_hint=key_prefix`` puts such keys in files of their own, so no
        byte has to be rewritten.
        """
        if isinstance(checkpoint_dir, storage.Store):
            return self._remove_on_store(checkpoint_dir, key_prefix)
        checkpoint_dir = Path(checkpoint_dir)
        md, doomed, by_file, new_storage = self._removal_plan(checkpoint_dir, key_prefix)
        to_delete, rewritten_bytes = [], 0
        moved: Dict[MetadataIndex, Tuple[_StorageInfo, _StorageInfo]] = {}
        tables: Dict[str, bytes] = {}  # block tables of the rewritten files
        store = storage.open_store(checkpoint_dir)
        manifest = read_manifest(checkpoint_dir)
        old = manifest.range_index() if manifest is not None else {}
        created: List[str] = []  # new data files, removed again if a carried item is damaged

        def refuse(message: str) -> None:
            for new in created:
                containment.remove_beneath(checkpoint_dir, new, checkpoint_dir)
            raise CheckpointingException(message + "; nothing was changed")

        for name, entries in sorted(by_file.items()):
            kept = [(i, info) for i, info in entries if i.fqn not in doomed]
            if len(kept) == len(entries):
                continue
            to_delete.append(name)
            if not kept:
                continue
            new_name = _fresh_name(checkpoint_dir, name)
            offsets = []
            source = checkpoint_dir / METADATA_FNAME
            src_fd = containment.open_beneath(checkpoint_dir, name, source)
            dst_fd = containment.create_beneath(checkpoint_dir, new_name, source)
            created.append(new_name)
            with open(src_fd, "rb") as src, open(dst_fd, "wb") as dst:
                for index, info in sorted(kept, key=lambda e: e[1].offset):
                    src.seek(info.offset)
                    data = src.read(info.length)
                    if len(data) != info.length:
                        refuse(f"{checkpoint_dir / name}: truncated at item {index.fqn!r}")
                    # The carried bytes keep their manifest checksum in the new file: checked
                    # now (they are in memory), so damage is refused rather than moved.
                    prev = old.get((name, info.offset))
                    if prev is not None and crc32c(data) != prev.crc32c:
                        refuse(
                            f"{checkpoint_dir / name}: key {index.fqn!r} at offset {info.offset}: CRC32C "
                            f"mismatch against {MANIFEST_FNAME} (corrupted data)"
                        )
                    new_storage[index] = _StorageInfo(new_name, dst.tell(), info.length)
                    moved[index] = (info, new_storage[index])
                    offsets.append((info.offset, dst.tell()))
                    dst.write(data)
                    rewritten_bytes += info.length
                dst.flush()
                os.fsync(dst.fileno())
            table = _carried_table(store, name, offsets)
            containment.remove_beneath(checkpoint_dir, blockcrc.table_name(new_name), source)
            if table is not None:
                tables[blockcrc.table_name(new_name)] = table
                atomic_write_bytes(checkpoint_dir / blockcrc.table_name(new_name), table)
        if rewritten_bytes:
            logger.warning(
                "%s: rewrote %d bytes of kept tensors that shared files with keys under %r; "
                "save with separation_hint=%r to make removal free",
                checkpoint_dir,
                rewritten_bytes,
                key_prefix,
                key_prefix,
            )
        md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k not in doomed}
        md.storage_data = new_storage
        mcore = getattr(md, "mcore_data", None)
        if mcore:
            md.mcore_data = {k: v for k, v in mcore.items() if k not in doomed}
        md_bytes = pickle.dumps(md)
        if manifest is not None:
            manifest.keys = {k: v for k, v in manifest.keys.items() if k not in doomed}
            for name in to_delete:
                manifest.drop(name)
                manifest.drop(blockcrc.table_name(name))
            for tname, data in tables.items():
                manifest.set_bytes(tname, data)
            for index, (old_info, new_info) in moved.items():
                prev = old.get((old_info.relative_path, old_info.offset))
                if prev is not None:
                    manifest.ranges.setdefault(new_info.relative_path, []).append(
                        RangeChecksum(new_info.offset, new_info.length, prev.crc32c, index.fqn, prev.chunk)
                    )
                manifest.files[new_info.relative_path] = (
                    (checkpoint_dir / new_info.relative_path).stat().st_size
                )
            manifest.set_bytes(METADATA_FNAME, md_bytes)
        index_bytes = _reindex(md, md_bytes, manifest)
        if manifest is not None:
            write_manifest(checkpoint_dir, manifest)
        (checkpoint_dir / INDEX_FNAME).unlink(missing_ok=True)
        atomic_write_bytes(checkpoint_dir / METADATA_FNAME, md_bytes)
        if index_bytes is not None:
            atomic_write_bytes(checkpoint_dir / INDEX_FNAME, index_bytes)
        for name in to_delete:
            # Each name passed the containment rule in _removal_plan; removal resolves it again
            # beneath the checkpoint (a symlink is removed itself, never its target).
            containment.remove_beneath(checkpoint_dir, name, checkpoint_dir / METADATA_FNAME)
            containment.remove_beneath(
                checkpoint_dir, blockcrc.table_name(name), checkpoint_dir / METADATA_FNAME
            )

    def _removal_plan(self, location, key_prefix: str):
        """What ``remove_sharded_tensors`` works from: the metadata, the doomed keys, every file's
        (index, storage info) records, and the storage records that stay."""
        md = checked_metadata(location, self.trusted)
        doomed = {k for k in md.state_dict_metadata if k.startswith(key_prefix)}
        if not doomed:
            raise CheckpointingException(f"{location}: no key starts with {key_prefix!r}")
        by_file: Dict[str, List[Tuple[MetadataIndex, _StorageInfo]]] = defaultdict(list)
        source = storage.join(location, METADATA_FNAME)
        for index, info in md.storage_data.items():
            by_file[info.relative_path].append((index, info))
        # Every file the metadata names is checked before anything is rewritten or deleted: a
        # hostile name refuses the whole removal, leaving the checkpoint as it was.
        for name in by_file:
            containment.check_name(name, source, f"storage record of {by_file[name][0][0].fqn!r}: file name")
        # So is every file it will read, replace or delete: a missing, short or non-regular one
        # is refused now, not half-way through.
        for name, entries in sorted(by_file.items()):
            kept = [(i, info) for i, info in entries if i.fqn not in doomed]
            if len(kept) == len(entries):
                continue
            size = _surgery_file_size(location, name, source)
            need = max((info.offset + info.length for _, info in kept), default=0)
            if size is None and kept:
                raise CheckpointingException(
                    f"{storage.join(location, name)}: data file is missing (holds kept keys "
                    f"{sorted({i.fqn for i, _ in kept})[:5]}); nothing was changed"
                )
            if size is not None and size < need:
                raise CheckpointingException(
                    f"{storage.join(location, name)}: truncated ({size} bytes, kept items need {need}); "
                    f"nothing was changed"
                )
        new_storage = {i: info for i, info in md.storage_data.items() if i.fqn not in doomed}
        return md, doomed, by_file, new_storage

    def _remove_on_store(self, store: storage.Store, key_prefix: str) -> None:
        """``remove_sharded_tensors`` on an object store, in the same crash-safe order: kept items
        that shared an object with removed ones are copied into new objects (ranged GETs, one put
        each), then ``.metadata`` and the manifest are replaced, then the old objects deleted."""
        md, doomed, by_file, new_storage = self._removal_plan(store, key_prefix)
        manifest = read_manifest(store)
        old = manifest.range_index() if manifest is not None else {}
        to_delete: List[str] = []
        for name, entries in sorted(by_file.items()):
            kept = sorted(
                [(i, info) for i, info in entries if i.fqn not in doomed], key=lambda e: e[1].offset
            )
            if len(kept) == len(entries):
                continue
            to_delete.append(name)
            if manifest is not None:
                manifest.drop(name)
                manifest.drop(blockcrc.table_name(name))
            if not kept:
                continue
            stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
            new_name = f"{stem}.r{uuid.uuid4().hex[:8]}{DATA_SUFFIX}"
            views = store.get_ranges(
                name, [info.offset for _, info in kept], [info.length for _, info in kept]
            )
            position, offsets = 0, []
            for (index, info), view in zip(kept, views):
                new_storage[index] = _StorageInfo(new_name, position, info.length)
                offsets.append((info.offset, position))
                prev = old.get((name, info.offset))
                if prev is not None and (len(view) != info.length or crc32c(view) != prev.crc32c):
                    raise CheckpointingException(
                        f"{store.where(name)}: key {index.fqn!r} at offset {info.offset}: CRC32C mismatch "
                        f"against {MANIFEST_FNAME} (corrupted data); {METADATA_FNAME} was not changed"
                    )
                if manifest is not None and prev is not None:
                    manifest.ranges.setdefault(new_name, []).append(
                        RangeChecksum(position, info.length, prev.crc32c, index.fqn, prev.chunk)
                    )
                position += info.length
            store.put(new_name, b"".join(bytes(v) for v in views))
            if manifest is not None:
                manifest.files[new_name] = position
            table = _carried_table(store, name, offsets)
            if table is not None:
                store.put(blockcrc.table_name(new_name), table)
                if manifest is not None:
                    manifest.set_bytes(blockcrc.table_name(new_name), table)
        md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k not in doomed}
        md.storage_data = new_storage
        mcore = getattr(md, "mcore_data", None)
        if mcore:
            md.mcore_data = {k: v for k, v in mcore.items() if k not in doomed}
        md_bytes = pickle.dumps(md)
        if manifest is not None:
            manifest.keys = {k: v for k, v in manifest.keys.items() if k not in doomed}
            manifest.set_bytes(METADATA_FNAME, md_bytes)
        index_bytes = _reindex(md, md_bytes, manifest)
        if manifest is not None:
            write_manifest(store, manifest)
        store.delete(INDEX_FNAME)
        store.put(METADATA_FNAME, md_bytes)
        if index_bytes is not None:
            store.put(INDEX_FNAME, index_bytes)
        for name in to_delete:
            store.delete(name)
            store.delete(blockcrc.table_name(name))

    # ----------------------------------------------------------------- planning

    def _plan_tensor(self, plan: _Plan, sh: ShardedTensor, stored: _StoredKey, dest: torch.Tensor) -> None:
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
                self._plan_flat_to_flat(plan, sh, stored, dest, full_local, start, stop)
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
                self._plan_box_from_regular(plan, sh.key, stored, off, size, view)
            else:
                self._plan_box_from_flat(plan, sh.key, stored, off, size, view)

    @staticmethod
    def _plan_box_from_regular(plan, key, stored: _StoredKey, off, size, view) -> None:
        met = []
        for ch in stored.chunks:
            if ch.offset == off and ch.size == size:
                # The request is this chunk (a load in the layout it was saved in): all of it.
                plan.add(ch, CopyOp(key, 0, size, contiguous_strides(size), view))
                met.append((off, size))
                continue
            inter = _intersect(off, size, ch.offset, ch.size)
            if inter is None:
                continue
            met.append(inter)
            lo = tuple(a - b for a, b in zip(inter[0], ch.offset))
            plan.add(
                ch,
                CopyOp(
                    key,
                    _ravel(lo, ch.size),
                    inter[1],
                    contiguous_strides(ch.size),
                    view[_rel_slices(*inter, off)],
                ),
            )
        if len(met) != 1 or met[0] != (off, size):
            _check_covered(stored, off, size, met)

    @staticmethod
    def _plan_flat_to_flat(plan, sh, stored: _StoredKey, dest, full_local, start, stop) -> None:
        grid_index = tuple(o // s for o, s in zip(sh.global_offset, full_local))
        _plan_flat_slices(plan, sh.key, stored, grid_index, start, stop, dest, start)

    @staticmethod
    def _plan_box_from_flat(plan, key, stored: _StoredKey, off, size, view) -> None:
        chunk = stored.chunk_local_shape
        grid = stored.size[:-1]
        strides = contiguous_strides(chunk)
        ranges = [range(o // c, min(g, -(-(o + s) // c))) for o, s, c, g in zip(off, size, chunk, grid)]
        for idx in itertools.product(*ranges):
            chunk_off = tuple(i * c for i, c in zip(idx, chunk))
            inter = _intersect(off, size, chunk_off, chunk)
            if inter is None:
                continue
            lo = tuple(a - b for a, b in zip(inter[0], chunk_off))
            f_lo = _ravel(lo, chunk)
            f_hi = _ravel([a + b - 1 for a, b in zip(lo, inter[1])], chunk) + 1
            dst = view[_rel_slices(*inter, off)]
            if f_hi - f_lo == math.prod(inter[1]) and dst.is_contiguous():
                # The box is one flat range of the stored chunk: read straight into place.
                _plan_flat_slices(plan, key, stored, idx, f_lo, f_hi, dst.reshape(-1), f_lo)
                continue
            holder = next(
                (
                    ch
                    for ch in stored.flat_index.get(idx, [])
                    if ch.offset[-1] <= f_lo and f_hi <= ch.offset[-1] + ch.size[-1]
                ),
                None,
            )
            if holder is not None:
                # One stored slice holds the whole box: copy it out strided, no staging.
                plan.add(holder, CopyOp(key, f_lo - holder.offset[-1], inter[1], strides, dst))
                continue
            # The box spans several stored slices: gather its flat span, then copy the box out.
            buf = torch.empty(f_hi - f_lo, dtype=stored.dtype)
            _plan_flat_slices(plan, key, stored, idx, f_lo, f_hi, buf, f_lo)

            def fin(dst=dst, buf=buf, box=inter[1]):
                dst.copy_(buf.as_strided(box, strides))

            plan.finalizers.append(fin)

    # ----------------------------------------------------------------- execution

    def _checksums(self, checkpoint_dir) -> Optional[Dict]:
        """The manifest's checksums by (file, offset); None without a manifest, or when checks
        are switched off (``checksums=False``, not on an object store: its own checksums do not
        cover ranged reads)."""
        manifest = self._manifest(checkpoint_dir)
        return None if manifest is None else self._checks_of(manifest)

    def _checks_of(self, manifest: Manifest) -> Dict:
        """``manifest``'s checksums by (file, offset), as this load applies them."""
        return manifest.range_index() if self.verify else _DefaultChecks(manifest.range_index())

    def _manifest(self, checkpoint_dir) -> Optional[Manifest]:
        """The manifest a load checks against (see :meth:`_checksums`); None when it has none."""
        if not (self.verify or self.checksums or isinstance(checkpoint_dir, storage.Store)):
            return None
        manifest = read_manifest(checkpoint_dir)
        if manifest is None:
            if self.verify:
                logger.warning(
                    "%s has no integrity manifest: verify=True checks sizes and structure only",
                    checkpoint_dir,
                )
            else:
                logger.info(
                    "%s has no integrity manifest: its ranged reads are checked structurally only",
                    checkpoint_dir,
                )
            return None
        return manifest

    @staticmethod
    def _cross_check(md: Metadata, checkpoint_dir) -> None:
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

    @staticmethod
    def _check_allocations(
        sharded_state_dict: ShardedStateDict, index: Dict[str, Any], checkpoint_dir
    ) -> None:
        """Tensors this load allocates (requests without data, e.g. ``load_plain_tensors``, whose
        shape may come from the checkpoint's own claims) must be backed by stored bytes that
        exist: every record of the key inside its file, and together at least the request's
        bytes. So a claimed shape of 2^40 elements is refused before anything is allocated."""
        wanted = [
            sh
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and sh.data is None and isinstance(index.get(sh.key), _StoredKey)
        ]
        if not wanted:
            return
        source = storage.join(checkpoint_dir, METADATA_FNAME)
        sizes: Dict[str, int] = {}
        for sh in wanted:
            stored = index[sh.key]
            have = 0
            for c in stored.chunks:
                if c.relative_path not in sizes:
                    try:
                        sizes[c.relative_path] = _stored_file_size(checkpoint_dir, c.relative_path, source)
                    except FileNotFoundError:
                        sizes[c.relative_path] = 0
                if c.file_offset + c.length > sizes[c.relative_path]:
                    raise CheckpointingException(
                        f"{storage.join(checkpoint_dir, c.relative_path)}: key {sh.key!r}: record at offset {c.file_offset} "
                        f"of {c.length} bytes: file is truncated ({sizes[c.relative_path]} bytes)"
                    )
                have += c.length
            need = math.prod(sh.local_shape) * sh.dtype.itemsize
            if need > have:
                raise CheckpointingException(
                    f"{source}: key {sh.key!r}: loading {list(sh.local_shape)} needs {need} bytes, the "
                    f"checkpoint stores {have} for this key; refusing to allocate it"
                )

    def _execute(self, plan: _Plan, checkpoint_dir, checksums: Optional[Dict]) -> None:
        by_file: Dict[str, List[_Stored]] = defaultdict(list)
        for st in plan.ops:
            by_file[st.relative_path].append(st)
        verify = self.verify
        rank = dist.get_rank()
        counted = []  # per-file byte counts; list.append is atomic across reader threads
        gets: List[int] = []  # object stores: GET requests per batch

        def read_object(name: str) -> None:
            """Object store: ranged GETs of the bytes this rank needs, concurrent, in batches of at
            most REMOTE_READ_BATCH bytes, every byte checked against a CRC32C (the store's own
            checksums do not cover ranged reads). An item needed only in part is read block by
            block when its file has a block table (:mod:`distckpt.strategies.blockcrc`): the
            blocks holding the wanted bytes, runs closer than the store's ``coalesce`` merged,
            each block checked against its CRC32C. Other items are read whole and checked
            against the item's CRC32C."""
            where = checkpoint_dir.where(name)
            items = sorted(by_file[name], key=lambda c: c.file_offset)
            nbytes = 0
            table = None
            if (
                checksums is not None
                and not verify
                and any(_partial_candidate(st, plan.ops[st]) for st in items)
            ):
                table, nbytes = _block_table(checkpoint_dir, name)
                gets.append(1)
            gap = getattr(checkpoint_dir, "coalesce", 1 << 20)
            work = []  # (item, its partial read or None, [(file offset, length)])
            for st in items:
                part = (
                    _partial_read(st, plan.ops[st], table, checksums, gap, where)
                    if table is not None
                    else None
                )
                work.append((st, part, part.ranges() if part is not None else [(st.file_offset, st.length)]))
            batches, batch, size = [], [], 0
            for w in work:
                n = sum(length for _, length in w[2])
                if batch and size + n > REMOTE_READ_BATCH:
                    batches.append(batch)
                    batch, size = [], 0
                batch.append(w)
                size += n
            batches.append(batch)
            for group in batches:
                # Coalesced here (not only inside the client) so that bytes_read counts what is
                # transferred, gaps included.
                requests, places = storage.coalesce([r for _, _, rs in group for r in rs], gap)
                try:
                    got = checkpoint_dir.get_ranges(name, [o for o, _ in requests], [n for _, n in requests])
                except FileNotFoundError:
                    keys = sorted({op.key for st, _, _ in group for op in plan.ops[st]})
                    raise CheckpointingException(
                        f"{where}: data object is missing (needed for keys {keys}, rank {rank})"
                    ) from None
                views = iter(got[i][at : at + n] for i, at, n in places)
                for st, part, rs in group:
                    mine = [next(views) for _ in rs]
                    if part is None:
                        _read_chunk(
                            -1,
                            where,
                            st,
                            plan.ops[st],
                            checksums,
                            rank,
                            True,
                            bytearray(mine[0]),
                            claimed=plan.keys.get(plan.ops[st][0].key),
                        )
                    else:
                        part.copy(mine, plan.ops[st], rank)
                nbytes += sum(n for _, n in requests)
                gets.append(len(requests))
            counted.append(nbytes)

        def read_file(name: str) -> None:
            path = checkpoint_dir / name
            try:
                fd = containment.open_beneath(checkpoint_dir, name, checkpoint_dir / METADATA_FNAME)
            except FileNotFoundError:
                keys = sorted({op.key for st in by_file[name] for op in plan.ops[st]})
                raise CheckpointingException(
                    f"{path}: data file is missing (needed for keys {keys}, rank {rank})"
                ) from None
            try:
                nbytes = 0
                file_size = os.fstat(fd).st_size
                items = sorted(by_file[name], key=lambda c: c.file_offset)
                for st in items:
                    if st.file_offset + st.length > file_size:
                        raise CheckpointingException(
                            f"key {plan.ops[st][0].key!r} in {path} at offset {st.file_offset} (rank {rank}): file "
                            f"is truncated ({file_size} bytes, the record ends at {st.file_offset + st.length})"
                        )
                span = _small_span(items)
                if span is not None:
                    # Small items: one read of the span they lie in, then each item from memory.
                    first = items[0].file_offset
                    raw = bytearray(span)
                    view = memoryview(raw)
                    pread_exact(fd, view, first, str(path))
                    for st in items:
                        start = st.file_offset - first
                        _read_chunk(
                            fd,
                            path,
                            st,
                            plan.ops[st],
                            checksums,
                            rank,
                            verify,
                            view[start : start + st.length],
                            claimed=plan.keys.get(plan.ops[st][0].key),
                        )
                    counted.append(len(raw))
                    return
                table, vouched = None, False
                if (
                    checksums is not None
                    and not verify
                    and any(
                        st.length >= blockcrc.MIN_PAYLOAD and not _whole_into_cpu(st, plan.ops[st])
                        for st in items
                    )
                ):
                    table, vouched = _local_block_table(checkpoint_dir, name, checksums)
                bounce = HostBounce(self.pinned_slot_bytes) if self.pinned_slot_bytes else None
                try:
                    for st in items:
                        blocks = None
                        expected = checksums.get((name, st.file_offset)) if table is not None else None
                        if expected is not None and not _whole_into_cpu(st, plan.ops[st]):
                            entry = _table_entry(st, table, expected, vouched, str(path))
                            if entry is not None:
                                blocks = BlockReader(
                                    fd,
                                    st.file_offset + entry.payload_offset,
                                    entry,
                                    table.block,
                                    f"key {plan.ops[st][0].key!r} in {path} at offset "
                                    f"{st.file_offset} (rank {rank})",
                                    f"its block table {blockcrc.table_name(name)}",
                                )
                        nbytes += _read_chunk(
                            fd,
                            path,
                            st,
                            plan.ops[st],
                            checksums,
                            rank,
                            verify,
                            bounce=bounce,
                            blocks=blocks,
                            claimed=plan.keys.get(plan.ops[st][0].key),
                        )
                finally:
                    if bounce is not None:
                        bounce.close()
                counted.append(nbytes)
            finally:
                os.close(fd)

        names = sorted(by_file)
        if len(names) > 1:
            # Ranks that read the same files start at different ones rather than all at the
            # first: fewer ranks map and fault in the same file at once (on a parallel file
            # system, fewer on the same servers). 2 ranks, one reader each, a resharded load of
            # 256 MiB per rank: 0.167 -> 0.142 s.
            first = rank * len(names) // max(1, dist.get_world_size())
            names = names[first:] + names[:first]
        if isinstance(checkpoint_dir, storage.Store):
            read_file = read_object  # noqa: F811 - the object-store reader replaces the POSIX one
        small = sum(st.length for st in plan.ops) <= INLINE_READ_BYTES
        threads = self.reader_threads(checkpoint_dir)
        if small or not names:
            for n in names:
                read_file(n)
        else:
            # Also one reader is a worker thread, not the caller's: copies out of mappings run
            # in torch, whose intra-op threads fan out from the main thread (all the host's
            # cores unless OMP_NUM_THREADS says otherwise, as torchrun does). Two ranks on two
            # cores, each copying from its main thread with two intra-op threads, made a
            # resharded load 2-4x slower; from a worker thread it runs as one thread.
            with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
                for fut in [pool.submit(read_file, n) for n in names]:
                    fut.result()
        self.bytes_read += sum(counted)
        self.requests += sum(gets)
        for fin in plan.finalizers:
            fin()

    def reader_threads(self, checkpoint_dir=None) -> int:
        """Files (objects) read at once (see :func:`_io_threads`)."""
        return _io_threads(self.thread_count, self._threads_given, checkpoint_dir)

    def _load_object(
        self, obj: ShardedObject, stored: Optional[_Stored], checkpoint_dir: Path, checksums: Optional[Dict]
    ) -> Any:
        value = self._load_bytes(
            f"ShardedObject {obj.unique_key!r}", stored, checkpoint_dir, checksums, obj.unique_key
        )
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def _load_bytes(
        self, name: str, stored: Optional[_Stored], checkpoint_dir: Path, checksums: Optional[Dict], key: str
    ) -> Any:
        """Unpickle one byte item (safely unless ``trusted``); ``name`` says what it is. With
        ``checksums``, the manifest must list the item's range as one of ``key``: a key renamed
        in the metadata is refused, not returned under its new name."""
        if stored is None:
            raise CheckpointingException(
                f"{name} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})"
            )
        source = storage.join(checkpoint_dir, METADATA_FNAME)
        path = storage.join(checkpoint_dir, stored.relative_path)
        what = f"{name} in {path} (rank {dist.get_rank()})"
        try:
            size = _stored_file_size(checkpoint_dir, stored.relative_path, source)
            if stored.file_offset + stored.length > size:
                raise CheckpointingException(
                    f"{what}: file is truncated ({size} bytes, the record ends at "
                    f"{stored.file_offset + stored.length})"
                )
            if isinstance(checkpoint_dir, storage.Store):
                raw = bytes(
                    checkpoint_dir.get_ranges(stored.relative_path, [stored.file_offset], [stored.length])[0]
                )
            else:
                with open(containment.open_beneath(checkpoint_dir, stored.relative_path, source), "rb") as f:
                    f.seek(stored.file_offset)
                    raw = f.read(stored.length)
        except FileNotFoundError:
            raise CheckpointingException(f"{what}: data file is missing") from None
        if len(raw) != stored.length:
            raise CheckpointingException(f"{what}: file is truncated")
        _check_item(raw, stored, checksums, what, key)
        return safe_torch_load(raw, what=what, trusted=self.trusted)

    def _load_index(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir
    ) -> Tuple[Dict[str, Any], Optional[Dict]]:
        """The stored keys this load needs and the items' checksums (None: do not check): from
        the sidecar index when the checkpoint has one (only the requested keys' records are
        read), else from ``.metadata`` (and the manifest)."""
        reader = self._open_index(checkpoint_dir) if self.use_index else None
        if reader is None:
            self.last_load_used_index = False
            _, index = self._parsed_metadata(checkpoint_dir)
            manifest = self._manifest(checkpoint_dir)
            if manifest is None:
                return index, None
            if manifest.keys:
                # Each tensor key this load reads, as .metadata declares it, against what the
                # writer declared (the sidecar path has no manifest to ask: see the class doc).
                source = storage.join(checkpoint_dir, METADATA_FNAME)
                where = storage.join(checkpoint_dir, MANIFEST_FNAME)
                for fqn in {
                    sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)
                }:
                    stored = index.get(fqn)
                    if isinstance(stored, _StoredKey):
                        check_declared(
                            fqn, stored.dtype, stored.size, stored.orig_shape, manifest.keys, source, where
                        )
            return index, self._checks_of(manifest)
        self.last_load_used_index = True
        # verify=True checks against the manifest itself (read whole: an opt-in, full check),
        # .metadata and the sidecar included; object-store loads take the items' checksums from
        # the sidecar's records.
        checksums = None
        if self.verify:
            for name in (METADATA_FNAME, INDEX_FNAME):
                check_whole_file(checkpoint_dir, name, storage.read_bytes(checkpoint_dir, name))
            md = read_metadata(checkpoint_dir, self.trusted)
            _index(md, storage.join(checkpoint_dir, METADATA_FNAME))  # its claims checked
            self._cross_check(md, checkpoint_dir)
            checksums = self._checksums(checkpoint_dir)
        own: Optional[Dict] = (
            {}
            if checksums is None
            and (self.verify or self.checksums or isinstance(checkpoint_dir, storage.Store))
            else None
        )
        index = _index_from_sidecar(reader, sharded_state_dict, own)
        if own is not None:
            checksums = own
        self.index_bytes_read += reader.bytes_read
        self.index_node_bytes_read += reader.node_bytes_read
        return index, checksums

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = _location(checkpoint_dir)
        timings.begin("index")
        index, checksums = self._load_index(sharded_state_dict, checkpoint_dir)
        timings.begin("planning")
        self._check_allocations(sharded_state_dict, index, checkpoint_dir)
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
                    f"ShardedTensor {sh.key!r} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})"
                )
            if sh.data is None:
                sh.init_data("cpu")
            target = sh.data
            if _needs_staging(target):
                dest = torch.empty(tuple(target.shape), dtype=target.dtype, device=target.device)
                commits.append(lambda t=target, d=dest: t.copy_(d))
            else:
                dest = target.detach()  # same memory; copies into its views bypass autograd
            plan.keys[sh.key] = stored
            self._plan_tensor(plan, sh, stored, dest)
            return sh

        dict_list_map_inplace(prepare, sharded_state_dict)
        timings.begin("reading")
        self._execute(plan, checkpoint_dir, checksums)
        with torch.no_grad():
            for commit in commits:
                commit()

        def result(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return sh.data
            if isinstance(sh, ShardedObject):
                return self._load_object(sh, index.get(sh.unique_key), checkpoint_dir, checksums)
            return sh

        return dict_list_map_inplace(result, sharded_state_dict)


register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy)
register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy)
