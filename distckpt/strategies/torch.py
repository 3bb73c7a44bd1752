"""Kept for existing imports: the ``torch_dist`` backend now lives in :mod:`distckpt.strategies.torch_dist`.

This module only re-exports, under their old names, what code and tests import from it. Where
things live now:

- the strategies: ``torch_dist.save`` (:class:`TorchDistSaveShardedStrategy`) and
  ``torch_dist.load`` (:class:`TorchDistLoadShardedStrategy`); key removal ``torch_dist.surgery``;
- ``.metadata`` read, unpickled safely and built: ``torch_dist.metadata``; its claims checked and
  cross-checked with the manifest: ``torch_dist.claims``;
- save records, their tables, the sidecar index, ``LAST_SAVE``: ``torch_dist.records``;
- save planning and waves: ``torch_dist.plan``; writing: ``torch_dist.write``;
- a load's index of stored chunks and checksums: ``torch_dist.stored``; its copies:
  ``torch_dist.loadplan``; reading them: ``torch_dist.read`` and ``torch_dist.partial``;
- the geometry every backend shares (boxes, flattened ranges, the N-D reformulation):
  :mod:`distckpt.strategies.resharding`; ``CopyOp`` and the copies out of a tensor or a file
  mapping: :mod:`distckpt.io.copies`;
- :class:`BlockReader`: :mod:`distckpt.io.blockread`.

The strategies are registered by :mod:`distckpt.strategies.builtin` (``import distckpt`` runs it).

One class is defined here rather than re-exported: :class:`MCoreLoadPlanner`, Megatron-Core's
planner for ``torch.distributed.checkpoint.load`` (DCP's default planner plus a check of each
tensor's global shape). A ``torch_dist`` checkpoint is a DCP checkpoint, so DCP can read it with
this planner; distckpt's own ``load`` does not plan through DCP and never calls it. Who reads what
in distckpt's load is seen at ``distckpt.strategies.torch_dist.loadplan.LoadPlan.add(stored, op)``
(one call per copy out of a stored chunk; ``stored.relative_path`` names the file), see
docs/megatron-compat.md.
"""

from contextlib import contextmanager
from typing import Dict, Iterable, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.formats.manifest import write_manifest
from distckpt.io.blockread import BlockReader
from distckpt.io.copies import CopyOp, copy_from_mapping
from distckpt.io.copies import copy_boxes as _copy_boxes
from distckpt.io.device_io import is_plain as _is_plain
from distckpt.io.device_io import needs_staging as _needs_staging
from distckpt.io.filesystem import ChecksummingSink
from distckpt.mapping import ShardedTensor
from distckpt.strategies.resharding import ORIG_SHAPE as _ORIG_SHAPE
from distckpt.strategies.resharding import Shape, flat_range_boxes
from distckpt.strategies.resharding import intersect as _intersect
from distckpt.strategies.resharding import ravel as _ravel
from distckpt.strategies.resharding import rel_slices as _rel_slices
from distckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from distckpt.strategies.torch_dist.claims import (
    check_claims,
    check_declared,
    check_key_name,
    check_reformulated,
    cross_check,
)
from distckpt.strategies.torch_dist.loadplan import LoadPlan as _Plan
from distckpt.strategies.torch_dist.metadata import (
    DATA_SUFFIX,
    METADATA_FNAME,
    build_metadata,
    metadata_bytes_and_head,
    plain_byte_items,
    read_metadata,
)
from distckpt.strategies.torch_dist.metadata import MetadataUnpickler as _MetadataUnpickler
from distckpt.strategies.torch_dist.plan import (
    DEFAULT_FILES_PER_RANK,
    DEFAULT_READERS_PER_RANK,
    SavePlan,
    Wave,
    plan_waves,
)
from distckpt.strategies.torch_dist.plan import WriteItem as _WriteItem
from distckpt.strategies.torch_dist.plan import buckets as _buckets
from distckpt.strategies.torch_dist.read import (
    INLINE_READ_BYTES,
    REMOTE_READ_BATCH,
    SMALL_ITEM_BYTES,
)
from distckpt.strategies.torch_dist.read import read_chunk as _read_chunk
from distckpt.strategies.torch_dist.records import (
    LAST_SAVE,
    GatheredRecords,
    LastSave,
    RecordTable,
    patched_sidecar_index,
    sidecar_index,
)
from distckpt.strategies.torch_dist.records import KeyDecl as _KeyDecl
from distckpt.strategies.torch_dist.records import Record as _Record
from distckpt.strategies.torch_dist.stored import Stored as _Stored
from distckpt.strategies.torch_dist.stored import StoredKey as _StoredKey
from distckpt.strategies.torch_dist.stored import checked_metadata
from distckpt.strategies.torch_dist.stored import index_from_sidecar as _index_from_sidecar
from distckpt.strategies.torch_dist.write import INLINE_WRITE_BYTES, write_plan, write_waves


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that first checks the global shape of the given ShardedTensors
    against the checkpoint's metadata (``CheckpointingException`` naming the key on a mismatch or
    an absent key); keys in ``allow_shape_mismatch_sharded_tensors`` are planned with their
    requested shape instead (DCP would refuse them)."""

    def __init__(
        self,
        *args,
        shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
        allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors

    def _validate_global_shapes(self, metadata, sharded_tensors: Iterable[ShardedTensor]) -> None:
        stored = metadata.state_dict_metadata
        for sh in sharded_tensors:
            if sh.key not in stored:
                raise CheckpointingException(
                    f"key {sh.key!r} is not in the checkpoint (it has {len(stored)} keys)"
                )
            have, want = tuple(stored[sh.key].size), tuple(sh.global_shape)
            if have != want:
                raise CheckpointingException(
                    f"Global shape mismatch for loaded ({have}) and expected ({want}) tensor for key {sh.key}"
                )

    @contextmanager
    def _temporarily_bypass_shape_validation(self):
        """While planning, the stored size of each allowed key reads as the requested shape."""
        allowed = self.allow_shape_mismatch_sharded_tensors or {}
        stored = self.metadata.state_dict_metadata
        saved = {key: stored[key].size for key in allowed if key in stored}
        try:
            for key in saved:
                stored[key].size = torch.Size(allowed[key].global_shape)
            yield
        finally:
            for key, size in saved.items():
                stored[key].size = size

    def create_local_plan(self):
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()


__all__ = [
    "BlockReader",
    "MCoreLoadPlanner",
    "ChecksummingSink",
    "CopyOp",
    "DATA_SUFFIX",
    "DEFAULT_FILES_PER_RANK",
    "DEFAULT_READERS_PER_RANK",
    "GatheredRecords",
    "INLINE_READ_BYTES",
    "INLINE_WRITE_BYTES",
    "LAST_SAVE",
    "LastSave",
    "METADATA_FNAME",
    "REMOTE_READ_BATCH",
    "RecordTable",
    "SMALL_ITEM_BYTES",
    "SavePlan",
    "Shape",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "Wave",
    "atomic_write_bytes",
    "build_metadata",
    "check_claims",
    "check_declared",
    "check_key_name",
    "check_reformulated",
    "checked_metadata",
    "copy_from_mapping",
    "cross_check",
    "flat_range_boxes",
    "metadata_bytes_and_head",
    "patched_sidecar_index",
    "plain_byte_items",
    "plan_waves",
    "read_metadata",
    "sidecar_index",
    "write_manifest",
    "write_plan",
    "write_waves",
    # old private names still imported by tests and tools
    "_KeyDecl",
    "_MetadataUnpickler",
    "_ORIG_SHAPE",
    "_Plan",
    "_Record",
    "_Stored",
    "_StoredKey",
    "_WriteItem",
    "_buckets",
    "_copy_boxes",
    "_index_from_sidecar",
    "_intersect",
    "_is_plain",
    "_needs_staging",
    "_ravel",
    "_read_chunk",
    "_rel_slices",
]
