"""Whole tensors written one at a time into a new zarr checkpoint, for tools that stream (conversion)."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from distckpt import storage
from distckpt.core import CheckpointingException
from distckpt.strategies.zarr.engines import Engines
from distckpt.strategies.zarr.jobs import ChunkWrite
from distckpt.strategies.zarr.layout import (
    FileRecord,
    check_key_path,
    create_array,
    key_prefixes,
    open_root,
    write_root_group,
)
from distckpt.strategies.zarr.meta import Shape


class ZarrTensorWriter:
    """Writes whole tensors one at a time into a new zarr checkpoint (single process).

    The streaming counterpart of the save strategy, for tools (conversion) that hold one
    tensor at a time. ``finish`` writes the root group; committing (``metadata.json``) is the
    caller's.

    Args:
        max_chunk_bytes: split a tensor along its first axis into chunks of at most about this
            many bytes (None: one chunk per tensor).
    """

    def __init__(
        self,
        checkpoint_dir: storage.Location,
        *,
        io_engine: str = "auto",
        thread_count: int = 4,
        compression: Optional[str] = None,
        max_chunk_bytes: Optional[int] = None,
        fsync: bool = True,
    ):
        self.root = open_root(checkpoint_dir)
        self.engines = Engines(io_engine, thread_count, fsync)
        self.compression = compression
        self.max_chunk_bytes = max_chunk_bytes
        self.keys: List[str] = []
        self.records: List[FileRecord] = []
        self._folders: set = set()

    def _chunks(self, t: torch.Tensor) -> Shape:
        shape = tuple(max(s, 1) for s in t.shape)
        if self.max_chunk_bytes is None or t.dim() == 0 or t.shape[0] == 0:
            return shape
        row = max(1, math.prod(t.shape[1:]) * t.element_size())
        return (max(1, min(t.shape[0], self.max_chunk_bytes // row)),) + shape[1:]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        check_key_path(key)
        parents = key_prefixes(key)[:-1]
        if key in self._folders or key in self.keys or any(p in self.keys for p in parents):
            raise CheckpointingException(
                f"ShardedTensor key {key!r} clashes with a key already written (same key, or one "
                f"array folder would contain the other)"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        meta, record = create_array(
            self.root, key, tuple(t.shape), self._chunks(t), t.dtype, self.compression
        )
        jobs = []
        for index in meta.chunks_overlapping((0,) * t.dim(), tuple(t.shape)):
            c_off, c_size = meta.chunk_box(index)
            jobs.append(
                ChunkWrite(meta, tuple(index), t[tuple(slice(o, o + n) for o, n in zip(c_off, c_size))])
            )
        self.records += [record] + self.engines.write(jobs)
        self.keys.append(key)
        self._folders.update(parents)

    def finish(self) -> List[FileRecord]:
        """Write the root group; returns every file written, for the integrity manifest."""
        self.records += write_root_group(self.root, self.keys)
        return self.records
