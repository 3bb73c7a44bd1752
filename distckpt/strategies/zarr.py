"""The ``zarr`` strategy: one Zarr v3 array per ShardedTensor key, written by its owners without locks.

On disk (docs/formats-zarr.md has the full description and the trade-offs)::

    ckpt/zarr.json               root group; attributes.distckpt lists the tensor keys
    ckpt/<key>/zarr.json         the array of global tensor <key>: shape, data type, chunk grid
    ckpt/<key>/c/<i>/<j>...      one chunk: raw little-endian C-order bytes (no compression)
    ckpt/<unique_key>.pt         ShardedObjects, written by the common strategy
    ckpt/common.pt, metadata.json

Format versions: 2 is the layout above; 1 is Megatron-Core's legacy Zarr v2 layout
(``<key>/.zarray``, chunk files ``<key>/0.1``). The load strategy reads both, key by key; the
save strategy always writes version 2 (a request for ``("zarr", 1)`` gets it too).

Chunk grid: the gcd, per axis, of every cut point of every main replica's piece. Each chunk then
lies inside exactly one piece, so every chunk file has exactly one writer and needs no lock.
Flattened ranges are stored in the tensor's original shape: a flat range is cut into row-major
boxes (:func:`flat_range_boxes`) and the boxes' edges are cut points too. Where that makes chunks
smaller than ``min_flat_chunk_bytes`` the grid is coarsened inside each shard (never across
one); a chunk that then spans several writers' ranges is assembled and written by one rank
(rank 0, from the pieces gathered in the final collective), so still no two writers meet.

Save (every rank): describe local pieces -> one all-gather of per-key cut-point gcds -> each
array's ``zarr.json`` written by one rank (keys round-robin) -> every rank writes its whole
chunks (CRC32C of each file, and of each 256 KiB block of a large one, computed on the way)
-> gather the shared-chunk pieces and the
checksums to rank 0, which writes those chunks and the integrity manifest; any failure raises on
every rank. ``metadata.json`` is left to the caller (serialization commits). ``async_save``
stages the bytes and runs the chunk writes in the background, the gather at finalization.

Load (every rank, no collective): each requested piece is cut into boxes and intersected with the
chunk grid; only overlapping chunks are read, and of those only the overlapping byte ranges
(by default every byte copied is checked: whole chunks against the manifest's CRC32C, parts of
large chunks against the block CRC32Cs the manifest keeps for them; with ``verify``: whole
chunks).

I/O: the raw engine writes and reads chunk files with ``os.write``/``os.preadv`` straight from and
into tensor memory (no copies) on a thread pool. Arrays it cannot handle (compressed, sharded,
big-endian, F-order, other writers' codecs) go through tensorstore (strategies/tensorstore.py),
which can also be chosen for everything with ``io_engine="tensorstore"``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from distckpt import bounds, containment, dist, storage
from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.manifest import (
    MANIFEST_FNAME,
    build_manifest,
    crc32c,
    dtype_name,
    pack_block_crcs,
    read_manifest,
    write_manifest,
)
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from distckpt.strategies import blockcrc
from distckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from distckpt.strategies.filesystem import (
    ChecksummingSink,
    byte_view,
    contiguous_strides,
    pread_crc,
    pread_exact,
)
from distckpt.strategies.torch import BlockReader, CopyOp, copy_from_mapping, flat_range_boxes

logger = logging.getLogger(__name__)

BACKEND = "zarr"
FORMAT_VERSION = 2  # Zarr v3 layout written by distckpt
LEGACY_VERSION = 1  # Megatron-Core <= 0.15 Zarr v2 layout (read only)
ARRAY_META = "zarr.json"
LEGACY_ARRAY_META = ".zarray"
DEFAULT_MIN_FLAT_CHUNK_BYTES = 1 << 20
IO_ENGINES = ("auto", "raw", "tensorstore")
# Chunk requests in flight per rank on an object store: each waits on the network (obstore
# releases the GIL), so more of them than CPU threads hide the per-request latency.
OBJECT_STORE_REQUESTS = 16

# Names that would collide with the checkpoint's own files at the top level.
_RESERVED_TOP = {"zarr.json", "metadata.json", "common.pt", ".metadata", ".distckpt_manifest.json"}

Shape = Tuple[int, ...]
# A file written by a rank, for the integrity manifest: (relative path, size, crc32c, key, block
# CRC32Cs): the last, for a chunk file of at least blockcrc.MIN_PAYLOAD bytes, the CRC32C of each
# of its blockcrc.BLOCK_SIZE blocks, packed (manifest.pack_block_crcs); else empty.
FileRecord = Tuple[str, int, int, str, bytes]


# --------------------------------------------------------------------------- data types

# Zarr v3 data_type names. bfloat16 and the float8 types use the names of the zarr-extensions
# registry, tensorstore and ml_dtypes (= torch's names).
_TORCH_TO_ZARR: Dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _TORCH_TO_ZARR[getattr(torch, _name)] = _name
_ZARR_TO_TORCH: Dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_ZARR.items()}

# Zarr v2 ``dtype`` strings (numpy typestr; Megatron wrote bfloat16 as "bfloat16").
_V2_KINDS = {
    "b": {1: torch.bool},
    "i": {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64},
    "u": {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64},
    "f": {2: torch.float16, 4: torch.float32, 8: torch.float64},
    "c": {8: torch.complex64, 16: torch.complex128},
}


def zarr_data_type(dtype: torch.dtype, key: str = "?") -> str:
    """The Zarr v3 ``data_type`` for a torch dtype.

    Raises:
        CheckpointingException: the dtype has no exact Zarr representation here.
    """
    try:
        return _TORCH_TO_ZARR[dtype]
    except KeyError:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: dtype {dtype} cannot be stored by the zarr backend "
            f"(supported: {', '.join(sorted(map(str, _TORCH_TO_ZARR)))})"
        ) from None


def _fill_value_json(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    if dtype.is_complex:
        return [0.0, 0.0]
    return 0.0 if dtype.is_floating_point else 0


def _v2_dtype(typestr: Any) -> Tuple[Optional[torch.dtype], bool]:
    """(torch dtype or None, little-endian or single byte) of a Zarr v2 ``dtype`` string."""
    if typestr == "bfloat16":
        return torch.bfloat16, True
    if not isinstance(typestr, str) or len(typestr) < 3 or typestr[0] not in "<>|=":
        return None, False
    try:
        size = int(typestr[2:])
    except ValueError:
        return None, False
    dtype = _V2_KINDS.get(typestr[1], {}).get(size)
    return dtype, typestr[0] in "<|" or (typestr[0] == "=" and sys.byteorder == "little")


# --------------------------------------------------------------------------- array metadata


def _root(checkpoint_dir):
    """A local directory as a Path; an object store as its Store (chunks, zarr.json and objects
    become objects under the checkpoint's prefix)."""
    return checkpoint_dir if isinstance(checkpoint_dir, storage.Store) else Path(checkpoint_dir)


def _is_store(root) -> bool:
    return isinstance(root, storage.Store)


@dataclass(frozen=True)
class ArrayMeta:
    """What a reader or writer needs to know about one stored array.

    ``raw`` is True when every chunk file is the plain little-endian C-order bytes of a full
    chunk, so the raw engine can read and write it; else tensorstore must.
    """

    key: str
    path: Path  # the array's directory
    zarr_format: int  # 2 or 3
    shape: Shape
    chunks: Shape
    dtype: torch.dtype
    raw: bool
    key_prefix: str  # "c" for the v3 default encoding, "" otherwise
    separator: str
    store: Any = None  # the object store holding the array (None: local ``path``)
    # The element layout distckpt writes (little-endian, C order; compressed or not): an array
    # whose key the integrity manifest lists must have it, whoever decodes its chunks.
    native: bool = True

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def chunk_name(self, index: Sequence[int]) -> str:
        if self.key_prefix:
            return self.key_prefix + "".join(f"{self.separator}{i}" for i in index)
        return self.separator.join(map(str, index)) if index else "0"

    def chunk_path(self, index: Sequence[int]) -> Path:
        return self.path / self.chunk_name(index)

    def chunk_relpath(self, index: Sequence[int]) -> str:
        """The chunk file's path relative to the checkpoint folder (its name in the manifest)."""
        return f"{self.key}/{self.chunk_name(index)}"

    def chunk_box(self, index: Sequence[int]) -> Tuple[Shape, Shape]:
        """Offset and size of chunk ``index`` in the array, clipped to the array's shape."""
        lo = tuple(i * c for i, c in zip(index, self.chunks))
        return lo, tuple(min(c, s - o) for o, c, s in zip(lo, self.chunks, self.shape))

    def chunks_overlapping(self, offset: Sequence[int], size: Sequence[int]) -> Iterator[Shape]:
        ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(offset, size, self.chunks)]
        return itertools.product(*ranges)


def array_metadata_json(
    key: str, shape: Shape, chunks: Shape, dtype: torch.dtype, compression: Optional[str] = None
) -> Dict[str, Any]:
    """The ``zarr.json`` of an array written by distckpt."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_codec: Dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    codecs = [bytes_codec]
    if compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    elif compression == "gzip":
        codecs.append({"name": "gzip", "configuration": {"level": 5}})
    elif compression is not None:
        raise CheckpointingException(f"unknown zarr compression {compression!r} (use None, 'zstd' or 'gzip')")
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zarr_data_type(dtype, key),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_value_json(dtype),
        "codecs": codecs,
        "attributes": {"distckpt": {"key": key, "torch_dtype": str(dtype)}},
    }


def _meta_from_v3(key: str, path: Path, md: Dict[str, Any]) -> ArrayMeta:
    if md.get("node_type") != "array":
        raise ValueError(f"node_type is {md.get('node_type')!r}, not 'array'")
    data_type = md["data_type"]
    dtype = _ZARR_TO_TORCH.get(data_type) if isinstance(data_type, str) else None
    if dtype is None:
        raise ValueError(f"data_type {data_type!r} has no torch equivalent")
    grid = md["chunk_grid"]
    if grid.get("name") != "regular":
        raise ValueError(f"chunk grid {grid.get('name')!r} is not supported (only 'regular')")
    chunks = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    shape = tuple(int(s) for s in md["shape"])
    enc = md.get("chunk_key_encoding", {"name": "default"})
    sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name") == "default" else ".")
    prefix = "c" if enc.get("name") == "default" else ""
    codecs = md.get("codecs", [])
    raw = (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and (codecs[0].get("configuration") or {}).get("endian", "little") == "little"
        and not md.get("storage_transformers")
        and sys.byteorder == "little"
    )
    native = all(
        isinstance(c, dict)
        and c.get("name") != "transpose"
        and (c.get("name") != "bytes" or (c.get("configuration") or {}).get("endian", "little") == "little")
        for c in codecs
    )
    return ArrayMeta(key, path, 3, shape, chunks, dtype, raw, prefix, sep, native=native)


def _meta_from_v2(key: str, path: Path, md: Dict[str, Any]) -> ArrayMeta:
    dtype, little = _v2_dtype(md.get("dtype"))
    if dtype is None:
        raise ValueError(f"dtype {md.get('dtype')!r} has no torch equivalent")
    raw = (
        md.get("compressor") is None
        and not md.get("filters")
        and md.get("order", "C") == "C"
        and little
        and sys.byteorder == "little"
    )
    return ArrayMeta(
        key,
        path,
        2,
        tuple(md["shape"]),
        tuple(md["chunks"]),
        dtype,
        raw,
        "",
        md.get("dimension_separator", "."),
        native=False,
    )  # distckpt writes Zarr v3


# A chunk may be larger than its array (zarr pads the last chunk), but not absurdly so.
_CHUNK_SLACK_BYTES = 64 << 20


def _checked_meta(meta: ArrayMeta, source: Path) -> ArrayMeta:
    """Refuse shapes, chunk shapes and chunk-key separators that a real array cannot have: they
    would make reads allocate or loop far beyond what any request needs."""
    shape = bounds.shape(meta.shape, source, "shape")
    chunks = bounds.shape(meta.chunks, source, "chunk shape")
    if len(chunks) != len(shape) or any(c < 1 for c in chunks):
        raise CheckpointingException(
            f"{source}: chunk shape {list(chunks)} does not fit the shape {list(shape)}"
        )
    array_bytes = math.prod(shape) * meta.itemsize
    if meta.chunk_nbytes > 2 * array_bytes + _CHUNK_SLACK_BYTES:
        raise CheckpointingException(
            f"{source}: a chunk of {list(chunks)} ({meta.chunk_nbytes} bytes) for an array of "
            f"{list(shape)} ({array_bytes} bytes); refusing it"
        )
    if not isinstance(meta.separator, str) or meta.separator not in ("/", "."):
        raise CheckpointingException(f"{source}: chunk key separator {meta.separator!r} is not '/' or '.'")
    return dataclasses.replace(meta, shape=shape, chunks=chunks)


def meta_file(meta: ArrayMeta) -> str:
    """Where array ``meta`` was read from (its ``zarr.json`` or ``.zarray``), for messages."""
    where = meta.store.where(meta.key) if meta.store is not None else str(meta.path)
    return f"{where}/{ARRAY_META if meta.zarr_format == 3 else LEGACY_ARRAY_META}"


def manifest_disagreement(meta: ArrayMeta, manifest: Any) -> Optional[str]:
    """Why array ``meta`` (its ``zarr.json``) disagrees with what the integrity manifest says the
    writer wrote (its dtype and shape), naming both files; None when they agree, the manifest
    records nothing of the key, or there is no manifest (None)."""
    declared = None if manifest is None else manifest.keys.get(meta.key)
    if declared is None:
        return None
    if not meta.native:
        return (
            f"key {meta.key!r}: {meta_file(meta)} describes its elements in another layout (byte order, "
            f"element order or format) than the little-endian C-order Zarr v3 chunks distckpt writes, and the "
            f"integrity manifest {MANIFEST_FNAME} says distckpt wrote this key: the array metadata is damaged"
        )
    if (dtype_name(meta.dtype), tuple(meta.shape)) == (declared[0], tuple(declared[1])):
        return None
    return (
        f"key {meta.key!r}: {meta_file(meta)} says {dtype_name(meta.dtype)} of shape {list(meta.shape)}, the "
        f"integrity manifest {MANIFEST_FNAME} says the writer wrote {declared[0]} of shape "
        f"{list(declared[1])}: the array metadata or the manifest is damaged"
    )


def _check_allocation(meta: ArrayMeta, sh: ShardedTensor) -> None:
    """A tensor this load allocates (a request without data, e.g. ``load_plain_tensors``, whose
    shape comes from the checkpoint's claim) must be backed by chunk files that exist: for an
    uncompressed array, at least the request's bytes. (Compressed arrays, absent chunks, which
    read as the fill value, and arrays on object stores are not bounded this way; see
    docs/reliability.md.)"""
    need = math.prod(sh.local_shape) * meta.itemsize
    # On an object store this would take a LIST per key and rank (a load never lists there): the
    # shape bound of _checked_meta is what holds there.
    if need <= _CHUNK_SLACK_BYTES or not meta.raw or meta.store is not None:
        return
    have = 0
    for dirpath, _, filenames in os.walk(meta.path):
        for name in filenames:
            if name not in (ARRAY_META, LEGACY_ARRAY_META, ".zattrs"):
                have += os.stat(os.path.join(dirpath, name)).st_size
                if have >= need:
                    return
    raise CheckpointingException(
        f"{meta.path / ARRAY_META}: key {sh.key!r}: loading {list(sh.local_shape)} needs {need} bytes, the "
        f"array's chunk files hold {have}; refusing to allocate it"
    )


def read_array_meta(root: Path, key: str) -> Optional[ArrayMeta]:
    """Metadata of array ``key`` under ``root`` (``zarr.json``, else a legacy ``.zarray``).

    Returns None if there is no such array.

    Raises:
        CheckpointingException: the metadata file exists but is unreadable or unsupported.
    """
    if _is_store(root):
        key = bounds.relative_name(key, root.where(ARRAY_META), "array key")
        path = Path(key)
        for name, parse in ((ARRAY_META, _meta_from_v3), (LEGACY_ARRAY_META, _meta_from_v2)):
            try:
                text = bytes(root.get(f"{key}/{name}"))
            except FileNotFoundError:
                continue
            try:
                return replace(
                    _checked_meta(parse(key, path, json.loads(text)), root.where(f"{key}/{name}")), store=root
                )
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise CheckpointingException(
                    f"{root.where(key + '/' + name)}: unreadable Zarr metadata of key {key!r} "
                    f"(rank {dist.get_rank()}): {e}"
                ) from None
        return None
    path = bounds.inside(root, key, root / ARRAY_META, "array key")
    for name, parse in ((ARRAY_META, _meta_from_v3), (LEGACY_ARRAY_META, _meta_from_v2)):
        f = path / name
        try:
            text = containment.read_beneath(root, f"{key}/{name}", root / ARRAY_META, "array key")
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            return _checked_meta(parse(key, path, json.loads(text)), f)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointingException(
                f"{f}: unreadable Zarr metadata of key {key!r} (rank {dist.get_rank()}): {e}"
            ) from None
    return None


def _root_keys(root: Path) -> Optional[List[str]]:
    """The tensor keys listed in the root group's ``zarr.json`` (None: no such list)."""
    where = storage.join(root, ARRAY_META)
    try:
        md = json.loads(storage.read_bytes(root, ARRAY_META))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"{where}: unreadable root group metadata: {e}") from None
    if not isinstance(md, dict):
        raise CheckpointingException(
            f"{where}: root group metadata is a JSON {type(md).__name__}, not an object"
        )
    attributes = md.get("attributes")
    ours = attributes.get("distckpt") if isinstance(attributes, dict) else None
    if ours is None:
        return None  # not written by distckpt: the arrays are found by walking the tree
    keys = ours.get("keys") if isinstance(ours, dict) else None
    if not isinstance(keys, list):
        raise CheckpointingException(
            f"{where}: root group metadata lists its array keys as {type(keys).__name__}, not a list (damaged)"
        )
    names = [bounds.relative_name(k, where, "array key") for k in keys]
    if len(set(names)) != len(names):
        # Each listed key is one array folder: a key listed again would be read, checked and
        # walked again per mention (100,000 mentions of one array: minutes of every tool's time).
        seen: set = set()
        twice = next(k for k in names if k in seen or seen.add(k))
        raise CheckpointingException(f"{where}: lists array key {twice!r} more than once (damaged)")
    return names


def _is_array_meta(data: bytes) -> bool:
    """Whether ``data`` (a ``zarr.json`` met while walking the tree) describes an array; an
    unreadable one does not (its key is then absent, and asking for it says so)."""
    try:
        md = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(md, dict) and md.get("node_type") == "array"


def _scan_keys(root: Path) -> List[str]:
    """Find arrays by walking the tree (legacy layout): folders holding ``zarr.json`` of an array
    or ``.zarray``. Megatron's ``*.sync`` lock folders hold an empty ``.zarray`` and are skipped."""
    if _is_store(root):
        keys = []
        for name in root.list():  # a legacy checkpoint without a root listing: one LIST
            folder, _, base = name.rpartition("/")
            if not folder or any(part.endswith(".sync") for part in folder.split("/")):
                continue
            if base == LEGACY_ARRAY_META or (base == ARRAY_META and _is_array_meta(bytes(root.get(name)))):
                keys.append(folder)
        return sorted(k for k in set(keys) if not any(k.startswith(o + "/") for o in keys))
    keys = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.endswith(".sync"))
        here = Path(dirpath)
        if here == root:
            continue
        is_array = LEGACY_ARRAY_META in filenames
        if not is_array and ARRAY_META in filenames:
            rel = f"{here.relative_to(root).as_posix()}/{ARRAY_META}"
            is_array = _is_array_meta(containment.read_beneath(root, rel, root))
        if is_array:
            keys.append(here.relative_to(root).as_posix())
            dirnames[:] = []
    return sorted(keys)


def list_array_keys(root: Path) -> List[str]:
    """Every tensor key stored in checkpoint ``root``."""
    keys = _root_keys(root)
    return keys if keys is not None else _scan_keys(root)


def _check_key_path(key: str) -> None:
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or "\\" in key
        or any(p in ("", ".", "..") for p in parts)
        or parts[0] in _RESERVED_TOP
    ):
        raise CheckpointingException(
            f"ShardedTensor key {key!r} cannot name a Zarr array folder in the checkpoint (empty "
            f"segments, '.', '..', a leading '/', or a reserved top-level name {sorted(_RESERVED_TOP)})"
        )


def _check_key_paths(keys: Iterable[str]) -> None:
    keys = sorted(keys)
    for key in keys:
        _check_key_path(key)
    for a, b in zip(keys, keys[1:]):
        if b.startswith(a + "/"):
            raise CheckpointingException(
                f"ShardedTensor keys {a!r} and {b!r} cannot both be stored by the zarr backend: the "
                f"array folder of one would contain the other"
            )


def _write_json(rel: str, md: Dict[str, Any], root, key: str, atomic: bool = False) -> FileRecord:
    """Write ``md`` as ``rel`` under ``root`` (a put on an object store, atomic by itself)."""
    data = json.dumps(md).encode()
    if _is_store(root):
        root.put(rel, data)
    elif atomic:
        atomic_write_bytes(root / rel, data)
    else:
        (root / rel).write_bytes(data)
    return rel, len(data), crc32c(data), key, b""


def chunk_checksums(data) -> Tuple[int, bytes]:
    """CRC32C of a chunk file's bytes and, for a large one, its packed block CRC32Cs (one pass
    over the bytes: the file's CRC is combined from the blocks')."""
    if len(data) < blockcrc.MIN_PAYLOAD:
        return crc32c(data), b""
    crcs: List[int] = []
    crc = blockcrc.extend(0, data, crcs)
    return crc, pack_block_crcs(crcs)


def block_entries(records: Iterable[FileRecord]) -> Dict[str, Tuple[int, int, bytes]]:
    """The manifest's ``blocks`` (see distckpt/manifest.py) of the chunk files among ``records``."""
    return {path: (blockcrc.BLOCK_SIZE, crc, blocks) for path, _, crc, _, blocks in records if blocks}


def write_root_group(root: Path, keys: Iterable[str]) -> List[FileRecord]:
    """Write the root group (listing ``keys``) and a group node for every intermediate folder."""
    keys = sorted(keys)
    parents = {str(Path(k).parent.as_posix()) for k in keys} - {"."}
    records = []
    for g in sorted({p for parent in parents for p in _prefixes(parent)}):
        if not _is_store(root):
            (root / g).mkdir(parents=True, exist_ok=True)
        records.append(_write_json(f"{g}/{ARRAY_META}", {"zarr_format": 3, "node_type": "group"}, root, g))
    md = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"distckpt": {"format": BACKEND, "format_version": FORMAT_VERSION, "keys": keys}},
    }
    records.append(_write_json(ARRAY_META, md, root, ARRAY_META, atomic=True))
    return records


def _prefixes(path: str) -> List[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def create_array(
    root: Path, key: str, shape: Shape, chunks: Shape, dtype: torch.dtype, compression: Optional[str] = None
) -> Tuple[ArrayMeta, FileRecord]:
    """Write ``<root>/<key>/zarr.json``; return the array's metadata and the file's record."""
    md = array_metadata_json(key, shape, chunks, dtype, compression)
    record = _write_json(f"{key}/{ARRAY_META}", md, root, key) if _is_store(root) else None
    if record is not None:
        return replace(_meta_from_v3(key, Path(key), md), store=root), record
    path = root / key
    path.mkdir(parents=True, exist_ok=True)
    record = _write_json(f"{key}/{ARRAY_META}", md, root, key)
    return _meta_from_v3(key, path, md), record


# --------------------------------------------------------------------------- chunk grid


def _gcd_of_cuts(cuts: Iterable[int], size: int) -> int:
    """gcd of the cut points strictly inside ``(0, size)``; 0 when there are none."""
    g = 0
    for c in cuts:
        if 0 < c < size:
            g = math.gcd(g, c)
    return g


def _smallest_multiple_dividing(base: int, limit: int, need: int) -> int:
    """Smallest ``d`` with ``base | d``, ``d | limit`` and ``d >= need``; ``limit`` if none is."""
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
    """The chunk grid of one array.

    ``piece_gcd[a]``: gcd of every interior cut point of every main-replica piece along axis
    ``a`` (0 if none); ``shard_gcd[a]``: the same for whole shards (for a flattened shard, the
    chunk of the regular grid it belongs to). Chunks are ``piece_gcd`` (each inside one piece);
    where flattened pieces make them smaller than ``min_flat_chunk_bytes`` they grow, innermost
    axis first, to divisors of ``shard_gcd`` so they still never cross a shard.
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


# --------------------------------------------------------------------------- I/O jobs


@dataclass
class ChunkWrite:
    """Write chunk ``index`` of an array; ``data`` has the chunk's (clipped) shape."""

    meta: ArrayMeta
    index: Shape
    data: torch.Tensor
    owned: bool = False  # ``data`` is a private CPU copy (not a view of the caller's tensors)


@dataclass
class ChunkRead:
    """Copy region ``[lo, hi)`` of chunk ``index`` (chunk coordinates) into ``dest``."""

    meta: ArrayMeta
    index: Shape
    lo: Shape
    hi: Shape
    dest: torch.Tensor


def _padded(meta: ArrayMeta, data: torch.Tensor) -> torch.Tensor:
    """``data`` as a contiguous full chunk: edge chunks are padded with the fill value (0)."""
    if tuple(data.shape) == meta.chunks:
        return data if data.is_contiguous() else data.contiguous()
    buf = torch.zeros(meta.chunks, dtype=data.dtype)
    buf[tuple(slice(0, s) for s in data.shape)] = data
    return buf


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


class RawIO:
    """Chunk I/O with plain POSIX calls on a thread pool, straight from and into tensor memory.

    Args:
        thread_count: files written or read in parallel.
        fsync: fsync every chunk file after writing it.
    """

    def __init__(self, thread_count: int = 4, fsync: bool = True):
        self.thread_count = max(1, thread_count)
        self.fsync = fsync

    def _map(self, fn: Callable[[Any], Any], jobs: Sequence[Any], threads: Optional[int] = None) -> List[Any]:
        threads = threads or self.thread_count
        if len(jobs) <= 1 or threads == 1:
            return [fn(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
            return [fut.result() for fut in [pool.submit(fn, job) for job in jobs]]

    # ----------------------------------------------------------------- write

    def write(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        """Write whole chunk files; returns one manifest record per file."""
        made: set = set()

        def write_one(job: ChunkWrite) -> FileRecord:
            path = job.meta.chunk_path(job.index)
            if path.parent not in made:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.add(path.parent)
            view = byte_view(_padded(job.meta, job.data))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # Checksummed piece by piece as it is written (each piece's CRC while it is in cache).
                sink = ChecksummingSink(fd)
                blocks = b""
                if len(view) >= blockcrc.MIN_PAYLOAD:
                    blocks = pack_block_crcs(sink.write_blocks(view, blockcrc.BLOCK_SIZE))
                else:
                    sink.write(view)
                sink.drain()
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return job.meta.chunk_relpath(job.index), len(view), sink.crc, job.meta.key, blocks

        # Largest first keeps the pool busy to the end.
        return self._map(write_one, sorted(jobs, key=lambda j: -j.data.numel()))

    # ----------------------------------------------------------------- read

    def read(
        self,
        ops: Sequence[ChunkRead],
        checksums: Optional[Dict[str, Tuple[int, int]]] = None,
        blocks: Optional[BlockLookup] = None,
    ) -> None:
        """Run the reads, each chunk file opened once. With ``checksums`` (relative path ->
        (size, crc32c) from the manifest) every byte copied out of a listed chunk is checked: a
        whole chunk read into place as it arrives; part of a chunk whose block CRC32Cs
        ``blocks`` gives, block by block (only the blocks holding that part are read, see
        :func:`_block_reader`); any other listed chunk read whole and checked first."""
        by_file: Dict[Path, List[ChunkRead]] = {}
        for op in ops:
            by_file.setdefault(op.meta.chunk_path(op.index), []).append(op)

        def read_file(item: Tuple[Path, List[ChunkRead]]) -> None:
            path, file_ops = item
            meta = file_ops[0].meta
            where = f"key {meta.key!r}: chunk file {path} (rank {dist.get_rank()})"
            try:
                # Beneath the array's folder, never through a symlink out of it.
                fd = containment.open_beneath(
                    meta.path, meta.chunk_name(file_ops[0].index), meta.path / ARRAY_META, "chunk file"
                )
            except FileNotFoundError:
                raise CheckpointingException(f"{where} is missing") from None
            try:
                size = os.fstat(fd).st_size
                if size != meta.chunk_nbytes:
                    raise CheckpointingException(
                        f"{where} holds {size} bytes, expected {meta.chunk_nbytes} of an uncompressed "
                        f"chunk of shape {list(meta.chunks)} ({meta.dtype}); truncated or corrupt"
                    )
                expected = None if checksums is None else checksums.get(meta.chunk_relpath(file_ops[0].index))
                if expected is None:
                    for op in file_ops:
                        _read_region(fd, meta, op, where)
                    return
                op = file_ops[0]
                if (
                    len(file_ops) == 1
                    and not any(op.lo)
                    and tuple(op.hi) == tuple(meta.chunks)
                    and op.dest.device.type == "cpu"
                    and op.dest.dtype == meta.dtype
                    and op.dest.is_contiguous()
                ):
                    # The whole chunk into place, checksummed as it arrives (no second pass).
                    if pread_crc(fd, byte_view(op.dest), 0, where) != expected[1]:
                        raise CheckpointingException(
                            f"{where}: CRC32C mismatch against the manifest (corrupted data)"
                        )
                    return
                reader = (
                    None if blocks is None else _block_reader(fd, meta, file_ops, blocks, expected, where)
                )
                if reader is not None:
                    reader.copy([_copy_op(meta, op) for op in file_ops], None)
                    return
                chunk = torch.empty(meta.chunks, dtype=meta.dtype)
                if pread_crc(fd, byte_view(chunk), 0, where) != expected[1]:
                    raise CheckpointingException(
                        f"{where}: CRC32C mismatch against the manifest (corrupted data)"
                    )
                for op in file_ops:
                    op.dest.copy_(chunk[tuple(slice(lo, hi) for lo, hi in zip(op.lo, op.hi))])
            finally:
                os.close(fd)

        self._map(read_file, sorted(by_file.items(), key=lambda kv: str(kv[0])))

    # ----------------------------------------------------------------- object stores

    def write_objects(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        """Object store: one put per chunk (each rank its own chunks), straight from tensor memory."""

        def write_one(job: ChunkWrite) -> FileRecord:
            view = byte_view(_padded(job.meta, job.data))
            rel = job.meta.chunk_relpath(job.index)
            crc, blocks = chunk_checksums(view)
            job.meta.store.put(rel, view)
            return rel, len(view), crc, job.meta.key, blocks

        return self._map(write_one, sorted(jobs, key=lambda j: -j.data.numel()), OBJECT_STORE_REQUESTS)

    def read_objects(self, ops: Sequence[ChunkRead], checksums: Optional[Dict[str, Tuple[int, int]]]) -> None:
        """Object store: each needed chunk fetched once, whole, and checked against its CRC32C
        (``checksums``: the manifest's, when there is one) before its regions are copied out."""
        by_file: Dict[str, List[ChunkRead]] = {}
        for op in ops:
            by_file.setdefault(op.meta.chunk_relpath(op.index), []).append(op)

        def read_file(item: Tuple[str, List[ChunkRead]]) -> None:
            rel, file_ops = item
            meta = file_ops[0].meta
            where = f"key {meta.key!r}: chunk {meta.store.where(rel)} (rank {dist.get_rank()})"
            try:
                raw = meta.store.get(rel)
            except FileNotFoundError:
                raise CheckpointingException(f"{where} is missing") from None
            if len(raw) != meta.chunk_nbytes:
                raise CheckpointingException(
                    f"{where} holds {len(raw)} bytes, expected {meta.chunk_nbytes} of an uncompressed "
                    f"chunk of shape {list(meta.chunks)} ({meta.dtype}); truncated or corrupt"
                )
            expected = None if checksums is None else checksums.get(rel)
            if expected is not None and crc32c(raw) != expected[1]:
                raise CheckpointingException(
                    f"{where}: CRC32C mismatch against the manifest (corrupted data)"
                )
            chunk = torch.frombuffer(bytearray(raw), dtype=meta.dtype).reshape(meta.chunks)
            for op in file_ops:
                op.dest.copy_(chunk[tuple(slice(lo, hi) for lo, hi in zip(op.lo, op.hi))])

        self._map(read_file, sorted(by_file.items()), OBJECT_STORE_REQUESTS)


# The block CRC32Cs of a chunk file (relative path -> block size and CRC32Cs, or None):
# Manifest.block_crcs.
BlockLookup = Callable[[str], Optional[Tuple[int, List[int]]]]


def _copy_op(meta: ArrayMeta, op: ChunkRead) -> CopyOp:
    """Region ``[op.lo, op.hi)`` of a chunk as a box of the chunk file's elements (row-major)."""
    ext = tuple(b - a for a, b in zip(op.lo, op.hi))
    return CopyOp(meta.key, _ravel(op.lo, meta.chunks), ext, contiguous_strides(tuple(meta.chunks)), op.dest)


# A checked read that needs every block of a chunk reads a chunk of at most this size whole into
# a temporary (one read, one copy); a larger one block by block through BlockReader's windows,
# which stay in cache (a fresh temporary of tens of MiB is faulted in page by page). Half of
# every row of chunks of 2 to 32 MiB on tmpfs, per chunk: 2 MiB 784 vs 903 us, 8 MiB 1166 vs
# 1307 us, 16 MiB about even, 32 MiB 42 vs 12 ms (whole vs blocks; verify=False's copy out of a
# mapping: 928, 1201 us, 4.6, 9.1 ms).
_WHOLE_READ_BYTES = 8 << 20


def _block_reader(
    fd: int,
    meta: ArrayMeta,
    ops: Sequence[ChunkRead],
    blocks: BlockLookup,
    expected: Tuple[int, int],
    where: str,
) -> Optional[BlockReader]:
    """A reader of only the blocks of a chunk file that ``ops`` take bytes from, each checked
    against its CRC32C in the manifest before any of its bytes is copied; None when the chunk is
    better read whole and checked against its own CRC32C: no block CRC32Cs for it (a small
    chunk, or a checkpoint written before they were recorded), a block size other than the one
    distckpt writes (that of the CRC-checked read pieces), regions whose spans overlap in more
    blocks than the file has (a block would be read once per region), or regions that span
    every block of a chunk of at most :data:`_WHOLE_READ_BYTES` (a column block: then one read
    and one strided copy beat window-by-window reads)."""
    rel = meta.chunk_relpath(ops[0].index)
    found = blocks(rel)
    if found is None or found[0] != blockcrc.BLOCK_SIZE or expected[0] != meta.chunk_nbytes:
        return None
    block, crcs = found
    isz = meta.itemsize
    touched = 0
    for op in ops:
        box = _copy_op(meta, op)
        if box.numel:
            touched += -(-box.end * isz // block) - box.start * isz // block
    if touched > len(crcs) or (touched == len(crcs) and meta.chunk_nbytes <= _WHOLE_READ_BYTES):
        return None
    entry = blockcrc.Entry(0, expected[0], expected[1], 0, meta.chunk_nbytes, 0, 0, meta.dtype, crcs)
    return BlockReader(
        fd, 0, entry, block, where, f"the block CRC32Cs of {rel} in the integrity manifest {MANIFEST_FNAME}"
    )


def _read_region(fd: int, meta: ArrayMeta, op: ChunkRead, where: str) -> None:
    """Read region ``[op.lo, op.hi)`` of one uncompressed C-order chunk into ``op.dest``.

    One contiguous run: one ``pread`` (straight into ``dest`` when it can take the bytes). A
    strided region (a column block of a resharded load): copied out of a read-only mapping of
    the bytes it spans, as the torch_dist reader does: no run-by-run reads, no temporary.
    """
    chunks, isz = meta.chunks, meta.itemsize
    lo, hi = op.lo, op.hi
    ext = tuple(b - a for a, b in zip(lo, hi))
    ndim = len(chunks)
    # Axes from `inner` on are read whole; with those, axis inner-1 forms contiguous runs.
    inner = ndim
    while inner > 0 and lo[inner - 1] == 0 and hi[inner - 1] == chunks[inner - 1]:
        inner -= 1
    runs = math.prod(ext[: max(inner - 1, 0)])
    dest = op.dest
    if runs == 1:
        direct = dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == meta.dtype
        target = dest if direct else torch.empty(ext, dtype=meta.dtype)
        pread_exact(fd, byte_view(target), _ravel(lo, chunks) * isz, where)
        if not direct:
            dest.copy_(target)
        return
    first = _ravel(lo, chunks)
    last = _ravel(tuple(b - 1 for b in hi), chunks) + 1
    box = _copy_op(meta, op)
    copy_from_mapping(fd, first * isz, last - first, meta.dtype, [box], first, where)


def _tensorstore_io(thread_count: int):
    from distckpt.strategies.tensorstore import TensorStoreIO

    return TensorStoreIO(concurrency=thread_count)


class _Engines:
    """Chooses, per array, the engine that does its I/O."""

    def __init__(self, io_engine: str, thread_count: int, fsync: bool = True):
        if io_engine not in IO_ENGINES:
            raise CheckpointingException(f"unknown zarr io_engine {io_engine!r} (use one of {IO_ENGINES})")
        self.io_engine = io_engine
        self.thread_count = thread_count
        self.raw = RawIO(thread_count, fsync)
        self._ts = None

    @property
    def tensorstore(self):
        if self._ts is None:
            self._ts = _tensorstore_io(self.thread_count)
        return self._ts

    def uses_tensorstore(self, meta: ArrayMeta) -> bool:
        if meta.store is not None:
            if not meta.raw:
                raise CheckpointingException(
                    f"key {meta.key!r}: array at {meta.store.where(meta.key)} is compressed or otherwise "
                    f"encoded; on object stores the zarr backend reads and writes uncompressed arrays only"
                )
            return False
        if self.io_engine == "tensorstore":
            return True
        if not meta.raw:
            if self.io_engine == "raw":
                raise CheckpointingException(
                    f"key {meta.key!r}: array {meta.path} is compressed or otherwise encoded; "
                    f"io_engine='raw' cannot read or write it (use 'auto' or 'tensorstore')"
                )
            return True
        return False

    def write(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        store_jobs = [j for j in jobs if j.meta.store is not None and not self.uses_tensorstore(j.meta)]
        jobs = [j for j in jobs if j.meta.store is None]
        ts_jobs = [j for j in jobs if self.uses_tensorstore(j.meta)]
        raw_jobs = [j for j in jobs if not self.uses_tensorstore(j.meta)]
        records = self.tensorstore.write(ts_jobs) if ts_jobs else []
        if store_jobs:
            records += self.raw.write_objects(store_jobs)
        return records + self.raw.write(raw_jobs)

    def read(
        self,
        ops: Sequence[ChunkRead],
        checksums: Optional[Dict[str, Tuple[int, int]]] = None,
        blocks: Optional[BlockLookup] = None,
    ) -> None:
        store_ops = [o for o in ops if o.meta.store is not None and not self.uses_tensorstore(o.meta)]
        ops = [o for o in ops if o.meta.store is None]
        ts_ops = [o for o in ops if self.uses_tensorstore(o.meta)]
        raw_ops = [o for o in ops if not self.uses_tensorstore(o.meta)]
        if ts_ops:
            self.tensorstore.read(ts_ops, checksums)
        if store_ops:
            self.raw.read_objects(store_ops, checksums)
        self.raw.read(raw_ops, checksums, blocks)


# --------------------------------------------------------------------------- save


@dataclass
class _Piece:
    """A box of a global tensor held by this rank, with its data (a CPU tensor of that shape)."""

    key: str
    offset: Shape
    size: Shape
    data: torch.Tensor


@dataclass
class _KeyDecl:
    """One rank's description of a key: all that planning the chunk grid needs."""

    shape: Shape
    dtype: torch.dtype
    piece_gcd: List[int]
    shard_gcd: List[int]

    def merge(self, other: _KeyDecl, key: str) -> None:
        if other.shape != self.shape or other.dtype != self.dtype:
            raise CheckpointingException(
                f"key {key!r}: ranks disagree on the global shape or dtype "
                f"({list(self.shape)} {self.dtype} vs {list(other.shape)} {other.dtype})"
            )
        self.piece_gcd = [math.gcd(a, b) for a, b in zip(self.piece_gcd, other.piece_gcd)]
        self.shard_gcd = [math.gcd(a, b) for a, b in zip(self.shard_gcd, other.shard_gcd)]


_DEFER = object()  # as ``staging``: keep the caller's tensors (views), copy them later


def _shard_pieces(sh: ShardedTensor, staging: Optional[Any] = None) -> Tuple[List[_Piece], Shape, Shape]:
    """The boxes of ``sh`` with their data, and the box of the whole shard (its grid chunk).

    With ``staging`` (a StagingBuffers pool) the data is first copied into a pooled host buffer,
    so the caller may change its tensors while a background write runs.
    """
    if sh.data is None:
        raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save (rank {dist.get_rank()})")
    data = sh.data.detach()
    if staging is _DEFER:
        pass  # views of the caller's tensors, staged chunk by chunk later (async save waves)
    elif staging is not None:
        data = staging.acquire(data)
    elif data.device.type != "cpu":
        data = data.to("cpu")
    full_local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    origin = tuple(sh.global_offset)
    if sh.flattened_range is None:
        pieces = [_Piece(sh.key, origin, full_local, data.reshape(full_local))] if data.numel() else []
        return pieces, origin, full_local
    start = sh.flattened_range.start
    flat = data.reshape(-1)
    pieces = [
        _Piece(
            sh.key,
            tuple(o + b for o, b in zip(origin, off)),
            size,
            flat[pos - start : pos - start + math.prod(size)].reshape(size),
        )
        for off, size, pos in flat_range_boxes(full_local, start, sh.flattened_range.stop, start)
    ]
    return pieces, origin, full_local


def _local_plan(
    sharded_state_dict: ShardedStateDict, staging: Optional[Any] = None
) -> Tuple[List[_Piece], Dict[str, _KeyDecl]]:
    pieces: List[_Piece] = []
    decls: Dict[str, _KeyDecl] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            raise CheckpointingException(
                f"ShardedObject {sh.unique_key!r} reached the zarr strategy; objects are stored by "
                f"the common strategy"
            )
        if not isinstance(sh, ShardedTensor) or not is_main_replica(sh.replica_id):
            continue
        shape = tuple(sh.global_shape)
        shard_pieces, origin, full_local = _shard_pieces(sh, staging)
        shard_cuts: List[List[int]] = [[] for _ in shape]
        piece_cuts: List[List[int]] = [[] for _ in shape]
        if math.prod(full_local):
            for a, (o, n) in enumerate(zip(origin, full_local)):
                shard_cuts[a] += [o, o + n]
        for p in shard_pieces:
            for a, (o, n) in enumerate(zip(p.offset, p.size)):
                piece_cuts[a] += [o, o + n]
        shard_gcd = [_gcd_of_cuts(c, s) for c, s in zip(shard_cuts, shape)]
        piece_gcd = [math.gcd(_gcd_of_cuts(c, s), h) for c, s, h in zip(piece_cuts, shape, shard_gcd)]
        decl = _KeyDecl(shape, sh.dtype, piece_gcd, shard_gcd)
        if sh.key in decls:
            decls[sh.key].merge(decl, sh.key)
        else:
            decls[sh.key] = decl
        pieces += shard_pieces
    return pieces, decls


def _merge_decls(gathered: Sequence[Dict[str, _KeyDecl]]) -> Dict[str, _KeyDecl]:
    merged: Dict[str, _KeyDecl] = {}
    for rank_decls in gathered:
        for key, decl in rank_decls.items():
            if key in merged:
                merged[key].merge(decl, key)
            else:
                merged[key] = _KeyDecl(decl.shape, decl.dtype, list(decl.piece_gcd), list(decl.shard_gcd))
    return dict(sorted(merged.items()))


@dataclass
class _Fragment:
    """Part of a chunk that this rank cannot write alone: its box (array coordinates) and data."""

    key: str
    index: Shape
    offset: Shape
    data: torch.Tensor


def _split_into_chunks(pieces: Sequence[_Piece], metas: Dict[str, ArrayMeta]):
    """Whole chunks this rank writes, and fragments of chunks shared with other pieces."""
    writes: List[ChunkWrite] = []
    partial: Dict[Tuple[str, Shape], List[_Fragment]] = {}
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
                partial.setdefault((p.key, tuple(index)), []).append(_Fragment(p.key, tuple(index), lo, view))
    shared: List[_Fragment] = []
    for (key, index), frags in partial.items():
        meta = metas[key]
        if sum(f.data.numel() for f in frags) == math.prod(meta.chunk_box(index)[1]):
            writes.append(ChunkWrite(meta, index, _assemble(meta, index, frags), owned=True))
        else:
            # Copied: pickling a view would send its whole storage (and it may be on a device).
            shared += [
                _Fragment(
                    f.key, f.index, f.offset, torch.empty(f.data.shape, dtype=f.data.dtype).copy_(f.data)
                )
                for f in frags
            ]
    return writes, shared


def _assemble(meta: ArrayMeta, index: Shape, frags: Sequence[_Fragment]) -> torch.Tensor:
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


@dataclass
class _SavePlan:
    """One rank's part of a save, between its phases (see ZarrSaveShardedStrategy)."""

    root: Path
    metas: Dict[str, ArrayMeta]
    writes: List[ChunkWrite]
    shared: List[_Fragment]
    records: List[FileRecord]
    exc: Optional[BaseException] = None
    staged: Optional[Any] = None  # the StagedBatch holding the staged bytes (async save)
    waves: int = 1  # staging waves of an async save


class ZarrSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas as Zarr v3 arrays (backend ``zarr``, format version 2).

    Phases (every rank): ``prepare`` plans the chunk grid (one all-gather), writes this rank's
    share of the arrays' ``zarr.json`` and cuts the local pieces into chunk writes; ``write``
    writes the chunk files (no collective; the background part of an async save);
    ``finalize`` gathers the shared-chunk pieces and the written files' checksums to rank 0,
    which writes those chunks and the integrity manifest, and raises any rank's error on every
    rank.

    Args:
        thread_count: chunk files written in parallel per rank.
        io_engine: "auto"/"raw" (POSIX writes from tensor memory) or "tensorstore".
        compression: None (default, fastest), "zstd" or "gzip" (written through tensorstore).
        min_flat_chunk_bytes: smallest chunk worth having for flattened ranges (see module doc).
        fsync: fsync each chunk file.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = FORMAT_VERSION,
        thread_count: int = 4,
        io_engine: str = "auto",
        compression: Optional[str] = None,
        min_flat_chunk_bytes: int = DEFAULT_MIN_FLAT_CHUNK_BYTES,
        fsync: bool = True,
    ):
        # Whatever version was asked for, this writes (and metadata.json records) version 2.
        super().__init__(backend, FORMAT_VERSION)
        if thread_count < 1:
            raise CheckpointingException(f"thread_count must be >= 1, got {thread_count}")
        array_metadata_json("probe", (), (), torch.float32, compression)  # validates `compression`
        self.engines = _Engines(io_engine, thread_count, fsync)
        self.compression = compression
        self.min_flat_chunk_bytes = min_flat_chunk_bytes
        self._staging: Optional[Any] = None

    def _create_arrays(
        self, root: Path, decls: Dict[str, _KeyDecl]
    ) -> Tuple[Dict[str, ArrayMeta], List[FileRecord]]:
        """Every array's metadata; this rank writes the ``zarr.json`` of keys ``i`` with
        ``i % world == rank`` (and rank 0 the root group), so each is written exactly once."""
        rank, world = dist.get_rank(), dist.get_world_size()
        metas, records = {}, []
        for i, (key, d) in enumerate(decls.items()):
            itemsize = torch.empty((), dtype=d.dtype).element_size()
            chunks = choose_chunk_shape(
                d.shape, d.piece_gcd, d.shard_gcd, itemsize, self.min_flat_chunk_bytes
            )
            if i % world == rank:
                metas[key], record = create_array(root, key, d.shape, chunks, d.dtype, self.compression)
                records.append(record)
            else:
                md = array_metadata_json(key, d.shape, chunks, d.dtype, self.compression)
                if _is_store(root):
                    metas[key] = replace(_meta_from_v3(key, Path(key), md), store=root)
                else:
                    metas[key] = _meta_from_v3(key, root / key, md)
        if rank == 0:
            records += write_root_group(root, decls)
        return metas, records

    def prepare(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, stage: bool = False
    ) -> _SavePlan:
        """Plan and create the arrays; collective. A planning error raises on every rank; a
        later local error is kept in the plan and raised everywhere by ``finalize``."""
        root = _root(checkpoint_dir)
        exc: Optional[BaseException] = None
        decls: Optional[Dict[str, _KeyDecl]] = None
        pieces: List[_Piece] = []
        staging = None
        if stage:
            from distckpt.strategies.async_utils import StagingBuffers

            if self._staging is None:
                self._staging = StagingBuffers()
            staging = self._staging
        try:
            pieces, decls = _local_plan(sharded_state_dict, _DEFER if staging is not None else None)
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        staged = None  # staging happens in waves, after planning (stage_waves)
        try:
            gathered = dist.all_gather_or_raise("zarr save planning", exc, decls)
        except BaseException:
            if staged is not None:
                staged.release()
            raise
        plan = _SavePlan(root, {}, [], [], [], None, staged)
        try:
            merged = _merge_decls(gathered)
            _check_key_paths(merged)
            plan.metas, plan.records = self._create_arrays(root, merged)
        except Exception as e:  # noqa: BLE001
            plan.exc = e
        # tensorstore opens each array's zarr.json before writing, so every one must exist
        # first; the raw engine never reads them and needs no barrier here. (The condition
        # depends on the configuration only, so all ranks agree on it.)
        if self.engines.io_engine == "tensorstore" or self.compression is not None:
            try:
                dist.sync_errors("zarr array creation", plan.exc)
            except BaseException:
                if staged is not None:
                    staged.release()
                raise
        if plan.exc is None:
            try:
                plan.writes, plan.shared = _split_into_chunks(pieces, plan.metas)
            except Exception as e:  # noqa: BLE001
                plan.exc = e
        return plan

    def stage_waves(self, plan: _SavePlan, budget: int) -> None:
        """The blocking part of an async save: copy the chunk writes into staging buffers in
        waves of at most ``budget`` bytes, write every wave but the last now, and leave the last
        one (staged) to :meth:`write`. A failure is kept in the plan (raised by ``write``)."""
        staging = self._staging
        waves: List[List[ChunkWrite]] = [[]]
        used = 0
        for w in plan.writes:
            cost = 0 if w.owned else w.data.numel() * w.data.element_size()
            if used and used + cost > budget:
                waves.append([])
                used = 0
            waves[-1].append(w)
            used += cost
        plan.waves = len(waves)
        staging.reset_peak()
        try:
            for i, wave in enumerate(waves):
                if plan.exc is not None:
                    break
                needed: Dict[Any, int] = {}
                for w in wave:
                    if not w.owned:
                        key = staging.key_of(w.data)
                        needed[key] = needed.get(key, 0) + 1
                staging.keep_only(needed)
                for w in wave:
                    if not w.owned:
                        w.data, w.owned = staging.acquire(w.data), True
                staged = staging.seal()
                if i == len(waves) - 1:
                    plan.writes, plan.staged = wave, staged
                    return
                try:
                    plan.records += self.engines.write(wave)
                finally:
                    for w in wave:
                        w.data = None
                    staged.release()
        except Exception as e:  # noqa: BLE001 - raised by write, shared at finalize
            plan.exc = e
        plan.writes = []
        staging.seal().release()  # what this save staged and did not seal (another save's stay out)

    def write(self, plan: _SavePlan) -> None:
        """Write this rank's whole chunks; no collective (may run in a background thread)."""
        try:
            if plan.exc is not None:
                raise plan.exc
            plan.records += self.engines.write(plan.writes)
        finally:
            plan.writes = []
            if plan.staged is not None:
                plan.staged.release()

    def finalize(self, plan: _SavePlan, exc: Optional[BaseException]) -> None:
        """Gather to rank 0, which writes the shared chunks and the manifest; collective."""
        metas, root = plan.metas, plan.root

        def finish(payloads: List[Tuple[List[FileRecord], List[_Fragment]]]) -> None:
            by_chunk: Dict[Tuple[str, Shape], List[_Fragment]] = {}
            for _, frags in payloads:
                for f in frags:
                    by_chunk.setdefault((f.key, f.index), []).append(f)
            records = [r for rank_records, _ in payloads for r in rank_records]
            records += self.engines.write(
                [
                    ChunkWrite(metas[k], i, _assemble(metas[k], i, fs))
                    for (k, i), fs in sorted(by_chunk.items())
                ]
            )
            manifest = build_manifest(
                str(uuid.uuid4()),
                BACKEND,
                [(path, 0, size, crc, key) for path, size, crc, key, _ in records],
                {path: size for path, size, _, _, _ in records},
                {k: (dtype_name(m.dtype), tuple(m.shape)) for k, m in metas.items()},
                blocks=block_entries(records),
            )
            write_manifest(root, manifest)

        payload = None if exc is not None else (plan.records, plan.shared)
        dist.gather_and_decide("zarr write", exc, payload, finish)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        plan = self.prepare(sharded_state_dict, checkpoint_dir)
        exc: Optional[BaseException] = None
        try:
            self.write(plan)
        except Exception as e:  # noqa: BLE001 - shared with every rank in finalize
            exc = e
        self.finalize(plan, exc)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path):
        """Plan, create the arrays and stage the local bytes now (collective); return an
        AsyncRequest whose background part writes the chunks and whose finalization (every
        rank) writes the shared chunks and the manifest."""
        from distckpt.budget import host_memory_budget
        from distckpt.strategies.async_utils import AsyncRequest

        plan = self.prepare(sharded_state_dict, checkpoint_dir, stage=True)
        self.stage_waves(plan, host_memory_budget())
        return AsyncRequest(self.write, (plan,), [lambda: self.finalize(plan, None)])


# --------------------------------------------------------------------------- load


def _needs_staging(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """True if reads cannot land in ``t`` itself (other dtype or device, subclass, non-contiguous)."""
    return (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or not t.is_contiguous()
        or t.device.type != "cpu"
        or t.dtype != dtype
    )


def _request_boxes(sh: ShardedTensor, dest: torch.Tensor) -> List[Tuple[Shape, Shape, torch.Tensor]]:
    """(global offset, size, destination view) of each box ``sh`` asks for."""
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
    """Reads of every chunk overlapping box ``(offset, size)`` (clipped to the array) into ``view``."""
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


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``zarr`` checkpoints: distckpt's Zarr v3 layout and Megatron-Core's legacy Zarr v2.

    Args:
        thread_count: chunk files read in parallel.
        io_engine: "auto" (raw reads where the array allows, else tensorstore), "raw" or
            "tensorstore".
        checksums: (default) every byte a load copies out of a chunk file is checked against
            the integrity manifest: a chunk read whole into place is checksummed as it arrives;
            of a chunk read in part (resharding), only the 256 KiB blocks holding that part are
            read, each checked against its block CRC32C (chunks without block CRC32Cs, and
            chunks on object stores, are read whole and checked); and each array's
            ``zarr.json`` (dtype, shape) must agree with what the manifest says the writer
            wrote. False: no checks on local files (object stores are always checked). Chunks
            the manifest does not list are checked structurally only.
        verify: the same, but every chunk a load needs is read whole and checked.
        trusted: accepted for symmetry with other strategies; zarr arrays are never unpickled.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = FORMAT_VERSION,
        thread_count: int = 4,
        io_engine: str = "auto",
        verify: bool = False,
        trusted: bool = False,
        checksums: bool = True,
    ):
        super().__init__(backend, FORMAT_VERSION)
        self.engines = _Engines(io_engine, thread_count)
        self.verify = verify
        self.trusted = trusted
        self.checksums = checksums

    @staticmethod
    def _checksums(manifest: Any) -> Dict[str, Tuple[int, int]]:
        return {
            path: (manifest.files.get(path, r[0].length), r[0].crc32c)
            for path, r in manifest.ranges.items()
            if len(r) == 1 and r[0].offset == 0
        }

    def _meta(self, root: Path, key: str) -> ArrayMeta:
        meta = read_array_meta(root, key)
        if meta is None:
            raise CheckpointingException(
                f"ShardedTensor {key!r} is not in checkpoint {root} (rank {dist.get_rank()})"
            )
        return meta

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        root = _root(checkpoint_dir)
        out = {}
        manifest = read_manifest(root) if self.verify or self.checksums or _is_store(root) else None
        for key in list_array_keys(root):
            meta = self._meta(root, key)
            problem = manifest_disagreement(meta, manifest)
            if problem:
                raise CheckpointingException(problem)
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            )
        # A query returns every key: one the writer declared must not just drop out of the listing.
        missing = sorted(set(manifest.keys) - set(out)) if manifest is not None else []
        if missing:
            raise CheckpointingException(
                f"{storage.join(root, ARRAY_META)}: does not list array key(s) {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''} that {MANIFEST_FNAME} says the writer wrote (the root "
                f"metadata is damaged)"
            )
        return out

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        root = _root(checkpoint_dir)
        # The root group is not needed to find the arrays, but a damaged one means a damaged
        # checkpoint: refuse it rather than load around it (one small read per load).
        _root_keys(root)
        # On an object store every chunk read is checked (storage checksums do not reach us).
        manifest = read_manifest(root) if self.verify or self.checksums or _is_store(root) else None
        metas: Dict[str, ArrayMeta] = {}
        ops: List[ChunkRead] = []
        commits: List[Callable[[], None]] = []
        if _is_store(root):
            # One GET per array's zarr.json: issue them together instead of one after another.
            keys = sorted(
                {sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)}
            )
            found = self.engines.raw._map(lambda k: (k, self._meta(root, k)), keys, OBJECT_STORE_REQUESTS)
            metas.update(found)

        def prepare(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                raise CheckpointingException(
                    f"ShardedObject {sh.unique_key!r}: the zarr strategy leaves objects to the common strategy"
                )
            if not isinstance(sh, ShardedTensor):
                return sh
            if sh.key not in metas:
                metas[sh.key] = self._meta(root, sh.key)
            meta = metas[sh.key]
            if tuple(sh.global_shape) != meta.shape:
                if not sh.allow_shape_mismatch or len(sh.global_shape) != len(meta.shape):
                    # A damaged zarr.json (one the manifest contradicts) is the cause to report.
                    raise CheckpointingException(
                        manifest_disagreement(meta, manifest)
                        or (
                            f"ShardedTensor {sh.key!r}: global shape {list(sh.global_shape)} was requested but "
                            f"the checkpoint stores {list(meta.shape)} (in {meta_file(meta)}; set "
                            f"allow_shape_mismatch=True to load the overlap and zero the rest)"
                        )
                    )
            if sh.data is None:
                _check_allocation(meta, sh)
                sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
            target = sh.data
            if _needs_staging(target, meta.dtype):
                dest = torch.empty(tuple(target.shape), dtype=meta.dtype)
                commits.append(lambda t=target, d=dest: t.copy_(d))
            else:
                # Detached: a parameter that requires grad is filled in place like any tensor.
                dest = target.detach()
            if tuple(sh.global_shape) != meta.shape:
                dest.zero_()
            for offset, size, view in _request_boxes(sh, dest):
                ops.extend(plan_reads(meta, offset, size, view))
            return sh

        dict_list_map_inplace(prepare, sharded_state_dict)
        checksums = None
        if manifest is not None:
            for meta in metas.values():
                problem = manifest_disagreement(meta, manifest)
                if problem:
                    raise CheckpointingException(problem)
            checksums = self._checksums(manifest)
        # verify=True reads every chunk it needs whole; the default reads and checks only the
        # blocks a partial read takes bytes from.
        blocks = manifest.block_crcs if manifest is not None and not self.verify else None
        self.engines.read(ops, checksums, blocks)
        with torch.no_grad():
            for commit in commits:
                commit()
        return dict_list_map_inplace(
            lambda sh: sh.data if isinstance(sh, ShardedTensor) else sh, sharded_state_dict
        )

    def remove_sharded_tensors(self, checkpoint_dir: Path, key_prefix: str) -> None:
        """Drop every array whose key starts with ``key_prefix``: the root group's listing and
        the manifest first (atomically rewritten), then the array folders."""
        root = _root(checkpoint_dir)
        keys = list_array_keys(root)
        gone = [k for k in keys if k.startswith(key_prefix)]
        if not gone:
            return
        kept = [k for k in keys if k not in gone]
        records = write_root_group(root, kept) if _root_keys(root) is not None else []
        manifest = read_manifest(root)
        if manifest is not None:
            dropped = tuple(f"{k}/" for k in gone)
            for name in [n for n in manifest.files if n.startswith(dropped)]:
                manifest.drop(name)
            for key in gone:
                manifest.keys.pop(key, None)
            for path, size, crc, key, _ in records:
                manifest.set_whole(path, size, crc, key)
            write_manifest(root, manifest)
        for key in gone:
            if _is_store(root):
                for name in root.list(f"{key}/"):
                    root.delete(name)
            else:
                shutil.rmtree(self._meta(root, key).path)


# --------------------------------------------------------------------------- whole-tensor writer


class ZarrTensorWriter:
    """Writes whole tensors one at a time into a new zarr checkpoint (single process).

    The streaming counterpart of the save strategy, for tools (conversion) that hold one
    tensor at a time. ``finish`` writes the root group; committing (``metadata.json``) is the
    caller's.

    Args:
        max_chunk_bytes: split a tensor along its first axis into chunks of at most about this
            many bytes (None: one chunk per tensor).
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        *,
        io_engine: str = "auto",
        thread_count: int = 4,
        compression: Optional[str] = None,
        max_chunk_bytes: Optional[int] = None,
        fsync: bool = True,
    ):
        self.root = _root(checkpoint_dir)
        self.engines = _Engines(io_engine, thread_count, fsync)
        self.compression = compression
        self.max_chunk_bytes = max_chunk_bytes
        self.keys: List[str] = []
        self.records: List[FileRecord] = []
        self._folders: set = set()

    def _chunks(self, t: torch.Tensor) -> Shape:
        shape = tuple(max(s, 1) for s in t.shape)
        if self.max_chunk_bytes is None or t.dim() == 0 or t.shape[0] == 0:
            return shape
        row = max(1, math.prod(t.shape[1:]) * t.element_size())
        return (max(1, min(t.shape[0], self.max_chunk_bytes // row)),) + shape[1:]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        _check_key_path(key)
        parents = _prefixes(key)[:-1]
        if key in self._folders or key in self.keys or any(p in self.keys for p in parents):
            raise CheckpointingException(
                f"ShardedTensor key {key!r} clashes with a key already written (same key, or one "
                f"array folder would contain the other)"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        meta, record = create_array(
            self.root, key, tuple(t.shape), self._chunks(t), t.dtype, self.compression
        )
        jobs = []
        for index in meta.chunks_overlapping((0,) * t.dim(), tuple(t.shape)):
            c_off, c_size = meta.chunk_box(index)
            jobs.append(
                ChunkWrite(meta, tuple(index), t[tuple(slice(o, o + n) for o, n in zip(c_off, c_size))])
            )
        self.records += [record] + self.engines.write(jobs)
        self.keys.append(key)
        self._folders.update(parents)

    def finish(self) -> List[FileRecord]:
        """Write the root group; returns every file written, for the integrity manifest."""
        self.records += write_root_group(self.root, self.keys)
        return self.records


# --------------------------------------------------------------------------- zarr-python data types


_ZARR_PYTHON_EXTRA = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_zarr_python_registered = False


def register_zarr_python_dtypes() -> bool:
    """Teach zarr-python (3.1 and earlier) the bfloat16 and float8 data types, via ml_dtypes.

    Tensorstore and zarrs read these names natively; zarr-python 3.1 rejects them ("No Zarr
    data type found that matches 'bfloat16'"). After this call ``zarr.open`` returns such arrays
    with ml_dtypes dtypes, bit-exact. Best effort: returns False if zarr-python's internals
    differ from what this expects (nothing is registered then).
    """
    global _zarr_python_registered
    if _zarr_python_registered:
        return True
    try:
        from typing import ClassVar

        import ml_dtypes
        import numpy as np
        from zarr.core.dtype import data_type_registry
        from zarr.core.dtype.npy.float import BaseFloat
    except ImportError:
        return False

    def make(name: str):
        np_dtype = np.dtype(getattr(ml_dtypes, name))

        @dataclass(frozen=True, kw_only=True)
        class MlDtypesFloat(BaseFloat):
            dtype_cls = type(np_dtype)
            _zarr_v3_name = name
            _zarr_v2_names: ClassVar[Tuple[str, ...]] = (name,)

            def to_native_dtype(self):
                return np_dtype

            @property
            def item_size(self) -> int:
                return np_dtype.itemsize

        MlDtypesFloat.__name__ = MlDtypesFloat.__qualname__ = f"MlDtypes_{name}"
        return MlDtypesFloat

    try:
        for name in _ZARR_PYTHON_EXTRA:
            if hasattr(ml_dtypes, name) and name not in data_type_registry.contents:
                data_type_registry.register(name, make(name))
    except Exception as e:  # noqa: BLE001 - an optional convenience; never fatal
        logger.debug("could not register ml_dtypes types with zarr-python: %s", e)
        return False
    _zarr_python_registered = True
    return True


# --------------------------------------------------------------------------- registration


def _register() -> None:
    # One writer: ("zarr", 1) asks for the legacy layout, which is not written any more; it
    # gets the current one, and metadata.json records version 2.
    for version in (LEGACY_VERSION, FORMAT_VERSION):
        register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, version, ZarrSaveShardedStrategy)
        register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, version, ZarrLoadShardedStrategy)


_register()
