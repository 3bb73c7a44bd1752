"""What a ``torch_dist`` save records: key declarations, where each item landed, and their tables.

Each rank declares its keys (:class:`KeyDecl`) and records where each of its items landed
(:class:`Record`); ``finalize`` gathers them to rank 0 as one compact :class:`RecordTable` per
rank, which rank 0 merges into :class:`GatheredRecords` to build ``.metadata``, the manifest and
the sidecar index (:func:`sidecar_index`). :data:`LAST_SAVE` remembers rank 0's last commit so a
save of the same structure reuses its ``.metadata`` and sidecar.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from distckpt.core import CheckpointingException, gc_paused
from distckpt.formats.index_write import IndexTemplate, build_index_from_rows
from distckpt.formats.manifest import dtype_name
from distckpt.formats.metadata_pickle import respell
from distckpt.strategies.resharding import Shape


@dataclass
class KeyDecl:
    """What rank 0 needs to describe a key in ``.metadata`` even if it holds no chunk of it."""

    is_bytes: bool
    dtype: Optional[torch.dtype] = None
    size: Shape = ()
    orig_shape: Optional[Shape] = None


@dataclass(frozen=True)
class Record:
    """Where one item landed. Everything but ``crc32c`` is the save's *structure*."""

    fqn: str
    chunk_offset: Shape
    chunk_size: Shape
    relative_path: str
    offset: int
    length: int
    crc32c: int = 0

    def structure(self) -> Tuple:
        return (self.fqn, self.chunk_offset, self.chunk_size, self.relative_path, self.offset, self.length)


@dataclass
class RecordTable:
    """One rank's key declarations and written records, compact: what ``finalize`` gathers.

    - ``keys``: ``(fqn, is_bytes, dtype, size, orig_shape)`` of every key this rank declared
      (its :class:`KeyDecl`\\ s);
    - ``files``: the names of the files the rows point into;
    - ``rows``: int64 ``[n, 5 + 2 * ndim]``, one per record: key index, file index, file offset,
      length, crc32c, chunk offset, chunk size (``ndim`` the most axes of this rank's keys; a
      key with fewer has its columns padded with 0 / 1).

    A few objects per key and file instead of one per record, so rank 0 unpickles
    ``world`` small payloads and builds ``.metadata`` and the sidecar from arrays. ``layout``:
    a digest of ``keys`` (ranks that declare the same keys are recognized by it).
    """

    keys: Tuple[Tuple[str, bool, Optional[torch.dtype], Shape, Optional[Shape]], ...]
    files: Tuple[str, ...]
    rows: Any  # np.ndarray
    layout: bytes = b""

    @property
    def ndim(self) -> int:
        return (self.rows.shape[1] - 5) // 2

    @classmethod
    def of(cls, decls: Dict[str, KeyDecl], records: Sequence[Record]) -> RecordTable:
        keys = tuple(
            (fqn, d.is_bytes, d.dtype, tuple(d.size), None if d.orig_shape is None else tuple(d.orig_shape))
            for fqn, d in decls.items()
        )
        key_ids = {k[0]: i for i, k in enumerate(keys)}
        file_ids: Dict[str, int] = {}
        ndim = max((len(k[3]) for k in keys), default=0)
        flat: List[int] = []
        for r in records:
            kid = key_ids.get(r.fqn)
            if kid is None:
                raise CheckpointingException(f"record for undeclared key {r.fqn!r}")
            pad = ndim - len(r.chunk_offset)
            flat += (kid, file_ids.setdefault(r.relative_path, len(file_ids)), r.offset, r.length, r.crc32c)
            flat += r.chunk_offset
            flat += (0,) * pad
            flat += r.chunk_size
            flat += (1,) * pad
        rows = np.array(flat, dtype=np.int64).reshape(len(records), 5 + 2 * ndim)
        return cls(keys, tuple(file_ids), rows, hashlib.blake2b(repr(keys).encode(), digest_size=16).digest())

    def with_crcs(self, crcs: Any) -> RecordTable:
        rows = self.rows.copy()
        rows[:, 4] = crcs
        return RecordTable(self.keys, self.files, rows, self.layout)

    def decls(self) -> Dict[str, KeyDecl]:
        return {fqn: KeyDecl(is_bytes, dtype, size, orig) for fqn, is_bytes, dtype, size, orig in self.keys}

    def ranges(self) -> List[Tuple[str, int, int, int, str]]:
        """``(file, offset, length, crc32c, key)`` of every record (what the manifest takes)."""
        keys, files = self.keys, self.files
        return [
            (files[f], off, length, crc, keys[k][0]) for k, f, off, length, crc in self.rows[:, :5].tolist()
        ]


@dataclass
class GatheredRecords:
    """Every rank's :class:`RecordTable` in one array (rank 0, at commit).

    ``decls``: fqn -> (is_bytes, dtype, size, orig_shape), every rank's declarations merged in
    rank order; ``fqns``: key index -> fqn; ``files``: file index -> name; ``rows``: int64
    ``[n, 5 + 2 * ndim]`` as in a RecordTable, with global key and file indices, grouped by key
    (in rank order within a key).
    """

    decls: Dict[str, Tuple[bool, Optional[torch.dtype], Shape, Optional[Shape]]]
    fqns: List[str]
    files: List[str]
    rows: Any

    @property
    def ndim(self) -> int:
        return (self.rows.shape[1] - 5) // 2

    @classmethod
    def of(cls, tables: Sequence[RecordTable]) -> GatheredRecords:
        decls: Dict[str, Tuple] = {}
        fqns: List[str] = []
        key_ids: Dict[str, int] = {}
        key_maps: Dict[object, Any] = {}  # a rank's layout -> its keys' global indices (DP ranks share it)
        files: List[str] = []
        ndim = max((t.ndim for t in tables), default=0)
        parts = []
        for t in tables:
            kmap = key_maps.get(t.layout)
            if kmap is None:
                ids = []
                for fqn, *decl in t.keys:
                    decls[fqn] = tuple(decl)
                    kid = key_ids.get(fqn)
                    if kid is None:
                        kid = key_ids[fqn] = len(fqns)
                        fqns.append(fqn)
                    ids.append(kid)
                kmap = key_maps[t.layout or object()] = np.array(ids, dtype=np.int64)
            rows = t.rows
            if not len(rows):
                continue
            fmap = np.arange(len(files), len(files) + len(t.files), dtype=np.int64)
            files.extend(t.files)
            if t.ndim < ndim:
                pad, n = ndim - t.ndim, len(rows)
                rows = np.concatenate(
                    [
                        rows[:, : 5 + t.ndim],
                        np.zeros((n, pad), np.int64),
                        rows[:, 5 + t.ndim :],
                        np.ones((n, pad), np.int64),
                    ],
                    axis=1,
                )
            else:
                rows = rows.copy()
            rows[:, 0] = kmap[rows[:, 0]]
            rows[:, 1] = fmap[rows[:, 1]]
            parts.append(rows)
        rows = np.concatenate(parts) if parts else np.zeros((0, 5 + 2 * ndim), np.int64)
        # Grouped by key (stable: each key's rows stay in rank order).
        kid = rows[:, 0]
        rows = rows[np.argsort(kid.astype(np.int16) if len(fqns) < 2**15 else kid, kind="stable")]
        return cls(decls, fqns, files, rows)

    def by_key(self):
        """``(fqn, rows)`` of every key with records; rows in rank order."""
        bounds = np.concatenate(
            [[0], np.cumsum(np.bincount(self.rows[:, 0], minlength=len(self.fqns)))]
        ).tolist()
        for k, fqn in enumerate(self.fqns):
            if bounds[k + 1] > bounds[k]:
                yield fqn, self.rows[bounds[k] : bounds[k + 1]]

    def ranges(self) -> List[Tuple[str, int, int, int, str]]:
        """``(file, offset, length, crc32c, key)`` of every record (what the manifest takes)."""
        fqns, files = self.fqns, self.files
        return [(files[f], off, length, crc, fqns[k]) for k, f, off, length, crc in self.rows[:, :5].tolist()]

    def layout(self) -> Tuple[Dict[str, Tuple[Any, ...]], List[Optional[Tuple[Shape, Shape]]]]:
        """What the manifest records of the writer's intent besides checksums: each tensor key's
        (dtype name, stored shape[, original shape of a flattened key]), and the (chunk offset,
        chunk size) of every record, aligned with :meth:`ranges` (None for byte items)."""
        keys = {
            fqn: (dtype_name(d[1]), tuple(d[2])) + (() if d[3] is None else (tuple(d[3]),))
            for fqn, d in self.decls.items()
            if not d[0] and d[1] is not None
        }
        ndim, fqns = self.ndim, self.fqns
        boxes: List[Optional[Tuple[Shape, Shape]]] = []
        for row in self.rows.tolist():
            decl = keys.get(fqns[row[0]])
            n = len(decl[1]) if decl is not None else 0
            boxes.append(
                None if decl is None else (tuple(row[5 : 5 + n]), tuple(row[5 + ndim : 5 + ndim + n]))
            )
        return keys, boxes


def sidecar_index(records: GatheredRecords, metadata_bytes: int, template: bool = False) -> Any:
    """The sidecar index (see distckpt/strategies/index.py) of every rank's declarations and
    records; with ``template``, ``(bytes, IndexTemplate)`` (see :func:`patched_sidecar_index`)."""
    keys: Dict[str, Dict[str, Any]] = {}
    for fqn, (is_bytes, dtype, size, orig_shape) in records.decls.items():
        keys[fqn] = {"bytes": True} if is_bytes else {"dtype": dtype, "size": size, "orig_shape": orig_shape}
    rows: Dict[str, Any] = {}
    for fqn, r in records.by_key():
        if fqn not in keys:
            raise CheckpointingException(f"index: record for undeclared key {fqn!r}")
        n = 0 if keys[fqn].get("bytes") else len(keys[fqn]["size"])
        d = records.ndim
        # index rows: offset[n], size[n], file index, file offset, length, crc32c
        rows[fqn] = np.concatenate([r[:, 5 : 5 + n], r[:, 5 + d : 5 + d + n], r[:, 1:5]], axis=1)
    with gc_paused():
        return build_index_from_rows(keys, rows, records.files, metadata_bytes, template=template)


class LastSave:
    """Rank 0's memory of the last save it committed: its gathered records, its ``.metadata`` and
    a template of its sidecar. A training job saves the same structure again and again with new
    values; when a save's records equal the remembered ones in everything but their CRC32Cs, its
    ``.metadata`` is the remembered one with the two ids respelled and its sidecar the template
    with the new CRC32Cs patched in: the same bytes a rebuild gives, at a fraction of its cost.

    The records are compared whole (keys, declarations, files, offsets, lengths, chunks), so the
    memory is never trusted blindly, whichever strategy object or process group saved last.
    Unlike ``cached_metadata`` (where ranks that wrote the same items send only their CRC32Cs),
    it needs nothing from the other ranks. Saves of more than :attr:`MAX_RECORDS` records are
    not remembered (rank 0 would hold their tables between saves)."""

    MAX_RECORDS = 1 << 18

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: Optional[Tuple[GatheredRecords, bytes, int, str, str, Optional[IndexTemplate]]] = None

    def clear(self) -> None:
        with self._lock:
            self._last = None

    def _matching(self, records: GatheredRecords):
        last = self._last
        if last is None:
            return None
        old = last[0]
        a, b = old.rows, records.rows
        if (
            a.shape != b.shape
            or old.fqns != records.fqns
            or old.files != records.files
            or old.decls != records.decls
        ):
            return None
        if not (np.array_equal(a[:, :4], b[:, :4]) and np.array_equal(a[:, 5:], b[:, 5:])):
            return None
        return last

    def reuse(
        self, records: GatheredRecords, checkpoint_id: str, save_id: str, with_index: bool
    ) -> Optional[Tuple[bytes, int, Optional[bytes]]]:
        """``(.metadata, its head's length, sidecar or None)`` of ``records`` under the new ids,
        from the last save if ``records`` differ from its records only in CRC32Cs; else None."""
        with self._lock:
            last = self._matching(records)
            if last is None:
                return None
            _, md, head, old_checkpoint_id, old_save_id, template = last
            md_bytes = bytearray(md)
            head = respell(md_bytes, head, [(old_checkpoint_id, checkpoint_id), (old_save_id, save_id)])
            if head is None:
                return None
            index = None
            if with_index:
                if template is None:
                    return None
                index = patched_sidecar_index(template, records, len(md_bytes))
                if index is None:
                    return None
            return bytes(md_bytes), head, index

    def remember(
        self,
        records: GatheredRecords,
        md_bytes: bytes,
        head: int,
        checkpoint_id: str,
        save_id: str,
        template: Optional[IndexTemplate],
        reused: bool,
    ) -> None:
        """Keep this save; ``reused``: :meth:`reuse` just gave its ``.metadata`` (the records are
        the last ones, so a sidecar template of theirs, just patched, stays)."""
        with self._lock:
            if len(records.rows) > self.MAX_RECORDS:
                self._last = None
                return
            if template is None and reused and self._last is not None:
                template = self._last[5]
            self._last = (records, bytes(md_bytes), head, checkpoint_id, save_id, template)


LAST_SAVE = LastSave()


def patched_sidecar_index(
    template: IndexTemplate, records: GatheredRecords, metadata_bytes: int
) -> Optional[bytes]:
    """The sidecar of ``records`` from the template of an earlier save's records that differed
    only in their CRC32Cs (None if they do not fit it)."""
    return template.patch({fqn: r[:, 4] for fqn, r in records.by_key()}, metadata_bytes)
