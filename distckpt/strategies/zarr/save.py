"""The ``zarr`` save strategy: every rank writes its own whole chunks, rank 0 the shared ones and
the manifest.

See the package docstring for the phases. ``metadata.json`` is the caller's (serialization
commits the checkpoint); this module writes the arrays, the root group and the integrity
manifest.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt import dist, storage
from distckpt.budget import host_memory_budget
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import build_manifest, dtype_name, write_manifest
from distckpt.io import staging
from distckpt.io.staging_buffers import StagingBuffers
from distckpt.mapping import ShardedStateDict
from distckpt.strategies.async_utils import AsyncRequest
from distckpt.strategies.base import AsyncSaveShardedStrategy
from distckpt.strategies.zarr.engines import Engines
from distckpt.strategies.zarr.jobs import ChunkWrite
from distckpt.strategies.zarr.layout import (
    FileRecord,
    Root,
    array_meta_at,
    block_entries,
    check_key_paths,
    create_array,
    open_root,
    write_root_group,
)
from distckpt.strategies.zarr.meta import (
    BACKEND,
    FORMAT_VERSION,
    ArrayMeta,
    Shape,
    array_metadata_json,
)
from distckpt.strategies.zarr.plan import (
    DEFAULT_MIN_FLAT_CHUNK_BYTES,
    DEFER,
    Fragment,
    KeyDecl,
    Piece,
    assemble,
    choose_chunk_shape,
    local_plan,
    merge_decls,
    split_into_chunks,
)


@dataclass
class _SavePlan:
    """One rank's part of a save, between its phases (see ZarrSaveShardedStrategy)."""

    root: Root
    metas: Dict[str, ArrayMeta]
    writes: List[ChunkWrite]
    shared: List[Fragment]
    records: List[FileRecord]
    exc: Optional[BaseException] = None
    staged: Optional[Any] = None  # the StagedBatch holding the staged bytes (async save)
    staging: Optional[Any] = None  # this save's StagingBuffers over the process-wide pool (async save)
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
        self.engines = Engines(io_engine, thread_count, fsync)
        self.compression = compression
        self.min_flat_chunk_bytes = min_flat_chunk_bytes

    @property
    def staging_pool(self) -> staging.StagingPool:
        """Where async saves take their staging buffers: the process-wide pool."""
        return staging.pool()

    _staging = staging_pool  # its name before the pool was process-wide

    def _create_arrays(
        self, root: Root, decls: Dict[str, KeyDecl]
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
                metas[key] = array_meta_at(root, key, md)
        if rank == 0:
            records += write_root_group(root, decls)
        return metas, records

    def prepare(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location, stage: bool = False
    ) -> _SavePlan:
        """Plan and create the arrays; collective. A planning error raises on every rank; a
        later local error is kept in the plan and raised everywhere by ``finalize``."""
        root = open_root(checkpoint_dir)
        exc: Optional[BaseException] = None
        decls: Optional[Dict[str, KeyDecl]] = None
        pieces: List[Piece] = []
        try:
            pieces, decls = local_plan(sharded_state_dict, DEFER if stage else None)
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
        if stage:
            plan.staging = StagingBuffers(staging.pool())
        try:
            merged = merge_decls(gathered)
            check_key_paths(merged)
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
                plan.writes, plan.shared = split_into_chunks(pieces, plan.metas)
            except Exception as e:  # noqa: BLE001
                plan.exc = e
        return plan

    def stage_waves(self, plan: _SavePlan, budget: int) -> None:
        """The blocking part of an async save: copy the chunk writes into staging buffers in
        waves of at most ``budget`` bytes, write every wave but the last now, and leave the last
        one (staged) to :meth:`write`. A failure is kept in the plan (raised by ``write``)."""
        buffers = plan.staging
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
        buffers.reset_peak()
        try:
            for i, wave in enumerate(waves):
                if plan.exc is not None:
                    break
                needed: Dict[Any, int] = {}
                for w in wave:
                    if not w.owned:
                        key = buffers.key_of(w.data)
                        needed[key] = needed.get(key, 0) + 1
                buffers.keep_only(needed)
                for w in wave:
                    if not w.owned:
                        w.data, w.owned = buffers.acquire(w.data), True
                staged = buffers.seal()
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
        buffers.seal().release()  # what this save staged and did not seal (another save's stay out)

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

        def finish(payloads: List[Tuple[List[FileRecord], List[Fragment]]]) -> None:
            by_chunk: Dict[Tuple[str, Shape], List[Fragment]] = {}
            for _, frags in payloads:
                for f in frags:
                    by_chunk.setdefault((f.key, f.index), []).append(f)
            records = [r for rank_records, _ in payloads for r in rank_records]
            records += self.engines.write(
                [
                    ChunkWrite(metas[k], i, assemble(metas[k], i, fs))
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
                arrays={k: m.description for k, m in metas.items() if m.description is not None},
            )
            write_manifest(root, manifest)

        payload = None if exc is not None else (plan.records, plan.shared)
        dist.gather_and_decide("zarr write", exc, payload, finish)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> None:
        plan = self.prepare(sharded_state_dict, checkpoint_dir)
        exc: Optional[BaseException] = None
        try:
            self.write(plan)
        except Exception as e:  # noqa: BLE001 - shared with every rank in finalize
            exc = e
        self.finalize(plan, exc)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location):
        """Plan, create the arrays and stage the local bytes now (collective); return an
        AsyncRequest whose background part writes the chunks and whose finalization (every
        rank) writes the shared chunks and the manifest."""
        plan = self.prepare(sharded_state_dict, checkpoint_dir, stage=True)
        self.stage_waves(plan, host_memory_budget())
        return AsyncRequest(self.write, (plan,), [lambda: self.finalize(plan, None)])
