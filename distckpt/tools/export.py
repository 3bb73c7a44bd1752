"""Plain tensor files in and out: safetensors (single or HF-sharded) and ``torch.save`` files.

Readers (:class:`SafetensorsSource`, :class:`TorchFileSource`) are tensor sources like a
checkpoint (see :mod:`distckpt.tools.inspect`), so ``inspect``, ``show`` and ``diff`` work on
them too. Writers (:class:`SafetensorsWriter`, :class:`TorchFileWriter`) follow the output-writer
protocol of :mod:`distckpt.tools.convert`::

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

:func:`convert` is what ``distckpt convert`` runs: any source (checkpoint or file) into any
format, a checkpoint source through :func:`distckpt.tools.convert.stream_checkpoint`, a file
source through :func:`stream_tensors` -- so a safetensors or ``torch.save`` file is imported
into a new ``torch_dist``/``zarr`` checkpoint tensor by tensor. Importing this module registers
the ``safetensors`` and ``torch`` writers with :func:`distckpt.tools.convert.register_writer`.
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from distckpt import containment
from distckpt.core import CheckpointingException, PathLike, fsync_dir, write_all
from distckpt.strategies.filesystem import byte_view, pread_exact
from distckpt.tools.inspect import Progress, TensorMeta, TensorSource, dtype_name

INDEX_FNAME = "model.safetensors.index.json"
SINGLE_FNAME = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Like ``transformers``' ``save_pretrained`` default (``"5GB"``)."""

_ST_DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_ST_NAMES: Dict[torch.dtype, str] = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 1000 * 1000  # the safetensors library refuses larger headers


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


# --------------------------------------------------------------------------- safetensors: read


def is_safetensors(path: PathLike) -> bool:
    """A ``.safetensors`` file, an ``*.safetensors.index.json`` or a folder holding either."""
    path = Path(path)
    if path.is_file():
        return path.name.endswith(".safetensors") or path.name.endswith(".safetensors.index.json")
    if path.is_dir():
        return any(
            p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")
            for p in path.iterdir()
        )
    return False


def read_safetensors_header(path: PathLike) -> Tuple[Dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file; the header maps names to
    ``{"dtype", "shape", "data_offsets"}`` plus an optional ``"__metadata__"``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointingException(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise CheckpointingException(f"{path}: not a safetensors file (header size {n})")
            text = f.read(n)
    except OSError as e:
        raise CheckpointingException(f"{path}: cannot read: {e}") from None
    if len(text) != n:
        raise CheckpointingException(f"{path}: truncated safetensors header")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointingException(f"{path}: unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointingException(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


class SafetensorsSource(TensorSource):
    """A ``.safetensors`` file, an HF index (``*.safetensors.index.json``) or a folder with either.

    Reads whole tensors with ``pread`` straight into their memory (no mmap), boxes through the
    ``safetensors`` library's lazy slices.
    """

    format = "safetensors"

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.files = self._files()
        self._entries: Dict[str, Tuple[Path, int, Dict[str, Any]]] = {}
        self._metas: Dict[str, TensorMeta] = {}
        self.metadata: Dict[str, str] = {}
        for file in self.files:
            header, start = read_safetensors_header(file)
            meta = header.pop("__metadata__", None) or {}
            if isinstance(meta, dict):
                self.metadata.update({str(k): str(v) for k, v in meta.items()})
            for name, entry in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
                dtype = _ST_DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    raise CheckpointingException(
                        f"{file}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}"
                    )
                begin, end = entry["data_offsets"]
                self._entries[name] = (file, start, entry)
                self._metas[name] = TensorMeta(name, tuple(entry["shape"]), dtype, None, 1, None, end - begin)
        self._open: Dict[Path, Any] = {}

    def _files(self) -> List[Path]:
        path = self.path
        index = None
        if path.is_file() and path.name.endswith(".index.json"):
            index = path
        elif path.is_dir():
            candidates = sorted(path.glob("*.safetensors.index.json"))
            if (path / INDEX_FNAME).is_file():
                index = path / INDEX_FNAME
            elif candidates:
                index = candidates[0]
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise CheckpointingException(f"{path}: no .safetensors files")
                return files
        else:
            return [path]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointingException(f"{index}: unreadable safetensors index: {e}") from None
        names = list(dict.fromkeys(weight_map.values()))
        # The containment rule: the index names shard files beside it, never outside its folder
        # (safetensors opens them itself, so this is the checked resolve, not a no-follow open).
        paths = [containment.path_beneath(index.parent, n, index, "shard file") for n in names]
        missing = [n for n, p in zip(names, paths) if not p.is_file()]
        if missing:
            raise CheckpointingException(f"{index}: shard files missing: {', '.join(missing)}")
        return paths

    def tensors(self) -> Dict[str, TensorMeta]:
        return self._metas

    def extra(self) -> Dict[str, Any]:
        return {
            "files": len(self.files),
            "disk_bytes": sum(f.stat().st_size for f in self.files),
            "metadata": self.metadata,
        }

    def read(self, key: str, offset=None, size=None) -> torch.Tensor:
        meta = self.meta(key)
        file, start, entry = self._entries[key]
        if offset is not None and tuple(size) != meta.shape:
            return self._read_box(key, file, tuple(offset), tuple(size))
        out = torch.empty(meta.shape, dtype=meta.dtype)
        fd = os.open(file, os.O_RDONLY)
        try:
            pread_exact(fd, byte_view(out), start + entry["data_offsets"][0], f"{file}: tensor {key!r}")
        finally:
            os.close(fd)
        return out

    def _read_box(self, key: str, file: Path, offset, size) -> torch.Tensor:
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        view = self._open[file].get_slice(key)
        return view[tuple(slice(o, o + n) for o, n in zip(offset, size))].clone()

    def close(self) -> None:
        self._open.clear()


# --------------------------------------------------------------------------- torch files: read


def _flatten(obj: Any, prefix: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """Move every tensor of a nested dict/list into ``tensors`` under its dotted path; return
    the rest of the structure (tensors removed)."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix or "tensor"] = obj
        return _REMOVED
    if isinstance(obj, dict):
        rest = {}
        for k, v in obj.items():
            kept = _flatten(v, f"{prefix}.{k}" if prefix else str(k), tensors)
            if kept is not _REMOVED:
                rest[k] = kept
        return rest if rest or not obj else _REMOVED
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj):
        kept_items = [_flatten(v, f"{prefix}.{i}" if prefix else str(i), tensors) for i, v in enumerate(obj)]
        if all(k is _REMOVED for k in kept_items):
            return _REMOVED
        return (
            type(obj)(None if k is _REMOVED else k for k in kept_items)
            if isinstance(obj, tuple)
            else [None if k is _REMOVED else k for k in kept_items]
        )
    return obj


_REMOVED = object()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _drop_mapped_pages(t: torch.Tensor) -> None:
    """Let the kernel drop the file pages behind a memory-mapped tensor once it was copied:
    without this, every page read stays counted in the process's memory until the whole file
    is closed. The pages are clean (never written), so a later access reads them back from
    the file. Best effort (Linux ``madvise(MADV_DONTNEED)``); does nothing elsewhere."""
    import ctypes

    storage = t.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if not nbytes or not sys.platform.startswith("linux"):
        return
    lo = start // _PAGE * _PAGE
    hi = -(-(start + nbytes) // _PAGE) * _PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


class TorchFileSource(TensorSource):
    """A ``torch.save`` file: every tensor of its nested dicts/lists is a key (dotted path, as
    ``model.state_dict()`` names them); everything else is its common state.

    The file is memory-mapped where its format allows (torch's zip format), so opening it reads
    only the pickle, and tensors are paged in as they are read (and their pages released once
    copied); a legacy (non-zip) file is loaded whole. Loading is restricted to
    tensors, plain data and distckpt's allowlist unless ``trusted``.
    """

    format = "torch"

    def __init__(self, path: PathLike, trusted: bool = False):
        from distckpt.strategies.common import _SAFE_GLOBALS

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointingException(f"{self.path}: no such file")
        what = f"{self.path}"
        obj = None
        self._mapped = False
        for mmap in (True, False):
            try:
                if trusted:
                    obj = torch.load(self.path, map_location="cpu", mmap=mmap, weights_only=False)
                else:
                    with torch.serialization.safe_globals(list(_SAFE_GLOBALS)):
                        obj = torch.load(self.path, map_location="cpu", mmap=mmap, weights_only=True)
                self._mapped = mmap
                break
            except pickle.UnpicklingError as e:
                first = next((ln for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
                raise CheckpointingException(
                    f"{what}: refusing to unpickle a class outside the allowlist ({first.strip()}); "
                    f"pass --trust if you trust this file"
                ) from None
            except RuntimeError as e:
                if mmap and "mmap" in str(e):
                    continue  # legacy (non-zip) format: cannot be mapped, load it whole
                raise CheckpointingException(f"{what}: not a readable torch.save file ({e})") from None
            except (EOFError, OSError, ValueError) as e:
                raise CheckpointingException(f"{what}: not a readable torch.save file ({e})") from None
        self._tensors: Dict[str, torch.Tensor] = {}
        rest = _flatten(obj, "", self._tensors)
        self._common = rest if isinstance(rest, dict) else ({} if rest is _REMOVED else {"value": rest})
        self._metas = {k: TensorMeta(k, tuple(t.shape), t.dtype, None, 1) for k, t in self._tensors.items()}

    def tensors(self) -> Dict[str, TensorMeta]:
        return self._metas

    def common(self) -> Dict[str, Any]:
        return self._common

    def extra(self) -> Dict[str, Any]:
        return {"files": 1, "disk_bytes": self.path.stat().st_size}

    def read(self, key: str, offset=None, size=None) -> torch.Tensor:
        self.meta(key)
        whole = self._tensors[key]
        t = whole if offset is None else whole[tuple(slice(o, o + n) for o, n in zip(offset, size))]
        out = t.detach().clone()
        if self._mapped:  # only file-backed pages may be dropped: anonymous ones would be lost
            _drop_mapped_pages(whole)
        return out

    def close(self) -> None:
        self._tensors.clear()


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
            "dtype": _ST_NAMES[t.dtype],
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
        if t.dtype not in _ST_NAMES:
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


# --------------------------------------------------------------------------- conversion


FILE_FORMATS = ("safetensors", "torch")
OPTIMIZER_PREFIX = "optimizer."


def _wanted(keys: Optional[str], exclude: Optional[str]) -> Callable[[str], bool]:
    import re

    try:
        inc = re.compile(keys) if keys else None
        exc = re.compile(exclude) if exclude else None
    except re.error as e:
        raise CheckpointingException(f"invalid key pattern: {e}") from None
    return lambda k: (inc is None or inc.search(k) is not None) and (exc is None or exc.search(k) is None)


def model_only_exclude(exclude: Optional[str]) -> str:
    """``exclude`` extended to drop optimizer state (keys starting with ``optimizer.``)."""
    import re

    ours = "^" + re.escape(OPTIMIZER_PREFIX)
    return ours if not exclude else f"(?:{exclude})|{ours}"


class DropCommonEntries:
    """Wraps an output writer and leaves the given top-level entries out of the common state
    (``--model-only`` drops ``optimizer``)."""

    def __init__(self, inner: Any, names: Sequence[str]):
        self.inner = inner
        self.names = set(names)

    def begin(self, common: Dict[str, Any], objects: Dict[str, Any]) -> None:
        self.inner.begin({k: v for k, v in common.items() if k not in self.names}, objects)

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        self.inner.write_tensor(key, tensor)

    def finish(self) -> Any:
        return self.inner.finish()

    def abort(self) -> None:
        self.inner.abort()


def stream_tensors(
    source: TensorSource,
    writer: Any,
    *,
    keys: Optional[str] = None,
    exclude: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Progress] = None,
    read_budget: Optional[int] = None,
) -> Dict[str, Any]:
    """Copy a tensor source (e.g. a safetensors or torch.save file) into ``writer`` (the
    output-writer protocol), one tensor at a time, with the semantics of
    :func:`distckpt.tools.convert.stream_checkpoint`: ``keys``/``exclude`` are regular
    expressions (``re.search``; for objects, on their key), ``dtype`` casts floating-point
    tensors only. On any error the writer is aborted.

    Returns ``{"tensors", "nbytes", "objects", "skipped"}``.
    """
    wanted = _wanted(keys, exclude)
    metas = source.tensors()
    chosen = [k for k in metas if wanted(k)]
    object_keys = [uk for uk in source.objects() if wanted(uk.rpartition("/shard_")[0] or uk)]
    written = 0
    try:
        writer.begin(dict(source.common()), {uk: source.read_object(uk) for uk in object_keys})
        if progress is not None:
            progress.start(sum(metas[k].nbytes for k in chosen), f"converting {len(chosen)} tensors")
        for key, tensor in source.iter_tensors(chosen, budget=read_budget, progress=progress):
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            writer.write_tensor(key, tensor)
            written += tensor.numel() * tensor.element_size()
            del tensor
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {
        "tensors": len(chosen),
        "nbytes": written,
        "objects": len(object_keys),
        "skipped": len(metas) - len(chosen),
    }


def convert(
    src: PathLike,
    dst: PathLike,
    to_format: str,
    *,
    keys: Optional[str] = None,
    exclude: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    model_only: bool = False,
    max_shard_size: Optional[int] = None,
    trusted: bool = False,
    overwrite: bool = False,
    read_budget: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> Dict[str, Any]:
    """Convert ``src`` (checkpoint, safetensors, torch.save file) into a new ``dst`` of format
    ``to_format`` (``torch_dist``, ``zarr``, ``safetensors``, ``torch``), tensor by tensor.

    Checkpoint sources stream through :func:`distckpt.tools.convert.stream_checkpoint`; file
    sources through :func:`stream_tensors`. ``model_only`` drops keys starting with
    ``optimizer.`` and the common state's ``optimizer`` entry. Memory stays near
    ``max(read_budget, largest tensor)`` (``read_budget`` default: the host memory budget,
    :func:`distckpt.host_memory_budget`).

    Returns ``{"tensors", "nbytes", "objects", "skipped", "dropped_common_entries",
    "dropped_objects"}`` (the last two: what a tensor-only output left out).
    """
    from distckpt import storage
    from distckpt.budget import host_memory_budget
    from distckpt.core import CONFIG_FNAME
    from distckpt.tools import convert as convert_tool
    from distckpt.tools.inspect import open_source

    src_remote, dst_remote = storage.is_remote(src), storage.is_remote(dst)
    src = src if src_remote else Path(src)
    dst = dst if dst_remote else Path(dst)
    if not src_remote and not src.exists():
        raise CheckpointingException(f"{src}: no such file or directory")
    if not (src_remote or dst_remote) and dst.exists() and os.path.samefile(src, dst):
        raise CheckpointingException(f"{dst}: cannot convert into the source itself")
    if dst_remote and to_format in FILE_FORMATS:
        raise CheckpointingException(
            f"{dst}: {to_format} output goes to a local path; object stores take checkpoints (torch_dist)"
        )
    budget = host_memory_budget() if read_budget is None else read_budget
    if to_format in FILE_FORMATS:
        writer = make_file_writer(to_format, dst, max_shard_size, overwrite=overwrite)
    else:
        if max_shard_size is not None:
            raise CheckpointingException("max_shard_size applies to safetensors output only")
        writer = convert_tool.get_writer(to_format, dst, overwrite=overwrite)
    if model_only:
        exclude = model_only_exclude(exclude)
        writer = DropCommonEntries(writer, ["optimizer"])
    if src_remote or (src.is_dir() and (src / CONFIG_FNAME).exists()):
        report = convert_tool.stream_checkpoint(
            src,
            writer,
            keys=keys,
            exclude=exclude,
            dtype=dtype,
            progress=progress,
            trusted=trusted,
            read_budget_bytes=budget,
            dst_name=str(dst),
            dst_backend=to_format,
        )
        summary = {
            "tensors": len(report.tensors),
            "nbytes": report.tensor_bytes,
            "objects": len(report.objects),
            "skipped": len(report.skipped),
        }
    else:
        with open_source(src, trusted) as source:
            summary = stream_tensors(
                source, writer, keys=keys, exclude=exclude, dtype=dtype, progress=progress, read_budget=budget
            )
    inner = writer.inner if isinstance(writer, DropCommonEntries) else writer
    summary["dropped_common_entries"] = getattr(inner, "dropped_common", 0)
    summary["dropped_objects"] = getattr(inner, "dropped_objects", 0)
    return summary


def _register_writers() -> None:
    from distckpt.tools.convert import register_writer

    register_writer("safetensors", SafetensorsWriter)
    register_writer("torch", TorchFileWriter)


_register_writers()
