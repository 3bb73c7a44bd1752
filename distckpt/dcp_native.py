"""Checkpoints of plain PyTorch DCP: a directory with ``.metadata`` and no ``metadata.json``.

``torch.distributed.checkpoint.save`` (plain tensors, DTensors over a device mesh, FSDP2 and
torchtitan state), ``format_utils.torch_save_to_dcp`` and Megatron-Core's ``torch_dcp`` and
``fsdp_dtensor`` formats all write the same thing: ``.distcp`` data files and a ``.metadata``
that DCP writes *last* (temp file + rename), so ``.metadata`` is their commit marker. distckpt
reads them as ``torch_dist`` checkpoints whose ``metadata.json`` is implied:
``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
"common_backend_version": 1}``. They are read-only to distckpt: every load, query and reading
CLI command works; surgery in place (``rm-prefix``, ``rename``) refuses them — ``distckpt
convert`` one first.

A torch_dist save of distckpt or Megatron-Core writes ``common.pt`` before ``.metadata`` and
``metadata.json`` after it; a directory holding ``.metadata`` *and* ``common.pt`` (or distckpt's
manifest) but no ``metadata.json`` is therefore an interrupted save, never taken for a DCP
checkpoint.
"""

from __future__ import annotations

from typing import Optional

from distckpt import storage
from distckpt.core import CONFIG_FNAME, CheckpointingConfig, maybe_load_config, parse_config

__all__ = ["DCP_METADATA_FNAME", "checkpoint_config", "describe_missing_config", "is_dcp_native"]

DCP_METADATA_FNAME = ".metadata"
# Files only a torch_dist save of distckpt or Megatron-Core writes (before metadata.json).
_TORCH_DIST_ONLY = ("common.pt", ".distckpt_manifest.json")


def implied_config() -> CheckpointingConfig:
    """The config a DCP-native checkpoint is read with."""
    return CheckpointingConfig("torch_dist", 1, "torch", 1)


def is_dcp_native(checkpoint_dir: storage.Location) -> bool:
    """True iff ``checkpoint_dir`` is a local, complete checkpoint of plain PyTorch DCP:
    ``.metadata`` present, and none of ``metadata.json``, ``common.pt`` and distckpt's manifest."""
    root = storage.local_root(checkpoint_dir)
    if root is None:
        return False
    if not (root / DCP_METADATA_FNAME).is_file() or (root / CONFIG_FNAME).exists():
        return False
    return not any((root / name).exists() for name in _TORCH_DIST_ONLY)


def checkpoint_config(checkpoint_dir: storage.Location) -> Optional[CheckpointingConfig]:
    """``metadata.json``'s config; for a local DCP-native directory the implied ``torch_dist``
    one; otherwise None (not a checkpoint, or an interrupted save). On an object store only
    ``metadata.json`` counts (plain DCP checkpoints are read from local file systems).

    Raises:
        CheckpointingException: ``metadata.json`` exists but is invalid.
    """
    root = storage.local_root(checkpoint_dir)
    if root is None:
        store = storage.open_store(checkpoint_dir)
        try:
            raw = store.get(CONFIG_FNAME)
        except FileNotFoundError:
            return None
        return parse_config(bytes(raw), store.where(CONFIG_FNAME))
    config = maybe_load_config(root)
    if config is None and is_dcp_native(root):
        return implied_config()
    return config


def describe_missing_config(checkpoint_dir: storage.Location) -> str:
    """Why ``checkpoint_dir`` (a location without a usable config) is not readable."""
    root = storage.local_root(checkpoint_dir)
    if root is None:
        store = storage.open_store(checkpoint_dir)
        if store.is_empty():
            return (
                f"{store.url} is not a distributed checkpoint: no object at all is stored under this "
                f"prefix (a wrong path? the bucket exists)"
            )
        return (
            f"{store.url} is not a distributed checkpoint: "
            f"{CONFIG_FNAME} is missing, so it is "
            f"either not a checkpoint or an interrupted save"
        )
    if (root / DCP_METADATA_FNAME).is_file():
        extra = [n for n in _TORCH_DIST_ONLY if (root / n).exists()]
        return (
            f"{root} is not a distributed checkpoint: it has DCP's {DCP_METADATA_FNAME} but also "
            f"{' and '.join(extra)} and no {CONFIG_FNAME}, so it is an interrupted torch_dist save "
            f"(a plain DCP checkpoint, read as torch_dist, has {DCP_METADATA_FNAME} and neither)"
        )
    return (
        f"{root} is not a distributed checkpoint: {CONFIG_FNAME} is missing (distckpt, Megatron-Core) and "
        f"so is DCP's {DCP_METADATA_FNAME} (plain PyTorch DCP), so it is either not a checkpoint or an "
        f"interrupted save"
    )
