"""The writers a conversion streams into when its output is a distckpt checkpoint.

:class:`TorchDistWriter` and :class:`ZarrWriter` follow the writer protocol of
:mod:`distckpt.tools.convert` (``begin``, ``write_tensor`` per key, ``finish`` or ``abort``) and
produce checkpoints committed the distckpt way (:class:`DistckptWriter`): nothing old in the
destination can be mistaken for the result (stale commit files go first), the integrity
manifest covers every file, and ``metadata.json`` is written last, atomically. On a file system
the output is assembled in a staging directory beside the destination and swapped in by
``finish``; on an object store it is written in place and committed by a conditional put.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt import commit, containment, storage
from distckpt.core import (
    CheckpointingConfig,
    CheckpointingException,
    atomic_write_bytes,
    write_all,
    write_file_durably,
)
from distckpt.formats.manifest import build_manifest, crc32c, write_manifest
from distckpt.io.filesystem import (
    ChecksummingSink,
    WriterSink,
    write_bytes_item,
    write_tensor_item,
    zip_crc_disabled,
)
from distckpt.mapping import StateDict
from distckpt.strategies.torch_dist.metadata import metadata_file
from distckpt.strategies.torch_dist.records import KeyDecl, Record
from distckpt.strategies.zarr.layout import block_entries
from distckpt.strategies.zarr.meta import FORMAT_VERSION
from distckpt.strategies.zarr.writer import ZarrTensorWriter

__all__ = ["DistckptWriter", "TorchDistWriter", "ZarrWriter"]


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class DistckptWriter:
    """Common part of the writers that produce distckpt checkpoints.

    Prepares the destination (refusing a non-empty one unless ``overwrite``), writes
    ``common.pt``, keeps the manifest records, and commits: manifest, then ``metadata.json``.
    Subclasses store tensors and objects.

    Args:
        dst_dir: the new checkpoint's folder.
        overwrite: allow a non-empty destination (an earlier checkpoint's commit files are
            removed before anything is written).
    """

    backend: str = ""
    version: int = 1

    def __init__(self, dst_dir: storage.Location, overwrite: bool = False):
        # Committed by the destination's protocol (distckpt.commit): on a file system written into
        # a staging directory beside it and swapped in at ``finish``, so an interrupted or failed
        # conversion leaves the destination as it was; on an object store written in place and
        # committed by a conditional put of metadata.json.
        self.target = commit.resolve_target(dst_dir)
        # Where the target has no local directory (an object store), files go through the store.
        self.remote = storage.local_root(self.target) is None
        self.dst = self.target
        self._protocol = commit.protocol_for(self.target)
        self._staging = None
        self.overwrite = overwrite
        # (relative path, offset, length, crc32c, key) of every byte range written.
        self.ranges: List[Tuple[str, int, int, int, str]] = []
        self.sizes: Dict[str, int] = {}
        # The manifest's block CRC32Cs of large files written as one range (zarr chunks).
        self.blocks: Dict[str, Tuple[int, int, bytes]] = {}
        self.tensor_count = 0
        self.tensor_bytes = 0

    def _prepare_destination(self) -> None:
        if not self.remote:
            if self.target.exists() and not self.target.is_dir():
                raise CheckpointingException(f"{self.target}: exists and is not a directory")
            if self.target.is_dir() and any(self.target.iterdir()) and not self.overwrite:
                raise CheckpointingException(
                    f"{self.target}: destination is not empty (pass overwrite=True to replace it)"
                )
        self._protocol.cleanup_leftovers(self.target)
        # An object store refuses a committed checkpoint unless overwrite.
        self._staging = self._protocol.begin(self.target, commit.new_save_id(), self.overwrite)
        self.dst = self._protocol.where(self._staging)
        self._moved_to(self.dst)

    def _moved_to(self, path) -> None:
        """The writer's files go under ``path`` (the staging directory) from now on."""

    def _record_file(self, name: str, data: bytes, key: str) -> None:
        self.ranges.append((name, 0, len(data), crc32c(data), key))
        self.sizes[name] = len(data)

    def begin(self, common: StateDict, objects: Dict[str, Any]) -> None:
        self._prepare_destination()
        data = _torch_bytes(common)
        if self.remote:
            self.dst.put("common.pt", data)
        else:
            write_file_durably(self.dst / "common.pt", data)
        self._record_file("common.pt", data, "common.pt")
        self._begin_objects(objects)

    def _begin_objects(self, objects: Dict[str, Any]) -> None:
        raise NotImplementedError

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        self._write_tensor(key, tensor)
        self.tensor_count += 1
        self.tensor_bytes += tensor.numel() * tensor.element_size()

    def _write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _finish_data(self) -> None:
        """Write the backend's own index; runs before the manifest and the commit."""

    def _release(self) -> None:
        """Close whatever is open (after a failure)."""

    def finish(self) -> Dict[str, Any]:
        """Write the backend's index and the manifest, then commit (``metadata.json`` last)."""
        self._finish_data()
        write_manifest(
            self.dst,
            build_manifest(self._staging.save_id, self.backend, self.ranges, self.sizes, blocks=self.blocks),
        )
        self._protocol.commit(self._staging, CheckpointingConfig(self.backend, self.version, "torch", 1))
        self._protocol.after_commit(self._staging)
        return {
            "path": str(self.target),
            "backend": self.backend,
            "tensors": self.tensor_count,
            "nbytes": self.tensor_bytes,
            "files": len(self.sizes) + 2,
        }

    def abort(self) -> None:
        """Drop the output: the staging directory goes; the destination stays as it was."""
        self._release()
        if self._staging is not None:
            self._protocol.abort(self._staging)


class ZarrWriter(DistckptWriter):
    """Writes a ``zarr`` checkpoint (format version 2): one array per key, objects as
    ``<unique_key>.pt`` files (``torch.save(obj)``, as the common strategy writes them).

    Args:
        max_chunk_bytes: cut each tensor along its first axis into chunks of about this size
            (None: one chunk per tensor).
        compression, io_engine, thread_count: as for the zarr save strategy.
    """

    backend = "zarr"

    def __init__(
        self,
        dst_dir: storage.Location,
        overwrite: bool = False,
        *,
        max_chunk_bytes: Optional[int] = None,
        compression: Optional[str] = None,
        io_engine: str = "auto",
        thread_count: int = 4,
    ):
        super().__init__(dst_dir, overwrite)
        if self.remote and compression is not None:
            raise CheckpointingException(
                f"{self.dst}: on object stores the zarr backend writes uncompressed arrays only"
            )
        self.version = FORMAT_VERSION
        self.arrays = ZarrTensorWriter(
            self.dst,
            io_engine=io_engine,
            thread_count=thread_count,
            compression=compression,
            max_chunk_bytes=max_chunk_bytes,
        )

    def _moved_to(self, path: Path) -> None:
        self.arrays.root = path

    def _begin_objects(self, objects: Dict[str, Any]) -> None:
        for unique_key, obj in objects.items():
            data = _torch_bytes(obj)
            if self.remote:
                self.dst.put(f"{unique_key}.pt", data)
            else:
                # The key comes from the source checkpoint: the file is created beneath the
                # destination by the containment rule, never through '..' or a symlink out.
                fd = containment.create_beneath(
                    self.dst, f"{unique_key}.pt", self.dst, "ShardedObject file name"
                )
                try:
                    write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._record_file(f"{unique_key}.pt", data, unique_key)

    def _write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        self.arrays.write(key, tensor)

    def _finish_data(self) -> None:
        records = self.arrays.finish()
        for path, size, crc, key, _ in records:
            self.ranges.append((path, 0, size, crc, key))
            self.sizes[path] = size
        self.blocks.update(block_entries(records))


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning exactly its bytes (torch.save writes whole storages)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class TorchDistWriter(DistckptWriter):
    """Writes a ``torch_dist`` checkpoint (PyTorch DCP layout, loadable by Megatron-Core): every
    tensor one chunk of ``__0_<n>.distcp``, objects as byte items ``torch.save([obj])``.

    Args:
        max_file_bytes: start a new data file once one holds this many bytes (None: one file).
    """

    backend = "torch_dist"
    version = 1

    def __init__(
        self, dst_dir: storage.Location, overwrite: bool = False, *, max_file_bytes: Optional[int] = None
    ):
        super().__init__(dst_dir, overwrite)
        self.max_file_bytes = max_file_bytes
        self._file_index = -1
        self._fd: Optional[int] = None
        self._sink = None
        self._name = ""
        # Every key as .metadata declares it, and where each stored item landed (one chunk per
        # tensor, the whole tensor; one byte item per object).
        self._decls: Dict[str, KeyDecl] = {}
        self._records: List[Record] = []

    def _open_next(self) -> None:
        self._close()
        self._file_index += 1
        # An overwrite on an object store names data files with the save's token (storage.record).
        token = getattr(self.dst, "file_token", None) or ""
        self._name = f"{token}__0_{self._file_index}.distcp"
        if self.remote:
            self._fd = self.dst.open_writer(self._name)  # a multipart upload
            self._sink = WriterSink(self._fd)
        else:
            self._fd = os.open(self.dst / self._name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._sink = ChecksummingSink(self._fd)

    def _close(self) -> None:
        if self._fd is not None:
            self._sink.fsync()
            if self.remote:
                self._fd.close()
            else:
                os.close(self._fd)
            self.sizes[self._name] = self._sink.position
            self._fd = None

    def _sink_for_next_item(self):
        if self._fd is None or (
            self.max_file_bytes is not None and self._sink.position >= self.max_file_bytes
        ):
            self._open_next()
        return self._sink

    def _begin_objects(self, objects: Dict[str, Any]) -> None:
        for unique_key, obj in objects.items():
            offset, length, crc = write_bytes_item(self._sink_for_next_item(), _torch_bytes([obj]))
            self._decls[unique_key] = KeyDecl(is_bytes=True)
            self._records.append(Record(unique_key, (), (), self._name, offset, length, crc))
            self.ranges.append((self._name, offset, length, crc, unique_key))

    def _release(self) -> None:
        if self._fd is not None:
            if self.remote:
                self._fd.abort()
            else:
                os.close(self._fd)
            self._fd = None

    def _write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._decls:
            raise CheckpointingException(f"{self.dst}: key {key!r} written twice")
        shape = tuple(tensor.shape)
        self._decls[key] = KeyDecl(False, tensor.dtype, shape)
        if tensor.numel() == 0:
            return
        with zip_crc_disabled():
            offset, length, crc = write_tensor_item(self._sink_for_next_item(), _standalone(tensor))
        self._records.append(Record(key, (0,) * len(shape), shape, self._name, offset, length, crc))
        self.ranges.append((self._name, offset, length, crc, key))

    def _finish_data(self) -> None:
        self._close()
        # The builder a torch_dist save uses, so the file unpickles to what a save writes.
        data = metadata_file(self._decls, self._records, str(self.target))
        if self.remote:
            self.dst.put(".metadata", data)
        else:
            atomic_write_bytes(self.dst / ".metadata", data)
        self._record_file(".metadata", data, ".metadata")
