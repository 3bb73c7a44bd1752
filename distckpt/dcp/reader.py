"""``distckpt.dcp.StorageReader``: PyTorch DCP's ``StorageReader`` interface over distckpt's load path.

``dcp.load(state_dict, storage_reader=StorageReader(location))`` keeps DCP's planning (its
default planner resharding into DTensors, FSDP2 state, ``Stateful`` objects) and reads with
distckpt, which treats everything the checkpoint says as untrusted input, exactly as
``distckpt.load`` does:

- ``.metadata`` is unpickled by the restricted unpickler (only DCP's metadata classes), and its
  claims (shapes, chunk boxes, file names, offsets, lengths) are checked before DCP plans
  anything from them; file names resolve inside the checkpoint by the containment rule, and
  (local directories) every record must lie inside its file;
- every byte copied is checked against the integrity manifest's CRC32C as it is read (an item
  read whole against its checksum, part of a large item block by block against its file's block
  table), and each item's own header must agree with the dtype ``.metadata`` claims;
- the pickled non-tensor values (DCP's byte items: ``step``, optimizer ``param_groups``, a
  ``Stateful``'s extra state), which DCP's planner would hand to ``torch.load(weights_only=False)``,
  are unpickled here under distckpt's allowlist (``weights_only=True`` plus
  ``distckpt.add_safe_globals``); the planner gets them re-serialized from the objects so built.
  ``trusted=True`` hands it the stored bytes instead;
- the checkpoint must be committed: ``metadata.json`` present (distckpt's commit marker), or a
  local directory of plain DCP (``.metadata`` and neither ``metadata.json`` nor distckpt's
  files: what DCP's own ``FileSystemWriter`` leaves); a swap an interrupted overwrite left half
  done is finished first, and a checkpoint replaced while it is read is an error.

Reads go through :func:`~distckpt.strategies.torch_dist.read.execute_plan`: ``preadv`` into
place and strided copies out of mappings locally; on object stores concurrent ranged GETs of
only the needed blocks, coalesced.

Who calls what (DCP's sequence and collectives): every rank ``reset(checkpoint_id)`` (with
``checkpoint_id=``), ``read_metadata()`` (each rank reads and checks ``.metadata``),
``set_up_storage_reader``, ``prepare_local_plan``; the coordinator ``prepare_global_plan``; every
rank ``read_data(plan, planner)``. A failure on any rank is raised by DCP on every rank.
"""

from __future__ import annotations

import io
import logging
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import StorageReader as DCPStorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from distckpt import commit, dist, storage
from distckpt.core import CheckpointingException
from distckpt.dcp import locations
from distckpt.dcp_native import checkpoint_config, describe_missing_config
from distckpt.formats.manifest import read_manifest
from distckpt.formats.zip_archive import contiguous_strides
from distckpt.io import device_io
from distckpt.io.copies import CopyOp
from distckpt.io.device_io import is_plain
from distckpt.strategies.common import safe_torch_load
from distckpt.strategies.resharding import ravel
from distckpt.strategies.torch_dist import loadplan
from distckpt.strategies.torch_dist.claims import extent_error, record_name
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, read_metadata_bytes, unpickle_metadata
from distckpt.strategies.torch_dist.plan import DEFAULT_READERS_PER_RANK, checked_thread_count, io_threads
from distckpt.strategies.torch_dist.read import execute_plan, read_item_bytes
from distckpt.strategies.torch_dist.stored import (
    Stored,
    StoredKey,
    check_item,
    check_keys_declared,
    cross_check_manifest,
    index_metadata,
    manifest_checks,
    stored_file_size,
)

logger = logging.getLogger(__name__)

__all__ = ["StorageReader"]


class StorageReader(locations.AtLocation, DCPStorageReader):
    """A DCP ``StorageReader`` that reads through distckpt (see the module docstring).

    Args:
        location: a path or a URL (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``);
            ``checkpoint_id=`` of ``dcp.load`` replaces it.
        storage_options: options of an object store URL, as for ``distckpt.load``.
        trusted: unpickle ``.metadata`` and the non-tensor values without the allowlist (only
            for checkpoints whose origin you trust).
        verify: also read every needed item whole and check ``.metadata`` against the manifest
            (every storage record and key declaration cross-checked).
        checksums: check every byte read against the manifest's CRC32C (default). False skips
            that on local directories; object-store reads are always checked.
        thread_count: files read at once (default: 4 on an object store; on a file system at
            most one per core this rank may count on).
        pinned_slot_bytes: CUDA destinations are filled through two pinned host slots of this
            size per reader thread (0: from pageable memory).
    """

    def __init__(
        self,
        location: locations.Location,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        trusted: bool = False,
        verify: bool = False,
        checksums: bool = True,
        thread_count: Optional[int] = None,
        pinned_slot_bytes: int = device_io.SLOT_BYTES,
    ):
        super().__init__()
        if pinned_slot_bytes < 0:
            raise CheckpointingException(f"pinned_slot_bytes must be >= 0, got {pinned_slot_bytes}")
        self.location = location
        self.storage_options = storage_options
        self.trusted = trusted
        self.verify = verify
        self.checksums = checksums
        self.thread_count, self._threads_given = checked_thread_count(thread_count, DEFAULT_READERS_PER_RANK)
        self.pinned_slot_bytes = pinned_slot_bytes
        self.load_id = str(uuid.uuid4())
        self.bytes_read = 0  # bytes read from storage by this reader (all loads)
        self._reset_state()

    def _reset_state(self) -> None:
        self._resolved: Any = None
        self._metadata: Optional[Metadata] = None
        self._index: Dict[str, Any] = {}
        self._chunks: Dict[str, Dict[Tuple[int, ...], Stored]] = {}
        self._identity: Any = None
        self._declared: Optional[Dict[str, Tuple]] = None  # the manifest's key declarations

    def reset(self, checkpoint_id: Optional[locations.Location] = None) -> None:
        """A new load begins (``checkpoint_id``: its location, replacing the constructor's)."""
        if checkpoint_id:
            self.location = checkpoint_id
        self.load_id = str(uuid.uuid4())
        self._reset_state()

    # ----------------------------------------------------------------- metadata

    def read_metadata(self) -> Metadata:
        """``.metadata`` of a committed checkpoint, unpickled safely and its claims checked
        (every rank). No ``rank`` argument: DCP's per-rank metadata (``use_collectives=False``)
        is not a committed checkpoint."""
        location = locations.resolve(self.location, self.storage_options)
        if storage.local_root(location) is not None:
            commit.recover(location)
        config = checkpoint_config(location)
        if config is None:
            raise CheckpointingException(describe_missing_config(location))
        if config.sharded_backend != "torch_dist":
            raise CheckpointingException(
                f"{storage.join(location, 'metadata.json')}: a {config.sharded_backend} checkpoint, not "
                f"DCP's format (torch_dist); load it with distckpt.load"
            )
        self._identity = commit.tree_identity(location)
        source = storage.join(location, METADATA_FNAME)
        raw = read_metadata_bytes(location, self.trusted, self.verify)
        md = unpickle_metadata(raw, source, self.trusted)
        self._index = index_metadata(md, source)
        if self.verify:
            cross_check_manifest(md, location)
        if storage.local_root(location) is not None or self.verify:
            _check_records_inside_files(md, location, source)
        self._resolved, self._metadata, self._chunks = location, md, {}
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata is None or metadata is not self._metadata:
            raise CheckpointingException(
                f"{self.location}: distckpt.dcp.StorageReader reads only the metadata its own read_metadata "
                f"returned and checked (rank {dist.get_rank()})"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    # ----------------------------------------------------------------- data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Fill the planner's tensors and hand it the values of ``plan`` (every rank)."""
        location, rank = self._resolved, dist.get_rank()
        checksums = self._checksums(location)
        copies = loadplan.LoadPlan()
        targets: List[Tuple[Any, torch.Tensor, torch.Tensor]] = []  # (read item, target, filled)
        values: List[Tuple[Any, Stored]] = []
        for req in plan.items:
            fqn = req.storage_index.fqn
            stored = self._index.get(fqn)
            if req.type == LoadItemType.BYTE_IO:
                if not isinstance(stored, Stored):
                    raise CheckpointingException(
                        f"value {fqn!r} is not in checkpoint {location} (rank {rank})"
                    )
                values.append((req, stored))
                continue
            if not isinstance(stored, StoredKey):
                raise CheckpointingException(f"tensor {fqn!r} is not in checkpoint {location} (rank {rank})")
            chunk = self._chunk(stored, req.storage_index.offset, location)
            lo, size = tuple(req.storage_offsets), tuple(req.lengths)
            if len(lo) != len(chunk.size) or any(
                o < 0 or n < 0 or o + n > c for o, n, c in zip(lo, size, chunk.size)
            ):
                raise CheckpointingException(
                    f"key {fqn!r}: the planner asks for {list(size)} elements at {list(lo)} of its chunk at "
                    f"{list(chunk.offset)} of size {list(chunk.size)} (rank {rank})"
                )
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != size:
                raise CheckpointingException(
                    f"key {fqn!r}: the planner's tensor is {list(target.shape)}, the read is {list(size)} "
                    f"(rank {rank})"
                )
            filled = (
                target if is_plain(target) else torch.empty(size, dtype=target.dtype, device=target.device)
            )
            targets.append((req, target, filled))
            if filled.numel():
                copies.keys[fqn] = stored
                copies.add(
                    chunk, CopyOp(fqn, ravel(lo, chunk.size), size, contiguous_strides(chunk.size), filled)
                )
        if copies.ops:
            self._check_declared(copies, location)
            nbytes, _ = execute_plan(
                copies, location, checksums, self.verify, self.pinned_slot_bytes, self._threads(location)
            )
            self.bytes_read += nbytes
        with torch.no_grad():
            for req, target, filled in targets:
                if filled is not target:
                    target.copy_(filled)
                planner.commit_tensor(req, target)
        for req, stored in values:
            fqn = req.storage_index.fqn
            what = f"value {fqn!r} in {storage.join(location, stored.relative_path)} (rank {rank})"
            raw = read_item_bytes(location, stored, what)
            self.bytes_read += len(raw)
            check_item(raw, stored, checksums, what, fqn)
            planner.load_bytes(req, self._value_bytes(raw, what))
        commit.check_unchanged(location, self._identity)
        future: Future = Future()
        future.set_result(None)
        return future

    def _value_bytes(self, raw: bytes, what: str) -> io.BytesIO:
        """What the planner unpickles for a stored value: the stored bytes when ``trusted``, else
        the value loaded under the allowlist, serialized again (DCP's planner calls
        ``torch.load(weights_only=False)`` on it, which then runs only what the allowlist let
        through)."""
        if self.trusted:
            return io.BytesIO(raw)
        value = safe_torch_load(raw, what=what)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer

    def _chunk(self, stored: StoredKey, offset: Any, location: Any) -> Stored:
        by_offset = self._chunks.get(stored.fqn)
        if by_offset is None:
            by_offset = self._chunks[stored.fqn] = {c.offset: c for c in stored.chunks}
        chunk = by_offset.get(tuple(offset) if offset is not None else ())
        if chunk is None:
            raise CheckpointingException(
                f"{storage.join(location, METADATA_FNAME)}: key {stored.fqn!r} has no chunk at "
                f"{list(offset or ())} (rank {dist.get_rank()})"
            )
        return chunk

    def _threads(self, location: Any) -> int:
        return io_threads(self.thread_count, self._threads_given, location)

    def _checksums(self, location: Any) -> Optional[Dict]:
        """The manifest's checksums by (file, offset), as ``distckpt.load`` applies them; None
        without a manifest (a plain DCP checkpoint) or with checks off (local files only)."""
        if not (self.verify or self.checksums or storage.local_root(location) is None):
            return None
        manifest = read_manifest(location)
        if manifest is None:
            logger.info("%s has no integrity manifest: its reads are checked structurally only", location)
            self._declared = None
            return None
        self._declared = manifest.keys or None
        return manifest_checks(manifest, self.verify)

    def _check_declared(self, copies: loadplan.LoadPlan, location: Any) -> None:
        """Each tensor key read, as ``.metadata`` declares it, against the manifest's keys."""
        if self._declared:
            check_keys_declared(copies.keys.items(), self._declared, location)


def _check_records_inside_files(md: Metadata, location: Any, source: str) -> None:
    """Every storage record lies inside its file, which lies inside the checkpoint: what a load
    allocates from the metadata's claims (DCP's planner for ``dcp_to_torch_save``) is then backed
    by bytes that exist."""
    sizes: Dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = stored_file_size(location, name, source)
            except FileNotFoundError:
                raise CheckpointingException(
                    f"{source}: key {index.fqn!r}: its data file {storage.join(location, name)} is missing"
                ) from None
        if info.offset + info.length > sizes[name]:
            record = record_name(index.fqn, index.offset)
            raise extent_error(location, source, record, name, info.offset, info.length, sizes[name])
