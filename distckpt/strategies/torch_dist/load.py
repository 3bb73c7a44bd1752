"""The ``torch_dist`` load strategy: any checkpoint of this format, resharded on the fly.

Loading needs no collective: every requested piece is cut into boxes, each box is intersected
with the stored chunks (:mod:`.loadplan`), and each stored chunk is read at most once per rank
(:mod:`.read`), every byte copied checked against the integrity manifest's CRC32Cs. The stored
chunks come from the sidecar index when the checkpoint has one (only the requested keys' records
are read), else from ``.metadata`` (:mod:`.stored`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from distckpt import dist, storage, timings
from distckpt.commit import tree_identity
from distckpt.core import CheckpointingException
from distckpt.dict_utils import dict_list_map_inplace, nested_values
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_read import IndexReader
from distckpt.formats.manifest import (
    MANIFEST_FNAME,
    Manifest,
    check_whole_file,
    read_declared_keys,
    read_manifest,
)
from distckpt.io import device_io
from distckpt.io.device_io import needs_staging
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from distckpt.strategies.base import LoadShardedStrategy
from distckpt.strategies.common import safe_torch_load
from distckpt.strategies.torch_dist import surgery
from distckpt.strategies.torch_dist.claims import (
    check_all_declared,
    check_claims,
)
from distckpt.strategies.torch_dist.loadplan import LoadPlan, check_allocations, plan_tensor
from distckpt.strategies.torch_dist.metadata import (
    METADATA_FNAME,
    Resolved,
    is_object_key,
    plain_byte_items,
    read_metadata,
    read_metadata_bytes,
    set_at_path,
    tensors_metadata,
    unpickle_metadata,
)
from distckpt.strategies.torch_dist.plan import DEFAULT_READERS_PER_RANK, checked_thread_count, io_threads
from distckpt.strategies.torch_dist.read import execute_plan, read_item_bytes
from distckpt.strategies.torch_dist.stored import (
    Stored,
    StoredKey,
    check_item,
    check_keys_declared,
    cross_check_manifest,
    directory_objects,
    directory_tensors,
    index_from_sidecar,
    index_metadata,
    manifest_checks,
)

logger = logging.getLogger(__name__)


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``torch_dist`` checkpoints (distckpt's and Megatron-Core's), resharding on the fly.

    Args:
        trusted: unpickle ``.metadata`` and object payloads without the allowlist.
        thread_count: files read in parallel. Default (None): 4 on an object store; on a file
            system at most :func:`distckpt.budget.cores_per_rank` (reads from a page cache are
            memory copies, which more threads than cores only interleave). A number is used as
            given.
        checksums: (default) check every byte copied against the integrity manifest's CRC32C as
            it is read (an item read whole against its checksum, a part of one block by block
            against its file's block CRC table) and that each record read is the range the
            manifest lists (key, offset, length); a load that reads ``.metadata`` (no sidecar)
            also checks each tensor key it reads, and the metadata queries every key they
            return, against the dtype and shape the manifest says the writer declared
            (:func:`check_declared`). A sidecar load asks no manifest (reading it would cost
            what the sidecar saves): its records are CRC-checked, and the items' own headers
            must agree with its dtypes. False: no checks on local files (object stores are
            always checked). Whatever ``checksums`` says, the chunks met by each requested
            piece must cover it exactly once (:func:`check_covered`).
        verify: in addition, read every needed item whole, check ``.metadata`` and the sidecar
            against the manifest, and cross-check every storage record and key declaration of
            ``.metadata`` (key, chunk offset and size, offset, length, dtype, shape) against
            what the manifest says the writer wrote (:func:`cross_check`).
        use_index: read the sidecar index ``.distckpt_index`` when the checkpoint has one (only
            the records of the requested keys and boxes); False always reads ``.metadata``.
        pinned_slot_bytes: CUDA targets are filled through two pinned host slots of this size
            per reader thread, each slot's copy to the device overlapping the read into the
            other; 0 copies into them from pageable memory instead.
    """

    records_phases = True  # distckpt.timings: it begins its own phases (index, planning, reading)

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        trusted: bool = False,
        thread_count: Optional[int] = None,
        verify: bool = False,
        use_index: bool = True,
        pinned_slot_bytes: int = device_io.SLOT_BYTES,
        checksums: bool = True,
    ):
        super().__init__(backend, version)
        if pinned_slot_bytes < 0:
            raise CheckpointingException(f"pinned_slot_bytes must be >= 0, got {pinned_slot_bytes}")
        self.pinned_slot_bytes = pinned_slot_bytes
        self.trusted = trusted
        self.thread_count, self._threads_given = checked_thread_count(thread_count, DEFAULT_READERS_PER_RANK)
        self.verify = verify
        self.checksums = checksums
        self.bytes_read = 0  # bytes read from storage by this strategy object (all loads)
        self.requests = 0  # object stores: data GET requests (ranged, after coalescing) and block tables
        self.use_index = use_index
        self.index_bytes_read = 0  # bytes of the sidecar index read (all loads)
        self.index_node_bytes_read = 0  # of which chunk-record tree nodes
        # What finding the stored chunks cost (all loads): (record, box) pairs the sidecar query
        # tested, and stored chunks the planning tested against requested boxes. Both grow with
        # what the requests meet, not with the keys' chunk grids (tests pin it).
        self.index_box_tests = 0
        self.chunks_examined = 0
        self.last_load_used_index = False
        # The sidecar reader ``load_common_items`` opened, for the ``load`` that follows it: its
        # directory is parsed once per load. Kept with the tree's identity, and taken only while
        # the checkpoint at that path is still the same tree.
        self._opened: Optional[Tuple[Any, Any, IndexReader]] = None
        # ``.metadata`` as this object last read it: location, bytes, parsed, what was derived.
        self._parsed: Optional[Tuple[Any, bytes, Metadata, Dict[str, Any]]] = None

    def _metadata(
        self, checkpoint_dir: Resolved, verify: bool, derive: str = "claims"
    ) -> Tuple[Metadata, Any]:
        """``.metadata`` (``verify``: the file checked against the manifest first) and, per
        ``derive``, its claims checked (:func:`check_claims`, None) or its index (:func:`index_metadata`),
        for this object's own reads, which never modify them. Unpickled and checked once while the
        file holds the same bytes: a tool reads a checkpoint key by key through one strategy
        (diff, convert, verify --deep), and 20,000 chunks take about a second each time."""
        raw = read_metadata_bytes(checkpoint_dir, self.trusted, verify)
        source = storage.join(checkpoint_dir, METADATA_FNAME)
        parsed = self._parsed
        if parsed is None or parsed[0] != checkpoint_dir or parsed[1] != raw:
            parsed = self._parsed = (checkpoint_dir, raw, unpickle_metadata(raw, source, self.trusted), {})
        md, derived = parsed[2], parsed[3]
        if derive == "index" and "index" not in derived:
            derived["index"] = index_metadata(md, source)
            derived["claims"] = None  # index_metadata checks them first
        elif "claims" not in derived:
            derived["claims"] = check_claims(md, source)
        return md, derived[derive]

    def _parsed_metadata(self, checkpoint_dir: Resolved) -> Tuple[Metadata, Dict[str, Any]]:
        """``.metadata`` and its index for a load (with ``verify``, cross-checked too)."""
        md, index = self._metadata(checkpoint_dir, self.verify, "index")
        if self.verify:
            self._cross_check(md, checkpoint_dir)
        return md, index

    def _open_index(self, checkpoint_dir: Resolved, keep: bool = False) -> Optional[IndexReader]:
        """The sidecar reader of ``checkpoint_dir`` (None: no usable sidecar); ``keep``: leave it
        for the next call (the ``load`` after ``load_common_items``)."""
        opened, self._opened = self._opened, None
        root = storage.local_root(checkpoint_dir)
        identity = tree_identity(root) if root is not None else None
        if opened is not None and identity is not None and opened[:2] == (checkpoint_dir, identity):
            reader = opened[2]
        else:
            reader = IndexReader.open(checkpoint_dir)
        if keep and reader is not None and identity is not None:
            self._opened = (checkpoint_dir, identity, reader)
        return reader

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    # ----------------------------------------------------------------- metadata queries

    def _queried_metadata(self, checkpoint_dir: storage.Location) -> Metadata:
        """``.metadata`` for the metadata queries: its claims checked and, with checksums on (the
        default) and a manifest, the file against its CRC32C and its tensor keys against the
        manifest's declarations (:func:`check_all_declared`): what was damaged since the save, or
        written wrong, is refused rather than reported (reading the manifest costs about what the
        unpickling does)."""
        checkpoint_dir = storage.resolve(checkpoint_dir)
        md = self._metadata(checkpoint_dir, self.checksums or self.verify)[0]
        declared = read_declared_keys(checkpoint_dir) if self.checksums or self.verify else None
        if declared:
            check_all_declared(
                md,
                declared,
                storage.join(checkpoint_dir, METADATA_FNAME),
                storage.join(checkpoint_dir, MANIFEST_FNAME),
            )
        return md

    def _query_reader(self, checkpoint_dir: Resolved) -> Optional[IndexReader]:
        """The sidecar whose directory answers a metadata query (keys, dtypes, shapes) without
        ``.metadata``, which holds every chunk of every key (hundreds of MB at scale, read by
        every rank that asks); None: ``.metadata`` answers (no sidecar, ``use_index=False``, or
        ``verify=True``, which checks ``.metadata`` itself)."""
        if not self.use_index or self.verify:
            return None
        return self._open_index(checkpoint_dir, keep=True)

    def _declared(self, checkpoint_dir: Resolved) -> Optional[Dict[str, Tuple]]:
        """The manifest's key declarations a query's answer is checked against (None: no
        manifest, or ``checksums=False``): the sidecar's directory is what a writer wrote, and a
        buggy one could write it wrong consistently with ``.metadata``."""
        return read_declared_keys(checkpoint_dir) if self.checksums else None

    def load_tensors_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        checkpoint_dir = storage.resolve(checkpoint_dir)
        reader = self._query_reader(checkpoint_dir)
        if reader is not None:
            return directory_tensors(reader, self._declared(checkpoint_dir))
        return tensors_metadata(self._queried_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: storage.Location) -> ShardedStateDict:
        checkpoint_dir = storage.resolve(checkpoint_dir)
        reader = self._query_reader(checkpoint_dir)
        if reader is not None:
            out = directory_tensors(reader, self._declared(checkpoint_dir))
            for fqn, _ in directory_objects(reader):
                out[fqn] = ShardedObject.empty_from_unique_key(fqn)
            return out
        md = self._queried_metadata(checkpoint_dir)
        out = tensors_metadata(md)
        for fqn, meta in md.state_dict_metadata.items():
            # Byte items of other names are common values (load_common_items), not sharded.
            if isinstance(meta, BytesStorageMetadata) and is_object_key(fqn):
                out[fqn] = ShardedObject.empty_from_unique_key(fqn)
        return out

    def load_common_items(self, checkpoint_dir: storage.Location) -> StateDict:
        """The non-tensor values of a ``dcp.save`` (see :func:`plain_byte_items`), nested as saved."""
        checkpoint_dir = storage.resolve(checkpoint_dir)
        out: StateDict = {}
        reader = self._open_index(checkpoint_dir, keep=True) if self.use_index else None
        if reader is not None and not any(
            isinstance(e, dict) and e.get("bytes") and not is_object_key(fqn)
            for fqn, e in reader.keys.items()
        ):
            return out  # the sidecar's directory says there is none: .metadata is not read
        md, index = self._parsed_metadata(checkpoint_dir)
        items = plain_byte_items(md)
        if not items:
            return out
        checksums = self._checksums(checkpoint_dir)
        for fqn, path in items.items():
            value = self._load_bytes(f"value {fqn!r}", index.get(fqn), checkpoint_dir, checksums, fqn)
            set_at_path(out, path, value)
        return out

    # ----------------------------------------------------------------- surgery

    def remove_sharded_tensors(self, checkpoint_dir: storage.Location, key_prefix: str) -> None:
        """Drop every key starting with ``key_prefix`` (tensors and objects) from the checkpoint.

        Crash-safe order: data files that mix kept and removed items are first rewritten under new
        names, then ``.metadata`` is replaced atomically, and only then are the old files deleted.
        Saving with ``separation_hint=key_prefix`` puts such keys in files of their own, so no
        byte has to be rewritten (see :func:`~distckpt.strategies.torch_dist.surgery.remove_sharded_tensors`).
        """
        surgery.remove_sharded_tensors(checkpoint_dir, key_prefix, self.trusted)

    # ----------------------------------------------------------------- execution

    def _checksums(self, checkpoint_dir: Resolved) -> Optional[Dict]:
        """The manifest's checksums by (file, offset); None without a manifest, or when checks
        are switched off (``checksums=False``, not on an object store: its own checksums do not
        cover ranged reads)."""
        manifest = self._manifest(checkpoint_dir)
        return None if manifest is None else manifest_checks(manifest, self.verify)

    def _manifest(self, checkpoint_dir: Resolved) -> Optional[Manifest]:
        """The manifest a load checks against (see :meth:`_checksums`); None when it has none."""
        if not (self.verify or self.checksums or storage.local_root(checkpoint_dir) is None):
            return None
        manifest = read_manifest(checkpoint_dir)
        if manifest is None:
            if self.verify:
                logger.warning(
                    "%s has no integrity manifest: verify=True checks sizes and structure only",
                    checkpoint_dir,
                )
            else:
                logger.info(
                    "%s has no integrity manifest: its ranged reads are checked structurally only",
                    checkpoint_dir,
                )
            return None
        return manifest

    _cross_check = staticmethod(cross_check_manifest)  # ``verify=True``: .metadata against the manifest

    def _execute(self, plan: LoadPlan, checkpoint_dir: Resolved, checksums: Optional[Dict]) -> None:
        nbytes, requests = execute_plan(
            plan,
            checkpoint_dir,
            checksums,
            self.verify,
            self.pinned_slot_bytes,
            self.reader_threads(checkpoint_dir),
        )
        self.bytes_read += nbytes
        self.requests += requests

    def reader_threads(self, checkpoint_dir: Optional[storage.Location] = None) -> int:
        """Threads that read: files (objects) at once, or shares of local files when there are
        more threads than files (see :func:`io_threads`, ``read._PlanReads.shares``)."""
        return io_threads(self.thread_count, self._threads_given, checkpoint_dir)

    def _load_object(
        self,
        obj: ShardedObject,
        stored: Optional[Stored],
        checkpoint_dir: Resolved,
        checksums: Optional[Dict],
    ) -> Any:
        value = self._load_bytes(
            f"ShardedObject {obj.unique_key!r}", stored, checkpoint_dir, checksums, obj.unique_key
        )
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def _load_bytes(
        self,
        name: str,
        stored: Optional[Stored],
        checkpoint_dir: Resolved,
        checksums: Optional[Dict],
        key: str,
    ) -> Any:
        """Unpickle one byte item (safely unless ``trusted``); ``name`` says what it is. With
        ``checksums``, the manifest must list the item's range as one of ``key``: a key renamed
        in the metadata is refused, not returned under its new name."""
        if stored is None:
            raise CheckpointingException(
                f"{name} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})"
            )
        what = f"{name} in {storage.join(checkpoint_dir, stored.relative_path)} (rank {dist.get_rank()})"
        raw = read_item_bytes(checkpoint_dir, stored, what, name)
        check_item(raw, stored, checksums, what, key)
        return safe_torch_load(raw, what=what, trusted=self.trusted)

    def _load_index(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Resolved
    ) -> Tuple[Dict[str, Any], Optional[Dict]]:
        """The stored keys this load needs and the items' checksums (None: do not check): from
        the sidecar index when the checkpoint has one (only the requested keys' records are
        read), else from ``.metadata`` (and the manifest)."""
        reader = self._open_index(checkpoint_dir) if self.use_index else None
        if reader is None:
            self.last_load_used_index = False
            _, index = self._parsed_metadata(checkpoint_dir)
            manifest = self._manifest(checkpoint_dir)
            if manifest is None:
                return index, None
            if manifest.keys:
                # Each tensor key this load reads, as .metadata declares it, against what the
                # writer declared (the sidecar path has no manifest to ask: see the class doc).
                read = {sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)}
                check_keys_declared(((k, index.get(k)) for k in read), manifest.keys, checkpoint_dir)
            return index, manifest_checks(manifest, self.verify)
        self.last_load_used_index = True
        # verify=True checks against the manifest itself (read whole: an opt-in, full check),
        # .metadata and the sidecar included; object-store loads take the items' checksums from
        # the sidecar's records.
        checksums = None
        if self.verify:
            for name in (METADATA_FNAME, INDEX_FNAME):
                check_whole_file(checkpoint_dir, name, storage.read_bytes(checkpoint_dir, name))
            md = read_metadata(checkpoint_dir, self.trusted)
            index_metadata(md, storage.join(checkpoint_dir, METADATA_FNAME))  # its claims checked
            self._cross_check(md, checkpoint_dir)
            checksums = self._checksums(checkpoint_dir)
        own: Optional[Dict] = (
            {}
            if checksums is None
            and (self.verify or self.checksums or storage.local_root(checkpoint_dir) is None)
            else None
        )
        index = index_from_sidecar(reader, sharded_state_dict, own)
        if own is not None:
            checksums = own
        self.index_bytes_read += reader.bytes_read
        self.index_node_bytes_read += reader.node_bytes_read
        self.index_box_tests += reader.box_tests
        return index, checksums

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: storage.Location) -> StateDict:
        checkpoint_dir = storage.resolve(checkpoint_dir)
        timings.begin("index")
        index, checksums = self._load_index(sharded_state_dict, checkpoint_dir)
        timings.begin("planning")
        check_allocations(sharded_state_dict, index, checkpoint_dir)
        plan = LoadPlan()
        commits: List[Callable[[], None]] = []
        examined: Dict[str, int] = {}

        def prepare(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                return sh
            if not isinstance(sh, ShardedTensor):
                return sh
            stored = index.get(sh.key)
            if not isinstance(stored, StoredKey):
                raise CheckpointingException(
                    f"ShardedTensor {sh.key!r} is not in checkpoint {checkpoint_dir} (rank {dist.get_rank()})"
                )
            if sh.data is None:
                sh.init_data("cpu")
            target = sh.data
            if needs_staging(target):
                dest = torch.empty(tuple(target.shape), dtype=target.dtype, device=target.device)
                commits.append(lambda t=target, d=dest: t.copy_(d))
            else:
                dest = target.detach()  # same memory; copies into its views bypass autograd
            if sh.key not in plan.keys:
                plan.keys[sh.key] = stored
                examined[sh.key] = stored.examined  # a key indexed by an earlier load counts from here
            plan_tensor(plan, sh, stored, dest)
            return sh

        dict_list_map_inplace(prepare, sharded_state_dict)
        self.chunks_examined += sum(s.examined - examined[k] for k, s in plan.keys.items())
        timings.begin("reading")
        self._execute(plan, checkpoint_dir, checksums)
        with torch.no_grad():
            for commit in commits:
                commit()

        def result(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return sh.data
            if isinstance(sh, ShardedObject):
                return self._load_object(sh, index.get(sh.unique_key), checkpoint_dir, checksums)
            return sh

        return dict_list_map_inplace(result, sharded_state_dict)
