"""The sidecar index ``.distckpt_index``: the torch_dist chunk records, readable in part.

DCP's ``.metadata`` is one pickle holding every chunk of every key; at 16k ranks it is hundreds
of MB that every loading rank would fetch and unpickle. The sidecar holds the same records
(plus each item's CRC32C) in a layout a rank reads partially: a small directory of keys, and per
tensor key a packed tree of sorted chunk records whose nodes carry bounding boxes, so a load
fetches only the nodes whose boxes meet the boxes it asks for. It is written by rank 0 at commit
beside ``.metadata`` (which stays, for Megatron-Core and PyTorch), covered by the manifest, and
read through the storage layer (ranged reads, so it works on object stores too).

Layout (version 1; see docs/formats.md)::

    header     b"DCKIDX01" | u64 directory length | u32 CRC32C of the directory  (20 bytes)
    directory  JSON: {"format", "version", "metadata_bytes", "fanout", "keys": {fqn: entry}}
    nodes      node blobs; offsets below are relative to the end of the directory

A tensor key's entry: ``{"dtype", "size", "orig_shape", "count", "depth", "root": [offset,
length, crc32c], "bbox": [lo, hi]}``; an object/byte key's entry: ``{"bytes": true, "item":
[file, offset, length, crc32c]}`` (``item`` absent if it has no stored bytes).
A leaf node: ``u32 n_names | JSON list of file names | int64[n, 2*ndim + 4]`` rows
``offset[ndim], size[ndim], name index, file offset, length, crc32c`` sorted by ``offset``.
An inner node: ``int64[m, 3 + 2*ndim]`` rows ``child offset, child length, child crc32c,
lo[ndim], hi[ndim]`` (``hi`` exclusive: the child's bounding box). ``depth`` 1 means the root is
a leaf. Every node is checked against the CRC32C its parent (or the directory) records.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import struct
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from distckpt import bounds, containment, storage
from distckpt.core import CheckpointingException
from distckpt.manifest import crc32c

INDEX_FNAME = ".distckpt_index"
MAGIC = b"DCKIDX01"
FORMAT = "distckpt-index"
VERSION = 1
FANOUT = 64  # children per inner node
LEAF = 16  # chunk records per leaf: what a rank reads beyond its own records is at most a leaf per box
_HEADER = struct.Struct("<8sQI")
_PLAIN_BOXES = 4  # a query of at most this many boxes per key searches small leaves in Python

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, size)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# The dtypes named so far (only real ones: a sidecar's names are claims).
_DTYPES: Dict[str, torch.dtype] = {}


def _dtype_of(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        if type(name) is not str:
            raise ValueError(f"dtype {name!r} is not a name")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
        _DTYPES[name] = dtype
    return dtype


# --------------------------------------------------------------------------- writing


class _Blob:
    """The node bytes, appended in order, and where each node's checksum is recorded. ``traced``:
    also note where each record's CRC32C lands (what an :class:`IndexTemplate` needs)."""

    def __init__(self, traced: bool = False) -> None:
        self.parts: List[bytes] = []
        self.size = 0
        # Per node, in the order added (children before parents): [start, length, where its
        # checksum is recorded: the blob position of a parent's field, or the fqn of a root].
        self.nodes: List[List[Any]] = []
        self.traced = traced
        self.crc_at: Dict[str, np.ndarray] = {}  # fqn -> blob position of each record's CRC32C, input order

    def add(self, data: bytes) -> List[int]:
        ref = [self.size, len(data), crc32c(data)]
        self.nodes.append([self.size, len(data), None])
        self.parts.append(data)
        self.size += len(data)
        return ref

    def mark(self, node: int, target: Any) -> None:
        self.nodes[node][2] = target

    def record_positions(
        self,
        first_node: int,
        heads: List[int],
        starts: np.ndarray,
        total: int,
        width: int,
        order: Optional[np.ndarray],
    ) -> np.ndarray:
        """The blob position of each record's CRC32C, in input order: ``total`` rows, sorted by
        ``order`` (the input index of each sorted row; None: not reordered), were packed into
        the leaves added from node ``first_node`` on, one per start, ``heads[i]`` the bytes of
        leaf ``i`` before its rows (each row's CRC32C is its last 8 bytes)."""
        leaf_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, total)))
        base = np.array(
            [self.nodes[first_node + i][0] + heads[i] for i in range(len(starts))], dtype=np.int64
        )
        sorted_pos = base[leaf_of] + (np.arange(total) - starts[leaf_of]) * width + width - 8
        if order is None:
            return sorted_pos
        pos = np.empty(total, dtype=np.int64)
        pos[order] = sorted_pos
        return pos


class _Quoted:
    """The JSON-quoted bytes of the file names, by index, made once per index build."""

    def __init__(self, names: List[str]) -> None:
        self.names = names
        self.by_index: List[Optional[bytes]] = [None] * len(names)

    def lookup(self, used: np.ndarray):
        """``by_index.__getitem__``, after quoting every name in ``used`` not quoted yet."""
        by_index = self.by_index
        for f in np.unique(used).tolist():
            if f >= len(by_index):
                raise CheckpointingException(
                    f"index: record names file {f}, but there are {len(by_index)} files"
                )
            if by_index[f] is None:
                by_index[f] = json.dumps(self.names[f]).encode()
        return by_index.__getitem__


def _small_keys(
    blob: _Blob, group: List[Tuple[str, np.ndarray]], ndim: int, quoted: _Quoted
) -> Dict[str, Dict[str, Any]]:
    """The directory fields of keys whose records fit one leaf (most keys of most checkpoints),
    ``group`` all of ``ndim`` axes: one sort and one packing for all of them, each key's leaf
    then cut out, rather than numpy calls (or Python loops) per key."""
    counts = [len(r) for _, r in group]
    rows = np.concatenate([r for _, r in group])
    kid = np.repeat(np.arange(len(group)), counts)
    order = np.lexsort([rows[:, d] for d in reversed(range(ndim))] + [kid])
    starts = np.cumsum([0] + counts[:-1])
    leaves = _pack_leaves(rows[order], ndim, starts, quoted)
    first = len(blob.nodes)
    out = {}
    for i, ((fqn, _), c, (data, lo, hi, _)) in enumerate(zip(group, counts, leaves)):
        out[fqn] = {"count": c, "depth": 1, "root": blob.add(data), "bbox": [lo.tolist(), hi.tolist()]}
        blob.mark(first + i, fqn)
    if blob.traced:
        # The rows of each key keep their block in the sorted order (the key index sorts first).
        pos = blob.record_positions(
            first, [head for *_, head in leaves], starts, len(rows), rows.shape[1] * 8, order
        )
        for (fqn, _), s, c in zip(group, starts.tolist(), counts):
            blob.crc_at[fqn] = pos[s : s + c]
    return out


_U32 = struct.Struct("<I")


def _pack_leaves(
    rows: np.ndarray, ndim: int, starts: np.ndarray, quoted: _Quoted
) -> List[Tuple[bytes, np.ndarray, np.ndarray, int]]:
    """Leaves of sorted records, leaf ``i`` the rows from ``starts[i]`` to the next start: their
    bytes, bounding boxes and the length of their head (the names before the rows), with numpy
    over all leaves at once; per leaf, Python only joins its file names (quoted once per
    build) and frames its bytes."""
    m, col = len(rows), 2 * ndim
    leaf_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, m)))
    fid = rows[:, col]
    nfiles = max(len(quoted.names), int(fid.max()) + 1)
    # Each leaf names the files it uses, in file-index order, and its rows point into that list.
    codes, inverse = np.unique(leaf_of * nfiles + fid, return_inverse=True)
    code_bounds = np.searchsorted(codes, np.arange(len(starts) + 1) * nfiles)
    table = rows.copy()
    table[:, col] = inverse.reshape(-1) - code_bounds[leaf_of]
    data = table.astype("<i8").tobytes()
    width = 8 * (2 * ndim + 4)
    if ndim:
        lo = np.minimum.reduceat(rows[:, :ndim], starts)
        hi = np.maximum.reduceat(rows[:, :ndim] + rows[:, ndim:col], starts)
    else:
        lo = hi = np.zeros((len(starts), 0), dtype=np.int64)
    used = codes % nfiles
    quote = quoted.lookup(used)
    files, bounds = used.tolist(), code_bounds.tolist()
    ends = starts.tolist()[1:] + [m]
    out = []
    for i, (s, end) in enumerate(zip(starts.tolist(), ends)):
        names_json = b"[" + b",".join(map(quote, files[bounds[i] : bounds[i + 1]])) + b"]"
        out.append(
            (
                _U32.pack(len(names_json)) + names_json + data[s * width : end * width],
                lo[i],
                hi[i],
                4 + len(names_json),
            )
        )
    return out


def _build_key(
    blob: _Blob, fqn: str, rows: np.ndarray, ndim: int, fanout: int, leaf: int, quoted: _Quoted
) -> Dict[str, Any]:
    """Pack one key's records (sorted here) into a tree; returns the directory fields."""
    order = None
    if ndim:
        order = np.lexsort(rows[:, ndim - 1 :: -1].T)
        rows = rows[order]
    starts = np.arange(0, len(rows), leaf)
    leaves = _pack_leaves(rows, ndim, starts, quoted)
    first = len(blob.nodes)
    # Per node of the level: its reference, bounding box and node number in the blob.
    level: List[Tuple[List[int], np.ndarray, np.ndarray, int]] = [
        (blob.add(data), lo, hi, first + i) for i, (data, lo, hi, _) in enumerate(leaves)
    ]
    if blob.traced:
        blob.crc_at[fqn] = blob.record_positions(
            first, [head for *_, head in leaves], starts, len(rows), rows.shape[1] * 8, order
        )
    depth = 1
    while len(level) > 1:
        nxt = []
        for s in range(0, len(level), fanout):
            group = level[s : s + fanout]
            table = np.array([ref + lo.tolist() + hi.tolist() for ref, lo, hi, _ in group], dtype="<i8")
            lo = np.min([g[1] for g in group], axis=0)
            hi = np.max([g[2] for g in group], axis=0)
            ref = blob.add(table.tobytes())
            # Each child's checksum is the third field of its row in this table.
            for k, (*_, child) in enumerate(group):
                blob.mark(child, ref[0] + k * table.shape[1] * 8 + 16)
            nxt.append((ref, lo, hi, len(blob.nodes) - 1))
        level = nxt
        depth += 1
    ref, lo, hi, node = level[0]
    blob.mark(node, fqn)
    return {"count": len(rows), "depth": depth, "root": ref, "bbox": [lo.tolist(), hi.tolist()]}


def build_index(
    keys: Dict[str, Dict[str, Any]],
    records: Iterable[Tuple[str, Sequence[int], Sequence[int], str, int, int, int]],
    metadata_bytes: int,
    fanout: int = FANOUT,
    leaf: int = LEAF,
) -> bytes:
    """The sidecar's bytes.

    ``keys``: fqn -> ``{"bytes": True}`` or ``{"dtype": torch.dtype, "size": shape,
    "orig_shape": shape or None}``. ``records``: ``(fqn, chunk offset, chunk size, file, file
    offset, length, crc32c)`` of every stored item (offset/size ``()`` for byte items).
    ``metadata_bytes``: the length of the ``.metadata`` it describes (a cheap staleness check).
    """
    names: List[str] = []
    name_ids: Dict[str, int] = {}
    rows_by_key: Dict[str, List[Tuple[int, ...]]] = {}
    items: Dict[str, List[Any]] = {}
    for fqn, off, size, path, foff, length, crc in records:
        nid = name_ids.get(path)
        if nid is None:
            nid = name_ids[path] = len(names)
            names.append(path)
        info = keys.get(fqn)
        if info is None:
            raise CheckpointingException(f"index: record for undeclared key {fqn!r}")
        if info.get("bytes"):
            items[fqn] = [path, foff, length, crc]
            continue
        lst = rows_by_key.get(fqn)
        if lst is None:
            lst = rows_by_key[fqn] = []
        lst.append((*off, *size, nid, foff, length, crc))
    return _write_index(keys, rows_by_key, items, names, metadata_bytes, fanout, leaf)


def build_index_from_rows(
    keys: Dict[str, Dict[str, Any]],
    rows: Dict[str, np.ndarray],
    names: List[str],
    metadata_bytes: int,
    fanout: int = FANOUT,
    leaf: int = LEAF,
    template: bool = False,
) -> Any:
    """:func:`build_index` from arrays: ``rows[fqn]`` is int64 ``[n, 2 * ndim + 4]``, one row per
    record: chunk offset, chunk size, file (an index into ``names``), file offset, length,
    crc32c (a byte key's rows have ``ndim`` 0; its last row is its item). ``template``: return
    ``(bytes, IndexTemplate)``, the template able to patch in other CRC32Cs of the same records."""
    items: Dict[str, List[Any]] = {}
    tensor_rows: Dict[str, np.ndarray] = {}
    for fqn, r in rows.items():
        info = keys.get(fqn)
        if info is None:
            raise CheckpointingException(f"index: record for undeclared key {fqn!r}")
        if info.get("bytes"):
            if len(r):
                f, foff, length, crc = r[-1, -4:].tolist()
                items[fqn] = [names[f], foff, length, crc]
        elif len(r):
            tensor_rows[fqn] = r
    return _write_index(keys, tensor_rows, items, names, metadata_bytes, fanout, leaf, template)


def _write_index(
    keys: Dict[str, Dict[str, Any]],
    rows_by_key: Dict[str, Any],
    items: Dict[str, List[Any]],
    names: List[str],
    metadata_bytes: int,
    fanout: int,
    leaf: int,
    template: bool = False,
) -> Any:
    blob = _Blob(traced=template)
    quoted = _Quoted(names)
    directory: Dict[str, Any] = {}
    # Every tensor key's records as an array; those that fit one leaf go in groups by axes.
    arrays: Dict[str, np.ndarray] = {}
    small: Dict[int, List[Tuple[str, np.ndarray]]] = {}
    for fqn, info in keys.items():
        rows = rows_by_key.get(fqn)
        if info.get("bytes") or rows is None or not len(rows):
            continue
        ndim = len(info["size"])
        if not isinstance(rows, np.ndarray):
            rows = np.array(rows, dtype=np.int64).reshape(len(rows), 2 * ndim + 4)
        arrays[fqn] = rows
        if len(rows) <= leaf:
            small.setdefault(ndim, []).append((fqn, rows))
    small_entries: Dict[str, Dict[str, Any]] = {}
    for ndim, group in small.items():
        small_entries.update(_small_keys(blob, group, ndim, quoted))
    for fqn, info in keys.items():
        if info.get("bytes"):
            entry: Dict[str, Any] = {"bytes": True}
            if fqn in items:
                entry["item"] = items[fqn]
            directory[fqn] = entry
            continue
        ndim = len(info["size"])
        entry = {
            "dtype": _dtype_name(info["dtype"]),
            "size": list(info["size"]),
            "orig_shape": list(info["orig_shape"]) if info.get("orig_shape") is not None else None,
        }
        if fqn in small_entries:
            entry.update(small_entries[fqn])
        elif fqn in arrays:
            entry.update(_build_key(blob, fqn, arrays[fqn], ndim, fanout, leaf, quoted))
        else:
            entry["count"] = 0
        directory[fqn] = entry
    if not template:
        return _framed(directory, metadata_bytes, fanout, leaf, blob.parts)
    kept = IndexTemplate(directory, bytearray().join(blob.parts), blob.nodes, blob.crc_at, fanout, leaf)
    return _framed(directory, metadata_bytes, fanout, leaf, [kept.blob]), kept


def _framed(
    directory: Dict[str, Any], metadata_bytes: int, fanout: int, leaf: int, parts: List[Any]
) -> bytes:
    head = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "metadata_bytes": metadata_bytes,
            "fanout": fanout,
            "leaf": leaf,
            "keys": directory,
        },
        separators=(",", ":"),
    ).encode()
    return b"".join([_HEADER.pack(MAGIC, len(head), crc32c(head)), head, *parts])


class IndexTemplate:
    """A sidecar kept for the next save of the same records (``cached_metadata``): its directory
    and node bytes, where each record's CRC32C lies in them, and where each node's checksum is
    recorded (a parent's field, or a key's root in the directory). Records that differ only in
    their CRC32Cs give the sidecar :func:`build_index_from_rows` would build, by patching: the
    CRC32C fields, then every node's checksum, children before parents, then the directory."""

    def __init__(
        self,
        directory: Dict[str, Any],
        blob: bytearray,
        nodes: List[List[Any]],
        crc_at: Dict[str, np.ndarray],
        fanout: int,
        leaf: int,
    ) -> None:
        self.directory, self.blob, self.nodes, self.fanout, self.leaf = directory, blob, nodes, fanout, leaf
        self.keys = list(crc_at)
        self.counts = [len(crc_at[fqn]) for fqn in self.keys]
        self.positions = (
            np.concatenate([crc_at[fqn] for fqn in self.keys]) if crc_at else np.zeros(0, np.int64)
        )
        self.items = [fqn for fqn, entry in directory.items() if "item" in entry]
        self.head = _head_template(directory, fanout, leaf)

    def patch(self, crcs: Dict[str, np.ndarray], metadata_bytes: int) -> Optional[bytes]:
        """The sidecar with ``crcs[fqn]`` (each key's records' CRC32Cs, in the order its rows
        were given; a byte key's last one is its item's); None if they do not match the records
        the template was built from (the caller builds the sidecar anew)."""
        if any(len(crcs.get(fqn, ())) != n for fqn, n in zip(self.keys, self.counts)) or any(
            not len(crcs.get(fqn, ())) for fqn in self.items
        ):
            return None
        blob = self.blob
        if len(self.positions):
            new = np.concatenate([np.asarray(crcs[fqn], dtype="<i8") for fqn in self.keys])
            raw = np.frombuffer(blob, dtype=np.uint8)
            raw[self.positions[:, None] + np.arange(8)] = new.view(np.uint8).reshape(-1, 8)
            del raw  # no export may outlive the patch (the blob stays resizable)
        directory = self.directory
        view = memoryview(blob)
        try:
            for start, length, target in self.nodes:
                crc = crc32c(view[start : start + length])
                if isinstance(target, str):
                    directory[target]["root"][2] = crc
                else:
                    _I64.pack_into(blob, target, crc)
        finally:
            view.release()
        for fqn in self.items:
            directory[fqn]["item"][3] = int(crcs[fqn][-1])
        if self.head is None:
            return _framed(directory, metadata_bytes, self.fanout, self.leaf, [blob])
        # The directory's JSON with the changed numbers put in its gaps: the text json.dumps gives.
        pieces, slots = self.head
        values = [
            str(metadata_bytes if kind == "md" else directory[fqn][kind][2 if kind == "root" else 3])
            for kind, fqn in slots
        ]
        text = [pieces[0]]
        for value, piece in zip(values, pieces[1:]):
            text.append(value)
            text.append(piece)
        head = "".join(text).encode()
        return b"".join([_HEADER.pack(MAGIC, len(head), crc32c(head)), head, blob])


_I64 = struct.Struct("<q")
# Placeholders for the numbers a template patches, in the directory JSON it keeps (19 digits: far
# above any offset, length or checksum a sidecar holds; each must occur exactly once, or no text).
_PLACEHOLDER = 7_777_700_000_000_000_000
_PLACEHOLDERS = re.compile(r"77777\d{14}")


def _head_template(
    directory: Dict[str, Any], fanout: int, leaf: int
) -> Optional[Tuple[List[str], List[Tuple[str, str]]]]:
    """The sidecar directory's JSON cut around the numbers a patch changes (each key's root
    checksum, each byte item's CRC32C, ``metadata_bytes``): ``(pieces, slots)``, the text being
    ``pieces[0] + value(slots[0]) + pieces[1] + ...``. None if a placeholder is not found
    exactly once (the patch then dumps the directory anew)."""
    slots: List[Tuple[str, str]] = []

    def mark(kind: str, fqn: str) -> int:
        slots.append((kind, fqn))
        return _PLACEHOLDER + len(slots) - 1

    shadow: Dict[str, Any] = {}
    for fqn, entry in directory.items():
        entry = dict(entry)
        if "root" in entry:
            entry["root"] = [*entry["root"][:2], mark("root", fqn), *entry["root"][3:]]
        if "item" in entry:
            entry["item"] = [*entry["item"][:3], mark("item", fqn), *entry["item"][4:]]
        shadow[fqn] = entry
    md = mark("md", "")
    text = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "metadata_bytes": md,
            "fanout": fanout,
            "leaf": leaf,
            "keys": shadow,
        },
        separators=(",", ":"),
    )
    pieces, order, at = [], [], 0
    for m in _PLACEHOLDERS.finditer(text):
        index = int(m.group()) - _PLACEHOLDER
        if not 0 <= index < len(slots):
            return None
        pieces.append(text[at : m.start()])
        order.append(slots[index])
        at = m.end()
    pieces.append(text[at:])
    if sorted(order) != sorted(slots):
        return None
    return pieces, order


def index_from_metadata(md: Any, checksums: Dict[Tuple[str, int], Any], metadata_bytes: int) -> bytes:
    """The sidecar of a DCP ``Metadata`` (``checksums``: the manifest's ``range_index()``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    mcore = getattr(md, "mcore_data", None) or {}
    keys: Dict[str, Dict[str, Any]] = {}
    sizes: Dict[Tuple[str, Tuple[int, ...]], Tuple[int, ...]] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            keys[fqn] = {"bytes": True}
            continue
        orig = (
            mcore.get(fqn, {}).get("nd_reformulated_orig_global_shape")
            if isinstance(mcore.get(fqn), dict)
            else None
        )
        keys[fqn] = {"dtype": meta.properties.dtype, "size": tuple(meta.size), "orig_shape": orig}
        for c in meta.chunks:
            sizes[(fqn, tuple(c.offsets))] = tuple(c.sizes)

    def records():
        for index, info in md.storage_data.items():
            off = tuple(index.offset) if index.offset is not None else ()
            rc = checksums.get((info.relative_path, info.offset))
            if rc is None:
                raise CheckpointingException(f"index: no checksum for {index.fqn!r} in {info.relative_path}")
            yield (
                index.fqn,
                off,
                sizes.get((index.fqn, off), ()),
                info.relative_path,
                info.offset,
                info.length,
                rc.crc32c,
            )

    return build_index(keys, records(), metadata_bytes)


# --------------------------------------------------------------------------- reading


class IndexReader:
    """Reads a sidecar partially: the directory once, then only the nodes a query needs.

    ``bytes_read`` counts every byte fetched from storage.
    """

    def __init__(self, location, directory: Dict[str, Any], data_start: int, bytes_read: int):
        self.location = location
        self.where = storage.join(location, INDEX_FNAME)
        self.keys: Dict[str, Any] = directory["keys"]
        self.metadata_bytes = int(directory.get("metadata_bytes", -1))
        self._checked: set = set()  # keys whose entries passed _check_entry
        self.data_start = data_start
        self.bytes_read = bytes_read  # everything fetched (the first read may overshoot)
        self.node_bytes_read = 0  # bytes of tree nodes fetched by queries

    @classmethod
    def open(cls, location, head_guess: int = 16 << 10) -> Optional[IndexReader]:
        """The reader of ``location``'s sidecar, or None if it has none (or it is stale: the
        ``.metadata`` beside it is not the one it was built with)."""
        where = storage.join(location, INDEX_FNAME)
        try:
            first = _read_range(location, 0, head_guess, allow_short=True)
        except FileNotFoundError:
            return None
        if len(first) < _HEADER.size:
            raise CheckpointingException(f"{where}: sidecar index is truncated (corrupted)")
        magic, n, crc = _HEADER.unpack_from(first)
        if magic != MAGIC:
            raise CheckpointingException(f"{where}: not a distckpt sidecar index (bad magic; corrupted)")
        got = len(first)
        head = bytes(first[_HEADER.size : _HEADER.size + n])
        if len(head) < n:
            more = _read_range(location, _HEADER.size + len(head), n - len(head))
            got += len(more)
            head += bytes(more)
        if crc32c(head) != crc:
            raise CheckpointingException(
                f"{where}: sidecar index directory fails its CRC32C check (corrupted)"
            )
        try:
            directory = json.loads(head)
            if directory.get("format") != FORMAT or int(directory["version"]) > VERSION:
                raise ValueError(
                    f"unsupported format {directory.get('format')!r} version {directory.get('version')!r}"
                )
            if (
                not isinstance(directory.get("keys"), dict)
                or type(directory.get("metadata_bytes", -1)) is not int
            ):
                raise ValueError("'keys' is not an object or 'metadata_bytes' not an integer")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointingException(f"{where}: malformed sidecar index: {e}") from None
        reader = cls(location, directory, _HEADER.size + n, got)
        try:
            md_size = _size(location, ".metadata")
        except FileNotFoundError:
            return None
        if md_size != reader.metadata_bytes:
            return None  # .metadata was rewritten by a tool that does not know the sidecar
        return reader

    def entry(self, fqn: str) -> Optional[Dict[str, Any]]:
        """The directory entry of ``fqn`` (None: no such key), its fields checked on first use
        (the directory's CRC32C says only that it was written so, not that it is sane)."""
        e = self.keys.get(fqn)
        if e is not None and fqn not in self._checked:
            _check_entry(self.where, fqn, e)
            self._checked.add(fqn)
        return e

    def check_all(self) -> None:
        """Check every entry of the directory (what ``distckpt verify`` does)."""
        for fqn in self.keys:
            self.entry(fqn)

    def query(
        self, boxes: Dict[str, List[Box]]
    ) -> Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...], str, int, int, int]]]:
        """For each key, every stored chunk whose box meets one of ``boxes[key]`` (stored
        coordinates): ``(offset, size, file, file offset, length, crc32c)`` in offset order.

        Walks every key's tree level by level; each level is one batch of ranged reads.
        """
        out: Dict[str, List[Any]] = {k: [] for k in boxes}
        parsed_names: Dict[bytes, List[str]] = {}
        frontier = []  # (key, ndim, ref, levels below, query lo tuples, query hi tuples)
        for fqn, bxs in boxes.items():
            e = self.entry(fqn)
            if e is None or not bxs or not e.get("count") or e.get("bytes"):
                continue
            ndim = len(e["size"])
            # Plain tuples (a key of a few boxes needs no numpy); arrays only where a node or a
            # large leaf is searched.
            qlo, qhi = [], []
            for b_off, b_size in bxs:
                if len(b_off) != ndim or len(b_size) != ndim:
                    raise ValueError(f"{fqn}: query boxes must have {ndim} axes")
                qlo.append(tuple(b_off))
                qhi.append(tuple(map(operator.add, b_off, b_size)))
            lo, hi = e["bbox"]
            if _box_meets_any(lo, hi, qlo, qhi):
                frontier.append((fqn, ndim, e["root"], e["depth"] - 1, qlo, qhi))
        while frontier:
            blobs = self._fetch([f[2] for f in frontier])
            nxt = []
            for (fqn, ndim, _, below, qlo_list, qhi_list), raw in zip(frontier, blobs):
                if below:
                    if len(raw) % (8 * (3 + 2 * ndim)):
                        raise self._malformed(fqn, f"an inner node of {len(raw)} bytes")
                    qlo, qhi = _arrays(qlo_list, qhi_list, ndim)
                    table = np.frombuffer(raw, dtype="<i8").reshape(-1, 3 + 2 * ndim)
                    lo, hi = table[:, 3 : 3 + ndim], table[:, 3 + ndim :]
                    hit = np.zeros(len(table), dtype=bool)
                    for a, b in zip(qlo, qhi):
                        hit |= np.all((lo < b) & (hi > a), axis=1)
                    nxt.extend(
                        (fqn, ndim, ref, below - 1, qlo_list, qhi_list) for ref in table[hit, :3].tolist()
                    )
                    continue
                # A node passed its CRC32C, which says only that it was written so: its framing,
                # names and name references are checked before use.
                width = 2 * ndim + 4
                (nn,) = struct.unpack_from("<I", raw) if len(raw) >= 4 else (len(raw),)
                if 4 + nn > len(raw) or (len(raw) - 4 - nn) % (8 * width):
                    raise self._malformed(fqn, f"a leaf of {len(raw)} bytes with {nn} bytes of names")
                names_raw = bytes(raw[4 : 4 + nn])
                names = parsed_names.get(names_raw)
                if names is None:  # leaves mostly name the same few files: parse each list once
                    try:
                        names = json.loads(names_raw)
                    except (ValueError, RecursionError) as e:
                        raise self._malformed(fqn, f"a leaf's file names: {e}") from None
                    if type(names) is not list:
                        raise self._malformed(fqn, "a leaf's file names are not a list")
                    parsed_names[names_raw] = names
                if len(qlo_list) <= _PLAIN_BOXES and len(raw) - 4 - nn <= 8 * width * 16:
                    # A small leaf and a few boxes (a small key, loaded whole or in a few
                    # pieces): plain Python, cheaper than numpy on arrays of a few rows.
                    flat = _int64s(len(raw) - 4 - nn).unpack_from(raw, 4 + nn)
                    found = out[fqn]
                    for i in range(0, len(flat), width):
                        off = flat[i : i + ndim]
                        size = flat[i + ndim : i + 2 * ndim]
                        if _box_meets_any(off, tuple(map(operator.add, off, size)), qlo_list, qhi_list):
                            f, foff, length, crc = flat[i + 2 * ndim : i + width]
                            if not 0 <= f < len(names):
                                raise self._malformed(fqn, f"a record names file {f} of {len(names)}")
                            found.append((off, size, names[f], foff, length, crc))
                    continue
                qlo, qhi = _arrays(qlo_list, qhi_list, ndim)
                rows = np.frombuffer(raw, dtype="<i8", offset=4 + nn).reshape(-1, width)
                off, end = rows[:, :ndim], rows[:, :ndim] + rows[:, ndim : 2 * ndim]
                hit = np.zeros(len(rows), dtype=bool)
                for lo, hi in zip(qlo, qhi):
                    hit |= np.all((off < hi) & (end > lo), axis=1)
                picked = rows[hit]
                if len(picked) and not 0 <= picked[:, 2 * ndim].min() <= picked[:, 2 * ndim].max() < len(
                    names
                ):
                    raise self._malformed(fqn, f"a record names a file outside the leaf's {len(names)}")
                for r in picked.tolist():
                    out[fqn].append(
                        (
                            tuple(r[:ndim]),
                            tuple(r[ndim : 2 * ndim]),
                            names[r[2 * ndim]],
                            r[2 * ndim + 1],
                            r[2 * ndim + 2],
                            r[2 * ndim + 3],
                        )
                    )
            frontier = nxt
        return out

    def _malformed(self, fqn: str, what: str) -> CheckpointingException:
        return CheckpointingException(f"{self.where}: malformed sidecar index: key {fqn!r}: {what}")

    def _fetch(self, refs: List[List[int]]) -> List[memoryview]:
        if any(r[0] < 0 or r[1] < 0 for r in refs):
            raise CheckpointingException(
                f"{self.where}: malformed sidecar index: a node reference {refs[0]!r} "
                f"with a negative offset or length"
            )
        starts = [self.data_start + int(r[0]) for r in refs]
        lengths = [int(r[1]) for r in refs]
        views, fetched = _read_ranges(self.location, starts, lengths, self.where)
        self.bytes_read += fetched
        self.node_bytes_read += fetched
        for r, v in zip(refs, views):
            if len(v) != int(r[1]) or crc32c(v) != int(r[2]) & 0xFFFFFFFF:
                raise CheckpointingException(
                    f"{self.where}: sidecar index node at offset {starts[refs.index(r)]} fails its CRC32C "
                    f"check (corrupted)"
                )
        return views


def _check_entry(where: str, fqn: str, e: Any) -> None:
    """Raise, naming the sidecar, unless directory entry ``e`` of key ``fqn`` has the fields, types
    and ranges the reader uses (checked as ``.metadata``'s claims are: a directory that passed
    its CRC32C can still be what a damaged writer or an edit made)."""

    def bad(what: str, value: Any) -> CheckpointingException:
        return CheckpointingException(f"{where}: malformed sidecar index: key {fqn!r}: {what} {value!r:.200}")

    if type(e) is not dict:
        raise bad("entry", e)
    if e.get("bytes"):
        item = e.get("item")
        if item is not None and not (
            type(item) is list
            and len(item) == 4
            and type(item[0]) is str
            and all(bounds.fits(v) for v in item[1:])
        ):
            raise bad("item (not [file, offset, length, crc32c])", item)
        return
    if type(e.get("dtype")) is not str:
        raise bad("dtype", e.get("dtype"))
    size = bounds.shape(e.get("size"), where, f"key {fqn!r}: global shape")
    if e.get("orig_shape") is not None:
        bounds.shape(e["orig_shape"], where, f"key {fqn!r}: original shape")
    count = e.get("count")
    if not bounds.fits(count):
        raise bad("count", count)
    if not count:
        return
    depth, root, bbox = e.get("depth"), e.get("root"), e.get("bbox")
    if not (type(depth) is int and 1 <= depth <= 64):
        raise bad("depth", depth)
    if not (type(root) is list and len(root) == 3 and all(bounds.fits(v) for v in root)):
        raise bad("root (not [offset, length, crc32c])", root)
    if not (
        type(bbox) is list
        and len(bbox) == 2
        and all(type(b) is list and len(b) == len(size) and all(type(v) is int for v in b) for b in bbox)
    ):
        raise bad(f"bbox (not [lo, hi] of {len(size)} integers each)", bbox)
    # An empty or negative box would let a query find no records and leave the request unread
    # (the records a sound box leads to are checked one by one as they are read).
    if not all(0 <= a < b for a, b in zip(bbox[0], bbox[1])):
        raise bad("bbox (not a box of naturals with lo < hi)", bbox)


def _arrays(
    qlo: List[Tuple[int, ...]], qhi: List[Tuple[int, ...]], ndim: int
) -> Tuple[np.ndarray, np.ndarray]:
    return (
        np.array(qlo, dtype=np.int64).reshape(len(qlo), ndim),
        np.array(qhi, dtype=np.int64).reshape(len(qhi), ndim),
    )


def _box_meets_any(
    lo: Sequence[int], hi: Sequence[int], qlo: List[Tuple[int, ...]], qhi: List[Tuple[int, ...]]
) -> bool:
    """Whether the box ``[lo, hi)`` meets one of the boxes ``[qlo[k], qhi[k])`` (a loop with early
    exits: a few boxes of a few axes, where numpy's set-up would cost more than the test)."""
    for q0, q1 in zip(qlo, qhi):
        for a, b, c, d in zip(lo, hi, q0, q1):
            if a >= d or b <= c:
                break
        else:
            return True
    return False


@functools.lru_cache(maxsize=64)
def _int64s(nbytes: int) -> struct.Struct:
    """The little-endian int64 format of ``nbytes`` bytes (a leaf's rows), compiled once."""
    return struct.Struct(f"<{nbytes // 8}q")


def _size(location, name: str) -> int:
    if isinstance(location, storage.Store):
        return location.size(name)
    return containment.size_beneath(location, name, location)


def _read_range(location, start: int, length: int, allow_short: bool = False) -> bytes:
    if isinstance(location, storage.Store):
        if allow_short:
            length = max(0, min(length, location.size(INDEX_FNAME) - start))
        return bytes(location.get_ranges(INDEX_FNAME, [start], [length])[0])
    with open(containment.open_beneath(location, INDEX_FNAME, location), "rb") as f:
        f.seek(start)
        return f.read(length)


# Local sidecar reads: ranges at most _GAP bytes apart are read together, in spans of at most _SPAN.
_GAP = 4 << 10
_SPAN = 4 << 20


def _read_ranges(location, starts: List[int], lengths: List[int], where: str) -> Tuple[List[memoryview], int]:
    """The ranges' bytes and how many bytes were fetched for them (gaps between coalesced ranges
    included)."""
    try:
        if isinstance(location, storage.Store):
            views = list(location.get_ranges(INDEX_FNAME, starts, lengths))
            return views, sum(len(v) for v in views)
        # Nodes that lie close together in the file (the leaves of a load's many small keys are
        # packed one after another) are read in one call and cut apart.
        order = sorted(range(len(starts)), key=starts.__getitem__)
        requests, places = storage.coalesce([(starts[k], lengths[k]) for k in order], _GAP, _SPAN)
        out: List[Optional[memoryview]] = [None] * len(starts)
        with open(containment.open_beneath(location, INDEX_FNAME, location), "rb") as f:
            spans = []
            for lo, n in requests:
                f.seek(lo)
                spans.append(memoryview(f.read(n)))
        for k, (request, at, n) in zip(order, places):
            out[k] = spans[request][at : at + n]
        fetched = sum(len(span) for span in spans)
        return out, fetched
    except CheckpointingException as e:
        raise CheckpointingException(f"{where}: sidecar index is truncated (corrupted): {e}") from None
