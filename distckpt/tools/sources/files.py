"""Plain tensor files read as tensor sources: safetensors (single or HF-sharded) and ``torch.save``.

:class:`SafetensorsSource` and :class:`TorchFileSource` are tensor sources like a checkpoint (see
:mod:`distckpt.tools.sources.base`), so ``inspect``, ``show``, ``diff`` and ``convert`` work on them
too. A safetensors tensor is read with ``pread`` straight into its memory; a ``torch.save`` file
is memory-mapped where its format allows and its pages are released once a tensor was copied.
The writers of these formats are in :mod:`distckpt.tools.writers.files`.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import struct
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from safetensors import safe_open

from distckpt import containment
from distckpt.core import CheckpointingException, PathLike
from distckpt.io.byteio import byte_view, pread_exact
from distckpt.strategies.common import SAFE_GLOBALS
from distckpt.tools.sources.base import TensorMeta, TensorSource

INDEX_FNAME = "model.safetensors.index.json"
SINGLE_FNAME = "model.safetensors"

SAFETENSORS_DTYPES: Dict[str, torch.dtype] = {
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
SAFETENSORS_CODES: Dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1000 * 1000  # the safetensors library refuses larger headers

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
                dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
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
                    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
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
