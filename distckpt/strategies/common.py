"""Common (non-sharded) state in ``common.pt`` and ShardedObjects as files; safe unpickling.

Layout: ``common.pt`` holds ``torch.save(common_state_dict)`` written by rank 0; a ShardedObject
that the sharded strategy cannot hold is ``<unique_key>.pt`` = ``torch.save(obj)``, e.g.
``rng_state/shard_0_2.pt``.

Loading is safe by default: ``torch.load(weights_only=True)`` admits tensors, containers and
primitive types plus the classes in an explicit allowlist (:func:`add_safe_globals`). Anything
else fails with a CheckpointingException naming the file; ``trusted=True`` lifts the restriction
for checkpoints whose origin you trust.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Tuple, Union

import numpy as np
import torch

from distckpt import bounds, containment, dist, storage
from distckpt.budget import host_memory_budget
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.formats.manifest import check_whole_bytes, check_whole_file, read_manifest
from distckpt.io.filesystem import ChecksummingSink, WriterSink, save_to_sink
from distckpt.mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from distckpt.strategies.base import (
    LoadCommonStrategy,
    SaveCommonStrategy,
)

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"


def _numpy_globals() -> List[Any]:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtype_classes = {
        type(np.dtype(t))
        for t in (
            np.bool_,
            np.int8,
            np.int16,
            np.int32,
            np.int64,
            np.uint8,
            np.uint16,
            np.uint32,
            np.uint64,
            np.float16,
            np.float32,
            np.float64,
        )
    }
    return [_reconstruct, np.ndarray, np.dtype, *dtype_classes]


# Classes beyond torch's weights_only defaults that checkpoints commonly hold and that are safe
# to construct: argparse.Namespace (Megatron stores its args so), numpy arrays (RNG states).
# add_safe_globals extends it; whoever loads without ``trusted`` passes it to torch.
SAFE_GLOBALS: List[Any] = [argparse.Namespace, *_numpy_globals()]
_SAFE_GLOBALS = SAFE_GLOBALS  # its old name (the same list), until every importer switches


def add_safe_globals(globals_: List[Any]) -> None:
    """Admit more classes when loading common state and objects without ``trusted=True``."""
    SAFE_GLOBALS.extend(globals_)


def safe_torch_load(
    source: Union[str, os.PathLike, BinaryIO, bytes],
    *,
    what: str,
    trusted: bool = False,
    map_location: Any = "cpu",
) -> Any:
    """``torch.load`` restricted to tensors, plain data and the allowlist unless ``trusted``.

    Raises:
        CheckpointingException: the payload needs a class outside the allowlist (nothing of it
        was executed), or it is not a readable torch archive. The message names ``what``.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                check_archive(f, what)
        else:
            check_archive(source, what)
        if trusted:
            loaded = torch.load(source, map_location=map_location, weights_only=False)
        else:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                loaded = torch.load(source, map_location=map_location, weights_only=True)
        bounds.check_nesting(loaded, what, "the unpickled state")
        return loaded
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        hint = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise CheckpointingException(
            f"{what}: refusing to unpickle a class outside the allowlist ({hint.strip()}); "
            f"if you trust this checkpoint pass trusted=True (CLI: --trust), or admit the class "
            f"with distckpt.add_safe_globals([...])"
        ) from None
    except FileNotFoundError as e:
        raise CheckpointingException(f"{what}: file not found") from e
    except (
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        MemoryError,
        # A damaged pickle stream makes the unpickler's own stack operations fail.
        IndexError,
        KeyError,
        TypeError,
        AttributeError,
        OverflowError,
        RecursionError,
    ) as e:
        raise CheckpointingException(f"{what}: not a readable torch archive ({type(e).__name__}: {e})") from e


# Unpickling may build this many bytes of Python objects per byte of pickle at most (a 1-byte
# opcode can make a 56-byte list and append it for one more; real states stay far below)...
UNPICKLE_EXPANSION = 64
# ... and a pickle whose objects may reach this size is always admitted, whatever the budget.
UNPICKLE_FLOOR = 256 << 20
# Compressed entries (torch.save writes none) may inflate to this many times the file's size.
ARCHIVE_INFLATION = 16


def check_archive(source: BinaryIO, what: str) -> None:
    """Refuse a torch archive (a zip) whose loading would take more memory than its real size
    and the host memory budget (:mod:`distckpt.budget`) allow, from its central directory
    alone, before ``torch.load`` inflates or allocates anything. ``torch.save`` stores entries
    uncompressed, so a real one never inflates: a stored entry must lie inside the file with
    its declared size, compressed entries (a zip bomb, or a re-zipped archive) may inflate
    together to :data:`ARCHIVE_INFLATION` times the file's size and to the budget, and the
    pickle (``data.pkl``) may take at most :data:`UNPICKLE_EXPANSION`
    times its size in objects, within the budget (or :data:`UNPICKLE_FLOOR`). ``source`` is left
    at its start. A file that is no zip (torch's legacy format, garbage) is left to ``torch.load``.
    """
    source.seek(0, io.SEEK_END)
    size = source.tell()
    source.seek(0)
    try:
        if not zipfile.is_zipfile(source):
            return
        source.seek(0)
        entries = zipfile.ZipFile(source).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise CheckpointingException(f"{what}: damaged torch archive (zip directory: {e})") from None
    finally:
        source.seek(0)
    budget = host_memory_budget()
    inflated = 0
    for e in entries:
        if e.header_offset + e.compress_size > size:
            raise CheckpointingException(
                f"{what}: archive entry {e.filename!r} claims {e.compress_size} bytes at offset "
                f"{e.header_offset}, past the end of the file ({size} bytes)"
            )
        if e.compress_type == zipfile.ZIP_STORED:
            if e.file_size != e.compress_size:
                raise CheckpointingException(
                    f"{what}: stored archive entry {e.filename!r} claims {e.file_size} bytes but holds "
                    f"{e.compress_size}"
                )
        else:
            inflated += e.file_size
        if e.filename.endswith("data.pkl") and e.file_size * UNPICKLE_EXPANSION > max(budget, UNPICKLE_FLOOR):
            raise CheckpointingException(
                f"{what}: its pickle ({e.file_size} bytes) may unpickle to {UNPICKLE_EXPANSION} times "
                f"that in objects, more than the host memory budget ({budget} bytes); refusing it"
            )
    if inflated > min(budget, ARCHIVE_INFLATION * size):
        raise CheckpointingException(
            f"{what}: compressed archive entries inflate to {inflated} bytes from a {size}-byte file, "
            f"more than {ARCHIVE_INFLATION} times its size or the host memory budget ({budget} bytes); "
            f"torch.save never compresses: a zip bomb? Refusing to load it"
        )


class MissingFileError(CheckpointingException):
    """A file the checkpoint should hold is not there (e.g. ``common.pt`` of a ``dcp.save``)."""


def _save_whole(obj: Any, location: storage.Location, name: str) -> Tuple[int, int]:
    """torch.save ``obj`` as ``name``; returns (size, crc32c), both counted while writing. A local
    directory: written and fsynced in place; an object store: serialized in memory, then one
    atomic put (multipart when large)."""
    root = storage.local_root(location)
    if root is None:
        buffer = io.BytesIO()
        sink: ChecksummingSink = WriterSink(buffer)
    else:
        # ``name`` may come from a ShardedObject key (of another checkpoint, in a conversion): it
        # is created beneath ``root`` by the containment rule, never through a symlink out.
        fd = containment.create_beneath(root, name, root, "object file name")
        sink = ChecksummingSink(fd)
    try:
        save_to_sink(obj, sink)
        sink.fsync()
        if root is None:
            storage.open_store(location).put(name, buffer.getbuffer())
    finally:
        if root is not None:
            os.close(fd)
    return sink.position, sink.crc


_UNREAD = object()


def _read_checked(
    location: Union[Path, storage.Store],
    name: str,
    verify: bool,
    what: str,
    checksums: bool = True,
    manifest: Any = _UNREAD,
) -> bytes:
    """The bytes of ``name``, compared with the manifest: with ``verify`` the file must be listed;
    by default (``checksums``) it is compared when listed. ``manifest``: the checkpoint's
    manifest already read (None: it has none), for a caller that reads many files."""
    try:
        data = storage.read_bytes(location, name)
    except FileNotFoundError:
        raise MissingFileError(
            f"{what}: file {storage.join(location, name)} is missing (rank {dist.get_rank()})"
        ) from None
    except OSError as e:  # a directory where the file should be, no permission, an I/O error
        raise CheckpointingException(
            f"{what}: cannot read {storage.join(location, name)} (rank {dist.get_rank()}): {e.strerror or e}"
        ) from None
    if not (verify or checksums):
        return data
    if manifest is _UNREAD:
        check_whole_file(location, name, data, listed=verify)
    else:
        check_whole_bytes(manifest, location, name, data, listed=verify)
    return data


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` on rank 0 and ShardedObjects as ``<unique_key>.pt`` files.

    ``written_files`` maps each file this rank wrote to (size, crc32c) for the manifest.
    """

    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)
        self.written_files: Dict[str, Tuple[int, int]] = {}

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: storage.Location) -> None:
        self.written_files = {}
        if dist.get_rank() == 0:
            self.written_files[COMMON_STATE_FNAME] = _save_whole(
                common_state_dict, checkpoint_dir, COMMON_STATE_FNAME
            )

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: storage.Location
    ) -> None:
        for obj in nested_values(sharded_objects_state_dict):
            if not isinstance(obj, ShardedObject) or not is_main_replica(obj.replica_id):
                continue
            name = f"{obj.unique_key}.pt"
            self.written_files[name] = _save_whole(obj.data, checkpoint_dir, name)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` and ``<unique_key>.pt`` object files, safely unless ``trusted``.

    ``checksums`` (default): each file the integrity manifest lists is compared with it whole;
    ``verify``: every file must be listed."""

    def __init__(
        self,
        backend: str = "torch",
        version: int = 1,
        trusted: bool = False,
        verify: bool = False,
        checksums: bool = True,
    ):
        super().__init__(backend, version)
        self.trusted = trusted
        self.verify = verify
        self.checksums = checksums

    def load_common(self, checkpoint_dir: storage.Location) -> StateDict:
        location = storage.resolve(checkpoint_dir)
        data = _read_checked(location, COMMON_STATE_FNAME, self.verify, "common state", self.checksums)
        where = storage.join(location, COMMON_STATE_FNAME)
        state = safe_torch_load(data, what=where, trusted=self.trusted)
        if not isinstance(state, dict):  # it is merged into the loaded state dict
            raise CheckpointingException(f"{where}: the common state is a {type(state).__name__}, not a dict")
        return state

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: storage.Location
    ) -> StateDict:
        location = storage.resolve(checkpoint_dir)
        manifest: Any = _UNREAD

        def load_one(obj: Any) -> Any:
            nonlocal manifest
            if not isinstance(obj, ShardedObject):
                return obj
            if manifest is _UNREAD and (self.verify or self.checksums):
                manifest = read_manifest(location)  # once for all the objects of this load
            name = f"{obj.unique_key}.pt"
            what = f"ShardedObject {obj.unique_key!r} in {storage.join(location, name)}"
            data = _read_checked(location, name, self.verify, what, self.checksums, manifest)
            return safe_torch_load(data, what=what, trusted=self.trusted)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        manifest = read_manifest(checkpoint_dir)
        root = storage.local_root(checkpoint_dir)
        if manifest is not None:
            # The manifest lists every file written; no need to walk (possibly millions of) chunk files.
            names = [n for n in manifest.files if n.endswith(".pt") and Path(n).name.startswith("shard_")]
        elif root is None:
            listed = storage.open_store(checkpoint_dir).list()
            names = [n for n in listed if n.endswith(".pt") and Path(n).name.startswith("shard_")]
        else:
            names = [str(p.relative_to(root)) for p in root.rglob("shard_*.pt")]
        found = {}
        for name in names:
            unique_key = name[: -len(".pt")]
            try:
                obj = ShardedObject.empty_from_unique_key(unique_key)
            except CheckpointingException:
                continue
            found[unique_key] = obj
        return found
