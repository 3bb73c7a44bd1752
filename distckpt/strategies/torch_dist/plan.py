"""Planning a ``torch_dist`` save: which items go into which file, and in which waves.

:func:`plan_save` collects a rank's main replicas into items (:class:`WriteItem`, their bytes
not yet copied) and balances them over the rank's files; the result is a :class:`SavePlan`.
:func:`plan_waves` cuts the items into waves of at most a host memory budget of copies.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt import storage
from distckpt.budget import cores_per_rank
from distckpt.core import CheckpointingException
from distckpt.dict_utils import nested_values
from distckpt.io.device_io import is_plain
from distckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from distckpt.strategies.resharding import Shape, nd_reformulated
from distckpt.strategies.torch_dist.metadata import DATA_SUFFIX, Resolved
from distckpt.strategies.torch_dist.records import KeyDecl, Record


@dataclass
class WriteItem:
    fqn: str
    chunk_offset: Shape  # () for byte items
    chunk_size: Shape
    payload: Any  # a CPU tensor of shape chunk_size, or bytes; None until staged
    nbytes: int
    source: Optional[torch.Tensor] = None  # what to copy into ``payload`` when its wave comes
    copies: bool = False  # materializing ``source`` copies nbytes into host memory


Wave = List[Tuple[str, List[WriteItem]]]


@dataclass
class SavePlan:
    """One rank's part of a save: what to write where. Built by ``prepare``, filled by
    :func:`write_plan` (no collectives; may run in a background thread), committed by
    ``finalize`` (collective).

    Items are copied to host memory (staged) wave by wave, at most ``budget`` bytes of copies
    at once (one item larger than the budget makes a wave of its own): every wave but the last
    is written by :func:`write_waves` (the blocking part of an async save); ``write_plan`` writes
    the ``pending`` wave and closes the files. The files' bytes do not depend on the waves.
    """

    checkpoint_dir: Resolved
    rank: int
    jobs: List[Tuple[str, List[WriteItem]]]
    decls: Dict[str, KeyDecl]
    records: List[Record] = field(default_factory=list)
    file_sizes: Dict[str, int] = field(default_factory=dict)  # data files and block tables
    table_crcs: Dict[str, int] = field(default_factory=dict)  # block table name -> its CRC32C
    written: bool = False
    staged: Optional[Any] = None  # the StagedBatch holding the pending wave's staged copies
    staging: Optional[Any] = None  # the StagingBuffers pool (async saves), None: plain copies
    pending: Optional[Wave] = None  # the wave write_plan writes (None: every job, all of it)
    outputs: Dict[str, Any] = field(default_factory=dict)  # file name -> open Output
    error: Optional[BaseException] = None  # a failure of the blocking waves, raised by write_plan
    waves: int = 1  # how many waves the save was cut into

    def structure(self) -> Tuple:
        """What a ``cached_metadata`` save compares with the last one: its key declarations,
        where each item landed and the files' sizes (everything but the CRC32Cs)."""
        return (self.decls, [r.structure() for r in self.records], self.file_sizes)


def standalone_cpu(t: torch.Tensor, shape: Shape, staging: Optional[Any]) -> torch.Tensor:
    """A CPU tensor of ``shape`` owning exactly its bytes (torch.save writes whole storages).

    ``staging``: a StagingBuffers pool; when given, the bytes are always copied into one of its
    buffers (an async save must not see later mutations of the caller's tensors).
    """
    t = t.detach()
    if staging is not None:
        return staging.acquire(t).reshape(shape)
    if t.device.type != "cpu":
        # Off a plain save's hot path, which streams contiguous device tensors through pinned
        # slots (write.py): a tensor those do not take, copied whole in row-major order (as a
        # CPU tensor's copy below: the same bytes on disk; ``.to("cpu")`` keeps a transposed
        # tensor's strides, which torch.save then frames its own way).
        out = torch.empty(shape, dtype=t.dtype)
        out.view(t.shape).copy_(t)
        return out
    t = t.reshape(shape)
    if not _owns_its_bytes(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _owns_its_bytes(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _tensor_item(sh: ShardedTensor, stage: bool) -> Tuple[Optional[WriteItem], KeyDecl]:
    """The item of ``sh``, its bytes not yet copied (``source``); ``stage``: always copy them."""
    if sh.data is None:
        raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
    shape, offset, size, orig_shape = nd_reformulated(sh)
    decl = KeyDecl(False, sh.dtype, shape, orig_shape)
    if math.prod(size) == 0:
        return None, decl
    return tensor_write_item(sh.key, offset, size, sh.data, sh.dtype, stage), decl


def tensor_write_item(
    fqn: str, offset: Shape, size: Shape, data: torch.Tensor, dtype: torch.dtype, stage: bool
) -> WriteItem:
    """The item of one chunk (``data``, ``size`` elements of key ``fqn`` at ``offset``), its bytes
    not yet copied (``source``); ``stage``: always copy them (an async save). Also the item of a
    DCP write item (:mod:`distckpt.dcp`)."""
    data = data.detach()
    if not is_plain(data):
        # A tensor subclass (e.g. FP8 with a scale): store its values in the nominal dtype
        # without touching the caller's object.
        data = data.reshape(-1).to(dtype)
    copies = stage or data.device.type != "cpu" or not _owns_its_bytes(data)
    nbytes = math.prod(size) * data.element_size()
    return WriteItem(fqn, offset, size, None, nbytes, source=data, copies=copies)


def _object_item(obj: ShardedObject) -> Tuple[WriteItem, KeyDecl]:
    buf = io.BytesIO()
    torch.save([obj.data], buf)
    data = buf.getvalue()
    return WriteItem(obj.unique_key, (), (), data, len(data)), KeyDecl(True)


def buckets(items: List[WriteItem], count: int) -> List[List[WriteItem]]:
    """Greedy balance by bytes, largest first; deterministic."""
    count = max(1, min(count, len(items)))
    bins: List[List[WriteItem]] = [[] for _ in range(count)]
    loads = [0] * count
    for it in sorted(items, key=lambda i: (-i.nbytes, i.fqn, i.chunk_offset)):
        b = loads.index(min(loads))
        bins[b].append(it)
        loads[b] += it.nbytes
    return [b for b in bins if b]


def plan_waves(jobs: List[Tuple[str, List[WriteItem]]], budget: Optional[int]) -> List[Wave]:
    """Cut the jobs into waves of at most ``budget`` bytes of copies; each file's items keep
    their order (a wave takes the next items of every file in turn, so its files are written in
    parallel). ``budget`` None: one wave."""
    if budget is None or sum(it.nbytes for _, b in jobs for it in b if it.copies) <= budget:
        return [[(name, list(bucket)) for name, bucket in jobs]]
    queues = [(name, list(bucket)) for name, bucket in jobs]
    positions = [0] * len(queues)
    waves: List[Wave] = []
    current: Dict[str, List[WriteItem]] = {}
    used = 0
    while any(p < len(q) for p, (_, q) in zip(positions, queues)):
        for j, (name, queue) in enumerate(queues):
            if positions[j] >= len(queue):
                continue
            it = queue[positions[j]]
            cost = it.nbytes if it.copies else 0
            if used and used + cost > budget:
                waves.append([(n, items) for n, items in current.items()])
                current, used = {}, 0
            current.setdefault(name, []).append(it)
            used += cost
            positions[j] += 1
    if current:
        waves.append([(n, items) for n, items in current.items()])
    return waves


# Files per rank of a save that does not say (Megatron-Core's default thread_count).
DEFAULT_FILES_PER_RANK = 2
# At most this many writer threads per rank by default, however many cores it has (a GPU host gives
# each rank 8-16; they share the rank's files, see spans.py): issue #36 measured a save of 2.6 GiB
# of CUDA tensors to tmpfs at 1.30 s with 8 threads against 1.58-2.2 s with 2 (one H200, 16 cores;
# before the pinned pipeline).
MAX_WRITER_THREADS = 8
# Reader threads of a load that does not say (at most; see reader_threads): files, or shares of them.
DEFAULT_READERS_PER_RANK = 4


def checked_thread_count(thread_count: Optional[int], default: int) -> Tuple[int, bool]:
    """A strategy's ``thread_count`` argument checked: (the count, whether it was given)."""
    if thread_count is None:
        return default, False
    if not isinstance(thread_count, int) or thread_count < 1:
        raise CheckpointingException(f"thread_count must be an integer >= 1 or None, got {thread_count!r}")
    return thread_count, True


def writer_threads(count: int, given: bool, checkpoint_dir: Optional[storage.Location]) -> int:
    """Threads that write a rank's ``count`` files: ``count`` if it was given, or on an object
    store (one upload stream per file); by default on a file system one per core this rank may
    count on (:func:`distckpt.budget.cores_per_rank`), at most :data:`MAX_WRITER_THREADS`. The
    threads share the files' bytes (:mod:`.spans`), so the files a save writes do not depend on
    the host. Asked when a save writes (the ranks on the host are known by then)."""
    if given or storage.is_remote(checkpoint_dir):
        return count
    return max(1, min(MAX_WRITER_THREADS, cores_per_rank()))


def io_threads(count: int, given: bool, checkpoint_dir: Optional[storage.Location]) -> int:
    """Threads a load reads with (``count``: its ``thread_count``): all of them if the count was given
    or the location is an object store (each request waits on the network); by default on a
    file system at most :func:`distckpt.budget.cores_per_rank` (page-cache I/O is memory
    copies, which more threads than cores only interleave)."""
    if given or storage.is_remote(checkpoint_dir):
        return count
    return max(1, min(count, cores_per_rank()))


def plan_save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Resolved,
    rank: int,
    files: int,
    separation_hint: Optional[str],
    stage_cpu_tensors: bool,
    staging: Optional[Any],
) -> SavePlan:
    """Collect this rank's main replicas into at most ``files`` files (per separated prefix);
    ``staging``: the StagingBuffers pool their bytes will be copied into (an async save; CPU
    tensors only with ``stage_cpu_tensors``). Nothing is copied yet."""
    stage = staging is not None
    items: List[WriteItem] = []
    decls: Dict[str, KeyDecl] = {}
    for sh in nested_values(sharded_state_dict):
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedTensor):
            on_cpu = sh.data is not None and sh.data.device.type == "cpu"
            item, decl = _tensor_item(sh, stage and not (on_cpu and not stage_cpu_tensors))
            decls[sh.key] = decl
        elif isinstance(sh, ShardedObject):
            item, decl = _object_item(sh)
            decls[sh.unique_key] = decl
        else:
            raise CheckpointingException(f"cannot save {type(sh).__name__} under key {sh.key!r}")
        if item is not None:
            items.append(item)
    groups: Dict[str, List[WriteItem]] = defaultdict(list)
    for it in items:
        hint = separation_hint
        groups[hint if hint and it.fqn.startswith(hint) else ""].append(it)
    # An overwrite on an object store names its files with the save's token, so that it never
    # writes over a file of the checkpoint it replaces (storage.record; ``.metadata`` records
    # the names, which DCP and Megatron-Core read as they are).
    token = getattr(checkpoint_dir, "file_token", None) or ""
    jobs = []
    for prefix, group in sorted(groups.items()):
        for b, bucket in enumerate(buckets(group, files)):
            jobs.append((f"{prefix}{token}__{rank}_{b}{DATA_SUFFIX}", bucket))
    return SavePlan(checkpoint_dir, rank, jobs, decls, staging=staging)
