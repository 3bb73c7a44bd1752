"""The tensorstore engine of the ``zarr`` strategy: each chunk read and write a future, all run together.

The zarr strategy hands this engine the arrays its raw POSIX engine cannot handle (compressed,
sharded, big-endian or F-order chunks, Zarr v2 with a compressor) and, with
``io_engine="tensorstore"``, all of them. It sees the same jobs as the raw engine
(:class:`~distckpt.strategies.zarr.jobs.ChunkWrite`, :class:`~distckpt.strategies.zarr.jobs.ChunkRead`):
writes always cover whole chunks, so tensorstore never reads-modifies-writes a chunk that
another rank also writes.

Tensorstore treats a missing chunk as fill value; a checkpoint never lacks a chunk, so reads
first check that every chunk file is there, and writes store chunks even when they equal the
fill value (``store_data_equal_to_fill_value``).

The ``tensorstore`` package itself is imported only when an engine is made: it is an optional
dependency, and heavy.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from distckpt import containment, dist
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.strategies.zarr.jobs import ChunkRead, ChunkWrite
from distckpt.strategies.zarr.layout import FileRecord, chunk_checksums
from distckpt.strategies.zarr.meta import ARRAY_META, ArrayMeta, meta_file


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype with the same bytes as ``dtype`` (ml_dtypes for bfloat16 and float8)."""
    name = str(dtype).replace("torch.", "")
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # optional: only bfloat16 and float8 need it

        return np.dtype(getattr(ml_dtypes, name))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing the bytes of CPU tensor ``t`` (copied only if not contiguous)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().view(numpy_dtype(t.dtype)).reshape(tuple(t.shape))


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` sharing the bytes of ``a``."""
    shape = a.shape  # np.ascontiguousarray turns a 0-d array into a 1-d one
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a.reshape(-1).view(np.uint8)).view(dtype).reshape(shape)


def _box(meta: ArrayMeta, index: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> Tuple[slice, ...]:
    origin = [i * c for i, c in zip(index, meta.chunks)]
    return tuple(slice(o + a, o + b) for o, a, b in zip(origin, lo, hi))


class TensorStoreIO:
    """Chunk reads and writes through tensorstore, issued together and awaited together.

    Args:
        concurrency: tensorstore's file I/O and data copy concurrency limits.
    """

    def __init__(self, concurrency: int = 4):
        import tensorstore as ts  # optional and heavy: imported when an engine is made

        self._ts = ts
        self._context = ts.Context(
            {
                "file_io_concurrency": {"limit": max(1, concurrency)},
                "data_copy_concurrency": {"limit": max(1, concurrency)},
            }
        )

    def _open(self, meta: ArrayMeta, write: bool, opened: Dict[str, Any]) -> Any:
        """Open each array once per batch of jobs (never across batches: a later save into the
        same folder may have replaced the array)."""
        store = opened.get(str(meta.path))
        if store is None:
            spec: Dict[str, Any] = {
                "driver": "zarr3" if meta.zarr_format == 3 else "zarr",
                "kvstore": {"driver": "file", "path": str(meta.path) + "/"},
            }
            if write:
                spec["store_data_equal_to_fill_value"] = True
            try:
                store = self._ts.open(spec, read=True, write=write, open=True, context=self._context).result()
            except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError/RuntimeError alike
                raise CheckpointingException(
                    f"{meta_file(meta)}: key {meta.key!r}: tensorstore cannot open the array "
                    f"(rank {dist.get_rank()}): {e}"
                ) from None
            opened[str(meta.path)] = store
        return store

    def check_opens(self, meta: ArrayMeta) -> None:
        """Open array ``meta`` for reading as a load does, raising what a load would (tensorstore
        parses its ``zarr.json`` itself): what ``distckpt verify`` asks of an encoded array."""
        self._open(meta, False, {})

    def write(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        """Write whole chunks; returns (relative path, size, crc32c, key, block CRC32Cs) of each
        chunk file, read back once written (encoded chunks' bytes exist only in the file; only
        uncompressed ones get block CRC32Cs, parts of the others cannot be read anyway)."""
        pending: List[Tuple[ChunkWrite, Any]] = []
        opened: Dict[str, Any] = {}
        for job in jobs:
            store = self._open(job.meta, True, opened)
            full = tuple(0 for _ in job.index), tuple(job.data.shape)
            box = _box(job.meta, job.index, *full)
            pending.append((job, store[box].write(to_numpy(job.data))))
        for job, fut in pending:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                raise CheckpointingException(
                    f"key {job.meta.key!r}: writing chunk {list(job.index)} of {job.meta.path} failed "
                    f"(rank {dist.get_rank()}): {e}"
                ) from None
        records = []
        for job, _ in pending:
            data = job.meta.chunk_path(job.index).read_bytes()
            crc, blocks = chunk_checksums(data) if job.meta.raw else (crc32c(data), b"")
            records.append((job.meta.chunk_relpath(job.index), len(data), crc, job.meta.key, blocks))
        return records

    def read(self, ops: Sequence[ChunkRead], checksums: Optional[Dict[str, Tuple[int, int]]] = None) -> None:
        """Run the reads; with ``checksums`` (relative path -> (size, crc32c)) verify every
        listed chunk file first."""
        for op in {op.meta.chunk_relpath(op.index): op for op in ops}.values():
            path = op.meta.chunk_path(op.index)
            where = f"key {op.meta.key!r}: chunk file {path} (rank {dist.get_rank()})"
            # tensorstore opens the file itself: the containment rule's checked resolve first.
            containment.path_beneath(
                op.meta.path, op.meta.chunk_name(op.index), op.meta.path / ARRAY_META, "chunk file"
            )
            if not path.exists():
                raise CheckpointingException(f"{where} is missing")
            expected = None if checksums is None else checksums.get(op.meta.chunk_relpath(op.index))
            if expected is not None and crc32c(path.read_bytes()) != expected[1]:
                raise CheckpointingException(
                    f"{where}: CRC32C mismatch against the manifest (corrupted data)"
                )
        opened: Dict[str, Any] = {}
        pending = [
            (op, self._open(op.meta, False, opened)[_box(op.meta, op.index, op.lo, op.hi)].read())
            for op in ops
        ]
        for op, fut in pending:
            try:
                arr = fut.result()
            except Exception as e:  # noqa: BLE001
                raise CheckpointingException(
                    f"{op.meta.chunk_path(op.index)}: key {op.meta.key!r}: reading chunk {list(op.index)} "
                    f"failed (rank {dist.get_rank()}); corrupt or truncated chunk? {e}"
                ) from None
            op.dest.copy_(from_numpy(arr, op.meta.dtype))
