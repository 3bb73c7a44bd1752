"""``distckpt.dcp.StorageWriter``: PyTorch DCP's ``StorageWriter`` interface over distckpt's save path.

``dcp.save(state_dict, storage_writer=StorageWriter(location))`` keeps DCP's planning (its
default planner or any other, DTensor and FSDP2 state dicts, ``Stateful`` objects) and puts
distckpt underneath: the bytes go through the writer threads of distckpt's ``torch_dist`` save
(:func:`~distckpt.strategies.torch_dist.write.write_plan`: files shared by the threads,
CRC32C computed on the way, per-block CRC tables), and the checkpoint is committed by
distckpt's commit protocol (:mod:`distckpt.commit`).

The files are DCP's format, which is distckpt's ``torch_dist`` format::

    __<rank>_<b>.distcp        rank's data files (``thread_count`` per rank), each item a
                               torch.save archive (tensors) or DCP's pickled bytes (values)
    __<rank>_<b>.distcp.crc    block CRC32C tables of the files with large tensor items
    .metadata                  DCP's pickled Metadata (what DCP's FileSystemWriter writes)
    common.pt                  torch.save({}): no common state (DCP keeps values as items)
    .distckpt_manifest.json    size and CRC32C of every file and every item
    metadata.json              the commit marker (torch_dist, version 1), written last

Who calls what (DCP's sequence, DCP's collectives; this writer runs none of its own):

1. every rank: ``reset(checkpoint_id)`` when ``checkpoint_id=`` is given, ``storage_meta()``,
   ``set_up_storage_writer(is_coordinator, rank=...)``, ``prepare_local_plan`` (the location is
   resolved here, so a bad one fails the planning step on every rank);
2. coordinator: ``prepare_global_plan`` gives each rank's plan its file prefix ``__<rank>_``,
   then begins the save with the location's commit protocol: leftovers of interrupted saves
   removed, a staging directory created beside the target (local and shared file systems), or
   an object store's prefix checked (a committed checkpoint is refused unless ``overwrite``).
   The staging (plain data) is posted in the process group's key-value store under the
   save's name (the target, or ``save_name``); DCP scatters the plans after this step, so every
   rank finds it there, and the next save's post comes after every rank finished this one;
3. every rank: ``write_data`` reads the staging from the store (the coordinator has it),
   resolves its items through the planner and writes its files with distckpt's writer threads;
   each ``WriteResult`` carries the item's place and CRC32C (and, on a file's first item, the
   file's size and block table);
4. coordinator: ``finish(metadata, results)`` writes ``.metadata``, ``common.pt`` and the
   manifest into the staging directory and commits (``metadata.json`` then the atomic swap; a
   conditional put on object stores). A failure there aborts the staging.

A failure on any rank (planning, writing, the commit) is gathered by DCP and raised on every
rank as the same ``CheckpointException``, holding each failing rank's CheckpointingException
(key, file and rank named). The staging of a save that failed before ``finish`` is removed by
the coordinator at its next save (and by any later save to the same target).

Why the store and not ``SavePlan.storage_data``: DCP's plan caching
(``DefaultSavePlanner(enable_plan_caching=True)``) hands each rank its cached plan of an earlier
save, storage data included, so only what is the same in every save may ride on the plan.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import StorageWriter as DCPStorageWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan as DCPSavePlan
from torch.distributed.checkpoint.planner import SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from distckpt import commit, dist, storage
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingConfig, CheckpointingException
from distckpt.dcp import locations
from distckpt.dcp.stager import PoolStager
from distckpt.formats import blockcrc
from distckpt.formats.manifest import build_manifest, dtype_name, write_manifest
from distckpt.process_group import default_store
from distckpt.strategies.common import COMMON_STATE_FNAME
from distckpt.strategies.torch_dist.metadata import DATA_SUFFIX, METADATA_FNAME
from distckpt.strategies.torch_dist.plan import (
    DEFAULT_FILES_PER_RANK,
    SavePlan,
    WriteItem,
    buckets,
    checked_thread_count,
    tensor_write_item,
    writer_threads,
)
from distckpt.strategies.torch_dist.write import write_plan

__all__ = ["ItemWritten", "RankFiles", "StorageWriter"]

CONFIG = CheckpointingConfig("torch_dist", 1, "torch", 1)
# The store key under which the coordinator posts a save's staging (one per target).
STAGING_KEY = "distckpt.dcp.staging:"

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class RankFiles:
    """``SavePlan.storage_data`` of one rank: its data files are ``<prefix><b>.distcp``."""

    prefix: str


@dataclass(frozen=True)
class ItemWritten:
    """``WriteResult.storage_data``: where one item landed and its CRC32C; ``chunk`` the tensor
    chunk it holds (offset, size), None for a byte item. A file's first item also carries the
    file's size and its block table (name, size, CRC32C) when it has one."""

    relative_path: str
    offset: int
    length: int
    crc32c: int
    chunk: Optional[Tuple[Shape, Shape]] = None
    file_size: Optional[int] = None
    table: Optional[Tuple[str, int, int]] = None


class StorageWriter(locations.AtLocation, DCPStorageWriter, PoolStager):
    """A DCP ``StorageWriter`` that saves through distckpt (see the module docstring).

    Args:
        location: a path or a URL (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``);
            ``checkpoint_id=`` of ``dcp.save`` replaces it.
        storage_options: options of an object store URL, as for ``distckpt.save``
            (docs/storage.md); the environment (``AWS_ENDPOINT_URL`` ...) is read too.
        overwrite: replace a committed checkpoint at the location: None (default) replaces a
            local one atomically and refuses one on an object store, False refuses everywhere,
            True replaces.
        thread_count: data files per rank (default 2, as ``distckpt.save``).
        write_threads: threads that write a rank's files (they share the files' bytes); default
            one per core this rank may count on, at most 8, as ``distckpt.save``.
        save_name: the name every rank knows this save by: the coordinator posts the save's
            staging under it. Default: the location (a path or URL, the same on every rank).
            Give one when the location is a ``Store`` whose URL differs between ranks (the
            tiered manager's node-local tiers pass their remote URL).

    It is also its own ``AsyncStager`` (:class:`~distckpt.dcp.stager.PoolStager`): with
    ``dcp.async_save`` the state is copied into distckpt's reused staging buffers.
    """

    def __init__(
        self,
        location: locations.Location,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        overwrite: Optional[bool] = None,
        thread_count: Optional[int] = None,
        write_threads: Optional[int] = None,
        save_name: Optional[str] = None,
    ):
        super().__init__()
        self.save_name = save_name
        self.location = location
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.thread_count, self._threads_given = checked_thread_count(thread_count, DEFAULT_FILES_PER_RANK)
        self.write_threads = checked_thread_count(write_threads, 0)[0] if write_threads is not None else None
        self.save_id = commit.new_save_id()
        self.rank = 0
        self.is_coordinator = False
        self._target: Any = None
        self._protocol: Any = None
        self._staging: Optional[commit.Staging] = None

    # ----------------------------------------------------------------- every rank

    def reset(self, checkpoint_id: Optional[locations.Location] = None) -> None:
        """A new save begins (``checkpoint_id``: its location, replacing the constructor's)."""
        if checkpoint_id:
            self.location = checkpoint_id
        self.save_id = commit.new_save_id()
        self._staging = None

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.location), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", dist.get_rank())
        if not kwargs.get("use_collectives", True):
            raise CheckpointingException(
                f"{self.location}: distckpt.dcp.StorageWriter needs DCP's collectives "
                f"(use_collectives=True): the coordinator commits every rank's files (rank {self.rank})"
            )

    def prepare_local_plan(self, plan: DCPSavePlan) -> DCPSavePlan:
        self._target = commit.resolve_target(locations.resolve(self.location, self.storage_options))
        self._protocol = commit.protocol_for(self._target)
        return plan

    def write_data(self, plan: DCPSavePlan, planner: SavePlanner) -> Future:
        """Write this rank's items into its files; the future holds their WriteResults."""
        where = storage.join(self._target, "") if self._target is not None else str(self.location)
        try:
            staging = self._staging if self.is_coordinator else self._announced()
            location = self._protocol.where(staging)
            items, indices = self._items(plan, planner)
            # An overwrite on an object store names the data files with its save's token (they
            # are final where they land: .metadata records them; see distckpt.storage.record).
            prefix = (getattr(location, "file_token", None) or "") + plan.storage_data.prefix
            jobs = [
                (f"{prefix}{b}{DATA_SUFFIX}", bucket)
                for b, bucket in enumerate(buckets(items, self.thread_count))
            ]
            written = write_plan(SavePlan(location, self.rank, jobs, {}), self._threads(location))
            results = _results(written, indices)
        except CheckpointingException:
            raise
        except Exception as e:  # noqa: BLE001 - DCP gathers it to every rank
            raise CheckpointingException(
                f"{where}: rank {self.rank} could not write its files: {type(e).__name__}: {e}"
            ) from e
        future: Future = Future()
        future.set_result(results)
        return future

    def _threads(self, location: Any) -> int:
        if self.write_threads is not None:
            return self.write_threads
        return writer_threads(self.thread_count, self._threads_given, location)

    def _items(self, plan: DCPSavePlan, planner: SavePlanner) -> Tuple[List[WriteItem], Dict[Tuple, Any]]:
        """distckpt's write items of the plan's items (tensors not copied yet), and each one's
        DCP index by (key, chunk offset)."""
        items: List[WriteItem] = []
        indices: Dict[Tuple, Any] = {}
        for wi in plan.items:
            fqn = wi.index.fqn
            if wi.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(wi)
                payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                items.append(WriteItem(fqn, (), (), payload, len(payload)))
                indices[(fqn, ())] = wi.index
                continue
            chunk = wi.tensor_data.chunk
            offset, size = tuple(chunk.offsets), tuple(chunk.sizes)
            tensor = planner.resolve_data(wi)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != size:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise CheckpointingException(
                    f"key {fqn!r}: the planner resolved {got} for its chunk at {list(offset)} of size "
                    f"{list(size)} (rank {self.rank})"
                )
            items.append(tensor_write_item(fqn, offset, size, tensor, wi.tensor_data.properties.dtype, False))
            indices[(fqn, offset)] = wi.index
        return items, indices

    def _announced(self) -> commit.Staging:
        """The staging the coordinator posted for this save (see the module docstring)."""
        store = default_store()
        key = self._staging_key()
        if store is None:
            raise CheckpointingException(
                f"{self._target}: rank {self.rank} cannot learn where this save writes: the process "
                f"group has no key-value store"
            )
        try:
            store.wait([key], timedelta(seconds=dist.collective_timeout()))
            return pickle.loads(store.get(key))
        except Exception as e:  # noqa: BLE001 - a timeout, or the store went away
            raise CheckpointingException(
                f"{self._target}: rank {self.rank} did not find the staging of this save in the store "
                f"(the coordinator's step failed?): {e}"
            ) from e

    def _staging_key(self) -> str:
        """The store key of this save's staging: the same on every rank, one per target."""
        return STAGING_KEY + (self.save_name if self.save_name is not None else str(self._target))

    # ----------------------------------------------------------------- the coordinator

    def prepare_global_plan(self, plans: List[DCPSavePlan]) -> List[DCPSavePlan]:
        """Give each rank its file prefix, then begin the save (coordinator)."""
        target, protocol = self._target, self._protocol
        root = storage.local_root(target)
        if root is not None and target.exists() and not target.is_dir():
            raise CheckpointingException(f"checkpoint path {target} exists and is not a directory")
        _abort_ended_saves()
        protocol.cleanup_leftovers(target)
        # A fresh id per save, also when DCP reuses this writer without reset() (no checkpoint_id).
        self.save_id = commit.new_save_id()
        staging = protocol.begin(target, self.save_id, self.overwrite)
        _PENDING[id(staging)] = (protocol, staging, threading.current_thread())
        self._staging = staging
        store = default_store()
        if store is not None and len(plans) > 1:
            store.set(self._staging_key(), pickle.dumps(staging))
        return [replace(p, storage_data=RankFiles(f"__{i}_")) for i, p in enumerate(plans)]

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Write ``.metadata``, ``common.pt`` and the manifest, then commit (coordinator)."""
        staging, protocol = self._staging, self._protocol
        try:
            location = protocol.where(staging)
            ranges, chunks, sizes = [], [], {}
            storage_data = {}
            for wr in (wr for rank_results in results for wr in rank_results):
                item: ItemWritten = wr.storage_data
                storage_data[wr.index] = _StorageInfo(item.relative_path, item.offset, item.length)
                ranges.append((item.relative_path, item.offset, item.length, item.crc32c, wr.index.fqn))
                chunks.append(item.chunk)
                if item.file_size is not None:
                    sizes[item.relative_path] = item.file_size
                if item.table is not None:
                    name, size, crc = item.table
                    ranges.append((name, 0, size, crc, name))
                    chunks.append(None)
                    sizes[name] = size
            metadata.storage_data = storage_data
            metadata.storage_meta = StorageMeta(checkpoint_id=str(self._target), save_id=staging.save_id)
            metadata.version = CURRENT_DCP_VERSION
            buffer = io.BytesIO()
            torch.save({}, buffer)
            for name, data in (
                (METADATA_FNAME, pickle.dumps(metadata)),
                (COMMON_STATE_FNAME, buffer.getvalue()),
            ):
                storage.write_bytes(location, name, data)
                ranges.append((name, 0, len(data), crc32c(data), name))
                chunks.append(None)
                sizes[name] = len(data)
            keys = {
                fqn: (dtype_name(meta.properties.dtype), tuple(meta.size))
                for fqn, meta in metadata.state_dict_metadata.items()
                if isinstance(meta, TensorStorageMetadata)
            }
            write_manifest(
                location, build_manifest(staging.save_id, CONFIG.sharded_backend, ranges, sizes, keys, chunks)
            )
            protocol.commit(staging, CONFIG)
        except BaseException as e:
            protocol.abort(staging)
            if isinstance(e, (CheckpointingException, KeyboardInterrupt)):
                raise
            raise CheckpointingException(
                f"{self._target}: committing the checkpoint failed (rank {self.rank}): "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            _forget(staging)
            store = default_store()
            if store is not None:
                try:
                    store.delete_key(self._staging_key())
                except Exception:  # noqa: BLE001 - a store without deletes keeps one small key
                    pass
        # Committed: the protocol's follow-up (an object store's publication of an overwrite and
        # its clean-up; best effort, it never fails the committed save).
        protocol.after_commit(staging)


def _results(plan: SavePlan, indices: Dict[Tuple, Any]) -> List[WriteResult]:
    """The WriteResults of a written plan: every record under its DCP index (``indices``)."""
    out = []
    seen = set()
    for rec in plan.records:
        index = indices[(rec.fqn, tuple(rec.chunk_offset))]
        name = rec.relative_path
        size, table = None, None
        if name not in seen:  # the file's first item carries the file's size and block table
            seen.add(name)
            size = plan.file_sizes[name]
            crc = plan.table_crcs.get(blockcrc.table_name(name))
            if crc is not None:
                table = (blockcrc.table_name(name), plan.file_sizes[blockcrc.table_name(name)], crc)
        chunk = None if index.offset is None else (tuple(rec.chunk_offset), tuple(rec.chunk_size))
        item = ItemWritten(name, rec.offset, rec.length, rec.crc32c, chunk, size, table)
        out.append(WriteResult(index, rec.length, item))
    return out


# Stagings begun by this process and not yet committed or aborted, by id: (protocol, staging,
# thread). Saves on several threads (``dcp.async_save``) register and forget theirs concurrently:
# each step is one dict operation, atomic under the GIL.
_PENDING: Dict[int, Tuple[Any, commit.Staging, threading.Thread]] = {}


def _forget(staging: commit.Staging) -> None:
    _PENDING.pop(id(staging), None)


def _abort_ended_saves() -> None:
    """Abort the stagings of this process's earlier saves that ended without ``finish`` (a rank
    failed to write): their thread is this one (saves on one thread follow each other) or has
    ended (``dcp.async_save`` runs each save on a thread of its own). A save still running on
    another thread keeps its staging."""
    here = threading.current_thread()
    for key, (protocol, staging, thread) in list(_PENDING.items()):
        # Whoever takes it out of the registry aborts it (once).
        if (thread is here or not thread.is_alive()) and _PENDING.pop(key, None) is not None:
            protocol.abort(staging)
