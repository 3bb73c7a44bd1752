"""The raw engine: chunk files written and read straight from and into tensor memory, on a thread pool.

It handles the arrays whose chunks are plain little-endian C-order bytes (``ArrayMeta.raw``). A
chunk on a local file system is written with ``os.write`` and read with ``preadv`` (a strided
region: copied out of a mapping; part of a checksummed chunk: only the blocks it needs, each
checked); a chunk on an object store is one put or one whole get. Both go through the same
code: only the calls that move the bytes differ (:class:`_FileChunk`, :class:`_ObjectChunk`).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from distckpt import containment, dist
from distckpt.checksum import crc32c, pack_block_crcs
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.formats.manifest import MANIFEST_FNAME
from distckpt.formats.zip_archive import contiguous_strides
from distckpt.io.blockread import BlockReader
from distckpt.io.byteio import byte_view, pread_crc, pread_exact
from distckpt.io.copies import CopyOp, copy_from_mapping
from distckpt.io.filesystem import ChecksummingSink
from distckpt.strategies.resharding import ravel
from distckpt.strategies.zarr.jobs import BlockLookup, ChunkRead, ChunkWrite, padded
from distckpt.strategies.zarr.layout import FileRecord, chunk_checksums
from distckpt.strategies.zarr.meta import ARRAY_META, ArrayMeta, Shape

# Chunk requests in flight per rank on an object store: each waits on the network (obstore
# releases the GIL), so more of them than CPU threads hide the per-request latency.
OBJECT_STORE_REQUESTS = 16

# A checked read that needs every block of a chunk reads a chunk of at most this size whole into
# a temporary (one read, one copy); a larger one block by block through BlockReader's windows,
# which stay in cache (a fresh temporary of tens of MiB is faulted in page by page). Half of
# every row of chunks of 2 to 32 MiB on tmpfs, per chunk: 2 MiB 784 vs 903 us, 8 MiB 1166 vs
# 1307 us, 16 MiB about even, 32 MiB 42 vs 12 ms (whole vs blocks; verify=False's copy out of a
# mapping: 928, 1201 us, 4.6, 9.1 ms).
_WHOLE_READ_BYTES = 8 << 20


def _region(op: ChunkRead) -> Tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in zip(op.lo, op.hi))


def _copy_op(meta: ArrayMeta, op: ChunkRead) -> CopyOp:
    """The region ``[op.lo, op.hi)`` of a chunk as a box of the chunk file's row-major elements."""
    ext = tuple(b - a for a, b in zip(op.lo, op.hi))
    return CopyOp(meta.key, ravel(op.lo, meta.chunks), ext, contiguous_strides(tuple(meta.chunks)), op.dest)


def _block_reader(
    fd: int,
    meta: ArrayMeta,
    ops: Sequence[ChunkRead],
    blocks: BlockLookup,
    expected: Tuple[int, int],
    where: str,
) -> Optional[BlockReader]:
    """A reader of just the blocks of a chunk file that ``ops`` copy bytes from, each compared with
    its CRC32C in the manifest before any of its bytes is copied. None where reading the chunk
    whole and checking its own CRC32C is the better choice: the manifest has no block CRC32Cs
    for it (a small chunk, or a checkpoint older than them), they use a block size other than
    the one distckpt writes (that of the CRC-checked read pieces), the regions' spans overlap in
    more blocks than the file has (a block would be read once per region), or they span every
    block of a chunk of at most :data:`_WHOLE_READ_BYTES` (a column block, where one read and one
    strided copy win over reading window by window)."""
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
    """Fill ``op.dest`` with the region ``[op.lo, op.hi)`` of an uncompressed C-order chunk file.

    A region that is one contiguous run takes one ``pread``, straight into ``dest`` where the
    bytes can land there. A strided one (a column block of a resharded load) is copied out of a
    read-only mapping of the bytes it spans, as the torch_dist reader does: no read per run and
    no temporary.
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
        pread_exact(fd, byte_view(target), ravel(lo, chunks) * isz, where)
        if not direct:
            dest.copy_(target)
        return
    first = ravel(lo, chunks)
    last = ravel(tuple(b - 1 for b in hi), chunks) + 1
    box = _copy_op(meta, op)
    copy_from_mapping(fd, first * isz, last - first, meta.dtype, [box], first, where)


class _FileChunk:
    """A local chunk file, opened beneath its array's folder (never through a symlink out of it)."""

    def __init__(self, meta: ArrayMeta, index: Shape):
        self.meta = meta
        self.where = f"key {meta.key!r}: chunk file {meta.chunk_path(index)} (rank {dist.get_rank()})"
        try:
            self.fd = containment.open_beneath(
                meta.path, meta.chunk_name(index), meta.path / ARRAY_META, "chunk file"
            )
        except FileNotFoundError:
            raise CheckpointingException(f"{self.where} is missing") from None

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, view: memoryview) -> int:
        """Read the whole chunk into ``view``; its CRC32C, computed as the bytes arrive."""
        return pread_crc(self.fd, view, 0, self.where)

    def read_region(self, op: ChunkRead) -> None:
        _read_region(self.fd, self.meta, op, self.where)

    def block_reader(
        self, ops: Sequence[ChunkRead], blocks: BlockLookup, expected: Tuple[int, int]
    ) -> Optional[BlockReader]:
        return _block_reader(self.fd, self.meta, ops, blocks, expected, self.where)

    def close(self) -> None:
        os.close(self.fd)


class _ObjectChunk:
    """A chunk object of an object store, fetched whole with one get."""

    def __init__(self, meta: ArrayMeta, index: Shape):
        self.meta = meta
        rel = meta.chunk_relpath(index)
        self.where = f"key {meta.key!r}: chunk {meta.store.where(rel)} (rank {dist.get_rank()})"
        try:
            self.raw = meta.store.get(rel)
        except FileNotFoundError:
            raise CheckpointingException(f"{self.where} is missing") from None
        self._chunk: Optional[torch.Tensor] = None

    def size(self) -> int:
        return len(self.raw)

    def read_into(self, view: memoryview) -> int:
        crc = crc32c(self.raw)
        view[:] = memoryview(self.raw).cast("B")
        return crc

    def read_region(self, op: ChunkRead) -> None:
        if self._chunk is None:
            self._chunk = torch.frombuffer(bytearray(self.raw), dtype=self.meta.dtype).reshape(
                self.meta.chunks
            )
        op.dest.copy_(self._chunk[_region(op)])

    def block_reader(
        self, ops: Sequence[ChunkRead], blocks: BlockLookup, expected: Tuple[int, int]
    ) -> Optional[BlockReader]:
        return None  # the whole object is here already: checked whole

    def close(self) -> None:
        pass


class RawIO:
    """Chunk I/O from and into tensor memory with plain calls (POSIX, or a store's put/get) on a
    thread pool.

    Args:
        thread_count: local chunk files written or read at the same time.
        fsync: fsync each local chunk file once it is written.
    """

    def __init__(self, thread_count: int = 4, fsync: bool = True):
        self.thread_count = max(1, thread_count)
        self.fsync = fsync

    def parallel(
        self, fn: Callable[[Any], Any], jobs: Sequence[Any], threads: Optional[int] = None
    ) -> List[Any]:
        """``[fn(job) for job in jobs]``, run on up to ``threads`` threads (default: ``thread_count``)."""
        threads = threads or self.thread_count
        if len(jobs) <= 1 or threads == 1:
            return [fn(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
            return [fut.result() for fut in [pool.submit(fn, job) for job in jobs]]

    # ----------------------------------------------------------------- write

    def _write_file(self, path: Path, view: memoryview) -> Tuple[int, bytes]:
        """Write ``view`` as the local file ``path``; its CRC32C and block CRC32Cs."""
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
        return sink.crc, blocks

    def write(self, jobs: Sequence[ChunkWrite]) -> List[FileRecord]:
        """Write whole chunk files (on an object store: one put each, every rank its own chunks);
        one manifest record per file."""
        made: set = set()

        def write_one(job: ChunkWrite) -> FileRecord:
            meta = job.meta
            rel = meta.chunk_relpath(job.index)
            if meta.store is None:
                path = meta.chunk_path(job.index)
                if path.parent not in made:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    made.add(path.parent)
                view = byte_view(padded(meta, job.data))
                crc, blocks = self._write_file(path, view)
            else:
                view = byte_view(padded(meta, job.data))
                crc, blocks = chunk_checksums(view)
                meta.store.put(rel, view)
            return rel, len(view), crc, meta.key, blocks

        # Largest first keeps the pool busy to the end.
        ordered = sorted(jobs, key=lambda j: -j.data.numel())
        remote = [j for j in ordered if j.meta.store is not None]
        local = [j for j in ordered if j.meta.store is None]
        return self.parallel(write_one, remote, OBJECT_STORE_REQUESTS) + self.parallel(write_one, local)

    # ----------------------------------------------------------------- read

    def read(
        self,
        ops: Sequence[ChunkRead],
        checksums: Optional[Dict[str, Tuple[int, int]]] = None,
        blocks: Optional[BlockLookup] = None,
    ) -> None:
        """Run the reads, fetching each chunk once. With ``checksums`` (relative path -> (size,
        crc32c), the manifest's) every byte copied out of a listed chunk is checked: a chunk
        read whole into place while it arrives; part of a local chunk whose block CRC32Cs
        ``blocks`` has, block by block, reading only the blocks that hold it (see
        :func:`_block_reader`); any other listed chunk read whole and checked before its
        regions are copied out."""
        by_file: Dict[str, List[ChunkRead]] = {}
        for op in ops:
            by_file.setdefault(op.meta.chunk_relpath(op.index), []).append(op)
        files = [f for _, f in sorted(by_file.items(), key=lambda kv: kv[0])]

        def read_file(file_ops: List[ChunkRead]) -> None:
            meta = file_ops[0].meta
            source = (_FileChunk if meta.store is None else _ObjectChunk)(meta, file_ops[0].index)
            try:
                self._read_chunk(source, file_ops, checksums, blocks)
            finally:
                source.close()

        self.parallel(read_file, [f for f in files if f[0].meta.store is not None], OBJECT_STORE_REQUESTS)
        self.parallel(read_file, [f for f in files if f[0].meta.store is None])

    @staticmethod
    def _read_chunk(
        source: Any,
        file_ops: List[ChunkRead],
        checksums: Optional[Dict[str, Tuple[int, int]]],
        blocks: Optional[BlockLookup],
    ) -> None:
        """Copy the regions ``file_ops`` ask for out of one chunk (``source``: a :class:`_FileChunk`
        or an :class:`_ObjectChunk`), checked as :meth:`read` says."""
        meta, where = file_ops[0].meta, source.where
        size = source.size()
        if size != meta.chunk_nbytes:
            raise CheckpointingException(
                f"{where} holds {size} bytes, expected {meta.chunk_nbytes} of an uncompressed "
                f"chunk of shape {list(meta.chunks)} ({meta.dtype}); truncated or corrupt"
            )
        expected = None if checksums is None else checksums.get(meta.chunk_relpath(file_ops[0].index))
        if expected is None:
            for op in file_ops:
                source.read_region(op)
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
            if source.read_into(byte_view(op.dest)) != expected[1]:
                raise CheckpointingException(
                    f"{where}: CRC32C mismatch against the manifest (corrupted data)"
                )
            return
        reader = None if blocks is None else source.block_reader(file_ops, blocks, expected)
        if reader is not None:
            reader.copy([_copy_op(meta, op) for op in file_ops], None)
            return
        chunk = torch.empty(meta.chunks, dtype=meta.dtype)
        if source.read_into(byte_view(chunk)) != expected[1]:
            raise CheckpointingException(f"{where}: CRC32C mismatch against the manifest (corrupted data)")
        for op in file_ops:
            op.dest.copy_(chunk[_region(op)])
