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
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Tuple, Union

import numpy as np
import torch

from distckpt import dist, storage
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.manifest import check_whole_file, read_manifest
from distckpt.mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from distckpt.strategies.base import (
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"


def _numpy_globals() -> List[Any]:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtype_classes = {type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64,
                                                  np.uint8, np.uint16, np.uint32, np.uint64,
                                                  np.float16, np.float32, np.float64)}
    return [_reconstruct, np.ndarray, np.dtype, *dtype_classes]


# Classes beyond torch's weights_only defaults that checkpoints commonly hold and that are safe
# to construct: argparse.Namespace (Megatron stores its args so), numpy arrays (RNG states).
_SAFE_GLOBALS: List[Any] = [argparse.Namespace, *_numpy_globals()]


def add_safe_globals(globals_: List[Any]) -> None:
    """Admit more classes when loading common state and objects without ``trusted=True``."""
    _SAFE_GLOBALS.extend(globals_)


def safe_torch_load(source: Union[str, os.PathLike, BinaryIO, bytes], *, what: str,
                    trusted: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to tensors, plain data and the allowlist unless ``trusted``.

    Raises:
        CheckpointingException: the payload needs a class outside the allowlist (nothing of it
        was executed), or it is not a readable torch archive. The message names ``what``.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    try:
        if trusted:
            return torch.load(source, map_location=map_location, weights_only=False)
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        hint = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise CheckpointingException(
            f"{what}: refusing to unpickle a class outside the allowlist ({hint.strip()}); "
            f"if you trust this checkpoint pass trusted=True (CLI: --trust), or admit the class "
            f"with distckpt.add_safe_globals([...])") from None
    except FileNotFoundError as e:
        raise CheckpointingException(f"{what}: file not found") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointingException(f"{what}: not a readable torch archive ({e})") from e


def _fsynced_torch_save(obj: Any, path: Path) -> Tuple[int, int]:
    """torch.save into ``path``; returns (size, crc32c) computed while writing."""
    from distckpt.strategies.filesystem import ChecksummingSink, save_to_sink

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sink = ChecksummingSink(fd)
        save_to_sink(obj, sink)
        sink.fsync()
        return sink.position, sink.crc
    finally:
        os.close(fd)


class MissingFileError(CheckpointingException):
    """A file the checkpoint should hold is not there (e.g. ``common.pt`` of a ``dcp.save``)."""


def _save_whole(obj: Any, location, name: str) -> Tuple[int, int]:
    """torch.save ``obj`` as ``name``; returns (size, crc32c). Local: written and fsynced in place;
    object store: serialized in memory, then one atomic put (multipart when large)."""
    if isinstance(location, storage.Store):
        from distckpt.manifest import crc32c
        from distckpt.strategies.filesystem import save_to_sink

        buf = io.BytesIO()
        save_to_sink(obj, buf)
        data = buf.getbuffer()
        location.put(name, data)
        return len(data), crc32c(data)
    path = Path(location) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return _fsynced_torch_save(obj, path)


def _read_checked(location, name: str, verify: bool, what: str) -> bytes:
    try:
        data = storage.read_bytes(location, name)
    except FileNotFoundError:
        raise MissingFileError(
            f"{what}: file {storage.join(location, name)} is missing (rank {dist.get_rank()})") from None
    if verify:
        check_whole_file(location, name, data)
    return data


def _location(checkpoint_dir):
    return checkpoint_dir if isinstance(checkpoint_dir, storage.Store) else Path(checkpoint_dir)


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` on rank 0 and ShardedObjects as ``<unique_key>.pt`` files.

    ``written_files`` maps each file this rank wrote to (size, crc32c) for the manifest.
    """

    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)
        self.written_files: Dict[str, Tuple[int, int]] = {}

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        self.written_files = {}
        if dist.get_rank() == 0:
            self.written_files[COMMON_STATE_FNAME] = _save_whole(
                common_state_dict, _location(checkpoint_dir), COMMON_STATE_FNAME)

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict,
                             checkpoint_dir: Path) -> None:
        for obj in nested_values(sharded_objects_state_dict):
            if not isinstance(obj, ShardedObject) or not is_main_replica(obj.replica_id):
                continue
            name = f"{obj.unique_key}.pt"
            self.written_files[name] = _save_whole(obj.data, _location(checkpoint_dir), name)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` and ``<unique_key>.pt`` object files, safely unless ``trusted``."""

    def __init__(self, backend: str = "torch", version: int = 1, trusted: bool = False, verify: bool = False):
        super().__init__(backend, version)
        self.trusted = trusted
        self.verify = verify

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        location = _location(checkpoint_dir)
        data = _read_checked(location, COMMON_STATE_FNAME, self.verify, "common state")
        return safe_torch_load(data, what=storage.join(location, COMMON_STATE_FNAME), trusted=self.trusted)

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict,
                             checkpoint_dir: Path) -> StateDict:
        def load_one(obj: Any) -> Any:
            if not isinstance(obj, ShardedObject):
                return obj
            location, name = _location(checkpoint_dir), f"{obj.unique_key}.pt"
            what = f"ShardedObject {obj.unique_key!r} in {storage.join(location, name)}"
            data = _read_checked(location, name, self.verify, what)
            return safe_torch_load(data, what=what, trusted=self.trusted)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        root = _location(checkpoint_dir)
        manifest = read_manifest(root)
        if manifest is not None:
            # The manifest lists every file written; no need to walk (possibly millions of) chunk files.
            names = [n for n in manifest.files if n.endswith(".pt") and Path(n).name.startswith("shard_")]
        elif isinstance(root, storage.Store):
            names = [n for n in root.list() if n.endswith(".pt") and Path(n).name.startswith("shard_")]
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


def _register() -> None:
    factory: Callable = TorchCommonSaveStrategy
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, factory)
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy)


_register()
