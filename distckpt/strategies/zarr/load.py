"""The ``zarr`` load strategy: distckpt's Zarr v3 layout and Megatron-Core's legacy Zarr v2, key by key.

No collective: each rank cuts the boxes it asks for into the regions of the chunks they
overlap and reads only those (checked against the integrity manifest by default, see
:class:`ZarrLoadShardedStrategy`). Also the strategy's key removal and its metadata query.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any, Callable, Dict, List, Tuple

import torch

from distckpt import dist, storage
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.formats.manifest import read_manifest, write_manifest
from distckpt.io.device_io import needs_staging
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from distckpt.strategies.base import LoadShardedStrategy
from distckpt.strategies.zarr.engines import Engines
from distckpt.strategies.zarr.jobs import ChunkRead
from distckpt.strategies.zarr.layout import (
    Root,
    list_array_keys,
    open_root,
    read_array_meta,
    root_keys,
    write_root_group,
)
from distckpt.strategies.zarr.meta import (
    ARRAY_META,
    BACKEND,
    CHUNK_SLACK_BYTES,
    FORMAT_VERSION,
    LEGACY_ARRAY_META,
    ArrayMeta,
    listing_disagreement,
    manifest_disagreement,
    meta_file,
)
from distckpt.strategies.zarr.plan import plan_reads, request_boxes
from distckpt.strategies.zarr.rawio import OBJECT_STORE_REQUESTS


def _check_allocation(meta: ArrayMeta, sh: ShardedTensor) -> None:
    """A tensor this load allocates (a request without data, e.g. ``load_plain_tensors``, whose
    shape comes from the checkpoint's claim) must be backed by chunk files that exist: for an
    uncompressed array, at least the request's bytes. (Compressed arrays, absent chunks, which
    read as the fill value, and arrays on object stores are not bounded this way; see
    docs/reliability.md.)"""
    need = math.prod(sh.local_shape) * meta.itemsize
    # On an object store this would take a LIST per key and rank (a load never lists there): the
    # shape bound of meta.checked_meta is what holds there.
    if need <= CHUNK_SLACK_BYTES or not meta.raw or meta.store is not None:
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


def _needs_staging(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """True if the raw reads cannot land in ``t`` itself: a subclass or a non-contiguous tensor
    (:func:`~distckpt.io.device_io.needs_staging`), or one on a device or of another dtype."""
    return needs_staging(t) or t.device.type != "cpu" or t.dtype != dtype


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
        self.engines = Engines(io_engine, thread_count)
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

    def _meta(self, root: Root, key: str, manifest: Any = None) -> ArrayMeta:
        """Array ``key``'s metadata; with the ``manifest``, its file compared with it (with
        ``verify``, it must be listed) and its description (:func:`manifest_disagreement`)."""
        meta = read_array_meta(root, key, manifest, self.verify)
        if meta is None:
            raise CheckpointingException(
                f"ShardedTensor {key!r} is not in checkpoint {root} (rank {dist.get_rank()})"
            )
        problem = manifest_disagreement(meta, manifest)
        if problem:
            raise CheckpointingException(problem)
        return meta

    def load_tensors_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        root = open_root(checkpoint_dir)
        remote = storage.local_root(root) is None
        out = {}
        manifest = read_manifest(root) if self.verify or self.checksums or remote else None
        for key in list_array_keys(root):
            meta = self._meta(root, key, manifest)
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            )
        problem = listing_disagreement(list(out), manifest, storage.join(root, ARRAY_META))
        if problem:
            raise CheckpointingException(problem)
        return out

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> StateDict:
        root = open_root(checkpoint_dir)
        remote = storage.local_root(root) is None
        # On an object store every chunk read is checked (storage checksums do not reach us).
        manifest = read_manifest(root) if self.verify or self.checksums or remote else None
        # The root group is not needed to find the arrays, but a damaged one means a damaged
        # checkpoint: refuse it rather than load around it (one small read per load).
        root_keys(root, manifest, self.verify)
        metas: Dict[str, ArrayMeta] = {}
        ops: List[ChunkRead] = []
        commits: List[Callable[[], None]] = []
        if remote:
            # One GET per array's zarr.json: issue them together instead of one after another.
            keys = sorted(
                {sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)}
            )
            found = self.engines.raw.parallel(
                lambda k: (k, self._meta(root, k, manifest)), keys, OBJECT_STORE_REQUESTS
            )
            metas.update(found)

        def prepare(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                raise CheckpointingException(
                    f"ShardedObject {sh.unique_key!r}: "
                    f"the zarr strategy leaves objects to the common strategy"
                )
            if not isinstance(sh, ShardedTensor):
                return sh
            if sh.key not in metas:
                metas[sh.key] = self._meta(root, sh.key, manifest)
            meta = metas[sh.key]
            if tuple(sh.global_shape) != meta.shape:
                if not sh.allow_shape_mismatch or len(sh.global_shape) != len(meta.shape):
                    # A damaged zarr.json (one the manifest contradicts) is the cause to report.
                    raise CheckpointingException(
                        manifest_disagreement(meta, manifest)
                        or (
                            f"ShardedTensor {sh.key!r}: global shape {list(sh.global_shape)} "
                            f"was requested but "
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
            for offset, size, view in request_boxes(sh, dest):
                ops.extend(plan_reads(meta, offset, size, view))
            return sh

        dict_list_map_inplace(prepare, sharded_state_dict)
        checksums = None
        if manifest is not None:
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

    def remove_sharded_tensors(self, checkpoint_dir: storage.Location, key_prefix: str) -> None:
        """Drop every array whose key starts with ``key_prefix``: the root group's listing and
        the manifest first (atomically rewritten), then the array folders."""
        root = open_root(checkpoint_dir)
        keys = list_array_keys(root)
        gone = [k for k in keys if k.startswith(key_prefix)]
        if not gone:
            return
        kept = [k for k in keys if k not in gone]
        records = write_root_group(root, kept) if root_keys(root) is not None else []
        manifest = read_manifest(root)
        if manifest is not None:
            dropped = tuple(f"{k}/" for k in gone)
            for name in [n for n in manifest.files if n.startswith(dropped)]:
                manifest.drop(name)
            for key in gone:
                manifest.keys.pop(key, None)
                manifest.arrays.pop(key, None)
            for path, size, crc, key, _ in records:
                manifest.set_whole(path, size, crc, key)
            write_manifest(root, manifest)
        local = storage.local_root(root)
        for key in gone:
            if local is None:
                for name in root.list(f"{key}/"):
                    root.delete(name)
            else:
                shutil.rmtree(self._meta(root, key).path)
