"""Plain tensor files written as a conversion's output: safetensors and ``torch.save`` files.

Both writers follow the output-writer protocol of :mod:`distckpt.tools.convert`::

    writer.begin(common_state, objects)      # once
    writer.write_tensor(key, tensor)         # once per tensor, any order
    summary = writer.finish()                # commit: the output appears only now
    writer.abort()                           # or: drop everything written so far

Both stream: a tensor's bytes go to disk when it arrives and nothing but small metadata is
kept, so memory stays at the tensor being written. Output is written under a temporary name
beside the destination and renamed into place by ``finish``.

Formats:

- safetensors, one file (``DST.safetensors``) or an HF-style folder: shards
  ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` bytes each (a larger tensor
  gets a shard of its own) and ``model.safetensors.index.json`` with ``weight_map``; a folder
  whose tensors fit one shard gets a single ``model.safetensors`` and no index, as
  ``transformers`` writes it. The header is only known once a shard is full, so each shard's
  data is streamed to a side file first and then copied behind the header
  (``os.copy_file_range``: a kernel copy, or a reflink on filesystems that have them).
- ``torch``: one ``torch.save`` zip archive of ``{key: tensor}`` (what ``torch.load`` and
  ``model.load_state_dict`` expect; loadable with ``weights_only=True`` and ``mmap=True``).
  Each tensor becomes a storage record as it arrives; the pickle that refers to them is
  written last (``torch.load`` finds records by name).

Common state and ShardedObjects have no place in these formats and are left out (the summary
says how many); convert to ``torch_dist`` or ``zarr`` to keep them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from distckpt.core import CheckpointingException, PathLike, fsync_dir, write_all
from distckpt.io.byteio import byte_view
from distckpt.tools.sources.base import dtype_name
from distckpt.tools.sources.files import INDEX_FNAME, SAFETENSORS_CODES, SINGLE_FNAME

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Like ``transformers``' ``save_pretrained`` default (``"5GB"``)."""


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1e9"`` or ``"123"`` (bytes) -> bytes."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
    }
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise CheckpointingException(f"invalid size {text!r} (examples: 5GB, 500MiB, 1000000)")
    return int(value * units[unit])


# --------------------------------------------------------------------------- raw I/O


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        t = t.to(t.dtype)  # a subclass (e.g. FP8 with a scale): its plain values
    return t.contiguous()


def _copy_range(src_fd: int, dst_fd: int, length: int) -> None:
    """Append ``length`` bytes of ``src_fd`` (from its start) at ``dst_fd``'s position."""
    offset = 0
    if hasattr(os, "copy_file_range"):
        try:
            while offset < length:
                n = os.copy_file_range(src_fd, dst_fd, length - offset, offset)
                if n == 0:
                    break
                offset += n
        except OSError:
            pass  # cross-device or unsupported: fall back to read/write for the rest
    while offset < length:
        chunk = os.pread(src_fd, min(16 << 20, length - offset), offset)
        if not chunk:
            raise CheckpointingException("short read while assembling a safetensors shard")
        write_all(dst_fd, memoryview(chunk))
        offset += len(chunk)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _partial_name(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.partial-{os.getpid()}")


def _check_new_output(dst: Path) -> None:
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise CheckpointingException(f"{dst}: already exists (choose a new output path)")
    if not dst.parent.is_dir():
        raise CheckpointingException(f"{dst.parent}: output folder does not exist")


def _install(tmp: Path, dst: Path) -> None:
    """Move a finished output from its temporary name to ``dst``; what was there (an empty
    folder, or anything with ``overwrite``) goes, after the new output is in place."""
    old = None
    if dst.is_dir() and not tmp.is_dir() or dst.is_dir() and any(dst.iterdir()):
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    elif dst.is_dir():
        dst.rmdir()
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- writers


class _TensorOnlyWriter:
    """Shared bookkeeping: what was left out, the destination, abort."""

    def __init__(self, dst: PathLike, overwrite: bool = False):
        self.dst = Path(dst)
        if not overwrite:
            _check_new_output(self.dst)
        elif not self.dst.parent.is_dir():
            raise CheckpointingException(f"{self.dst.parent}: output folder does not exist")
        self.tmp = _partial_name(self.dst)
        self.dropped_common = 0
        self.dropped_objects = 0
        self.count = 0
        self.nbytes = 0

    def begin(
        self, common: Optional[Dict[str, Any]] = None, objects: Optional[Dict[str, Any]] = None
    ) -> None:
        self.dropped_common = len(common or {})
        self.dropped_objects = len(objects or {})

    def _summary(self, files: List[str]) -> Dict[str, Any]:
        return {
            "path": str(self.dst),
            "tensors": self.count,
            "nbytes": self.nbytes,
            "files": files,
            "dropped_common_entries": self.dropped_common,
            "dropped_objects": self.dropped_objects,
        }

    def abort(self) -> None:
        if self.tmp.is_dir():
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            try:
                os.remove(self.tmp)
            except FileNotFoundError:
                pass


class _Shard:
    """One safetensors file being written: data streamed to a side file, header at close."""

    def __init__(self, data_path: Path):
        self.data_path = data_path
        self.fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.header: Dict[str, Any] = {}
        self.size = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        view = byte_view(t)
        write_all(self.fd, view)
        self.header[key] = {
            "dtype": SAFETENSORS_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self.size, self.size + len(view)],
        }
        self.size += len(view)

    def close_into(self, path: Path, metadata: Dict[str, str]) -> None:
        header = {"__metadata__": metadata, **self.header} if metadata else dict(self.header)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # 8-byte aligned data, as the safetensors library writes
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(out, memoryview(struct.pack("<Q", len(text)) + text))
            _copy_range(self.fd, out, self.size)
            os.fsync(out)
        finally:
            os.close(out)
            os.close(self.fd)
            os.remove(self.data_path)


class SafetensorsWriter(_TensorOnlyWriter):
    """Writes tensors to safetensors: ``dst`` ending in ``.safetensors`` is one file, anything
    else an HF-style folder sharded at ``max_shard_size`` bytes (see the module docstring).

    Args:
        metadata: the header's ``__metadata__`` (string to string); default ``{"format": "pt"}``.
    """

    def __init__(
        self,
        dst: PathLike,
        overwrite: bool = False,
        *,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
        metadata: Optional[Dict[str, str]] = None,
    ):
        super().__init__(dst, overwrite)
        if max_shard_size <= 0:
            raise CheckpointingException(f"max_shard_size must be positive, got {max_shard_size}")
        self.single_file = self.dst.name.endswith(".safetensors")
        self.max_shard_size = max_shard_size
        self.metadata = {"format": "pt"} if metadata is None else dict(metadata)
        self.keys: set = set()
        self.shards: List[_Shard] = []
        self.closed: List[Tuple[Path, List[str], int]] = []  # (file, keys, data bytes)
        if not self.single_file:
            self.tmp.mkdir()

    def _new_shard(self) -> _Shard:
        if self.single_file:
            return _Shard(self.tmp.with_name(self.tmp.name + ".data"))
        return _Shard(self.tmp / f"shard-{len(self.closed) + 1:05d}.data")

    def _close_current(self) -> None:
        shard = self.shards.pop()
        path = self.tmp if self.single_file else self.tmp / f"shard-{len(self.closed) + 1:05d}.safetensors"
        shard.close_into(path, self.metadata)
        self.closed.append((path, list(shard.header), shard.size))

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.keys:
            raise CheckpointingException(f"safetensors output {self.dst}: key {key!r} written twice")
        t = _cpu_contiguous(tensor)
        if t.dtype not in SAFETENSORS_CODES:
            raise CheckpointingException(
                f"tensor {key!r}: dtype {dtype_name(t.dtype)} cannot be stored in safetensors "
                f"(convert it with --dtype, or use --to torch)"
            )
        nbytes = t.numel() * t.element_size()
        if (
            self.shards
            and not self.single_file
            and self.shards[-1].header
            and self.shards[-1].size + nbytes > self.max_shard_size
        ):
            self._close_current()
        if not self.shards:
            self.shards.append(self._new_shard())
        self.shards[-1].add(key, t)
        self.keys.add(key)
        self.count += 1
        self.nbytes += nbytes

    def finish(self) -> Dict[str, Any]:
        if self.shards:
            self._close_current()
        elif not self.closed:  # no tensor at all: still a valid (empty) file
            self.shards.append(self._new_shard())
            self._close_current()
        if self.single_file:
            _install(self.tmp, self.dst)
            return self._summary([self.dst.name])
        n = len(self.closed)
        names = [SINGLE_FNAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (path, keys, _), name in zip(self.closed, names):
            os.replace(path, self.tmp / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": weight_map}
            with open(self.tmp / INDEX_FNAME, "w") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            names.append(INDEX_FNAME)
        fsync_dir(self.tmp)
        _install(self.tmp, self.dst)
        return self._summary(names)

    def abort(self) -> None:
        for shard in self.shards:
            os.close(shard.fd)
        self.shards.clear()
        if self.single_file:
            try:
                os.remove(self.tmp.with_name(self.tmp.name + ".data"))
            except FileNotFoundError:
                pass
        super().abort()


class _StorageRef:
    """Stands for storage record ``data/<key>`` in the pickle of a streamed torch.save file."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, nbytes: int):
        self.key, self.dtype, self.numel, self.nbytes = key, dtype, numel, nbytes


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: Tuple[int, ...]):
        self.storage, self.shape = storage, shape


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class _TorchSavePickler(pickle.Pickler):
    """Pickles ``{key: _TensorRef}`` exactly as ``torch.save`` pickles ``{key: tensor}``:
    ``_rebuild_tensor_v2`` over a typed storage where one exists for the dtype, else
    ``_rebuild_tensor_v3`` over an untyped storage (how torch saves float8, uint16, ...)."""

    _typed = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            if obj.dtype in self._typed:
                return ("storage", getattr(torch, self._typed[obj.dtype]), obj.key, "cpu", obj.numel)
            return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            args = (obj.storage, 0, tuple(obj.shape), _contiguous_stride(obj.shape), False, OrderedDict())
            if obj.storage.dtype in self._typed:
                return torch._utils._rebuild_tensor_v2, args
            return torch._utils._rebuild_tensor_v3, args + (obj.storage.dtype,)
        return NotImplemented


class TorchFileWriter(_TensorOnlyWriter):
    """Writes ``{key: tensor}`` as one ``torch.save`` file, one storage record per tensor as it
    arrives (see the module docstring)."""

    def __init__(self, dst: PathLike, overwrite: bool = False):
        super().__init__(dst, overwrite)
        self.refs: Dict[str, _TensorRef] = {}
        self._zip_cm = torch.serialization._open_zipfile_writer(str(self.tmp))
        self._zip = self._zip_cm.__enter__()

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.refs:
            raise CheckpointingException(f"torch output {self.dst}: key {key!r} written twice")
        t = _cpu_contiguous(tensor)
        nbytes = t.numel() * t.element_size()
        storage = _StorageRef(str(len(self.refs)), t.dtype, t.numel(), nbytes)
        record = (
            t.reshape(-1).untyped_storage()
            if t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes
            else t.clone().untyped_storage()
        )
        self._zip.write_record(f"data/{storage.key}", record, nbytes)
        self.refs[key] = _TensorRef(storage, tuple(t.shape))
        self.count += 1
        self.nbytes += nbytes

    def finish(self) -> Dict[str, Any]:
        buf = io.BytesIO()
        _TorchSavePickler(buf, protocol=2).dump(self.refs)
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._zip_cm.__exit__(None, None, None)
        self._zip = None
        _fsync_file(self.tmp)
        _install(self.tmp, self.dst)
        return self._summary([self.dst.name])

    def abort(self) -> None:
        if self._zip is not None:
            try:
                self._zip_cm.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the file is deleted anyway
                pass
            self._zip = None
        super().abort()


def make_file_writer(fmt: str, dst: PathLike, max_shard_size: Optional[int] = None, overwrite: bool = False):
    """The writer for output format ``"safetensors"`` or ``"torch"``."""
    if fmt == "safetensors":
        return SafetensorsWriter(dst, overwrite, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    if fmt == "torch":
        if max_shard_size is not None:
            raise CheckpointingException("max_shard_size applies to safetensors output only")
        return TorchFileWriter(dst, overwrite)
    raise CheckpointingException(f"unknown file format {fmt!r} (safetensors or torch)")
