"""Convert a checkpoint to another backend (``torch_dist`` <-> ``zarr``), one tensor at a time.

:func:`convert_checkpoint` reads any committed checkpoint (distckpt's or Megatron-Core's, any
registered backend and version) in a single process, without a process group, and streams it
into a :class:`CheckpointWriter`: the common state and the ShardedObjects first, then every
tensor whole, then the commit. Memory stays bounded by ``max(read_budget_bytes, largest tensor)``
plus the objects and common state: keys are loaded in small groups (tensors smaller than the
budget together, each larger one alone) and each is dropped once written.

Writers are pluggable: a writer is anything with ``begin(common, objects)``,
``write_tensor(key, tensor)`` and ``finish()``; :func:`register_writer` adds one under a name
(the CLI adds plain ``torch`` and ``safetensors`` outputs this way). The built-in writers
(:mod:`distckpt.tools.writers.checkpoint`, re-exported here) produce distckpt checkpoints that
are committed the distckpt way: nothing old in the destination can be mistaken for the result
(stale commit files go first), the integrity manifest covers every file, and ``metadata.json`` is
written last, atomically.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Pattern, Protocol, Union

import torch

from distckpt import containment, storage
from distckpt.budget import host_memory_budget
from distckpt.core import CheckpointingException
from distckpt.dcp_native import checkpoint_config, describe_missing_config
from distckpt.mapping import ShardedObject, ShardedTensor, StateDict
from distckpt.serialization import read_common_state
from distckpt.strategies.base import StrategyAction, get_default_strategy
from distckpt.tools.writers.checkpoint import DistckptWriter, TorchDistWriter, ZarrWriter

__all__ = [
    "CheckpointWriter",
    "ConversionReport",
    "DistckptWriter",
    "TorchDistWriter",
    "ZarrWriter",
    "convert_checkpoint",
    "get_writer",
    "register_writer",
    "stream_checkpoint",
]

# None: the host memory budget of distckpt.budget (DISTCKPT_HOST_MEMORY_BUDGET).
DEFAULT_READ_BUDGET_BYTES: Optional[int] = None

# --------------------------------------------------------------------------- writer protocol


class CheckpointWriter(Protocol):
    """Where a conversion streams to. Called in this order, once each except ``write_tensor``:

    ``begin(common, objects)``: the common state (including stored content metadata) and every
    ShardedObject payload by unique key (``"rng_state/shard_0_2"``);
    ``write_tensor(key, tensor)``: one whole global tensor (CPU), once per key;
    ``finish()``: make the output complete (for a checkpoint: commit it); returns a summary;
    ``abort()``: instead of ``finish`` when the conversion failed: drop what was written. Until
    ``finish`` returns, the output must not look complete.
    """

    def begin(self, common: StateDict, objects: Dict[str, Any]) -> None: ...

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None: ...

    def finish(self) -> Any: ...

    def abort(self) -> None: ...


WriterFactory = Callable[..., CheckpointWriter]
_WRITERS: Dict[str, WriterFactory] = {}


def register_writer(name: str, factory: WriterFactory) -> None:
    """Make ``convert_checkpoint(..., to_backend=name)`` use ``factory(dst_dir, **writer_options)``."""
    _WRITERS[name] = factory


def get_writer(name: str, dst_dir: storage.Location, **options: Any) -> CheckpointWriter:
    """A new writer of kind ``name`` into ``dst_dir``.

    Raises:
        CheckpointingException: no writer of that name; the message lists the known ones.
    """
    try:
        factory = _WRITERS[name]
    except KeyError:
        raise CheckpointingException(
            f"no checkpoint writer {name!r}; known: {', '.join(sorted(_WRITERS))}"
        ) from None
    return factory(dst_dir if storage.is_remote(dst_dir) else Path(dst_dir), **options)


register_writer("torch_dist", TorchDistWriter)
register_writer("zarr", ZarrWriter)


# --------------------------------------------------------------------------- reading side


class _Source:
    """A committed checkpoint read through the registered load strategies, key by key."""

    def __init__(self, path: Union[Path, storage.Store], trusted: bool):
        local = storage.local_root(path)  # None: an object store, a "folder" by its keys
        is_folder = local is None or local.is_dir()
        config = checkpoint_config(path) if is_folder else None
        if config is None:
            raise CheckpointingException(
                f"not a committed checkpoint: {describe_missing_config(path)}"
                if is_folder
                else f"{path}: not a committed checkpoint (not a folder)"
            )
        self.path = path
        self.config = config
        self.sharded = get_default_strategy(
            StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
        )
        self.common = get_default_strategy(
            StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version
        )
        for strategy in (self.sharded, self.common):
            if hasattr(strategy, "trusted"):
                strategy.trusted = trusted

    def tensors(self) -> Dict[str, ShardedTensor]:
        return dict(self.sharded.load_tensors_metadata(self.path))

    def objects(self) -> Dict[str, ShardedObject]:
        found = dict(self.sharded.load_sharded_metadata(self.path))
        if not self.sharded.can_handle_sharded_objects:
            found.update(self.common.load_sharded_metadata(self.path))
        return {k: v for k, v in sorted(found.items()) if isinstance(v, ShardedObject)}

    def load_object(self, unique_key: str, obj: ShardedObject) -> Any:
        request = {unique_key: obj.without_data()}
        if self.sharded.can_handle_sharded_objects:
            return self.sharded.load(request, self.path)[unique_key]
        return self.common.load_sharded_objects(request, self.path)[unique_key]

    def load_tensors(self, metas: Dict[str, ShardedTensor]) -> Dict[str, torch.Tensor]:
        # Without data: the strategy allocates each tensor only after checking that the
        # checkpoint stores its bytes (a claimed shape of 2^40 elements is refused, not allocated).
        request = {
            key: ShardedTensor(
                key,
                None,
                m.dtype,
                tuple(m.global_shape),
                tuple(m.global_shape),
                (0,) * len(m.global_shape),
                None,
                0,
            )
            for key, m in metas.items()
        }
        return self.sharded.load(request, self.path)


def _nbytes(meta: ShardedTensor) -> int:
    n = torch.empty((), dtype=meta.dtype).element_size()
    for s in meta.global_shape:
        n *= s
    return n


def _groups(metas: Dict[str, ShardedTensor], budget: int) -> Iterator[List[str]]:
    group: List[str] = []
    size = 0
    for key, meta in metas.items():
        nbytes = _nbytes(meta)
        if group and size + nbytes > budget:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


# --------------------------------------------------------------------------- conversion


@dataclass
class ConversionReport:
    """What a conversion did.

    Attributes:
        tensors: keys written, in order.
        tensor_bytes: bytes of tensor values written (after any cast).
        objects: ShardedObject unique keys written.
        skipped: tensor keys and object unique keys left out by ``keys`` / ``exclude``.
        cast: keys whose dtype was changed by ``dtype``.
        seconds: wall time.
    """

    src: str
    dst: str
    src_backend: str
    dst_backend: str
    tensors: List[str] = field(default_factory=list)
    tensor_bytes: int = 0
    objects: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    cast: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


Progress = Union[Callable[[int, int, str], None], Any]
KeyFilter = Union[None, str, Pattern[str]]


def _matcher(keys: KeyFilter, exclude: KeyFilter) -> Callable[[str], bool]:
    try:
        inc = re.compile(keys) if isinstance(keys, str) else keys
        exc = re.compile(exclude) if isinstance(exclude, str) else exclude
    except re.error as e:
        raise CheckpointingException(f"invalid key pattern: {e}") from None

    def wanted(key: str) -> bool:
        return (inc is None or inc.search(key) is not None) and (exc is None or exc.search(key) is None)

    return wanted


def stream_checkpoint(
    src_dir: storage.Location,
    writer: CheckpointWriter,
    *,
    keys: KeyFilter = None,
    exclude: KeyFilter = None,
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Progress] = None,
    trusted: bool = False,
    read_budget_bytes: Optional[int] = DEFAULT_READ_BUDGET_BYTES,
    dst_name: str = "",
    dst_backend: str = "",
) -> ConversionReport:
    """Stream the checkpoint at ``src_dir`` into ``writer`` (see :func:`convert_checkpoint`).

    ``progress`` is either a callable ``progress(done_bytes, total_bytes, key)`` called after
    each tensor, or an object with ``start(total, description)`` and ``advance(amount)``
    (:class:`distckpt.tools.sources.base.Progress`).
    """
    started = time.perf_counter()
    src = _Source(storage.resolve(src_dir), trusted)
    wanted = _matcher(keys, exclude)
    report = ConversionReport(str(src_dir), dst_name, src.config.sharded_backend, dst_backend)
    if read_budget_bytes is None:
        read_budget_bytes = host_memory_budget()
    try:
        _stream(src, writer, wanted, dtype, progress, read_budget_bytes, report)
    except BaseException:
        if hasattr(writer, "abort"):
            writer.abort()
        raise
    report.seconds = time.perf_counter() - started
    return report


def _stream(
    src: _Source,
    writer: CheckpointWriter,
    wanted: Callable[[str], bool],
    dtype: Optional[torch.dtype],
    progress: Optional[Progress],
    read_budget_bytes: int,
    report: ConversionReport,
) -> None:
    metas = src.tensors()
    selected = {k: m for k, m in metas.items() if wanted(k)}
    report.skipped += [k for k in metas if k not in selected]
    objects = {}
    for unique_key, obj in src.objects().items():
        # A ShardedObject key becomes a file name in a zarr destination: refused here, before
        # anything is written, if it could name a file outside the destination.
        containment.check_name(f"{unique_key}.pt", src.path, "ShardedObject key as a file name")
        if wanted(obj.key):
            objects[unique_key] = src.load_object(unique_key, obj)
        else:
            report.skipped.append(unique_key)
    writer.begin(read_common_state(src.path, src.sharded, src.common), objects)
    report.objects = list(objects)
    del objects

    total = sum(_nbytes(m) for m in selected.values())
    done = 0
    if progress is not None and hasattr(progress, "start"):
        progress.start(total, f"converting {len(selected)} tensors")
    for group in _groups(selected, read_budget_bytes):
        loaded = src.load_tensors({k: selected[k] for k in group})
        for key in group:
            tensor = loaded.pop(key)
            if dtype is not None and tensor.dtype != dtype and tensor.dtype.is_floating_point:
                tensor = tensor.to(dtype)
                report.cast.append(key)
            writer.write_tensor(key, tensor)
            report.tensors.append(key)
            report.tensor_bytes += tensor.numel() * tensor.element_size()
            nbytes = _nbytes(selected[key])
            done += nbytes
            del tensor
            if progress is not None:
                if hasattr(progress, "advance"):
                    progress.advance(nbytes)
                else:
                    progress(done, total, key)
    writer.finish()


def convert_checkpoint(
    src_dir: storage.Location,
    dst_dir: storage.Location,
    to_backend: str,
    *,
    keys: KeyFilter = None,
    exclude: KeyFilter = None,
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Progress] = None,
    trusted: bool = False,
    overwrite: bool = False,
    read_budget_bytes: Optional[int] = DEFAULT_READ_BUDGET_BYTES,
    writer_options: Optional[Dict[str, Any]] = None,
) -> ConversionReport:
    """Convert the checkpoint at ``src_dir`` into a new ``to_backend`` checkpoint at ``dst_dir``.

    Single process, no process group. Every tensor is read whole (resharding to one piece) and
    written whole; the common state (content metadata included) and every ShardedObject are
    carried over unchanged. The result is committed only at the end (``metadata.json`` last),
    so an interrupted conversion never looks like a checkpoint.

    Args:
        to_backend: a registered writer: ``"torch_dist"``, ``"zarr"`` or one added with
            :func:`register_writer`.
        keys: regex; only tensors (and objects) whose key matches (``re.search``) are converted.
        exclude: regex; tensors (and objects) whose key matches are left out.
        dtype: cast floating-point tensors to this dtype (integer and bool tensors are kept).
        progress: see :func:`stream_checkpoint`.
        trusted: unpickle the source's metadata, common state and objects without the allowlist.
        overwrite: allow a non-empty ``dst_dir``.
        read_budget_bytes: tensors are loaded in groups of at most this many bytes (a larger
            tensor alone): the memory bound of the conversion. Default: the host memory budget
            (:func:`distckpt.host_memory_budget`).
        writer_options: extra arguments of the writer (e.g. ``{"max_chunk_bytes": 64 << 20}``).

    Raises:
        CheckpointingException: the source is not a committed checkpoint, the destination is the
            source or not empty, or reading or writing failed (naming key and file).
    """
    src, dst = storage.resolve(src_dir), storage.resolve(dst_dir)
    local_src, local_dst = storage.local_root(src), storage.local_root(dst)
    if (
        local_src is not None
        and local_dst is not None
        and local_dst.exists()
        and local_src.exists()
        and os.path.samefile(local_src, local_dst)
    ):
        raise CheckpointingException(f"{dst}: cannot convert a checkpoint into its own folder")
    writer = get_writer(to_backend, dst, overwrite=overwrite, **(writer_options or {}))
    return stream_checkpoint(
        src,
        writer,
        keys=keys,
        exclude=exclude,
        dtype=dtype,
        progress=progress,
        trusted=trusted,
        read_budget_bytes=read_budget_bytes,
        dst_name=str(dst),
        dst_backend=to_backend,
    )
