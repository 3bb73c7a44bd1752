"""Querying the sidecar index: the directory once, then only the tree nodes a load's boxes meet.

See :mod:`distckpt.formats.index_format` for the layout. Every node is checked against the
CRC32C recorded for it and every directory entry against the fields the reader uses.
"""

from __future__ import annotations

import functools
import json
import operator
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from distckpt import bounds, containment, storage
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats.index_format import FORMAT, HEADER, INDEX_FNAME, MAGIC, VERSION, Box, dtype_of

_PLAIN_BOXES = 4  # a query of at most this many boxes per key searches small leaves in Python
_MEET_BLOCK = 1 << 20  # box-axis comparisons per block of a vectorised test (~1 MiB temporaries)


class IndexReader:
    """Reads a sidecar partially: the directory once, then only the nodes a query needs.

    ``bytes_read`` counts every byte fetched from storage.
    """

    def __init__(
        self,
        location: Union[Path, storage.Store],
        directory: Dict[str, Any],
        data_start: int,
        bytes_read: int,
    ):
        self.location = location
        self.where = storage.join(location, INDEX_FNAME)
        self.keys: Dict[str, Any] = directory["keys"]
        self.metadata_bytes = directory.get("metadata_bytes", -1)
        self._checked: set = set()  # keys whose entries passed _check_entry
        self.data_start = data_start
        self.bytes_read = bytes_read  # everything fetched (the first read may overshoot)
        self.node_bytes_read = 0  # bytes of tree nodes fetched by queries
        self.box_tests = 0  # (node entry or record, query box) pairs tested by queries

    @classmethod
    def open(cls, location: storage.Location, head_guess: int = 16 << 10) -> Optional[IndexReader]:
        """The reader of ``location``'s sidecar, or None if it has none (or it is stale: the
        ``.metadata`` beside it is not the one it was built with)."""
        location = storage.resolve(location)
        where = storage.join(location, INDEX_FNAME)
        try:
            first = _read_range(location, 0, head_guess, allow_short=True)
        except FileNotFoundError:
            return None
        if len(first) < HEADER.size:
            raise CheckpointingException(f"{where}: sidecar index is truncated (corrupted)")
        magic, n, crc = HEADER.unpack_from(first)
        if magic != MAGIC:
            raise CheckpointingException(f"{where}: not a distckpt sidecar index (bad magic; corrupted)")
        got = len(first)
        head = bytes(first[HEADER.size : HEADER.size + n])
        if len(head) < n:
            more = _read_range(location, HEADER.size + len(head), n - len(head))
            got += len(more)
            head += bytes(more)
        if crc32c(head) != crc:
            raise CheckpointingException(
                f"{where}: sidecar index directory fails its CRC32C check (corrupted)"
            )
        try:
            directory = json.loads(head)
            if type(directory) is not dict:
                raise ValueError(f"the directory is {type(directory).__name__}, not an object")
            version = directory.get("version")
            if directory.get("format") != FORMAT or not bounds.fits(version, VERSION) or not version:
                raise ValueError(
                    f"unsupported format {directory.get('format')!r:.40} version {version!r:.40}"
                )
            if (
                not isinstance(directory.get("keys"), dict)
                or type(directory.get("metadata_bytes", -1)) is not int
            ):
                raise ValueError("'keys' is not an object or 'metadata_bytes' not an integer")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointingException(f"{where}: malformed sidecar index: {e}") from None
        reader = cls(location, directory, HEADER.size + n, got)
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

        Walks every key's tree level by level; each level is one batch of ranged reads. A node
        is searched only with the query boxes that meet its bounding box (its parent found
        them), so a key of ``n`` records queried with ``b`` boxes costs about
        ``b x fanout x depth`` box tests plus the records found -- not ``b x n``: a
        Mixture-of-Experts rank asks for thousands of boxes (one per expert and layer) of a key
        holding ``layers x experts`` records.
        """
        out: Dict[str, List[Any]] = {k: [] for k in boxes}
        parsed_names: Dict[bytes, List[str]] = {}
        frontier: List[_Visit] = []
        for fqn, bxs in boxes.items():
            e = self.entry(fqn)
            if e is None or not bxs or not e.get("count") or e.get("bytes"):
                continue
            ndim = len(e["size"])
            qlo, qhi = [], []
            for b_off, b_size in bxs:
                if len(b_off) != ndim or len(b_size) != ndim:
                    raise ValueError(f"{fqn}: query boxes must have {ndim} axes")
                qlo.append(tuple(b_off))
                qhi.append(tuple(map(operator.add, b_off, b_size)))
            lo, hi = e["bbox"]
            if _box_meets_any(lo, hi, qlo, qhi):
                frontier.append(_Visit(fqn, ndim, e["root"], e["depth"] - 1, _Boxes(qlo, qhi)))
        while frontier:
            blobs = self._fetch([v.ref for v in frontier])
            nxt: List[_Visit] = []
            for visit, raw in zip(frontier, blobs):
                if visit.below:
                    nxt.extend(self._inner(visit, raw))
                else:
                    out[visit.fqn].extend(self._leaf(visit, raw, parsed_names))
            frontier = nxt
        return out

    def _inner(self, visit: _Visit, raw: memoryview) -> List[_Visit]:
        """The children of an inner node that meet the visit's boxes, each with the boxes it meets."""
        ndim = visit.ndim
        if len(raw) % (8 * (3 + 2 * ndim)):
            raise self._malformed(visit.fqn, f"an inner node of {len(raw)} bytes")
        table = np.frombuffer(raw, dtype="<i8").reshape(-1, 3 + 2 * ndim)
        meets = visit.boxes.meets(table[:, 3 : 3 + ndim], table[:, 3 + ndim :])
        self.box_tests += meets.size
        refs = table[:, :3].tolist()
        return [
            _Visit(visit.fqn, ndim, refs[j], visit.below - 1, visit.boxes.subset(meets[j]))
            for j in np.flatnonzero(meets.any(axis=1)).tolist()
        ]

    def _leaf(self, visit: _Visit, raw: memoryview, parsed_names: Dict[bytes, List[str]]) -> List[Any]:
        """The records of a leaf that meet the visit's boxes."""
        # A node passed its CRC32C, which says only that it was written so: its framing,
        # names and name references are checked before use.
        fqn, ndim = visit.fqn, visit.ndim
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
        found = []
        boxes = visit.boxes
        if boxes.plain and len(raw) - 4 - nn <= 8 * width * 16:
            # A small leaf and a few boxes (a small key, loaded whole or in a few pieces):
            # plain Python, cheaper than numpy on arrays of a few rows.
            flat = _int64s(len(raw) - 4 - nn).unpack_from(raw, 4 + nn)
            self.box_tests += len(flat) // width * len(boxes.lo)
            for i in range(0, len(flat), width):
                off = flat[i : i + ndim]
                size = flat[i + ndim : i + 2 * ndim]
                if _box_meets_any(off, tuple(map(operator.add, off, size)), boxes.lo, boxes.hi):
                    f, foff, length, crc = flat[i + 2 * ndim : i + width]
                    if not 0 <= f < len(names):
                        raise self._malformed(fqn, f"a record names file {f} of {len(names)}")
                    found.append((off, size, names[f], foff, length, crc))
            return found
        rows = np.frombuffer(raw, dtype="<i8", offset=4 + nn).reshape(-1, width)
        off = rows[:, :ndim]
        meets = boxes.meets(off, off + rows[:, ndim : 2 * ndim])
        self.box_tests += meets.size
        picked = rows[meets.any(axis=1)]
        if len(picked) and not 0 <= picked[:, 2 * ndim].min() <= picked[:, 2 * ndim].max() < len(names):
            raise self._malformed(fqn, f"a record names a file outside the leaf's {len(names)}")
        for r in picked.tolist():
            found.append(
                (
                    tuple(r[:ndim]),
                    tuple(r[ndim : 2 * ndim]),
                    names[r[2 * ndim]],
                    r[2 * ndim + 1],
                    r[2 * ndim + 2],
                    r[2 * ndim + 3],
                )
            )
        return found

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
    try:
        dtype_of(e["dtype"])
    except ValueError:
        raise bad("dtype (not the name of a torch dtype)", e["dtype"]) from None
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


class _Boxes:
    """Query boxes ``[lo[k], hi[k])`` of one key: plain tuples while they are few, arrays (made
    once, on first need) for the vectorised tests."""

    __slots__ = ("lo", "hi", "_arrays")

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi
        self._arrays: Optional[Tuple[np.ndarray, np.ndarray]] = None

    @property
    def plain(self) -> bool:
        return len(self.lo) <= _PLAIN_BOXES

    def arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            if isinstance(self.lo, np.ndarray):
                self._arrays = (self.lo, self.hi)
            else:
                ndim = len(self.lo[0])
                self._arrays = (
                    np.array(self.lo, dtype=np.int64).reshape(len(self.lo), ndim),
                    np.array(self.hi, dtype=np.int64).reshape(len(self.hi), ndim),
                )
        return self._arrays

    def meets(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``[row, box]``: whether box ``[lo[row], hi[row])`` meets query box ``box``, in blocks
        of rows that bound the temporary arrays."""
        qlo, qhi = self.arrays()
        out = np.empty((len(lo), len(qlo)), dtype=bool)
        step = max(1, _MEET_BLOCK // max(1, len(qlo) * lo.shape[1]))
        for a in range(0, len(lo), step):
            b = a + step
            np.all(
                (lo[a:b, None, :] < qhi[None, :, :]) & (hi[a:b, None, :] > qlo[None, :, :]),
                axis=2,
                out=out[a:b],
            )
        return out

    def subset(self, mask: np.ndarray) -> _Boxes:
        qlo, qhi = self.arrays()
        if mask.all():
            return self
        lo, hi = qlo[mask], qhi[mask]
        if len(lo) <= _PLAIN_BOXES:
            return _Boxes([tuple(r) for r in lo.tolist()], [tuple(r) for r in hi.tolist()])
        return _Boxes(lo, hi)


class _Visit:
    """A node of one key's tree to visit, with the query boxes that meet its bounding box."""

    __slots__ = ("fqn", "ndim", "ref", "below", "boxes")

    def __init__(self, fqn: str, ndim: int, ref: List[int], below: int, boxes: _Boxes):
        self.fqn, self.ndim, self.ref, self.below, self.boxes = fqn, ndim, ref, below, boxes


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


def _size(location: Union[Path, storage.Store], name: str) -> int:
    root = storage.local_root(location)
    if root is None:
        return storage.open_store(location).size(name)
    return containment.size_beneath(root, name, root)


def _read_range(
    location: Union[Path, storage.Store], start: int, length: int, allow_short: bool = False
) -> bytes:
    root = storage.local_root(location)
    if root is None:
        store = storage.open_store(location)
        if allow_short:
            length = max(0, min(length, store.size(INDEX_FNAME) - start))
        return bytes(store.get_ranges(INDEX_FNAME, [start], [length])[0])
    with open(containment.open_beneath(root, INDEX_FNAME, root), "rb") as f:
        f.seek(start)
        return f.read(length)


# Local sidecar reads: ranges at most _GAP bytes apart are read together, in spans of at most _SPAN.
_GAP = 4 << 10
_SPAN = 4 << 20


def _read_ranges(
    location: Union[Path, storage.Store], starts: List[int], lengths: List[int], where: str
) -> Tuple[List[memoryview], int]:
    """The ranges' bytes and how many bytes were fetched for them (gaps between coalesced ranges
    included)."""
    root = storage.local_root(location)
    try:
        if root is None:
            views = list(storage.open_store(location).get_ranges(INDEX_FNAME, starts, lengths))
            return views, sum(len(v) for v in views)
        # Nodes that lie close together in the file (the leaves of a load's many small keys are
        # packed one after another) are read in one call and cut apart.
        order = sorted(range(len(starts)), key=starts.__getitem__)
        requests, places = storage.coalesce([(starts[k], lengths[k]) for k in order], _GAP, _SPAN)
        out: List[Optional[memoryview]] = [None] * len(starts)
        with open(containment.open_beneath(root, INDEX_FNAME, root), "rb") as f:
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
