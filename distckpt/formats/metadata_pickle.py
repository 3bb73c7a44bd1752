"""DCP's pickled ``.metadata``, written from arrays instead of pickled object by object.

A ``.metadata`` holds, per stored chunk, a ``ChunkStorageMetadata`` (two ``torch.Size``) and a
``MetadataIndex -> _StorageInfo`` entry. At 16k ranks that is millions of Python objects, and
building them and pickling them was most of rank 0's commit. The bytes of each chunk's objects
in a pickle stream follow one pattern with a few integers changing, so this module writes the
stream directly: the small part of the ``Metadata`` (every key's properties, empty chunk lists,
an empty ``storage_data``) is pickled by the standard pickler (protocol 2, which names every
memo slot explicitly), and the chunks are appended as packed numpy records that, when
unpickled, append the chunks to those lists and fill ``storage_data`` -- the same objects a
pickle of the whole ``Metadata`` gives. Any unpickler reads it (PyTorch DCP, Megatron-Core,
distckpt's restricted one): only standard opcodes and the same classes are used.

Objects shared on purpose (each pickled once, referenced by memo): a chunk's offset
``torch.Size`` is the ``offset`` of its ``MetadataIndex``; the chunks of one key with equal
sizes share one ``torch.Size``; each key name and file name is one string.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

_PUT = struct.Struct("<cI")  # LONG_BINPUT / LONG_BINGET + index


def _get(idx: int) -> bytes:
    return _PUT.pack(b"j", idx)


def _global(cls: type) -> bytes:
    return b"c" + f"{cls.__module__}\n{cls.__qualname__}\n".encode()


def _str(s: str) -> bytes:
    data = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v) if -(2**31) <= v < 2**31 else b"\x8a\x08" + struct.pack("<q", v)


_SMALL = 16  # keys with at most this many chunks are packed together (per number of axes)


def _int_op(col: np.ndarray) -> Tuple[bytes, str]:
    """The opcode and numpy type for a column of ints: BININT (4 bytes) or LONG1 with 8 bytes."""
    if not len(col) or (int(col.min()) >= -(2**31) and int(col.max()) < 2**31):
        return b"J", "<i4"
    return b"\x8a\x08", "<i8"


class _Memo:
    """Memo slots after the skeleton's: each value is pushed, stored and popped in a preamble."""

    def __init__(self, start: int) -> None:
        self.next = start
        self.preamble: List[bytes] = []

    def put(self, push: bytes) -> int:
        idx = self.next
        self.next += 1
        self.preamble.append(push + _PUT.pack(b"r", idx) + b"0")
        return idx

    def reserve(self, count: int) -> int:
        start = self.next
        self.next += count
        return start


def _records(count: int, parts: Sequence[Any]) -> bytes:
    """``count`` packed records; ``parts`` are constant bytes or ``(numpy type, column)``."""
    fields, values, const = [], [], b""
    for p in list(parts) + [None]:
        if isinstance(p, bytes):
            const += p
            continue
        if const:
            fields.append((f"f{len(fields)}", f"S{len(const)}"))
            values.append(const)
            const = b""
        if p is not None:
            fields.append((f"f{len(fields)}", p[0]))
            values.append(p[1])
    table = np.empty(count, dtype=np.dtype(fields))
    for (name, _), v in zip(fields, values):
        table[name] = v
    return table.tobytes()


def _int_parts(col: np.ndarray) -> List[Any]:
    op, kind = _int_op(col)
    return [op, (kind, col)]


def _unique_rows(a: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_inverse=True)``, through one int64 per row when the rows'
    ranges allow (sorting a void view, what ``axis=0`` does, is several times slower)."""
    if a.shape[1] and int(a.min()) >= 0:
        radix = [int(v) + 1 for v in a.max(axis=0)]
        if np.prod(np.array(radix, dtype=np.float64)) < 2**62:
            codes, inverse = np.unique(np.ravel_multi_index(a.T, radix), return_inverse=True)
            return np.stack(np.unravel_index(codes, radix), axis=1), inverse.reshape(-1)
    rows, inverse = np.unique(a, axis=0, return_inverse=True)
    return rows, inverse.reshape(-1)


def _chunk_records(
    slots: _Memo, offs: np.ndarray, sizes: np.ndarray, chunk_head: bytes, size_cls: int, get_sizes: bytes
) -> Tuple[bytes, np.ndarray]:
    """The packed ``ChunkStorageMetadata`` of ``len(offs)`` chunks (each offset stored in a memo
    slot of its own, equal sizes sharing one ``torch.Size``) and those offsets' memo slots."""
    m, n = offs.shape
    shapes, shape_of = _unique_rows(sizes)
    shape_slots = np.array(
        [slots.put(_get(size_cls) + b"(" + b"".join(map(_int, s)) + b"t\x85R") for s in shapes.tolist()],
        dtype=np.uint32,
    )
    offset_slots = np.arange(slots.reserve(m), slots.next, dtype=np.uint32)
    parts: List[Any] = [chunk_head]
    for d in range(n):
        parts += _int_parts(offs[:, d])
    parts += [b"t\x85Rr", ("<u4", offset_slots), get_sizes + b"j", ("<u4", shape_slots[shape_of]), b"ub"]
    return _records(m, parts), offset_slots


def pickle_metadata(
    skeleton: Metadata,
    chunks: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]],
    byte_items: Sequence[Tuple[str, int, int, int]],
    files: Sequence[str],
) -> Tuple[bytes, int]:
    """The pickled ``Metadata``: ``skeleton`` with its chunks and storage entries filled in, and
    the length of its head (the skeleton's own pickle, where ``storage_meta`` lies; see
    :func:`respell`).

    ``skeleton``: every key's ``TensorStorageMetadata`` with ``chunks`` an empty list (one list
    object per key) and an empty ``storage_data``. ``chunks[fqn]``: ``(offsets [m, n], sizes
    [m, n], items [m, 3])`` int64, already in the order the chunk list must have; ``items``
    are (file index, file offset, length). ``byte_items``: ``(fqn, file index, file offset,
    length)`` of byte (object) keys. ``files``: file names.
    """
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.dump(skeleton)
    memo = pickler.memo.copy()  # id(obj) -> (slot, obj)
    head = buf.getvalue()
    assert head.endswith(pickle.STOP)
    slots = _Memo(max((slot for slot, _ in memo.values()), default=-1) + 1)

    def cls_slot(cls: type) -> int:
        found = memo.get(id(cls))
        return found[0] if found is not None else slots.put(_global(cls))

    size_cls, chunk_cls = cls_slot(torch.Size), cls_slot(ChunkStorageMetadata)
    index_cls, info_cls = cls_slot(MetadataIndex), cls_slot(_StorageInfo)
    s_offsets, s_sizes, s_fqn, s_index, s_offset, s_path, s_length = (
        slots.put(_str(s)) for s in ("offsets", "sizes", "fqn", "index", "offset", "relative_path", "length")
    )
    file_slots = np.array([slots.put(_str(f)) for f in files], dtype=np.uint32)
    storage_slot = memo[id(skeleton.storage_data)][0]

    chunk_head = _get(chunk_cls) + b")\x81}(" + _get(s_offsets) + _get(size_cls) + b"("
    index_head = _get(index_cls) + b")\x81}(" + _get(s_fqn)
    index_tail = _get(s_index) + b"N" + _get(s_offset) + b"j"
    info_head = b"ub" + _get(info_cls) + b")\x81}(" + _get(s_path) + b"j"
    chunk_parts: List[bytes] = []
    storage_parts: List[bytes] = []
    get_sizes = _get(s_sizes)

    def storage_rows(offset_slots: np.ndarray, items: np.ndarray) -> List[Any]:
        # A storage entry after its MetadataIndex's fqn: the offset (memo), file, offset, length.
        return [
            ("<u4", offset_slots),
            info_head,
            ("<u4", file_slots[items[:, 0]]),
            _get(s_offset),
            *_int_parts(items[:, 1]),
            _get(s_length),
            *_int_parts(items[:, 2]),
            b"ub",
        ]

    # Keys of a few chunks (most keys of most models) are written together, per number of axes:
    # one packed table for all their chunks, cut into each key's list afterwards, so the work per
    # key is a few slices, not a numpy call per column.
    # Storage entries stay in key order (as DCP's own pickle has them): a small key's place in
    # ``storage_parts`` is kept and filled from its group's table.
    small: Dict[int, List[Tuple[int, int, np.ndarray, np.ndarray, np.ndarray, int]]] = {}
    for fqn, (offs, sizes, items) in chunks.items():
        m, n = offs.shape
        if not m:
            continue
        list_slot = memo[id(skeleton.state_dict_metadata[fqn].chunks)][0]
        fqn_slot = slots.put(_str(fqn))
        if m <= _SMALL:
            small.setdefault(n, []).append((list_slot, fqn_slot, offs, sizes, items, len(storage_parts)))
            storage_parts.append(b"")
            continue
        chunk_rows, offset_slots = _chunk_records(slots, offs, sizes, chunk_head, size_cls, get_sizes)
        chunk_parts.append(_get(list_slot) + b"(" + chunk_rows + b"e0")
        storage_parts.append(
            _records(m, [index_head + _get(fqn_slot) + index_tail, *storage_rows(offset_slots, items)])
        )
    for group in small.values():
        counts = [len(k[2]) for k in group]
        offs, sizes, items = (np.concatenate([k[i] for k in group]) for i in (2, 3, 4))
        chunk_rows, offset_slots = _chunk_records(slots, offs, sizes, chunk_head, size_cls, get_sizes)
        fqn_slots = np.repeat(np.array([k[1] for k in group], dtype=np.uint32), counts)
        entries = _records(
            len(offs), [index_head + b"j", ("<u4", fqn_slots), index_tail, *storage_rows(offset_slots, items)]
        )
        width, entry_width, at = len(chunk_rows) // len(offs), len(entries) // len(offs), 0
        for (list_slot, _, _, _, _, place), c in zip(group, counts):
            chunk_parts.append(_get(list_slot) + b"(" + chunk_rows[at * width : (at + c) * width] + b"e0")
            storage_parts[place] = entries[at * entry_width : (at + c) * entry_width]
            at += c
    for fqn, f, off, length in byte_items:
        storage_parts.append(
            index_head
            + _str(fqn)
            + _get(s_index)
            + b"N"
            + info_head
            + struct.pack("<I", int(file_slots[f]))
            + _get(s_offset)
            + _int(off)
            + _get(s_length)
            + _int(length)
            + b"ub"
        )
    storage = [_get(storage_slot) + b"(", *storage_parts, b"u0"] if storage_parts else []
    return b"".join([head[:-1], *slots.preamble, *chunk_parts, *storage, pickle.STOP]), len(head) - 1


def _pickled_str(text: str) -> bytes:
    """How protocol 2 pickles a str: BINUNICODE, a 4-byte length, the UTF-8 bytes."""
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def respell(data: bytearray, head: int, replacements: Sequence[Tuple[str, str]]) -> Optional[int]:
    """Replace, in place, the pickled string ``old`` by ``new`` for each pair in ``data``, a
    protocol-2 pickle, looking only in its first ``head`` bytes; returns the new length of that
    head, or None (``data`` unchanged: pickle anew) when an ``old`` string is not pickled exactly
    once there.

    What lets a save of an unchanged structure reuse the previous ``.metadata``: its bytes differ
    only in the two strings of ``storage_meta`` (where and which save), which lie in the head
    that :func:`pickle_metadata` reports. Protocol 2 has no frames and no absolute offsets, and
    the memo counts objects, not bytes, so a string of another length shifts what follows it
    and nothing else (one ``memmove`` of the rest; none when the lengths agree)."""
    places = []
    for old, new in replacements:
        before = _pickled_str(old)
        at = data.find(before, 0, head)
        if at < 0 or data.find(before, at + 1, head) >= 0:
            return None
        places.append((at, before, _pickled_str(new)))
    for at, before, after in sorted(places, reverse=True):  # from the end: earlier places stay put
        data[at : at + len(before)] = after
        head += len(after) - len(before)
    return head
