"""The ``torch_dist`` save strategy: plan, write, then commit ``.metadata`` and the manifest.

Each rank writes its main replicas into ``thread_count`` files in parallel (:mod:`.plan`,
:mod:`.write`), then the records of where every item landed are gathered to rank 0, which writes
``.metadata``, the sidecar index and the integrity manifest (``finalize``). A save of the same
structure as the last one reuses its ``.metadata`` and sidecar with the new ids and CRC32Cs.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from distckpt import dist, storage, timings
from distckpt.budget import host_memory_budget
from distckpt.checksum import crc32c
from distckpt.core import atomic_write_bytes
from distckpt.dict_utils import nested_values
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_write import IndexTemplate
from distckpt.formats.manifest import Manifest, build_manifest, write_manifest
from distckpt.formats.metadata_pickle import respell
from distckpt.io import staging
from distckpt.io.device_io import is_plain
from distckpt.io.staging_buffers import StagingBuffers
from distckpt.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from distckpt.strategies.async_utils import AsyncRequest
from distckpt.strategies.base import AsyncSaveShardedStrategy
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, Resolved, metadata_bytes_and_head
from distckpt.strategies.torch_dist.plan import (
    DEFAULT_FILES_PER_RANK,
    SavePlan,
    checked_thread_count,
    plan_save,
    plan_waves,
    writer_threads,
)
from distckpt.strategies.torch_dist.records import (
    LAST_SAVE,
    GatheredRecords,
    LastSave,
    RecordTable,
    patched_sidecar_index,
    sidecar_index,
)
from distckpt.strategies.torch_dist.write import write_plan, write_waves

# What rank 0 gathers per rank: ``(RecordTable, {file name: size})``.
RankTable = Tuple[RecordTable, Dict[str, int]]


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas in DCP format (``torch_dist``, version 1).

    Args:
        thread_count: files per rank (Megatron-Core's meaning) and, when given, the threads
            that write them. Default (None): 2 files, written on a file system by one thread per
            core this rank may count on (:func:`distckpt.budget.cores_per_rank`), at most 8,
            which share the files' bytes (:mod:`.spans`): a GPU host's 8-16 cores per rank all
            write, and the files do not depend on the host. On 2 cores shared by 2 ranks that is
            one writer per rank (a second slowed page-cache writes by up to 16%,
            docs/performance-history.md). A number given here is used as it is: more threads
            than cores pay off where writes wait on the storage, not on the CPU.
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
        write_threads: the threads that write this rank's files, whatever their number (they
            share the files' bytes); None: as ``thread_count`` says above.
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
        write_threads: Optional[int] = None,
    ):
        super().__init__(backend, version)
        self.write_index = write_index
        self._write_threads = checked_thread_count(write_threads, 0)[0] if write_threads is not None else None
        self.stage_cpu_tensors = stage_cpu_tensors
        self._prestaged: Optional[StagingBuffers] = None  # prestage's copies, for async_save
        self.thread_count, self._threads_given = checked_thread_count(thread_count, DEFAULT_FILES_PER_RANK)
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

    @property
    def staging_pool(self) -> staging.StagingPool:
        """Where async saves take their staging buffers: the process-wide pool, shared by every
        strategy object (:mod:`distckpt.io.staging`)."""
        return staging.pool()

    _staging = staging_pool  # its name before the pool was process-wide

    def prepare(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location, stage: bool = False
    ) -> SavePlan:
        """Collect this rank's main replicas into files; ``stage``: their bytes will be copied into
        staging buffers (an async save). Nothing is copied yet: that happens wave by wave."""
        buffers = None
        if stage:  # this save's view of the process-wide pool (with prestage's copies, if any)
            buffers, self._prestaged = self._prestaged or StagingBuffers(staging.pool()), None
        return plan_save(
            sharded_state_dict,
            storage.resolve(checkpoint_dir),
            dist.get_rank(),
            self.thread_count,
            self.separation_hint,
            self.stage_cpu_tensors,
            buffers,
        )

    def writer_threads(self, checkpoint_dir: Optional[storage.Location] = None) -> int:
        """Threads that write this rank's ``thread_count`` files: ``write_threads`` if given, else
        :func:`.plan.writer_threads`."""
        if self._write_threads is not None:
            return self._write_threads
        return writer_threads(self.thread_count, self._threads_given, checkpoint_dir)

    def _plan_and_write(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location
    ) -> Tuple[Optional[SavePlan], Optional[BaseException]]:
        """Plan and write this rank's files; a failure is returned, to be shared in finalize."""
        timings.begin("planning")
        try:
            plan = self.prepare(sharded_state_dict, checkpoint_dir)
            timings.begin("writing")
            return write_plan(plan, self.writer_threads(plan.checkpoint_dir)), None
        except Exception as e:  # noqa: BLE001 - shared with every rank in finalize
            return None, e

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> None:
        plan, exc = self._plan_and_write(sharded_state_dict, checkpoint_dir)
        timings.begin("commit")
        self.finalize(plan, storage.resolve(checkpoint_dir), exc)

    def save_and_commit(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: storage.Location,
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
            self.finalize(plan, storage.resolve(checkpoint_dir), exc)
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
            if on_cuda and is_plain(sh.data) and sh.data.numel():
                sources.append(sh.data.detach())
        if not sources or staged > host_memory_budget():
            return False  # nothing to copy, or the save stages in waves: prestaging would hold more
        self.discard_prestaged()
        buffers = StagingBuffers(staging.pool())
        started = False
        try:
            for t in sources:
                # Never waits: with another save's buffers still out, the rest is copied later.
                if not buffers.prestage(t, wait=False):
                    break
                started = True
        except BaseException:
            buffers.discard_unsealed()
            raise
        self._prestaged = buffers if started else None
        return started

    def discard_prestaged(self) -> None:
        buffers, self._prestaged = self._prestaged, None
        if buffers is not None:
            buffers.discard_unsealed()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location):
        """Stage the local bytes now; return an AsyncRequest that writes them in the background
        and, at finalize (every rank, main thread), writes ``.metadata`` and the manifest.

        With a host memory budget (:mod:`distckpt.budget`) smaller than this rank's staged bytes,
        the blocking part stages and writes waves of at most the budget, reusing the same
        buffers; only the last wave is left to the background."""
        timings.begin("planning")
        plan = self.prepare(sharded_state_dict, checkpoint_dir, stage=True)
        timings.begin("staging")
        budget = host_memory_budget()
        if plan.staging is not None:
            plan.staging.reset_peak()
        threads = self.writer_threads(plan.checkpoint_dir)
        write_waves(plan, plan_waves(plan.jobs, budget), threads)
        return AsyncRequest(
            write_plan, (plan, threads), [lambda: self.finalize(plan, storage.resolve(checkpoint_dir), None)]
        )

    def finalize(
        self, plan: Optional[SavePlan], checkpoint_dir: Resolved, exc: Optional[BaseException]
    ) -> None:
        """Gather every rank's records to rank 0, which writes ``.metadata`` and the manifest.

        Collective; raises the same error on every rank if any rank failed to write.
        """
        payload = None if exc is not None else self._payload(plan)
        commit, stage = getattr(self, "_commit", None), "torch_dist write"
        if commit is None:

            def decide(payloads):
                return self._commit_records(payloads, checkpoint_dir)

        else:
            payload, stage = (payload, commit[0]), "torch_dist write and commit"

            def decide(payloads):
                whole_files = {name: v for p in payloads for name, v in p[1].items()}
                reused = self._commit_records([p[0] for p in payloads], checkpoint_dir, whole_files)
                commit[1]()
                return reused

        self.last_save_reused_metadata = bool(dist.gather_and_decide(stage, exc, payload, decide))
        if self.cached_metadata:
            self._local_structure = plan.structure()

    def _payload(self, plan: SavePlan) -> Tuple:
        """What this rank sends rank 0: only its CRC32Cs (``"same"``) when it wrote exactly what
        it wrote last time under ``cached_metadata``, else its whole record table (``"full"``)."""
        if self.cached_metadata and plan.structure() == self._local_structure:
            return ("same", np.array([r.crc32c for r in plan.records], dtype=np.int64), plan.table_crcs)
        return ("full", RecordTable.of(plan.decls, plan.records), plan.file_sizes, plan.table_crcs)

    def _commit_records(
        self, payloads: List[Tuple], checkpoint_dir: Resolved, whole_files: Optional[Dict] = None
    ) -> bool:
        """Rank 0: write ``.metadata``, the sidecar and the manifest of every rank's payload;
        returns whether the last save's ``.metadata`` was reused."""
        per_rank, reused, tables = self._rank_tables(payloads)
        records = GatheredRecords.of([t for t, _ in per_rank])
        save_id, checkpoint_id = str(uuid.uuid4()), str(checkpoint_dir)
        md_bytes, head, index_bytes, again = self._metadata_file(records, checkpoint_id, save_id, reused)
        reused = reused or again
        template = None
        if self.write_index and index_bytes is None:
            index_bytes, template = self._sidecar(records, len(md_bytes), reused)
        if index_bytes is not None:
            storage.write_bytes(checkpoint_dir, INDEX_FNAME, index_bytes)
        root = storage.local_root(checkpoint_dir)
        if root is None:
            checkpoint_dir.put(METADATA_FNAME, md_bytes)
        else:
            atomic_write_bytes(root / METADATA_FNAME, md_bytes)
        manifest = self._manifest(records, per_rank, tables, md_bytes, index_bytes, save_id)
        for name, (size, crc) in (whole_files or {}).items():
            manifest.set_whole(name, size, crc)
        write_manifest(checkpoint_dir, manifest)
        if self.cached_metadata:
            self._global_cache = per_rank
        else:
            LAST_SAVE.remember(records, md_bytes, head, checkpoint_id, save_id, template, again)
        return reused

    def _rank_tables(self, payloads: List[Tuple]) -> Tuple[List[RankTable], bool, Dict[str, int]]:
        """Every rank's record table (from the cache for ranks that sent only CRC32Cs), whether
        all of them came from the cache, and every block table's CRC32C."""
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
        return per_rank, reused, tables

    def _metadata_file(
        self, records: GatheredRecords, checkpoint_id: str, save_id: str, reused: bool
    ) -> Tuple[Any, int, Optional[bytes], bool]:
        """``.metadata`` of ``records`` (its head's length; a sidecar when the last save gave
        one; whether :data:`LAST_SAVE` gave them): respelled from the cached one when every rank
        sent the same structure, from the last save rank 0 committed when the records match, else
        built."""
        md_bytes, head, index_bytes = None, None, None
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
        if head is None:
            md_bytes, head = metadata_bytes_and_head(records, checkpoint_id, save_id)
            if self.cached_metadata:
                md_bytes = bytearray(md_bytes)
        self._metadata_cache = (md_bytes, head, checkpoint_id, save_id) if self.cached_metadata else None
        return md_bytes, head, index_bytes, again is not None

    def _sidecar(
        self, records: GatheredRecords, md_length: int, reused: bool
    ) -> Tuple[Optional[bytes], Optional[IndexTemplate]]:
        """The sidecar index of ``records`` and, when :data:`LAST_SAVE` is to remember it, its
        template: the last sidecar with the new CRC32Cs patched in when the items are the same."""
        index_bytes, template = None, None
        if reused and self._index_template is not None:
            index_bytes = patched_sidecar_index(self._index_template, records, md_length)
        remember = not self.cached_metadata and len(records.rows) <= LastSave.MAX_RECORDS
        if index_bytes is None and self.cached_metadata:
            index_bytes, self._index_template = sidecar_index(records, md_length, template=True)
        elif index_bytes is None and remember:
            index_bytes, template = sidecar_index(records, md_length, template=True)
        elif index_bytes is None:
            index_bytes = sidecar_index(records, md_length)
        return index_bytes, template

    @staticmethod
    def _manifest(
        records: GatheredRecords,
        per_rank: List[RankTable],
        tables: Dict[str, int],
        md_bytes: Any,
        index_bytes: Optional[bytes],
        save_id: str,
    ) -> Manifest:
        """The integrity manifest: every record's range and CRC32C, the block tables,
        ``.metadata`` and the sidecar, every file's size, and the writer's key declarations."""
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
        return build_manifest(save_id, "torch_dist", ranges, sizes, keys, boxes)
