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
- the geometry every backend shares (boxes, flattened ranges, ``CopyOp``, copies out of a
  mapping, the N-D reformulation): :mod:`distckpt.strategies.resharding`;
- :class:`BlockReader`: :mod:`distckpt.strategies.blockread`.

The strategies are registered by :mod:`distckpt.strategies.builtin` (``import distckpt`` runs it).
"""

from distckpt.core import atomic_write_bytes
from distckpt.manifest import write_manifest
from distckpt.strategies.blockread import BlockReader
from distckpt.strategies.device_io import is_plain as _is_plain
from distckpt.strategies.device_io import needs_staging as _needs_staging
from distckpt.strategies.filesystem import ChecksummingSink
from distckpt.strategies.resharding import ORIG_SHAPE as _ORIG_SHAPE
from distckpt.strategies.resharding import CopyOp, Shape, copy_from_mapping, flat_range_boxes
from distckpt.strategies.resharding import copy_boxes as _copy_boxes
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

__all__ = [
    "BlockReader",
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
