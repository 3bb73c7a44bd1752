"""Any tensor source into any format: what ``distckpt convert`` runs (:func:`convert`).

A checkpoint source goes through :func:`distckpt.tools.convert.stream_checkpoint`, a file source
(safetensors or ``torch.save``) through :func:`stream_tensors` -- so a plain tensor file is
imported into a new ``torch_dist``/``zarr`` checkpoint tensor by tensor, and a checkpoint is
exported into a safetensors folder or a ``torch.save`` file the same way. Importing this module
registers the ``safetensors`` and ``torch`` writers with
:func:`distckpt.tools.convert.register_writer`.

The file formats themselves have their readers in :mod:`distckpt.tools.sources.files` and their
writers in :mod:`distckpt.tools.writers.files`; this module re-exports both (as it held them
before), so ``export.SafetensorsWriter``, ``export.is_safetensors``, ... keep working.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from distckpt import storage
from distckpt.budget import host_memory_budget
from distckpt.core import CONFIG_FNAME, CheckpointingException
from distckpt.tools import convert as convert_tool
from distckpt.tools.inspection import open_source
from distckpt.tools.sources.base import Progress, TensorSource
from distckpt.tools.sources.files import (
    INDEX_FNAME,
    SINGLE_FNAME,
    SafetensorsSource,
    TorchFileSource,
    is_safetensors,
    read_safetensors_header,
)
from distckpt.tools.writers.files import (
    DEFAULT_MAX_SHARD_SIZE,
    SafetensorsWriter,
    TorchFileWriter,
    make_file_writer,
    parse_size,
)

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FILE_FORMATS",
    "INDEX_FNAME",
    "OPTIMIZER_PREFIX",
    "SINGLE_FNAME",
    "DropCommonEntries",
    "SafetensorsSource",
    "SafetensorsWriter",
    "TorchFileSource",
    "TorchFileWriter",
    "convert",
    "is_safetensors",
    "make_file_writer",
    "model_only_exclude",
    "parse_size",
    "read_safetensors_header",
    "stream_tensors",
]

FILE_FORMATS = ("safetensors", "torch")
OPTIMIZER_PREFIX = "optimizer."


def _wanted(keys: Optional[str], exclude: Optional[str]) -> Callable[[str], bool]:
    try:
        inc = re.compile(keys) if keys else None
        exc = re.compile(exclude) if exclude else None
    except re.error as e:
        raise CheckpointingException(f"invalid key pattern: {e}") from None
    return lambda k: (inc is None or inc.search(k) is not None) and (exc is None or exc.search(k) is None)


def model_only_exclude(exclude: Optional[str]) -> str:
    """``exclude`` extended to drop optimizer state (keys starting with ``optimizer.``)."""
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
    src: storage.Location,
    dst: storage.Location,
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


convert_tool.register_writer("safetensors", SafetensorsWriter)
convert_tool.register_writer("torch", TorchFileWriter)
