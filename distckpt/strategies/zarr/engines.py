"""Which engine does each array's I/O: the raw one where the chunks are plain bytes, else tensorstore.

On an object store only the raw engine runs (uncompressed arrays only); on a local file system
``io_engine`` chooses: ``"auto"`` (raw where it can, tensorstore for the rest), ``"raw"`` (an
encoded array is an error) or ``"tensorstore"`` (everything).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from distckpt.core import CheckpointingException
from distckpt.strategies.zarr.jobs import BlockLookup, ChunkRead, ChunkWrite
from distckpt.strategies.zarr.layout import FileRecord
from distckpt.strategies.zarr.meta import ArrayMeta
from distckpt.strategies.zarr.rawio import RawIO
from distckpt.strategies.zarr.tensorstore_io import TensorStoreIO

IO_ENGINES = ("auto", "raw", "tensorstore")


class Engines:
    """Picks, per array, the engine that reads or writes it, and runs each engine's share.

    Args:
        io_engine: one of :data:`IO_ENGINES`.
        thread_count: chunk files each engine handles at the same time.
        fsync: fsync each chunk file the raw engine writes.
    """

    def __init__(self, io_engine: str, thread_count: int, fsync: bool = True):
        if io_engine not in IO_ENGINES:
            raise CheckpointingException(f"unknown zarr io_engine {io_engine!r} (use one of {IO_ENGINES})")
        self.io_engine = io_engine
        self.thread_count = thread_count
        self.raw = RawIO(thread_count, fsync)
        self._ts: Optional[TensorStoreIO] = None

    @property
    def tensorstore(self) -> TensorStoreIO:
        """The tensorstore engine, made (and ``tensorstore`` imported) on first use."""
        if self._ts is None:
            self._ts = TensorStoreIO(concurrency=self.thread_count)
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

    def check_readable(self, meta: ArrayMeta) -> None:
        """Raise what a load of array ``meta`` would before reading a chunk: an engine that
        cannot read it, or (tensorstore) an array it cannot open. ``distckpt verify`` asks this."""
        if self.uses_tensorstore(meta):
            self.tensorstore.check_opens(meta)

    def write(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        ts_jobs = [j for j in jobs if self.uses_tensorstore(j.meta)]
        raw_jobs = [j for j in jobs if not self.uses_tensorstore(j.meta)]
        records = self.tensorstore.write(ts_jobs) if ts_jobs else []
        return records + self.raw.write(raw_jobs)

    def read(
        self,
        ops: Sequence[ChunkRead],
        checksums: Optional[Dict[str, Tuple[int, int]]] = None,
        blocks: Optional[BlockLookup] = None,
    ) -> None:
        ts_ops = [o for o in ops if self.uses_tensorstore(o.meta)]
        raw_ops = [o for o in ops if not self.uses_tensorstore(o.meta)]
        if ts_ops:
            self.tensorstore.read(ts_ops, checksums)
        self.raw.read(raw_ops, checksums, blocks)
