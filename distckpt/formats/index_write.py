"""Building the sidecar index (rank 0, at commit): records packed into per-key trees of nodes.

See :mod:`distckpt.formats.index_format` for the layout. :class:`IndexTemplate` keeps a built
sidecar so that the next save of the same records only patches in their new CRC32Cs.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats.index_format import FANOUT, FORMAT, HEADER, LEAF, MAGIC, VERSION, dtype_name


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
            "dtype": dtype_name(info["dtype"]),
            "size": list(info["size"]),
            "orig_shape": list(info["orig_shape"]) if info.get("orig_shape") is not None else None,
        }
        if fqn in small_entries:
            entry.update(small_entries[fqn])
        elif fqn in arrays:
            entry.update(_build_key(blob, fqn, arrays[fqn], ndim, fanout, leaf, quoted))
        else:
            entry["count"] = 0
        # The bytes its records hold (what `distckpt inspect` reports without reading .metadata).
        entry["nbytes"] = int(arrays[fqn][:, -2].sum()) if fqn in arrays else 0
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
    return b"".join([HEADER.pack(MAGIC, len(head), crc32c(head)), head, *parts])


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
        return b"".join([HEADER.pack(MAGIC, len(head), crc32c(head)), head, blob])


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
