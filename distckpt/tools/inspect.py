"""Read any checkpoint key by key, without a model or a process group: sources, inspect, show.

A *tensor source* is something tensors can be read from one key (or one box of a key) at a
time: a distckpt/Megatron checkpoint directory (:class:`CheckpointSource`, any registered
backend) or a plain file (``torch.save`` state dict, safetensors file or HF-sharded folder; see
:mod:`distckpt.tools.export`). :func:`open_source` picks the right one for a path. The other
tools (verify, diff, export, surgery) and the ``distckpt`` command build on these.

Everything here runs in one process with no ``torch.distributed`` process group, on CPU, and
reads only the bytes it needs: metadata for :func:`inspect_source`, the overlapping chunks for
:func:`read_tensor` (a box of one key), one key (or a group of small keys) at a time for
:meth:`CheckpointSource.iter_tensors`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from distckpt import containment
from distckpt.core import CONFIG_FNAME, CheckpointingException, PathLike
from distckpt.dcp_native import checkpoint_config, describe_missing_config, is_dcp_native
from distckpt.mapping import ShardedObject, ShardedTensor

Shape = Tuple[int, ...]

DEFAULT_READ_BUDGET = 64 << 20
"""Small keys are read together until a group holds this many bytes (or the largest tensor)."""


# --------------------------------------------------------------------------- progress


class Progress(Protocol):
    """What long-running tools report to: the CLI passes a progress bar, tests a recorder.

    ``start`` is called once per phase with the phase's total (bytes), ``advance`` as work is done.
    """

    def start(self, total: int, description: str) -> None: ...

    def advance(self, amount: int) -> None: ...


class NoProgress:
    """A :class:`Progress` that ignores everything."""

    def start(self, total: int, description: str) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


# --------------------------------------------------------------------------- plain data


@dataclass(frozen=True)
class TensorMeta:
    """What is known about one stored tensor without reading its data.

    Attributes:
        key: the tensor's key.
        shape: its global shape (for flattened keys: the original shape, not the stored one).
        dtype: element type.
        stored_shape: the shape on disk when it differs from ``shape`` (``torch_dist`` stores
            flattened-range keys N-D reformulated: the chunk grid plus one flat axis).
        chunks: number of stored pieces (DCP chunks, Zarr chunks, safetensors: 1), if known.
        chunk_shape: the Zarr chunk shape, if the format has a regular grid.
        disk_bytes: bytes the tensor's pieces take on disk (format overhead included), if known.
    """

    key: str
    shape: Shape
    dtype: torch.dtype
    stored_shape: Optional[Shape] = None
    chunks: Optional[int] = None
    chunk_shape: Optional[Shape] = None
    disk_bytes: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's values (``numel * itemsize``)."""
        return self.numel * dtype_itemsize(self.dtype)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "key": self.key,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "nbytes": self.nbytes,
        }
        if self.stored_shape is not None:
            out["stored_shape"] = list(self.stored_shape)
        for name in ("chunks", "disk_bytes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.chunk_shape is not None:
            out["chunk_shape"] = list(self.chunk_shape)
        return out


@dataclass(frozen=True)
class ObjectMeta:
    """One stored ShardedObject (by unique key, e.g. ``rng_state/shard_0_2``)."""

    key: str
    disk_bytes: Optional[int] = None
    where: Optional[str] = None  # file (and offset) holding it

    def to_json(self) -> Dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def parse_dtype(text: str) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    name = text.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointingException(
            f"unknown dtype {text!r} (examples: bf16, fp16, fp32, float8_e4m3fn, int64)"
        )
    return dtype


# --------------------------------------------------------------------------- sources


class TensorSource:
    """Tensors (and common state, objects) readable key by key. Subclasses fill in the rest.

    Attributes:
        path: what was opened.
        format: ``torch_dist``, ``zarr``, ``safetensors``, ``torch`` or another backend name.
        format_version: the backend's format version, where there is one.
    """

    path: Path
    format: str
    format_version: Optional[int] = None

    def tensors(self) -> Dict[str, TensorMeta]:
        """Every stored tensor by key, in storage order (cached)."""
        raise NotImplementedError

    def objects(self) -> Dict[str, ObjectMeta]:
        """Every stored ShardedObject by unique key."""
        return {}

    def common(self) -> Dict[str, Any]:
        """The common (non-sharded) state; {} if the format has none."""
        return {}

    def content_metadata(self) -> Optional[dict]:
        return None

    def read(self, key: str, offset: Optional[Shape] = None, size: Optional[Shape] = None) -> torch.Tensor:
        """The tensor ``key`` whole, or its box ``[offset, offset + size)``."""
        raise NotImplementedError

    def read_many(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Several whole tensors at once (one pass over the storage where the format allows)."""
        return {k: self.read(k) for k in keys}

    def read_object(self, unique_key: str) -> Any:
        raise CheckpointingException(
            f"{self.path}: no ShardedObject {unique_key!r} in a {self.format} source"
        )

    def extra(self) -> Dict[str, Any]:
        """Format-specific facts for ``inspect`` (manifest, save id, file metadata, ...)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def meta(self, key: str) -> TensorMeta:
        """Metadata of ``key``; a CheckpointingException naming close matches if it is absent."""
        metas = self.tensors()
        if key not in metas:
            raise CheckpointingException(f"{self.path}: no tensor {key!r}{_suggest(key, metas)}")
        return metas[key]

    def iter_tensors(
        self,
        keys: Optional[Iterable[str]] = None,
        budget: Optional[int] = None,
        progress: Optional[Progress] = None,
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield ``(key, tensor)`` for ``keys`` (default: all), holding few tensors at a time.

        Keys are read in groups whose values total at most ``max(budget, largest tensor)`` bytes
        (``budget`` defaults to :data:`DEFAULT_READ_BUDGET`); a tensor larger than the budget is
        read alone. The caller should drop each tensor before asking for the next group.
        ``progress.advance`` receives each tensor's value bytes.
        """
        for group in self.group_keys(keys, budget):
            yield from self._read_group(group, progress)

    def group_keys(
        self, keys: Optional[Iterable[str]] = None, budget: Optional[int] = None
    ) -> List[List[str]]:
        """Cut ``keys`` (default: all) into consecutive groups of at most ``budget`` value bytes
        (default :data:`DEFAULT_READ_BUDGET`); a larger tensor forms a group of its own."""
        keys = list(self.tensors()) if keys is None else list(keys)
        budget = DEFAULT_READ_BUDGET if budget is None else budget
        groups: List[List[str]] = []
        size = 0
        for key in keys:
            nbytes = self.meta(key).nbytes
            if groups and groups[-1] and size + nbytes <= budget:
                groups[-1].append(key)
                size += nbytes
            else:
                groups.append([key])
                size = nbytes
        return groups

    def _read_group(
        self, group: List[str], progress: Optional[Progress]
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        loaded = self.read_many(group) if len(group) > 1 else {group[0]: self.read(group[0])}
        for key in group:
            tensor = loaded.pop(key)
            if progress is not None:
                progress.advance(self.meta(key).nbytes)
            yield key, tensor
            del tensor


def _suggest(key: str, candidates: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


class CheckpointSource(TensorSource):
    """A committed distckpt or Megatron-Core checkpoint directory, read through the library's
    strategies (any registered backend), with format-specific details for ``torch_dist`` and
    ``zarr``.

    Args:
        trusted: unpickle ``.metadata``, ``common.pt`` and objects without the allowlist.
    """

    def __init__(self, path: PathLike, trusted: bool = False):
        from distckpt import storage
        from distckpt.strategies.base import StrategyAction, get_default_strategy

        self.path = storage.resolve(path)
        self.trusted = trusted
        if isinstance(self.path, Path):
            if not self.path.exists():
                raise CheckpointingException(f"{self.path}: no such file or directory")
            if not self.path.is_dir():
                raise CheckpointingException(f"{self.path}: not a checkpoint directory")
        config = checkpoint_config(self.path)
        if config is None:
            raise CheckpointingException(
                f"{describe_missing_config(self.path)}; `distckpt verify` tells what is there"
            )
        self.dcp_native = is_dcp_native(self.path)
        self.config = config
        self.format = config.sharded_backend
        self.format_version = config.sharded_backend_version
        try:
            self.sharded = get_default_strategy(
                StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
            )
            self.common_strategy = get_default_strategy(
                StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version
            )
        except CheckpointingException as e:
            raise CheckpointingException(f"{self.path}/{CONFIG_FNAME}: {e}") from None
        for strategy in (self.sharded, self.common_strategy):
            if hasattr(strategy, "trusted"):
                strategy.trusted = trusted
        self._tensors: Optional[Dict[str, TensorMeta]] = None
        self._objects: Optional[Dict[str, ObjectMeta]] = None
        self._common: Optional[Dict[str, Any]] = None
        self._dcp_metadata: Any = None

    # ------------------------------------------------------------------ metadata

    def dcp_metadata(self):
        """The ``torch_dist`` ``.metadata`` (read once)."""
        from distckpt import storage
        from distckpt.strategies.torch import METADATA_FNAME, check_claims, read_metadata

        if self._dcp_metadata is None:
            md = read_metadata(self.path, self.trusted)
            # Every field the tools read of it, checked as a load checks it first.
            check_claims(md, storage.join(self.path, METADATA_FNAME))
            self._dcp_metadata = md
        return self._dcp_metadata

    def tensors(self) -> Dict[str, TensorMeta]:
        if self._tensors is None:
            if self.format == "torch_dist":
                self._tensors, self._objects = self._torch_dist_metas()
            elif self.format == "zarr":
                self._tensors = self._zarr_metas()
            else:
                self._tensors = {
                    k: TensorMeta(k, tuple(sh.global_shape), sh.dtype)
                    for k, sh in self.sharded.load_tensors_metadata(self.path).items()
                }
        return self._tensors

    def _torch_dist_metas(self) -> Tuple[Dict[str, TensorMeta], Dict[str, ObjectMeta]]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        from distckpt.strategies.torch import plain_byte_items

        md = self.dcp_metadata()
        values = plain_byte_items(md)  # a dcp.save's non-tensor values: common state, not objects
        mcore = getattr(md, "mcore_data", None) or {}
        disk: Dict[str, int] = {}
        where: Dict[str, str] = {}
        for index, info in md.storage_data.items():
            disk[index.fqn] = disk.get(index.fqn, 0) + info.length
            where[index.fqn] = f"{info.relative_path}@{info.offset}"
        tensors, objects = {}, {}
        for fqn, meta in md.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                stored = tuple(meta.size)
                orig = (mcore.get(fqn) or {}).get("nd_reformulated_orig_global_shape")
                shape = tuple(orig) if orig is not None else stored
                tensors[fqn] = TensorMeta(
                    fqn,
                    shape,
                    meta.properties.dtype,
                    stored if orig is not None else None,
                    len(meta.chunks),
                    None,
                    disk.get(fqn, 0),
                )
            elif isinstance(meta, BytesStorageMetadata) and fqn not in values:
                objects[fqn] = ObjectMeta(fqn, disk.get(fqn), where.get(fqn))
        return tensors, objects

    def _zarr_metas(self) -> Dict[str, TensorMeta]:
        from distckpt.strategies import zarr as zarr_strategy

        out = {}
        listing = None if isinstance(self.path, Path) else self.path.list()  # one LIST: chunk sizes
        for key in zarr_strategy.list_array_keys(self.path):
            meta = zarr_strategy.read_array_meta(self.path, key)
            if meta is None:
                raise CheckpointingException(f"{self.path}: key {key!r} is listed but has no array metadata")
            grid = [-(-s // c) if c else 0 for s, c in zip(meta.shape, meta.chunks)]
            if listing is None:
                disk = _zarr_chunk_bytes(meta.path)
            else:
                disk = sum(
                    n
                    for name, n in listing.items()
                    if name.startswith(f"{key}/")
                    and not name.endswith(("zarr.json", ".zarray", ".zattrs", ".pt"))
                )
            out[key] = TensorMeta(
                key, tuple(meta.shape), meta.dtype, None, math.prod(grid), tuple(meta.chunks), disk
            )
        return out

    def objects(self) -> Dict[str, ObjectMeta]:
        if self._objects is None:
            if self.format == "torch_dist":
                self.tensors()
            else:
                self._objects = {}
                for uk in sorted(self.common_strategy.load_sharded_metadata(self.path)):
                    if isinstance(self.path, Path):
                        try:
                            size = containment.size_beneath(
                                self.path, f"{uk}.pt", self.path, "ShardedObject file"
                            )
                        except FileNotFoundError:
                            size = None
                    else:
                        size = self.path.size(f"{uk}.pt") if self.path.exists(f"{uk}.pt") else None
                    self._objects[uk] = ObjectMeta(uk, size, f"{uk}.pt")
        return self._objects

    def common(self) -> Dict[str, Any]:
        from distckpt.serialization import CONTENT_METADATA_KEY, read_common_state

        if self._common is None:
            self._common = read_common_state(self.path, self.sharded, self.common_strategy)
        return {k: v for k, v in self._common.items() if k != CONTENT_METADATA_KEY}

    def content_metadata(self) -> Optional[dict]:
        from distckpt.serialization import CONTENT_METADATA_KEY

        self.common()
        return self._common.get(CONTENT_METADATA_KEY)

    def extra(self) -> Dict[str, Any]:
        from distckpt.manifest import read_manifest

        out: Dict[str, Any] = {
            "common_backend": f"{self.config.common_backend} v{self.config.common_backend_version}"
        }
        if self.dcp_native:
            out["dcp_native"] = True  # plain PyTorch DCP: no metadata.json, config implied
        manifest = read_manifest(self.path)
        if manifest is not None:
            out["manifest"] = {
                "save_id": manifest.save_id,
                "files": len(manifest.files),
                "checksummed_ranges": sum(len(r) for r in manifest.ranges.values()),
            }
        if self.format == "torch_dist":
            meta = getattr(self.dcp_metadata(), "storage_meta", None)
            if meta is not None and getattr(meta, "save_id", None):
                out["save_id"] = meta.save_id
        files, size = 0, 0
        if not isinstance(self.path, Path):
            listing = self.path.list()  # one LIST, in the tool's single process
            files, size = len(listing), sum(listing.values())
        for dirpath, _, filenames in os.walk(self.path) if isinstance(self.path, Path) else ():
            for name in filenames:
                files += 1
                size += os.path.getsize(os.path.join(dirpath, name))
        out["files"] = files
        out["disk_bytes"] = size
        return out

    # ------------------------------------------------------------------ reading

    def _request(self, key: str, offset: Optional[Shape], size: Optional[Shape]) -> ShardedTensor:
        meta = self.meta(key)
        shape = meta.shape
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        size = tuple(size) if size is not None else shape
        # Without data: the strategy allocates it only after checking that the checkpoint stores
        # its bytes (a claimed shape of 2^40 elements is refused, not allocated).
        return ShardedTensor(key, None, meta.dtype, size, shape, offset, None, 0)

    def read(self, key: str, offset: Optional[Shape] = None, size: Optional[Shape] = None) -> torch.Tensor:
        request = self._request(key, offset, size)
        if math.prod(request.local_shape) == 0:
            return torch.empty(request.local_shape, dtype=request.dtype)
        return self.sharded.load({key: request}, self.path)[key]

    def read_many(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        requests = {k: self._request(k, None, None) for k in keys}
        empty = {
            k: torch.empty(r.local_shape, dtype=r.dtype)
            for k, r in requests.items()
            if math.prod(r.local_shape) == 0
        }
        wanted = {k: r for k, r in requests.items() if k not in empty}
        loaded = self.sharded.load(wanted, self.path) if wanted else {}
        return {k: empty[k] if k in empty else loaded[k] for k in keys}

    def read_object(self, unique_key: str) -> Any:
        objects = self.objects()
        if unique_key not in objects:
            raise CheckpointingException(
                f"{self.path}: no ShardedObject {unique_key!r}{_suggest(unique_key, objects)}"
            )
        request = {unique_key: ShardedObject.empty_from_unique_key(unique_key)}
        if self.sharded.can_handle_sharded_objects:
            return self.sharded.load(request, self.path)[unique_key]
        return self.common_strategy.load_sharded_objects(request, self.path)[unique_key]


def _zarr_chunk_bytes(array_dir: Path) -> int:
    """Bytes of an array's chunk files (metadata and object payloads not counted)."""
    total = 0
    for dirpath, _, filenames in os.walk(array_dir):
        for name in filenames:
            if name in ("zarr.json", ".zarray", ".zattrs") or name.endswith(".pt"):
                continue
            total += os.path.getsize(os.path.join(dirpath, name))
    return total


def open_source(path: PathLike, trusted: bool = False) -> TensorSource:
    """Open a checkpoint directory, a safetensors file/folder or a ``torch.save`` file.

    Raises:
        CheckpointingException: the path does not exist or is none of these.
    """
    from distckpt import storage
    from distckpt.tools import export

    if storage.is_remote(path):
        return CheckpointSource(path, trusted)
    path = Path(path)
    if not path.exists():
        raise CheckpointingException(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / CONFIG_FNAME).exists():
            return CheckpointSource(path, trusted)
        if export.is_safetensors(path):
            return export.SafetensorsSource(path)
        return CheckpointSource(path, trusted)  # raises with the "not committed" explanation
    if export.is_safetensors(path):
        return export.SafetensorsSource(path)
    return export.TorchFileSource(path, trusted)


# --------------------------------------------------------------------------- inspect


@dataclass
class SourceInfo:
    """Everything ``distckpt inspect`` shows; :meth:`to_json` is the ``--json`` document."""

    path: str
    format: str
    format_version: Optional[int]
    tensors: List[TensorMeta]
    objects: List[ObjectMeta]
    common: Any  # a summary (see :func:`summarize`), or None
    common_error: Optional[str]  # why the common state could not be read
    content_metadata: Any
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "num_tensors": len(self.tensors),
            "num_objects": len(self.objects),
            "nbytes": self.nbytes,
            **self.extra,
            "tensors": [t.to_json() for t in self.tensors],
            "objects": [o.to_json() for o in self.objects],
            "common": self.common,
            "common_error": self.common_error,
            "content_metadata": summarize(self.content_metadata),
        }


def inspect_source(path: PathLike, trusted: bool = False) -> SourceInfo:
    """Describe a checkpoint or tensor file from its metadata (no tensor data is read).

    A common state that cannot be unpickled safely is reported in ``common_error`` instead of
    failing the whole inspection.
    """
    with open_source(path, trusted) as src:
        common, common_error, content = None, None, None
        try:
            common = summarize(src.common())
            content = src.content_metadata()
        except CheckpointingException as e:
            common_error = str(e)
        return SourceInfo(
            str(src.path),
            src.format,
            src.format_version,
            list(src.tensors().values()),
            list(src.objects().values()),
            common,
            common_error,
            content,
            src.extra(),
        )


def summarize(obj: Any, max_items: int = 20, max_str: int = 80, depth: int = 6) -> Any:
    """A JSON-able preview of a nested structure: tensors and arrays become
    ``"tensor[8, 6] float32"``, long containers and strings are cut."""
    if isinstance(obj, torch.Tensor):
        return f"tensor{list(obj.shape)} {dtype_name(obj.dtype)}"
    if type(obj).__name__ == "ndarray":
        return f"ndarray{list(obj.shape)} {obj.dtype}"
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, str):
        return obj if len(obj) <= max_str else obj[:max_str] + f"... ({len(obj)} chars)"
    if isinstance(obj, bytes):
        return f"bytes[{len(obj)}]"
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if depth <= 0:
        return f"{type(obj).__name__}(...)"
    if isinstance(obj, dict):
        items = list(obj.items())
        out = {str(k): summarize(v, max_items, max_str, depth - 1) for k, v in items[:max_items]}
        if len(items) > max_items:
            out["..."] = f"{len(items) - max_items} more entries"
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        seq = list(obj)
        out_list = [summarize(v, max_items, max_str, depth - 1) for v in seq[:max_items]]
        if len(seq) > max_items:
            out_list.append(f"... {len(seq) - max_items} more items")
        return tuple(out_list) if isinstance(obj, tuple) else out_list
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return str(obj)
    text = repr(obj)
    return text if len(text) <= max_str else text[:max_str] + "..."


# --------------------------------------------------------------------------- key trees


@dataclass
class KeyTreeRow:
    """One row of the key tree: ``label`` (with tree guides), the tensor (leaf) or the aggregate
    of the subtree (``count`` tensors, ``nbytes``/``disk_bytes`` summed)."""

    label: str
    depth: int
    meta: Optional[TensorMeta]
    count: int
    nbytes: int
    disk_bytes: Optional[int]


def key_tree_rows(
    metas: Sequence[TensorMeta], max_depth: Optional[int] = None, sep: str = "."
) -> List[KeyTreeRow]:
    """Lay out keys as a tree split on ``sep``: chains of single children are merged into one
    label (``decoder.layers.0``), keys keep their stored order. Below ``max_depth`` a subtree is
    shown as one aggregate row."""
    root: Dict[str, Any] = {}
    for m in metas:
        node = root
        parts = m.key.split(sep)
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node.setdefault(parts[-1], {})["\0leaf"] = m

    rows: List[KeyTreeRow] = []

    def leaves(node: Dict[str, Any]) -> List[TensorMeta]:
        out = []
        for k, child in node.items():
            if k == "\0leaf":
                out.append(child)
            else:
                out.extend(leaves(child))
        return out

    def emit(name: str, node: Dict[str, Any], prefix: str, last: bool, depth: int, top: bool) -> None:
        # merge chains: a node with no leaf of its own and exactly one child
        while "\0leaf" not in node and len(node) == 1:
            ((child_name, child),) = node.items()
            name, node = f"{name}{sep}{child_name}", child
        guide = "" if top else ("└── " if last else "├── ")
        own = node.get("\0leaf")
        children = [(k, v) for k, v in node.items() if k != "\0leaf"]
        subtree = leaves(node)
        collapsed = max_depth is not None and depth >= max_depth and children
        disk = [m.disk_bytes for m in subtree]
        if own is not None and not children:
            rows.append(KeyTreeRow(prefix + guide + name, depth, own, 1, own.nbytes, own.disk_bytes))
            return
        rows.append(
            KeyTreeRow(
                prefix + guide + name,
                depth,
                own if not collapsed else None,
                len(subtree),
                sum(m.nbytes for m in subtree),
                None if any(d is None for d in disk) else sum(disk),
            )
        )
        if collapsed:
            return
        child_prefix = prefix + ("" if top else ("    " if last else "│   "))
        for i, (k, v) in enumerate(children):
            emit(k, v, child_prefix, i == len(children) - 1, depth + 1, False)

    for i, (k, v) in enumerate(root.items()):
        emit(k, v, "", i == len(root) - 1, 0, True)
    return rows


# --------------------------------------------------------------------------- show


_INDEX = re.compile(r"^\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?(?::\s*(-?\d+)?\s*)?$")


def parse_slice(text: str, shape: Shape) -> Tuple[Shape, Shape, Tuple[Any, ...]]:
    """Parse ``"0:4,:"``-style numpy indexing against ``shape``.

    Returns ``(offset, size, post)``: the bounding box to read and the index to apply to it
    afterwards (steps, and integer indices that drop an axis). Supports integers (negative
    too), ``start:stop:step`` with a positive step, and one ``...``.

    Raises:
        CheckpointingException: malformed, too many indices, or out of range.
    """
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    if parts.count("...") > 1:
        raise CheckpointingException(f"slice {text!r}: at most one '...'")
    if "..." in parts:
        i = parts.index("...")
        fill = len(shape) - (len(parts) - 1)
        if fill < 0:
            raise CheckpointingException(
                f"slice {text!r} has more indices than the tensor's {len(shape)} axes"
            )
        parts = parts[:i] + [":"] * fill + parts[i + 1 :]
    if len(parts) > len(shape):
        raise CheckpointingException(
            f"slice {text!r} has {len(parts)} indices; the tensor has {len(shape)} axes {list(shape)}"
        )
    parts += [":"] * (len(shape) - len(parts))
    offset, size, post = [], [], []
    for axis, (part, n) in enumerate(zip(parts, shape)):
        m = _INDEX.match(part)
        if not m or part == "":
            raise CheckpointingException(f"slice {text!r}: cannot parse {part!r} (use e.g. 0:4,:,3)")
        if ":" not in part:
            i = int(m.group(1))
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                raise CheckpointingException(
                    f"slice {text!r}: index {i} is out of range for axis {axis} of size {n}"
                )
            offset.append(j)
            size.append(1)
            post.append(0)
            continue
        start, stop, step = (int(g) if g is not None else None for g in m.groups())
        if step is not None and step <= 0:
            raise CheckpointingException(f"slice {text!r}: only positive steps are supported")
        lo, hi, st = slice(start, stop, step).indices(n)
        hi = max(lo, hi)
        offset.append(lo)
        size.append(hi - lo)
        post.append(slice(None, None, st))
    return tuple(offset), tuple(size), tuple(post)


def read_tensor(source: TensorSource, key: str, slice_text: Optional[str] = None) -> torch.Tensor:
    """Read ``key`` whole or, with ``slice_text`` (``"0:4,:"``), only the sliced box of it."""
    meta = source.meta(key)
    if not slice_text:
        return source.read(key)
    offset, size, post = parse_slice(slice_text, meta.shape)
    box = source.read(key, offset, size)
    return box[post] if post else box
