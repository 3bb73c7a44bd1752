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
from typing import Any, BinaryIO, Callable, List, Union

import numpy as np
import torch

from distckpt import dist
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
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


def _fsynced_torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` on rank 0 and ShardedObjects as ``<unique_key>.pt`` files."""

    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        if dist.get_rank() == 0:
            _fsynced_torch_save(common_state_dict, Path(checkpoint_dir) / COMMON_STATE_FNAME)

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict,
                             checkpoint_dir: Path) -> None:
        for obj in nested_values(sharded_objects_state_dict):
            if not isinstance(obj, ShardedObject) or not is_main_replica(obj.replica_id):
                continue
            path = Path(checkpoint_dir) / f"{obj.unique_key}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            _fsynced_torch_save(obj.data, path)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` and ``<unique_key>.pt`` object files, safely unless ``trusted``."""

    def __init__(self, backend: str = "torch", version: int = 1, trusted: bool = False):
        super().__init__(backend, version)
        self.trusted = trusted

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointingException(f"{path}: common state file is missing (rank {dist.get_rank()})")
        return safe_torch_load(path, what=str(path), trusted=self.trusted)

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict,
                             checkpoint_dir: Path) -> StateDict:
        def load_one(obj: Any) -> Any:
            if not isinstance(obj, ShardedObject):
                return obj
            path = Path(checkpoint_dir) / f"{obj.unique_key}.pt"
            if not path.is_file():
                raise CheckpointingException(
                    f"ShardedObject {obj.unique_key!r}: file {path} is missing (rank {dist.get_rank()})")
            return safe_torch_load(path, what=f"ShardedObject {obj.unique_key!r} in {path}",
                                   trusted=self.trusted)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        root = Path(checkpoint_dir)
        found = {}
        for path in root.rglob("shard_*.pt"):
            unique_key = str(path.relative_to(root))[: -len(".pt")]
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
