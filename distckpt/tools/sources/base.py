"""What the tools read from: tensor sources, their plain metadata, progress reporting, dtypes.

A *tensor source* is something tensors can be read from one key (or one box of a key) at a
time. :class:`TensorSource` is the base every kind of source fills in: a checkpoint directory
(:class:`~distckpt.tools.sources.checkpoint.CheckpointSource`) or a plain tensor file
(:mod:`distckpt.tools.sources.files`); :func:`~distckpt.tools.inspection.open_source` picks the
right one for a path. What a source knows without reading data is plain data here
(:class:`TensorMeta`, :class:`ObjectMeta`), and long-running tools report to a :class:`Progress`.

This is the ground floor of :mod:`distckpt.tools`: it imports no other tool module.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from distckpt.core import CheckpointingException

Shape = Tuple[int, ...]

DEFAULT_READ_BUDGET = 64 << 20
"""Small keys are read together until a group holds this many bytes (or the largest tensor)."""


# --------------------------------------------------------------------------- progress


class Progress(Protocol):
    """What long-running tools report to: the CLI passes a progress bar, tests a recorder.

    ``start`` is called once per phase with the phase's total (bytes), ``advance`` as work is done.
    """

    def start(self, total: int, description: str) -> None: ...

    def advance(self, amount: int) -> None: ...


class NoProgress:
    """A :class:`Progress` that ignores everything."""

    def start(self, total: int, description: str) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


# --------------------------------------------------------------------------- plain data


@dataclass(frozen=True)
class TensorMeta:
    """What is known about one stored tensor without reading its data.

    Attributes:
        key: the tensor's key.
        shape: its global shape (for flattened keys: the original shape, not the stored one).
        dtype: element type.
        stored_shape: the shape on disk when it differs from ``shape`` (``torch_dist`` stores
            flattened-range keys N-D reformulated: the chunk grid plus one flat axis).
        chunks: number of stored pieces (DCP chunks, Zarr chunks, safetensors: 1), if known.
        chunk_shape: the Zarr chunk shape, if the format has a regular grid.
        disk_bytes: bytes the tensor's pieces take on disk (format overhead included), if known.
    """

    key: str
    shape: Shape
    dtype: torch.dtype
    stored_shape: Optional[Shape] = None
    chunks: Optional[int] = None
    chunk_shape: Optional[Shape] = None
    disk_bytes: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's values (``numel * itemsize``)."""
        return self.numel * dtype_itemsize(self.dtype)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "key": self.key,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "nbytes": self.nbytes,
        }
        if self.stored_shape is not None:
            out["stored_shape"] = list(self.stored_shape)
        for name in ("chunks", "disk_bytes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.chunk_shape is not None:
            out["chunk_shape"] = list(self.chunk_shape)
        return out


@dataclass(frozen=True)
class ObjectMeta:
    """One stored ShardedObject (by unique key, e.g. ``rng_state/shard_0_2``)."""

    key: str
    disk_bytes: Optional[int] = None
    where: Optional[str] = None  # file (and offset) holding it

    def to_json(self) -> Dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def dtype_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def parse_dtype(text: str) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    name = text.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointingException(
            f"unknown dtype {text!r} (examples: bf16, fp16, fp32, float8_e4m3fn, int64)"
        )
    return dtype


# --------------------------------------------------------------------------- sources


class TensorSource:
    """Tensors (and common state, objects) readable key by key. Subclasses fill in the rest.

    Attributes:
        path: what was opened.
        format: ``torch_dist``, ``zarr``, ``safetensors``, ``torch`` or another backend name.
        format_version: the backend's format version, where there is one.
    """

    path: Path
    format: str
    format_version: Optional[int] = None

    def tensors(self) -> Dict[str, TensorMeta]:
        """Every stored tensor by key, in storage order (cached)."""
        raise NotImplementedError

    def objects(self) -> Dict[str, ObjectMeta]:
        """Every stored ShardedObject by unique key."""
        return {}

    def common(self) -> Dict[str, Any]:
        """The common (non-sharded) state; {} if the format has none."""
        return {}

    def content_metadata(self) -> Optional[dict]:
        return None

    def read(self, key: str, offset: Optional[Shape] = None, size: Optional[Shape] = None) -> torch.Tensor:
        """The tensor ``key`` whole, or its box ``[offset, offset + size)``."""
        raise NotImplementedError

    def read_many(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Several whole tensors at once (one pass over the storage where the format allows)."""
        return {k: self.read(k) for k in keys}

    def read_object(self, unique_key: str) -> Any:
        raise CheckpointingException(
            f"{self.path}: no ShardedObject {unique_key!r} in a {self.format} source"
        )

    def extra(self) -> Dict[str, Any]:
        """Format-specific facts for ``inspect`` (manifest, save id, file metadata, ...)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def meta(self, key: str) -> TensorMeta:
        """Metadata of ``key``; a CheckpointingException naming close matches if it is absent."""
        metas = self.tensors()
        if key not in metas:
            raise CheckpointingException(f"{self.path}: no tensor {key!r}{did_you_mean(key, metas)}")
        return metas[key]

    def iter_tensors(
        self,
        keys: Optional[Iterable[str]] = None,
        budget: Optional[int] = None,
        progress: Optional[Progress] = None,
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield ``(key, tensor)`` for ``keys`` (default: all), holding few tensors at a time.

        Keys are read in groups whose values total at most ``max(budget, largest tensor)`` bytes
        (``budget`` defaults to :data:`DEFAULT_READ_BUDGET`); a tensor larger than the budget is
        read alone. The caller should drop each tensor before asking for the next group.
        ``progress.advance`` receives each tensor's value bytes.
        """
        for group in self.group_keys(keys, budget):
            yield from self._read_group(group, progress)

    def group_keys(
        self, keys: Optional[Iterable[str]] = None, budget: Optional[int] = None
    ) -> List[List[str]]:
        """Cut ``keys`` (default: all) into consecutive groups of at most ``budget`` value bytes
        (default :data:`DEFAULT_READ_BUDGET`); a larger tensor forms a group of its own."""
        keys = list(self.tensors()) if keys is None else list(keys)
        budget = DEFAULT_READ_BUDGET if budget is None else budget
        groups: List[List[str]] = []
        size = 0
        for key in keys:
            nbytes = self.meta(key).nbytes
            if groups and groups[-1] and size + nbytes <= budget:
                groups[-1].append(key)
                size += nbytes
            else:
                groups.append([key])
                size = nbytes
        return groups

    def _read_group(
        self, group: List[str], progress: Optional[Progress]
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        loaded = self.read_many(group) if len(group) > 1 else {group[0]: self.read(group[0])}
        for key in group:
            tensor = loaded.pop(key)
            if progress is not None:
                progress.advance(self.meta(key).nbytes)
            yield key, tensor
            del tensor


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'a', 'b'?)`` naming up to three close matches of ``key``, or ``""``."""
    close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
