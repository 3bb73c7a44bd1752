"""Reading a ``torch_dist`` load's planned copies out of the stored items.

:func:`read_chunk` serves every copy of one stored item (a ``preadv`` into place, a strided copy
out of a file mapping, a checked read block by block, or an item already in memory), checking
what it copies against the manifest's CRC32Cs. :func:`execute_plan` reads a
:class:`~distckpt.strategies.torch_dist.loadplan.LoadPlan` file by file: ``pread`` and mappings
on a local directory, coalesced ranged GETs from an object store.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple, Union

import torch

from distckpt import containment, dist, storage
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.formats.manifest import dtype_name
from distckpt.formats.zip_archive import framed_layout, read_archive_layout
from distckpt.io.blockread import BlockReader
from distckpt.io.byteio import pread_exact, pread_into
from distckpt.io.copies import CopyOp, copy_boxes, copy_from_mapping
from distckpt.io.device_io import HostBounce, caller_streams
from distckpt.io.filesystem import copy_framed_from, read_framed_crc, read_framed_into
from distckpt.strategies.common import safe_torch_load
from distckpt.strategies.torch_dist.claims import extent_error, record_name
from distckpt.strategies.torch_dist.loadplan import LoadPlan
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, Resolved
from distckpt.strategies.torch_dist.partial import (
    block_table,
    local_block_table,
    partial_candidate,
    partial_read,
    table_entry,
)
from distckpt.strategies.torch_dist.stored import (
    Stored,
    StoredKey,
    check_item,
    compare_crc,
    expected_checksum,
    stored_file_size,
)

# Bytes one reader thread fetches from an object store at a time (ranged GETs).
REMOTE_READ_BATCH = 256 << 20

# Loads of at most this many item bytes read in the calling thread, file after file; a file whose
# items are each at most SMALL_ITEM_BYTES and lie within a span of at most INLINE_READ_BYTES is
# read with one pread of that span (a few syscalls per file instead of a few per item).
INLINE_READ_BYTES = 4 << 20
SMALL_ITEM_BYTES = 64 << 10


def small_span(items: List[Stored]) -> Optional[int]:
    """The length of the span ``items`` (sorted by offset) cover, when one read of it serves them."""
    if not items or any(st.length > SMALL_ITEM_BYTES for st in items):
        return None
    span = max(st.file_offset + st.length for st in items) - items[0].file_offset
    needed = sum(st.length for st in items)
    return span if span <= INLINE_READ_BYTES and span <= 2 * needed else None


def whole_into_cpu(st: Stored, ops: List[CopyOp]) -> bool:
    """Whether ``ops`` is one copy of the whole item into a contiguous CPU tensor (a load in the
    layout the item was saved in)."""
    if len(ops) != 1:
        return False
    op = ops[0]
    return (
        op.start == 0
        and op.numel == math.prod(st.size)
        and op.is_range
        and op.dst.device.type == "cpu"
        and op.dst.is_contiguous()
    )


def read_chunk(
    fd: int,
    path: Union[str, os.PathLike],
    st: Stored,
    ops: List[CopyOp],
    checksums: Optional[Dict],
    rank: int,
    verify: bool,
    raw: Optional[Union[bytes, memoryview]] = None,
    bounce: Optional[HostBounce] = None,
    blocks: Optional[BlockReader] = None,
    claimed: Optional[StoredKey] = None,
) -> int:
    """Serve every copy of one stored item; returns the bytes taken from storage.

    ``claimed``: the key as the metadata describes it. An item whose own header says another dtype
    (a frame that matches the destination's dtype proves it agrees) is refused: the metadata is
    damaged, and a load that allocates from its claims would get converted values.

    With ``checksums`` (the manifest's, by (file, offset)) every byte copied is checked: a
    whole item in the saved layout as it is read into place, other copies through ``blocks``
    (the item's block CRCs) block by block, an item without block CRCs read whole first.

    A box that is a plain element range lands in a contiguous destination of the same dtype
    with one ``preadv`` (a CUDA destination: through ``bounce``'s pinned slots, its copies
    overlapping the next reads). Other boxes (column blocks, strided flat slices, other dtypes or
    layouts) are copied out of a read-only mapping of the bytes they span. The common case of a
    load in the saved layout, one copy of the whole item into a contiguous CPU tensor, reads
    frame and bytes in one call (:func:`read_framed_into`), or, when the item is ``raw`` already
    (a file of small items read at once), moves its bytes with one ``memmove``
    (:func:`copy_framed_from`).
    """
    numel = math.prod(st.size)
    what = f"key {ops[0].key!r} in {path} at offset {st.file_offset} (rank {rank})"
    checked = False
    if checksums is not None and not verify:
        # The default checks: every byte copied is checked against a CRC32C as it is read.
        if raw is not None:
            check_item(raw, st, checksums, what, ops[0].key)  # a small item, in memory already
            checked = True
        elif (expected := expected_checksum(st, checksums, ops[0].key, what)) is None:
            checksums = None  # a file the manifest says nothing of: read as without one
        else:
            if whole_into_cpu(st, ops):
                crc = read_framed_crc(fd, st.file_offset, st.length, tuple(st.size), ops[0].dst, what)
                if crc is not None:
                    compare_crc(crc, expected, what)
                    return st.length
            if blocks is not None:
                return blocks.copy(ops, bounce)
    if not verify and whole_into_cpu(st, ops):
        # In the saved layout: the tensor bytes straight into place, the frame compared, not parsed
        # (from the file in one call, or out of the span already read and checked).
        if (
            raw is None
            and checksums is None
            and read_framed_into(fd, st.file_offset, st.length, tuple(st.size), ops[0].dst)
        ):
            return st.length
        if (
            raw is not None
            and (checked or checksums is None)
            and copy_framed_from(memoryview(raw), st.file_offset, tuple(st.size), ops[0].dst)
        ):
            return st.length
    if isinstance(raw, memoryview):
        raw = bytearray(raw)
    if raw is not None or verify or checksums is not None:
        if raw is None:
            raw = os.pread(fd, st.length, st.file_offset)
        if len(raw) != st.length:
            raise CheckpointingException(f"{what}: file is truncated ({len(raw)} of {st.length} bytes)")
        if not checked:
            check_item(raw, st, checksums, what, ops[0].key)

        def read(offset: int, n: int) -> bytes:
            return raw[offset : offset + n]
    else:

        def read(offset: int, n: int) -> bytes:
            n = max(0, min(n, st.length - offset))
            return os.pread(fd, n, st.file_offset + offset)

    layout = None
    if st.length:  # distckpt's own frame: compared with the expected one, not parsed
        layout = framed_layout(raw, tuple(st.size), ops[0].dst.dtype, st.length, read, st.file_offset)
    if layout is None and st.length:
        layout = read_archive_layout(read, st.length)
    if layout is None or not layout.is_contiguous or math.prod(layout.size) != numel:
        whole = raw if raw is not None else read(0, st.length)
        if len(whole) != st.length:
            raise CheckpointingException(f"{what}: file is truncated ({len(whole)} of {st.length} bytes)")
        tensor = safe_torch_load(whole, what=what)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != numel:
            # The record's claim against what the data file holds there: name the claim's source.
            source = claimed.source if claimed is not None and claimed.source else METADATA_FNAME
            holds = (
                f"a tensor of {tensor.numel()} elements"
                if isinstance(tensor, torch.Tensor)
                else f"a {type(tensor).__name__}"
            )
            raise CheckpointingException(
                f"{source}: records {record_name(ops[0].key, st.offset)} of {list(st.size)} ({numel} "
                f"elements) at offset {st.file_offset} of {path}, which holds {holds} there: the metadata "
                f"or the data file is damaged (rank {rank})"
            )
        _check_claimed_dtype(tensor.dtype, claimed, what)
        copy_boxes(tensor.reshape(-1).contiguous(), 0, ops)
        return st.length
    _check_claimed_dtype(layout.dtype, claimed, what)
    itemsize = layout.dtype.itemsize
    base = layout.data_offset + layout.storage_offset * itemsize
    if base + numel * itemsize > layout.data_offset + layout.data_length:
        raise CheckpointingException(f"{what}: tensor bytes extend past the item")
    if raw is not None:
        if not numel:
            return st.length
        # A byte offset, not a view of a uint8 tensor: the data is aligned in the file, not
        # necessarily within the item, and viewing uint8 as the dtype needs the latter.
        src = torch.frombuffer(
            raw if isinstance(raw, bytearray) else bytearray(raw),
            dtype=layout.dtype,
            count=numel,
            offset=base,
        )
        copy_boxes(src, 0, [op for op in ops if op.numel])
        return st.length
    nbytes = 0
    strided = []
    for op in ops:
        if op.numel == 0:
            continue
        if op.is_range and op.dst.dtype == layout.dtype and op.dst.is_contiguous():
            if op.dst.device.type == "cpu":
                pread_into(fd, op.dst, st.file_offset + base + op.start * itemsize, what)
            elif bounce is not None and op.dst.device.type == "cuda":
                bounce.fill(fd, st.file_offset + base + op.start * itemsize, op.dst, what)
            else:
                strided.append(op)
        else:
            strided.append(op)
        nbytes += op.numel * itemsize
    if strided and bounce is not None and all(op.dst.device.type == "cuda" for op in strided):
        strided = bounce.fill_boxes(fd, st.file_offset + base, layout.dtype, strided, what)
    if strided:
        first = min(op.start for op in strided)
        last = max(op.end for op in strided)
        copy_from_mapping(
            fd, st.file_offset + base + first * itemsize, last - first, layout.dtype, strided, first, what
        )
    return nbytes


def read_item_bytes(
    checkpoint_dir: Resolved, stored: Stored, what: str, record: Optional[str] = None
) -> bytes:
    """The bytes of one stored item, read whole (a byte item: a pickled object or value), after
    its file name passed the containment rule and its range was found inside the file; ``what``
    names the item in errors, ``record`` its storage record (a record past the end of its file
    is blamed on the file that lies: :func:`extent_error`). Not checked against a checksum: the
    caller does that."""
    source = storage.join(checkpoint_dir, METADATA_FNAME)
    try:
        size = stored_file_size(checkpoint_dir, stored.relative_path, source)
        if stored.file_offset + stored.length > size:
            raise extent_error(
                checkpoint_dir,
                source,
                record or what,
                stored.relative_path,
                stored.file_offset,
                stored.length,
                size,
            )
        root = storage.local_root(checkpoint_dir)
        if root is None:
            raw = bytes(
                checkpoint_dir.get_ranges(stored.relative_path, [stored.file_offset], [stored.length])[0]
            )
        else:
            with open(containment.open_beneath(root, stored.relative_path, source), "rb") as f:
                f.seek(stored.file_offset)
                raw = f.read(stored.length)
    except FileNotFoundError:
        raise CheckpointingException(f"{what}: data file is missing") from None
    if len(raw) != stored.length:
        raise CheckpointingException(f"{what}: file is truncated")
    return raw


def _check_claimed_dtype(actual: torch.dtype, claimed: Optional[StoredKey], what: str) -> None:
    if claimed is not None and actual != claimed.dtype:
        raise CheckpointingException(
            f"{what}: the item holds {dtype_name(actual)} values, {claimed.source} says the key is "
            f"{dtype_name(claimed.dtype)} (the metadata is damaged)"
        )


class _PlanReads:
    """One load's reads of the stored items its plan copies from, file by file (one reader
    thread per file at a time): the local and the object-store reader share the bookkeeping
    (items in file order, errors, byte and request counts)."""

    def __init__(
        self, plan: LoadPlan, location: Resolved, checksums: Optional[Dict], verify: bool, slot: int
    ):
        self.plan, self.location, self.checksums, self.verify = plan, location, checksums, verify
        self.pinned_slot_bytes = slot
        self.root = storage.local_root(location)
        self.by_file: Dict[str, List[Stored]] = defaultdict(list)
        for st in plan.ops:
            self.by_file[st.relative_path].append(st)
        self.rank = dist.get_rank()
        # The loading thread's streams: the reader threads' copies wait for the work queued there
        # (the targets' allocation and zeroing), not for their own default streams.
        self.after = caller_streams([op.dst for ops in plan.ops.values() for op in ops])
        self.counted: List[int] = []  # per-file byte counts; list.append is atomic across reader threads
        self.gets: List[int] = []  # object stores: GET requests per batch

    def items(self, name: str) -> List[Stored]:
        return sorted(self.by_file[name], key=lambda c: c.file_offset)

    def missing(
        self, where: Union[str, os.PathLike], what: str, items: List[Stored]
    ) -> CheckpointingException:
        keys = sorted({op.key for st in items for op in self.plan.ops[st]})
        return CheckpointingException(
            f"{where}: {what} is missing (needed for keys {keys}, rank {self.rank})"
        )

    def read(self, name: str, items: Optional[List[Stored]] = None) -> None:
        """Read ``name``'s items (``items``: a consecutive share of them, local files only)."""
        if self.root is None:
            self.read_object(name)
        else:
            self.read_file(name, items)

    def shares(self, names: List[str], threads: int) -> List[Tuple[str, Optional[List[Stored]]]]:
        """The reads of ``names`` for ``threads`` threads: a file each, or (local files, more
        threads than files) each file's items cut into consecutive shares of about an equal
        part of the bytes, so that every thread reads (an item is never cut: one larger than a
        share is a share of its own). A rank's 2 files then keep 4 or 8 readers busy."""
        if self.root is None or threads <= len(names):
            return [(name, None) for name in names]
        target = max(1, sum(st.length for st in self.plan.ops) // threads)
        out: List[Tuple[str, Optional[List[Stored]]]] = []
        for name in names:
            share: List[Stored] = []
            size = 0
            for st in self.items(name):
                share.append(st)
                size += st.length
                if size >= target:
                    out.append((name, share))
                    share, size = [], 0
            if share:
                out.append((name, share))
        return out

    def read_object(self, name: str) -> None:
        """Object store: ranged GETs of the bytes this rank needs, concurrent, in batches of at
        most REMOTE_READ_BATCH bytes, every byte checked against a CRC32C (the store's own
        checksums do not cover ranged reads). An item needed only in part is read block by
        block when its file has a block table (:mod:`distckpt.formats.blockcrc`): the
        blocks holding the wanted bytes, runs closer than the store's ``coalesce`` merged,
        each block checked against its CRC32C. Other items are read whole and checked
        against the item's CRC32C."""
        store, plan, checksums, rank = self.location, self.plan, self.checksums, self.rank
        where = store.where(name)
        items = self.items(name)
        nbytes = 0
        table = None
        if (
            checksums is not None
            and not self.verify
            and any(partial_candidate(st, plan.ops[st]) for st in items)
        ):
            table, nbytes = block_table(store, name)
            self.gets.append(1)
        gap = getattr(store, "coalesce", 1 << 20)
        work = []  # (item, its partial read or None, [(file offset, length)])
        for st in items:
            part = partial_read(st, plan.ops[st], table, checksums, gap, where) if table is not None else None
            work.append((st, part, part.ranges() if part is not None else [(st.file_offset, st.length)]))
        batches, batch, size = [], [], 0
        for w in work:
            n = sum(length for _, length in w[2])
            if batch and size + n > REMOTE_READ_BATCH:
                batches.append(batch)
                batch, size = [], 0
            batch.append(w)
            size += n
        batches.append(batch)
        for group in batches:
            # Coalesced here (not only inside the client) so that bytes_read counts what is
            # transferred, gaps included.
            requests, places = storage.coalesce([r for _, _, rs in group for r in rs], gap)
            try:
                got = store.get_ranges(name, [o for o, _ in requests], [n for _, n in requests])
            except FileNotFoundError:
                raise self.missing(where, "data object", [st for st, _, _ in group]) from None
            views = iter(got[i][at : at + n] for i, at, n in places)
            for st, part, rs in group:
                mine = [next(views) for _ in rs]
                if part is None:
                    read_chunk(
                        -1,
                        where,
                        st,
                        plan.ops[st],
                        checksums,
                        rank,
                        True,
                        bytearray(mine[0]),
                        claimed=plan.keys.get(plan.ops[st][0].key),
                    )
                else:
                    part.copy(mine, plan.ops[st], rank)
            nbytes += sum(n for _, n in requests)
            self.gets.append(len(requests))
        self.counted.append(nbytes)

    def read_file(self, name: str, items: Optional[List[Stored]] = None) -> None:
        """Local file: ``pread`` into place, strided copies out of a mapping, small items out of
        one read of the span they lie in, parts of large items block by block against the
        file's block table (:class:`~distckpt.io.blockread.BlockReader`). ``items``: a
        share of the file's items in offset order (default: all of them)."""
        root, plan, checksums, rank, verify = self.root, self.plan, self.checksums, self.rank, self.verify
        path = root / name
        items = self.items(name) if items is None else items
        try:
            fd = containment.open_beneath(root, name, root / METADATA_FNAME)
        except FileNotFoundError:
            raise self.missing(path, "data file", items) from None
        try:
            nbytes = 0
            file_size = os.fstat(fd).st_size
            for st in items:
                if st.file_offset + st.length > file_size:
                    key = plan.ops[st][0].key
                    claimed = plan.keys.get(key)
                    raise extent_error(
                        self.location,
                        claimed.source if claimed is not None and claimed.source else root / METADATA_FNAME,
                        record_name(key, st.offset),
                        name,
                        st.file_offset,
                        st.length,
                        file_size,
                    )
            span = small_span(items)
            if span is not None:
                # Small items: one read of the span they lie in, then each item from memory.
                first = items[0].file_offset
                raw = bytearray(span)
                view = memoryview(raw)
                pread_exact(fd, view, first, str(path))
                for st in items:
                    start = st.file_offset - first
                    read_chunk(
                        fd,
                        path,
                        st,
                        plan.ops[st],
                        checksums,
                        rank,
                        verify,
                        view[start : start + st.length],
                        claimed=plan.keys.get(plan.ops[st][0].key),
                    )
                self.counted.append(len(raw))
                return
            table, vouched = None, False
            if (
                checksums is not None
                and not verify
                and any(
                    st.length >= blockcrc.MIN_PAYLOAD and not whole_into_cpu(st, plan.ops[st]) for st in items
                )
            ):
                table, vouched = local_block_table(root, name, checksums)
            bounce = HostBounce(self.pinned_slot_bytes, after=self.after) if self.pinned_slot_bytes else None
            try:
                for st in items:
                    blocks = None
                    expected = checksums.get((name, st.file_offset)) if table is not None else None
                    if expected is not None and not whole_into_cpu(st, plan.ops[st]):
                        entry = table_entry(st, table, expected, vouched, str(path))
                        if entry is not None:
                            blocks = BlockReader(
                                fd,
                                st.file_offset + entry.payload_offset,
                                entry,
                                table.block,
                                (
                                    f"key {plan.ops[st][0].key!r} in {path} at offset {st.file_offset} "
                                    f"(rank {rank})"
                                ),
                                f"its block table {blockcrc.table_name(name)}",
                            )
                    nbytes += read_chunk(
                        fd,
                        path,
                        st,
                        plan.ops[st],
                        checksums,
                        rank,
                        verify,
                        bounce=bounce,
                        blocks=blocks,
                        claimed=plan.keys.get(plan.ops[st][0].key),
                    )
            finally:
                if bounce is not None:
                    bounce.close()
            self.counted.append(nbytes)
        finally:
            os.close(fd)


def execute_plan(
    plan: LoadPlan,
    checkpoint_dir: Resolved,
    checksums: Optional[Dict],
    verify: bool,
    pinned_slot_bytes: int,
    threads: int,
) -> Tuple[int, int]:
    """Read every stored item ``plan`` copies from (``threads`` files, or shares of local files,
    at once: :meth:`_PlanReads.shares`), then run its finalizers; returns the bytes read from
    storage and (object stores) the requests made."""
    reads = _PlanReads(plan, checkpoint_dir, checksums, verify, pinned_slot_bytes)
    names = sorted(reads.by_file)
    if len(names) > 1:
        # Ranks that read the same files start at different ones rather than all at the
        # first: fewer ranks map and fault in the same file at once (on a parallel file
        # system, fewer on the same servers). 2 ranks, one reader each, a resharded load of
        # 256 MiB per rank: 0.167 -> 0.142 s.
        first = reads.rank * len(names) // max(1, dist.get_world_size())
        names = names[first:] + names[:first]
    small = sum(st.length for st in plan.ops) <= INLINE_READ_BYTES
    if small or not names:
        for n in names:
            reads.read(n)
    else:
        # Also one reader is a worker thread, not the caller's: copies out of mappings run
        # in torch, whose intra-op threads fan out from the main thread (all the host's
        # cores unless OMP_NUM_THREADS says otherwise, as torchrun does). Two ranks on two
        # cores, each copying from its main thread with two intra-op threads, made a
        # resharded load 2-4x slower; from a worker thread it runs as one thread.
        work = reads.shares(names, threads)
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(work)))) as pool:
            for fut in [pool.submit(reads.read, n, share) for n, share in work]:
                fut.result()
    for fin in plan.finalizers:
        fin()
    return sum(reads.counted), sum(reads.gets)
