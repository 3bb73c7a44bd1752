"""PyTorch DCP's own engine behind distckpt, and distckpt state dicts as torch's sharded types.

:func:`to_torch_state_dict` turns a distckpt sharded state dict into the flat state dict that
``torch.distributed.checkpoint`` (DCP) expects: one entry per ShardedTensor key, a ``DTensor``
where the key's layout is a placement over the ``device_mesh`` the caller gives (``Shard(d)``
or ``Replicate()`` on a 1-D mesh), else a torch ``ShardedTensor``
(``_init_from_local_shards_and_global_metadata``); ShardedObjects are byte items ``[data]``
under their unique key. Flattened distributed-optimizer slices become pieces of the N-D
reformulated tensor ``grid + (prod(chunk),)`` that distckpt's ``torch_dist`` writer stores.

The ``torch_dcp`` strategies save and load through DCP's planner and any ``StorageWriter`` /
``StorageReader`` (``FileSystemWriter``/``Reader`` by default; DCP's fsspec or HuggingFace
plug-ins when given), for users who need one of DCP's storage plug-ins. What they write is the
``torch_dist`` format: ``metadata.json`` names ``torch_dist`` (Megatron-Core and distckpt's fast
reader load it); ``.metadata`` carries the original shape of flattened keys like distckpt's own
writer. The default strategy stays distckpt's own writer, several times faster.

Loading through DCP covers what DCP can express: regular pieces resharded any way, flattened
slices against a checkpoint with the same chunk grid. Pieces DCP cannot express (a flattened
slice from a regular checkpoint or the other way round, ``allow_shape_mismatch``) are read by
distckpt's reader in the same call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from distckpt import containment, dist
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.foreign import normalize_sharded_state_dict
from distckpt.formats.manifest import build_manifest, crc32c, write_manifest
from distckpt.io.device_io import is_plain, needs_staging
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from distckpt.strategies.base import SaveShardedStrategy
from distckpt.strategies.chunk_index import ChunkIndex
from distckpt.strategies.common import safe_torch_load
from distckpt.strategies.resharding import ORIG_SHAPE, Shape, nd_reformulated
from distckpt.strategies.torch_dist.claims import extent_error, orig_shapes, record_name
from distckpt.strategies.torch_dist.load import TorchDistLoadShardedStrategy
from distckpt.strategies.torch_dist.loadplan import LoadPlan, plan_tensor
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME
from distckpt.strategies.torch_dist.stored import Stored, StoredKey, check_item

__all__ = [
    "DCPPieces",
    "TorchDCPLoadShardedStrategy",
    "TorchDCPSaveShardedStrategy",
    "dcp_planners",
    "to_torch_state_dict",
]

BACKEND_NAME = "torch_dcp"  # registry name; the format written is torch_dist


# --------------------------------------------------------------------------- conversion


def _dcp_view(sh: ShardedTensor, data: torch.Tensor) -> Tuple[Shape, Shape, torch.Tensor, Optional[Shape]]:
    """(DCP global shape, offset, local view of ``data``, original shape or None) of one piece
    (the N-D reformulation for flattened slices: :func:`~distckpt.strategies.resharding.nd_reformulated`)."""
    shape, offset, size, orig_shape = nd_reformulated(sh)
    view = data.view(size) if sh.flattened_range is None else data.reshape(-1).view(size)
    return shape, offset, view, orig_shape


def _complement(shape: Shape, boxes: Sequence[Tuple[Shape, Shape]]) -> List[Tuple[Shape, Shape]]:
    """Boxes that tile ``shape`` minus the (non-overlapping) ``boxes``: the cells of the grid of
    their cut points that none of them covers. Each cell lies inside a box or outside all of
    them, so one box found meeting it decides; the boxes are found through an index (a rank's
    pieces of a Mixture-of-Experts key are thousands, and so are the cells)."""
    cuts = [
        sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes})
        for d, n in enumerate(shape)
    ]
    index = ChunkIndex([tuple(o) for o, _ in boxes], [tuple(s) for _, s in boxes])
    out = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        lo = tuple(cuts[d][i] for d, i in enumerate(cell))
        size = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
        if all(size) and next(index.overlapping(lo, size), None) is None:
            out.append((lo, size))
    return out


def _torch_sharded_tensor(shape: Shape, dtype: torch.dtype, pieces: List[Tuple[Shape, torch.Tensor]]):
    """A torch ShardedTensor holding ``pieces`` (offset, local tensor) on this rank.

    DCP uses only the local shards and the global size; the rest of the tensor is described by
    filler shards placed on another rank, so every rank builds its metadata alone (no
    collective), as torch allows ("no cross rank validations"). Needs a process group.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    rank, world = dist.get_rank(), dist.get_world_size()
    other = (rank + 1) % world
    boxes = [(off, tuple(t.shape)) for off, t in pieces]
    local = [Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/cpu")) for off, t in pieces]
    fillers = [ShardMetadata(list(o), list(s), f"rank:{other}/cpu") for o, s in _complement(shape, boxes)]
    props = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    md = ShardedTensorMetadata([s.metadata for s in local] + fillers, torch.Size(shape), props)
    return TorchShardedTensor._init_from_local_shards_and_global_metadata(local, md)


class DCPPieces:
    """This rank's pieces of one global tensor, in DCP's checkpointable protocol (what DTensor
    implements: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``).

    Any layout, any number of pieces per rank, no process group needed: what the ``torch_dcp``
    strategies hand to ``dcp.save`` / ``dcp.load``, and what :func:`to_torch_state_dict` returns
    for a key that is neither a DTensor placement nor, without a process group, a torch
    ShardedTensor. Use it with :func:`dcp_planners`' planners.
    """

    def __init__(self, shape: Shape, dtype: torch.dtype, pieces: List[Tuple[Shape, torch.Tensor]]):
        self.shape, self.dtype, self.pieces = tuple(shape), dtype, pieces
        # DCP asks for each piece by its offset: found at once, not by walking all of them.
        self._by_offset: Dict[Shape, torch.Tensor] = {}
        for off, t in pieces:
            self._by_offset.setdefault(tuple(off), t)

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_write_items__(self, fqn: str, obj: Any):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(t.shape)),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size(),
                ),
            )
            for off, t in self.pieces
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(t.shape)) for off, t in self.pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        t = self._by_offset.get(tuple(index.offset))
        if t is not None:
            return t
        raise CheckpointingException(f"key {index.fqn!r}: no local piece at offset {list(index.offset)}")


def _dtensor_or_none(shape: Shape, pieces: List[Tuple[Shape, torch.Tensor]], mesh: Any):
    """The placement of this rank's single piece on a 1-D ``mesh`` (``Shard(d)`` or
    ``Replicate()``), or None if the piece is not what DTensor would hold there."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if mesh is None or mesh.ndim != 1 or len(pieces) != 1:
        return None
    off, t = pieces[0]
    candidates = [Replicate()] + [Shard(d) for d in range(len(shape))]
    for placement in candidates:
        local_shape, global_offset = compute_local_shape_and_global_offset(
            torch.Size(shape), mesh, [placement]
        )
        if tuple(local_shape) == tuple(t.shape) and tuple(global_offset) == tuple(off):
            return placement
    return None


def to_torch_state_dict(
    sharded_state_dict: ShardedStateDict, device_mesh: Any = None, *, for_save: bool = True
) -> Dict[str, Any]:
    """The state dict DCP expects for ``sharded_state_dict`` (distckpt's or Megatron-Core's
    objects): ``{key: DTensor | torch ShardedTensor}`` and ``{unique_key: [data]}`` for objects.

    Args:
        device_mesh: a 1-D ``DeviceMesh``; keys whose every piece is this rank's part of a
            ``Shard(d)`` or ``Replicate()`` placement on it (the same on every rank of the mesh,
            agreed with one all-gather over the mesh's group; only its ranks call this) become
            DTensors. None: torch ShardedTensors only (no collective).
        for_save: keep only main replicas (DCP writes each piece once). False (loading) keeps
            every piece, so replicas are filled too.

    The local tensors are views of the ShardedTensors' data (no copy): ``dcp.load`` fills them
    in place. Flattened slices appear in the N-D reformulated shape.
    """
    normalize_sharded_state_dict(sharded_state_dict)
    # key -> [(offset, view, is main replica)]; every piece of this rank, replicas included.
    by_key: Dict[str, List[Tuple[Shape, torch.Tensor, bool]]] = defaultdict(list)
    shapes: Dict[str, Tuple[Shape, torch.dtype]] = {}
    out: Dict[str, Any] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            if not for_save or is_main_replica(sh.replica_id):
                out[sh.unique_key] = [sh.data]
            continue
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.data is None:
            sh.init_data("cpu")
        shape, offset, view, _ = _dcp_view(sh, sh.data)
        shapes[sh.key] = (shape, sh.dtype)
        if view.numel():
            by_key[sh.key].append((offset, view, is_main_replica(sh.replica_id)))
    placements = {
        k: _dtensor_or_none(shapes[k][0], [(o, t) for o, t, _ in by_key.get(k, [])], device_mesh)
        for k in shapes
    }
    if device_mesh is not None:
        agreed = dist.all_gather_object(
            {k: repr(p) for k, p in placements.items()}, group=device_mesh.get_group()
        )
        for k in placements:
            if any(a.get(k) != repr(placements[k]) for a in agreed):
                placements[k] = None
    for key, (shape, dtype) in shapes.items():
        if placements[key] is not None:  # DCP itself writes a replicated DTensor once
            pieces = [(o, t) for o, t, _ in by_key[key]]
        else:
            pieces = [(o, t) for o, t, main in by_key.get(key, []) if main or not for_save]
        if placements[key] is not None:
            from torch.distributed.tensor import DTensor

            out[key] = DTensor.from_local(
                pieces[0][1],
                device_mesh,
                [placements[key]],
                run_check=False,
                shape=torch.Size(shape),
                stride=_strides(shape),
            )
            continue
        if dist.is_initialized() and dist.get_world_size() > 1:
            out[key] = _torch_sharded_tensor(shape, dtype, pieces)
        else:
            out[key] = DCPPieces(shape, dtype, pieces)
    return out


def _strides(shape: Shape) -> Tuple[int, ...]:
    acc, out = 1, []
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


# --------------------------------------------------------------------------- planners


def dcp_planners():
    """(SavePlanner, LoadPlanner) classes: DCP's default planners that also take
    :class:`DCPPieces` values; the save planner records flattened keys' original shapes, the
    load planner unpickles byte items under distckpt's allowlist."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        """DCP's default planner; records the original shape of flattened keys in
        ``Metadata.mcore_data`` (what distckpt's writer and Megatron-Core 0.15 record)."""

        def __init__(self, orig_shapes: Dict[str, Shape]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.orig_shapes = orig_shapes

        def lookup_object(self, index):
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DCPPieces):
                return obj.__get_tensor_shard__(index)
            return super().lookup_object(index)

        def create_local_plan(self):
            plan = super().create_local_plan()
            return dataclasses.replace(plan, planner_data=dict(self.orig_shapes))

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            shapes = {}
            for p in all_plans:
                shapes.update(p.planner_data or {})
            metadata.planner_data = None
            metadata.mcore_data = {k: {ORIG_SHAPE: tuple(v)} for k, v in shapes.items()}
            return plans, metadata

    class LoadPlanner(DefaultLoadPlanner):
        """DCP's default planner; byte items unpickled under distckpt's allowlist."""

        def __init__(self, trusted: bool):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.trusted = trusted

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DCP's own set-up first "initializes meta tensors" by walking the state dict, which
            # replaces values of types it does not know (DCPPieces) by None; nothing here is on
            # the meta device, so only the rest of it is done.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index):
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DCPPieces):
                return obj.__get_tensor_shard__(index)
            return super().lookup_tensor(index)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            self.state_dict[fqn] = safe_torch_load(
                value.getvalue(), what=f"object {fqn!r}", trusted=self.trusted
            )

    return SavePlanner, LoadPlanner


def _dcp_errors(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` (a ``dcp.save`` or ``dcp.load``), its failures as CheckpointingExceptions: DCP
    gathers each rank's exception into a ``CheckpointException`` (a ``BaseException``); where a
    rank's is distckpt's own (the checked reader's, naming the file), that one is raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn()
    except CheckpointingException:
        raise
    except CheckpointException as e:
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(cause, CheckpointingException):
                raise cause from None
        raise CheckpointingException(
            f"{what} through DCP's engine failed (rank {dist.get_rank()}): {type(e).__name__}: {e}"
        ) from e
    except Exception as e:  # noqa: BLE001 - DCP raises the same CheckpointException on every rank
        raise CheckpointingException(
            f"{what} through DCP's engine failed (rank {dist.get_rank()}): {type(e).__name__}: {e}"
        ) from e


# --------------------------------------------------------------------------- strategies


class TorchDCPSaveShardedStrategy(SaveShardedStrategy):
    """Saves through DCP's engine (``dcp.save`` with a planner and a ``StorageWriter``).

    Args:
        storage_writer: ``checkpoint_dir -> StorageWriter``; default DCP's ``FileSystemWriter``
            (``thread_count`` threads, files fsynced). Give e.g. ``lambda d: FsspecWriter(url)``
            to use one of DCP's storage plug-ins.
        checksums: after saving, read each rank's items back once and write distckpt's
            integrity manifest (local directories only), so ``verify`` checks them.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        *,
        storage_writer: Optional[Callable[[Path], Any]] = None,
        thread_count: int = 1,
        checksums: bool = True,
    ):
        super().__init__(backend, version)
        self.storage_writer = storage_writer
        self.thread_count = thread_count
        self.checksums = checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        checkpoint_dir = Path(checkpoint_dir)
        orig = {
            sh.key: tuple(sh.global_shape)
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and sh.flattened_range is not None
        }
        exc, state = None, None
        try:
            state = _pieces_state(
                [
                    sh
                    for sh in nested_values(sharded_state_dict)
                    if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id)
                ]
            )
            for obj in nested_values(sharded_state_dict):
                if isinstance(obj, ShardedObject) and is_main_replica(obj.replica_id):
                    state[obj.unique_key] = [obj.data]
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        dist.sync_errors("DCP save preparation", exc)
        writer = (
            self.storage_writer(checkpoint_dir)
            if self.storage_writer is not None
            else FileSystemWriter(checkpoint_dir, thread_count=self.thread_count, sync_files=True)
        )
        SavePlanner, _ = dcp_planners()
        md = _dcp_errors("save", lambda: dcp.save(state, storage_writer=writer, planner=SavePlanner(orig)))
        if self.checksums and self.storage_writer is None:
            self._write_manifest(checkpoint_dir, md)

    @staticmethod
    def _write_manifest(checkpoint_dir: Path, md: Any) -> None:
        """Each rank checksums the items in its own files (``__<rank>_*``); rank 0 writes the
        manifest with them and ``.metadata``."""
        exc, payload = None, None
        try:
            prefix = f"__{dist.get_rank()}_"
            mine = defaultdict(list)
            for index, info in md.storage_data.items():
                if info.relative_path.startswith(prefix):
                    mine[info.relative_path].append((index.fqn, info.offset, info.length))
            ranges, sizes = [], {}
            for name, items in mine.items():
                with open(checkpoint_dir / name, "rb") as f:
                    for fqn, offset, length in items:
                        f.seek(offset)
                        ranges.append((name, offset, length, crc32c(f.read(length)), fqn))
                sizes[name] = os.path.getsize(checkpoint_dir / name)
            payload = (ranges, sizes)
        except Exception as e:  # noqa: BLE001
            exc = e

        def decide(payloads):
            ranges = [r for p in payloads for r in p[0]]
            sizes = {k: v for p in payloads for k, v in p[1].items()}
            raw = (checkpoint_dir / METADATA_FNAME).read_bytes()
            ranges.append((METADATA_FNAME, 0, len(raw), crc32c(raw), METADATA_FNAME))
            sizes[METADATA_FNAME] = len(raw)
            save_id = getattr(getattr(md, "storage_meta", None), "save_id", None) or "dcp"
            write_manifest(checkpoint_dir, build_manifest(str(save_id), "torch_dist", ranges, sizes))

        dist.gather_and_decide("DCP save checksums", exc, payload, decide)


class TorchDCPLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Loads ``torch_dist`` checkpoints (and plain DCP ones) through DCP's engine
    (``dcp.load`` with a planner and a ``StorageReader``); metadata queries as distckpt's reader.

    Args:
        storage_reader: ``checkpoint_dir -> StorageReader``; default DCP's ``FileSystemReader``.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        trusted: bool = False,
        thread_count: int = 4,
        verify: bool = False,
        *,
        storage_reader: Optional[Callable[[Path], Any]] = None,
    ):
        super().__init__(backend, version, trusted=trusted, thread_count=thread_count, verify=verify)
        self.storage_reader = storage_reader

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        checkpoint_dir = Path(checkpoint_dir)
        if self.verify:  # every item read whole and checked, the metadata cross-checked: ours
            return super().load(sharded_state_dict, checkpoint_dir)
        # The checks distckpt's own reader makes before it reads (schema, claims, records): DCP
        # trusts what .metadata says, file names and offsets included.
        md, index = self._parsed_metadata(checkpoint_dir)
        stored = md.state_dict_metadata
        orig = orig_shapes(md)

        def dcp_can(sh: Any) -> bool:
            if isinstance(sh, ShardedObject):
                return True
            if not isinstance(sh, ShardedTensor) or sh.allow_shape_mismatch:
                return False
            meta = stored.get(sh.key)
            if not isinstance(meta, TensorStorageMetadata):
                return False
            flat_stored = sh.key in orig
            if (sh.flattened_range is not None) != flat_stored:
                return False
            if flat_stored:
                grid = tuple(sh.max_allowed_chunks())
                if tuple(meta.size) != grid + (math.prod(sh.local_shape),) or orig[sh.key] != tuple(
                    sh.global_shape
                ):
                    return False
            elif tuple(meta.size) != tuple(sh.global_shape):
                return False
            return True

        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor) and sh.key not in stored:
                raise CheckpointingException(
                    f"ShardedTensor {sh.key!r} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})"
                )
            if isinstance(sh, ShardedObject) and sh.unique_key not in stored:
                raise CheckpointingException(
                    f"ShardedObject {sh.unique_key!r} is not in checkpoint {checkpoint_dir} "
                    f"(rank {dist.get_rank()})"
                )
        ours: Dict[str, Any] = {}
        theirs: List[Any] = []
        commits: List[Callable[[], None]] = []
        counter = itertools.count()

        def split(sh: Any) -> Any:
            if dcp_can(sh):
                if isinstance(sh, ShardedTensor):
                    if sh.data is None:
                        sh.init_data("cpu")
                    if needs_staging(sh.data):
                        target = sh.data
                        sh.data = torch.empty(tuple(target.shape), dtype=target.dtype, device=target.device)
                        commits.append(lambda t=target, s=sh: (t.copy_(s.data), setattr(s, "data", t)))
                theirs.append(sh)
                return sh
            ours[f"__distckpt_{next(counter)}"] = sh
            return sh

        dict_list_map_inplace(split, sharded_state_dict)
        # DCP's part: one local tensor view per piece (replicas included), filled in place.
        tensors = [sh for sh in theirs if isinstance(sh, ShardedTensor)]
        objects = [sh for sh in theirs if isinstance(sh, ShardedObject)]
        # distckpt's own planning of the same pieces, for its checks only: DCP reads the chunks a
        # piece meets and trusts that they fill it (a chunk box of no elements left it unread).
        probe = LoadPlan()
        for sh in tensors:
            plan_tensor(probe, sh, index[sh.key], sh.data)
        state = _pieces_state(tensors)
        for obj in objects:
            state[obj.unique_key] = None
        reader = (
            self.storage_reader(checkpoint_dir)
            if self.storage_reader is not None
            else checked_reader(checkpoint_dir, md, index, self._checksums(checkpoint_dir))
        )
        _, LoadPlanner = dcp_planners()
        if state:
            _dcp_errors(
                "load",
                lambda: dcp.load(
                    state, storage_reader=reader, planner=LoadPlanner(self.trusted), no_dist=True
                ),
            )
        with torch.no_grad():
            for commit in commits:
                commit()
        loaded_objects = {}
        for obj in objects:
            value = state[obj.unique_key]
            loaded_objects[obj.unique_key] = (
                value[0] if isinstance(value, list) and len(value) == 1 else value
            )
        if ours:
            super().load(ours, checkpoint_dir)

        def result(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return sh.data
            if isinstance(sh, ShardedObject):
                return loaded_objects[sh.unique_key]
            return sh

        return dict_list_map_inplace(result, sharded_state_dict)


def checked_reader(checkpoint_dir: Path, md: Any, index: Dict[str, Any], checksums: Optional[Dict]) -> Any:
    """DCP's ``FileSystemReader`` of ``checkpoint_dir`` held to what distckpt's reader checks:
    its metadata is ``md`` (checked by the caller; DCP's own reader would unpickle ``.metadata``
    again, with any class), and every item it reads lies inside its file (else the error names
    the metadata or the file, :func:`extent_error`) and matches the manifest's CRC32C
    (``checksums``, :func:`check_item`). ``index``: the stored chunks and objects of ``md``
    (``index_metadata``), which say what each record holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    records: Dict[Tuple[str, int], Tuple[str, Stored]] = {}
    for fqn, entry in index.items():
        for st in entry.chunks if isinstance(entry, StoredKey) else [entry] if entry is not None else []:
            records[(st.relative_path, st.file_offset)] = (fqn, st)
    source = checkpoint_dir / METADATA_FNAME

    class BeneathCheckpoint(FileSystem):
        """DCP's file system, opening data files beneath the checkpoint only (the containment
        rule: never through a symlink that leads out of it)."""

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            name = Path(path).relative_to(checkpoint_dir).as_posix()
            try:
                fd = containment.open_beneath(checkpoint_dir, name, source)
            except FileNotFoundError:
                raise CheckpointingException(
                    f"{path}: data file is missing (named by {source}, rank {dist.get_rank()})"
                ) from None
            with os.fdopen(fd, "rb") as stream:
                yield stream

    class CheckedReader(FileSystemReader):
        def __init__(self) -> None:
            super().__init__(checkpoint_dir)
            self.fs = BeneathCheckpoint()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        # DCP's hook for one item's bytes (a private name of torch's reader, pinned torch).
        def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
            fqn, st = records[(sinfo.relative_path, sinfo.offset)]
            path = checkpoint_dir / st.relative_path
            size = os.fstat(file.fileno()).st_size
            if st.file_offset + st.length > size:
                raise extent_error(
                    checkpoint_dir,
                    source,
                    record_name(fqn, st.offset),
                    st.relative_path,
                    st.file_offset,
                    st.length,
                    size,
                )
            raw = os.pread(file.fileno(), st.length, st.file_offset)
            what = f"key {fqn!r} in {path} (rank {dist.get_rank()})"
            if len(raw) != st.length:
                raise CheckpointingException(f"{what}: file is truncated ({len(raw)} of {st.length} bytes)")
            check_item(raw, st, checksums, what, fqn)
            return io.BytesIO(raw)

    return CheckedReader()


def _pieces_state(tensors: List[ShardedTensor]) -> Dict[str, Any]:
    """One DCP entry per key: this rank's non-empty pieces (views of the data) as
    :class:`DCPPieces`."""
    by_key: Dict[str, List[Tuple[Shape, torch.Tensor]]] = defaultdict(list)
    shapes: Dict[str, Tuple[Shape, torch.dtype]] = {}
    for sh in tensors:
        if sh.data is None:
            raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data")
        data = sh.data.detach()
        if not is_plain(data):
            data = data.reshape(-1).to(sh.dtype)  # e.g. an FP8 wrapper: its values, nominal dtype
        shape, offset, view, _ = _dcp_view(sh, data)
        shapes[sh.key] = (shape, sh.dtype)
        if view.numel():
            by_key[sh.key].append((offset, view))
    return {
        key: DCPPieces(shape, dtype, by_key[key]) for key, (shape, dtype) in shapes.items() if by_key.get(key)
    }
