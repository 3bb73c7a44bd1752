"""A committed checkpoint directory read key by key as a tensor source: :class:`CheckpointSource`.

Any registered backend is read through the library's load strategies (distckpt's checkpoints and
Megatron-Core's, plain PyTorch DCP ones too), in one process, without a process group, on CPU.
``torch_dist`` and ``zarr`` get format-specific facts (chunk counts, bytes on disk, where each
object is stored) from their own metadata; nothing but metadata is read until a tensor is asked
for, and then only the chunks it overlaps.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from distckpt import bounds, containment, storage
from distckpt.core import CONFIG_FNAME, CheckpointingException
from distckpt.dcp_native import checkpoint_config, describe_missing_config, is_dcp_native
from distckpt.formats.index_read import IndexReader
from distckpt.formats.manifest import read_manifest
from distckpt.mapping import ShardedObject, ShardedTensor
from distckpt.serialization import CONTENT_METADATA_KEY, read_common_state
from distckpt.strategies.base import StrategyAction, get_default_strategy
from distckpt.strategies.torch_dist.claims import check_claims
from distckpt.strategies.torch_dist.metadata import (
    METADATA_FNAME,
    plain_byte_items,
    read_metadata,
)
from distckpt.strategies.torch_dist.stored import directory_keys, directory_objects
from distckpt.strategies.zarr import layout as zarr_layout
from distckpt.tools.sources.base import ObjectMeta, Shape, TensorMeta, TensorSource, did_you_mean


class CheckpointSource(TensorSource):
    """A committed distckpt or Megatron-Core checkpoint directory, read through the library's
    strategies (any registered backend), with format-specific details for ``torch_dist`` and
    ``zarr``.

    Args:
        trusted: unpickle ``.metadata``, ``common.pt`` and objects without the allowlist.
    """

    def __init__(self, path: storage.Location, trusted: bool = False):
        self.path = storage.resolve(path)
        # The local directory (plain files: POSIX walks and sizes), or None for an object store.
        self.local = storage.local_root(self.path)
        self.trusted = trusted
        if self.local is not None:
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
        reader = IndexReader.open(self.path)
        if reader is not None:
            return _sidecar_metas(reader)
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
        out = {}
        listing = None if self.local is not None else self.path.list()  # one LIST: chunk sizes
        for key in zarr_layout.list_array_keys(self.path):
            meta = zarr_layout.read_array_meta(self.path, key)
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
                    if self.local is not None:
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
        if self._common is None:
            self._common = read_common_state(self.path, self.sharded, self.common_strategy)
        return {k: v for k, v in self._common.items() if k != CONTENT_METADATA_KEY}

    def content_metadata(self) -> Optional[dict]:
        self.common()
        return self._common.get(CONTENT_METADATA_KEY)

    def extra(self) -> Dict[str, Any]:
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
        if self.local is None:
            listing = self.path.list()  # one LIST, in the tool's single process
            files, size = len(listing), sum(listing.values())
        for dirpath, _, filenames in os.walk(self.local) if self.local is not None else ():
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
                f"{self.path}: no ShardedObject {unique_key!r}{did_you_mean(unique_key, objects)}"
            )
        request = {unique_key: ShardedObject.empty_from_unique_key(unique_key)}
        if self.sharded.can_handle_sharded_objects:
            return self.sharded.load(request, self.path)[unique_key]
        return self.common_strategy.load_sharded_objects(request, self.path)[unique_key]


def _sidecar_metas(reader: IndexReader) -> Tuple[Dict[str, TensorMeta], Dict[str, ObjectMeta]]:
    """Every key's facts from the sidecar's directory alone (no record, no ``.metadata``, which
    holds every chunk of every key: ``show`` of one slice costs what the keys cost)."""
    tensors, objects = {}, {}
    for k in directory_keys(reader):
        nbytes = k.entry.get("nbytes")
        tensors[k.fqn] = TensorMeta(
            k.fqn,
            k.shape,
            k.dtype,
            k.size if k.orig_shape is not None else None,
            k.entry["count"],
            None,
            nbytes if bounds.fits(nbytes) else None,
        )
    for fqn, e in directory_objects(reader):
        item = e.get("item")
        objects[fqn] = ObjectMeta(fqn, item[2], f"{item[0]}@{item[1]}") if item else ObjectMeta(fqn)
    return tensors, objects


def _zarr_chunk_bytes(array_dir: Path) -> int:
    """Bytes of an array's chunk files (metadata and object payloads not counted)."""
    total = 0
    for dirpath, _, filenames in os.walk(array_dir):
        for name in filenames:
            if name in ("zarr.json", ".zarray", ".zattrs") or name.endswith(".pt"):
                continue
            total += os.path.getsize(os.path.join(dirpath, name))
    return total
