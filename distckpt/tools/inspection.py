"""Describe and peek into any tensor source: open it, inspect its metadata, read a slice of a key.

:func:`open_source` opens a path as the right tensor source: a distckpt/Megatron checkpoint
directory (:class:`~distckpt.tools.sources.checkpoint.CheckpointSource`, any registered backend)
or a plain file (``torch.save`` state dict, safetensors file or HF-sharded folder; see
:mod:`distckpt.tools.sources.files`). :func:`inspect_source` describes a source from its metadata
alone; :func:`key_tree_rows` lays its keys out as a tree; :func:`read_tensor` reads one key, or
only the box a numpy-style slice (:func:`parse_slice`) covers. The other tools (verify, diff,
export, surgery) and the ``distckpt`` command build on these.

Everything here runs in one process with no ``torch.distributed`` process group, on CPU, and
reads only the bytes it needs: metadata for :func:`inspect_source`, the overlapping chunks for
:func:`read_tensor` (a box of one key), one key (or a group of small keys) at a time for
:meth:`~distckpt.tools.sources.base.TensorSource.iter_tensors`.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from distckpt import storage
from distckpt.core import CONFIG_FNAME, CheckpointingException
from distckpt.tools.sources.base import ObjectMeta, Shape, TensorMeta, TensorSource, dtype_name
from distckpt.tools.sources.checkpoint import CheckpointSource
from distckpt.tools.sources.files import SafetensorsSource, TorchFileSource, is_safetensors


def open_source(path: storage.Location, trusted: bool = False) -> TensorSource:
    """Open a checkpoint directory, a safetensors file/folder or a ``torch.save`` file.

    Raises:
        CheckpointingException: the path does not exist or is none of these.
    """
    if storage.is_remote(path):
        return CheckpointSource(path, trusted)
    path = Path(path)
    if not path.exists():
        raise CheckpointingException(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / CONFIG_FNAME).exists():
            return CheckpointSource(path, trusted)
        if is_safetensors(path):
            return SafetensorsSource(path)
        return CheckpointSource(path, trusted)  # raises with the "not committed" explanation
    if is_safetensors(path):
        return SafetensorsSource(path)
    return TorchFileSource(path, trusted)


# --------------------------------------------------------------------------- inspect


@dataclass
class SourceInfo:
    """Everything ``distckpt inspect`` shows; :meth:`to_json` is the ``--json`` document."""

    path: str
    format: str
    format_version: Optional[int]
    tensors: List[TensorMeta]
    objects: List[ObjectMeta]
    common: Any  # a summary (see :func:`summarize`), or None
    common_error: Optional[str]  # why the common state could not be read
    content_metadata: Any
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "num_tensors": len(self.tensors),
            "num_objects": len(self.objects),
            "nbytes": self.nbytes,
            **self.extra,
            "tensors": [t.to_json() for t in self.tensors],
            "objects": [o.to_json() for o in self.objects],
            "common": self.common,
            "common_error": self.common_error,
            "content_metadata": summarize(self.content_metadata),
        }


def inspect_source(path: storage.Location, trusted: bool = False) -> SourceInfo:
    """Describe a checkpoint or tensor file from its metadata (no tensor data is read).

    A common state that cannot be unpickled safely is reported in ``common_error`` instead of
    failing the whole inspection.
    """
    with open_source(path, trusted) as src:
        common, common_error, content = None, None, None
        try:
            common = summarize(src.common())
            content = src.content_metadata()
        except CheckpointingException as e:
            common_error = str(e)
        return SourceInfo(
            str(src.path),
            src.format,
            src.format_version,
            list(src.tensors().values()),
            list(src.objects().values()),
            common,
            common_error,
            content,
            src.extra(),
        )


def summarize(obj: Any, max_items: int = 20, max_str: int = 80, depth: int = 6) -> Any:
    """A JSON-able preview of a nested structure: tensors and arrays become
    ``"tensor[8, 6] float32"``, long containers and strings are cut."""
    if isinstance(obj, torch.Tensor):
        return f"tensor{list(obj.shape)} {dtype_name(obj.dtype)}"
    if type(obj).__name__ == "ndarray":
        return f"ndarray{list(obj.shape)} {obj.dtype}"
    if obj is None or isinstance(obj, (bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, str):
        return obj if len(obj) <= max_str else obj[:max_str] + f"... ({len(obj)} chars)"
    if isinstance(obj, bytes):
        return f"bytes[{len(obj)}]"
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if depth <= 0:
        return f"{type(obj).__name__}(...)"
    if isinstance(obj, dict):
        items = list(obj.items())
        out = {str(k): summarize(v, max_items, max_str, depth - 1) for k, v in items[:max_items]}
        if len(items) > max_items:
            out["..."] = f"{len(items) - max_items} more entries"
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        seq = list(obj)
        out_list = [summarize(v, max_items, max_str, depth - 1) for v in seq[:max_items]]
        if len(seq) > max_items:
            out_list.append(f"... {len(seq) - max_items} more items")
        return tuple(out_list) if isinstance(obj, tuple) else out_list
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return str(obj)
    text = repr(obj)
    return text if len(text) <= max_str else text[:max_str] + "..."


# --------------------------------------------------------------------------- key trees


@dataclass
class KeyTreeRow:
    """One row of the key tree: ``label`` (with tree guides), the tensor (leaf) or the aggregate
    of the subtree (``count`` tensors, ``nbytes``/``disk_bytes`` summed)."""

    label: str
    depth: int
    meta: Optional[TensorMeta]
    count: int
    nbytes: int
    disk_bytes: Optional[int]


def key_tree_rows(
    metas: Sequence[TensorMeta], max_depth: Optional[int] = None, sep: str = "."
) -> List[KeyTreeRow]:
    """Lay out keys as a tree split on ``sep``: chains of single children are merged into one
    label (``decoder.layers.0``), keys keep their stored order. Below ``max_depth`` a subtree is
    shown as one aggregate row."""
    root: Dict[str, Any] = {}
    for m in metas:
        node = root
        parts = m.key.split(sep)
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node.setdefault(parts[-1], {})["\0leaf"] = m

    rows: List[KeyTreeRow] = []

    def leaves(node: Dict[str, Any]) -> List[TensorMeta]:
        out = []
        for k, child in node.items():
            if k == "\0leaf":
                out.append(child)
            else:
                out.extend(leaves(child))
        return out

    def emit(name: str, node: Dict[str, Any], prefix: str, last: bool, depth: int, top: bool) -> None:
        # merge chains: a node with no leaf of its own and exactly one child
        while "\0leaf" not in node and len(node) == 1:
            ((child_name, child),) = node.items()
            name, node = f"{name}{sep}{child_name}", child
        guide = "" if top else ("└── " if last else "├── ")
        own = node.get("\0leaf")
        children = [(k, v) for k, v in node.items() if k != "\0leaf"]
        subtree = leaves(node)
        collapsed = max_depth is not None and depth >= max_depth and children
        disk = [m.disk_bytes for m in subtree]
        if own is not None and not children:
            rows.append(KeyTreeRow(prefix + guide + name, depth, own, 1, own.nbytes, own.disk_bytes))
            return
        rows.append(
            KeyTreeRow(
                prefix + guide + name,
                depth,
                own if not collapsed else None,
                len(subtree),
                sum(m.nbytes for m in subtree),
                None if any(d is None for d in disk) else sum(disk),
            )
        )
        if collapsed:
            return
        child_prefix = prefix + ("" if top else ("    " if last else "│   "))
        for i, (k, v) in enumerate(children):
            emit(k, v, child_prefix, i == len(children) - 1, depth + 1, False)

    for i, (k, v) in enumerate(root.items()):
        emit(k, v, "", i == len(root) - 1, 0, True)
    return rows


# --------------------------------------------------------------------------- show


_INDEX = re.compile(r"^\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?(?::\s*(-?\d+)?\s*)?$")


def parse_slice(text: str, shape: Shape) -> Tuple[Shape, Shape, Tuple[Any, ...]]:
    """Parse ``"0:4,:"``-style numpy indexing against ``shape``.

    Returns ``(offset, size, post)``: the bounding box to read and the index to apply to it
    afterwards (steps, and integer indices that drop an axis). Supports integers (negative
    too), ``start:stop:step`` with a positive step, and one ``...``.

    Raises:
        CheckpointingException: malformed, too many indices, or out of range.
    """
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    if parts.count("...") > 1:
        raise CheckpointingException(f"slice {text!r}: at most one '...'")
    if "..." in parts:
        i = parts.index("...")
        fill = len(shape) - (len(parts) - 1)
        if fill < 0:
            raise CheckpointingException(
                f"slice {text!r} has more indices than the tensor's {len(shape)} axes"
            )
        parts = parts[:i] + [":"] * fill + parts[i + 1 :]
    if len(parts) > len(shape):
        raise CheckpointingException(
            f"slice {text!r} has {len(parts)} indices; the tensor has {len(shape)} axes {list(shape)}"
        )
    parts += [":"] * (len(shape) - len(parts))
    offset, size, post = [], [], []
    for axis, (part, n) in enumerate(zip(parts, shape)):
        m = _INDEX.match(part)
        if not m or part == "":
            raise CheckpointingException(f"slice {text!r}: cannot parse {part!r} (use e.g. 0:4,:,3)")
        if ":" not in part:
            i = int(m.group(1))
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                raise CheckpointingException(
                    f"slice {text!r}: index {i} is out of range for axis {axis} of size {n}"
                )
            offset.append(j)
            size.append(1)
            post.append(0)
            continue
        start, stop, step = (int(g) if g is not None else None for g in m.groups())
        if step is not None and step <= 0:
            raise CheckpointingException(f"slice {text!r}: only positive steps are supported")
        lo, hi, st = slice(start, stop, step).indices(n)
        hi = max(lo, hi)
        offset.append(lo)
        size.append(hi - lo)
        post.append(slice(None, None, st))
    return tuple(offset), tuple(size), tuple(post)


def read_tensor(source: TensorSource, key: str, slice_text: Optional[str] = None) -> torch.Tensor:
    """Read ``key`` whole or, with ``slice_text`` (``"0:4,:"``), only the sliced box of it."""
    meta = source.meta(key)
    if not slice_text:
        return source.read(key)
    offset, size, post = parse_slice(slice_text, meta.shape)
    box = source.read(key, offset, size)
    return box[post] if post else box
