"""Convert a checkpoint to another backend (``torch_dist`` <-> ``zarr``), one tensor at a time.

:func:`convert_checkpoint` reads any committed checkpoint (distckpt's or Megatron-Core's, any
registered backend and version) in a single process, without a process group, and streams it
into a :class:`CheckpointWriter`: the common state and the ShardedObjects first, then every
tensor whole, then the commit. Memory stays bounded by ``max(read_budget_bytes, largest tensor)``
plus the objects and common state: keys are loaded in small groups (tensors smaller than the
budget together, each larger one alone) and each is dropped once written.

Writers are pluggable: a writer is anything with ``begin(common, objects)``,
``write_tensor(key, tensor)`` and ``finish()``; :func:`register_writer` adds one under a name
(the CLI adds plain ``torch`` and ``safetensors`` outputs this way). The built-in writers produce
distckpt checkpoints that are committed the distckpt way: nothing old in the destination can be
mistaken for the result (stale commit files go first), the integrity manifest covers every file,
and ``metadata.json`` is written last, atomically.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Pattern, Protocol, Tuple, Union

import torch

from distckpt import commit, containment, storage
from distckpt.core import (
    CheckpointingConfig,
    CheckpointingException,
    PathLike,
    atomic_write_bytes,
    write_all,
    write_file_durably,
)
from distckpt.dcp_native import checkpoint_config, describe_missing_config
from distckpt.manifest import build_manifest, crc32c, write_manifest
from distckpt.mapping import ShardedObject, ShardedTensor, StateDict
from distckpt.serialization import read_common_state
from distckpt.strategies.base import StrategyAction, get_default_strategy

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


def get_writer(name: str, dst_dir: PathLike, **options: Any) -> CheckpointWriter:
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


# --------------------------------------------------------------------------- distckpt writers


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

    def __init__(self, dst_dir: PathLike, overwrite: bool = False):
        # Committed by the destination's protocol (distckpt.commit): on a file system written into
        # a staging directory beside it and swapped in at ``finish``, so an interrupted or failed
        # conversion leaves the destination as it was; on an object store written in place and
        # committed by a conditional put of metadata.json.
        self.target = commit.resolve_target(dst_dir)
        self.remote = isinstance(self.target, storage.Store)
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
        dst_dir: PathLike,
        overwrite: bool = False,
        *,
        max_chunk_bytes: Optional[int] = None,
        compression: Optional[str] = None,
        io_engine: str = "auto",
        thread_count: int = 4,
    ):
        from distckpt.strategies.zarr import FORMAT_VERSION, ZarrTensorWriter

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
        from distckpt.strategies.zarr import block_entries

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

    def __init__(self, dst_dir: PathLike, overwrite: bool = False, *, max_file_bytes: Optional[int] = None):
        super().__init__(dst_dir, overwrite)
        self.max_file_bytes = max_file_bytes
        self._file_index = -1
        self._fd: Optional[int] = None
        self._sink = None
        self._name = ""
        # key -> (dtype, shape) for tensors, None for objects; and (key, shape, file, offset, length).
        self._decls: Dict[str, Optional[Tuple[torch.dtype, Tuple[int, ...]]]] = {}
        self._items: List[Tuple[str, Optional[Tuple[int, ...]], str, int, int]] = []

    def _open_next(self) -> None:
        from distckpt.strategies.filesystem import ChecksummingSink, WriterSink

        self._close()
        self._file_index += 1
        self._name = f"__0_{self._file_index}.distcp"
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
        from distckpt.strategies.filesystem import write_bytes_item

        for unique_key, obj in objects.items():
            offset, length, crc = write_bytes_item(self._sink_for_next_item(), _torch_bytes([obj]))
            self._decls[unique_key] = None
            self._items.append((unique_key, None, self._name, offset, length))
            self.ranges.append((self._name, offset, length, crc, unique_key))

    def _release(self) -> None:
        if self._fd is not None:
            if self.remote:
                self._fd.abort()
            else:
                os.close(self._fd)
            self._fd = None

    def _write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        from distckpt.strategies.filesystem import write_tensor_item, zip_crc_disabled

        if key in self._decls:
            raise CheckpointingException(f"{self.dst}: key {key!r} written twice")
        shape = tuple(tensor.shape)
        self._decls[key] = (tensor.dtype, shape)
        if tensor.numel() == 0:
            return
        with zip_crc_disabled():
            offset, length, crc = write_tensor_item(self._sink_for_next_item(), _standalone(tensor))
        self._items.append((key, shape, self._name, offset, length))
        self.ranges.append((self._name, offset, length, crc, key))

    def _finish_data(self) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        self._close()
        chunks: Dict[str, List[Any]] = {}
        storage: Dict[Any, Any] = {}
        for key, shape, name, offset, length in self._items:
            if shape is None:
                storage[MetadataIndex(key)] = _StorageInfo(name, offset, length)
            else:
                zero = torch.Size((0,) * len(shape))
                chunks[key] = [ChunkStorageMetadata(zero, torch.Size(shape))]
                storage[MetadataIndex(key, zero)] = _StorageInfo(name, offset, length)
        state: Dict[str, Any] = {}
        for key, decl in self._decls.items():
            if decl is None:
                state[key] = BytesStorageMetadata()
            else:
                state[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=decl[0]),
                    size=torch.Size(decl[1]),
                    chunks=chunks.get(key, []),
                )
        md = Metadata(
            state_dict_metadata=state,
            planner_data=None,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(self.target), save_id=str(uuid.uuid4())),
        )
        md.mcore_data = {}
        data = pickle.dumps(md)
        if self.remote:
            self.dst.put(".metadata", data)
        else:
            atomic_write_bytes(self.dst / ".metadata", data)
        self._record_file(".metadata", data, ".metadata")


register_writer("torch_dist", TorchDistWriter)
register_writer("zarr", ZarrWriter)


# --------------------------------------------------------------------------- reading side


class _Source:
    """A committed checkpoint read through the registered load strategies, key by key."""

    def __init__(self, path, trusted: bool):
        is_folder = isinstance(path, storage.Store) or path.is_dir()
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
    src_dir: PathLike,
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
    (:class:`distckpt.tools.inspect.Progress`).
    """
    started = time.perf_counter()
    src = _Source(storage.resolve(src_dir), trusted)
    wanted = _matcher(keys, exclude)
    report = ConversionReport(str(src_dir), dst_name, src.config.sharded_backend, dst_backend)
    if read_budget_bytes is None:
        from distckpt.budget import host_memory_budget

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
    src_dir: PathLike,
    dst_dir: PathLike,
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
    if (
        isinstance(src, Path)
        and isinstance(dst, Path)
        and dst.exists()
        and src.exists()
        and os.path.samefile(src, dst)
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
