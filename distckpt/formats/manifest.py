"""The integrity manifest ``.distckpt_manifest.json``: sizes and CRC32C of everything written.

Every byte range a rank writes (one chunk archive, one object payload, one zarr chunk file) is
checksummed while it is written and recorded here, with the size of every data file and the
save id. Rank 0 writes the manifest after all ranks finished writing and *before*
``metadata.json``, so a committed checkpoint always has a complete manifest. It is plain JSON and
kept apart from ``metadata.json`` (which Megatron-Core requires to hold exactly its four keys).

Format (version 1)::

    {"format": "distckpt-manifest", "version": 1, "save_id": "...", "backend": "torch_dist",
     "files": {"__0_0.distcp": 123456, ...},                 # relative path -> size in bytes
     "ranges": {"__0_0.distcp": [[offset, length, crc32c, "key"], ...], ...},
     "keys": {"key": ["bfloat16", [global shape]], ...},      # optional: what each tensor key is
             # (a flattened torch_dist key: [dtype, [stored N-D reformulated shape], [original shape]])
     "chunks": {"__0_0.distcp": [[offset, [chunk offset], [chunk size]], ...], ...},  # optional
     "blocks": {"w/c/0/0": [block size, crc32c, "base64"], ...},  # optional
     "arrays": {"w": {"zarr_format": 3, "codecs": [...], "fill_value": 0.0, ...}, ...}}  # optional

``keys`` and ``chunks`` (added later, in the same version: readers that do not know them ignore
them) record what the writer put in each range: the dtype and stored shape of each tensor key
(and the original shape of a flattened one), and which chunk of its key each range holds.
``verify=True`` and ``distckpt verify`` compare the
metadata's claims (``.metadata``'s storage records, a zarr array's ``zarr.json``) with them;
manifests without them are checked by key, offset and length only.

``arrays`` (optional, zarr): each array's ``zarr.json`` as the writer wrote it, but its
``attributes`` (chunk grid, chunk key encoding, fill value, codecs, ...); a reader compares the
``zarr.json`` it parses with it (``strategies.zarr.meta.manifest_disagreement``), so an edit of how
the chunks are encoded is refused even when the file's own checksum was brought up to date.

Every member is parsed by schema where it is read: offsets, lengths, sizes and shapes are
integers in range (not ``2.5``, ``true`` or ``"5"``), CRC32Cs 32-bit, names strings; a wrong
value is a ``CheckpointingException`` naming the manifest and the member.

``blocks`` (also optional, also ignored by readers that do not know it) holds, for a file that
is one checksummed range of at least two blocks (a large zarr chunk file), the CRC32C of each
consecutive ``block size`` bytes of it (the last block may be shorter), packed as little-endian
32-bit words and base64-encoded, with the whole file's CRC32C it was computed with. A load that
needs part of such a file reads and checks only the blocks holding that part; the entry is
believed only while its CRC32C is the file's range CRC32C (an edit that re-described the file
without its blocks leaves a stale entry: the file is then read whole and checked against that).
torch_dist keeps its block CRCs in per-file tables instead (``formats/blockcrc.py``).

Checkpoints without a manifest (Megatron's, or older ones) still load; they are verified only
structurally.
"""

from __future__ import annotations

import base64
import itertools
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from distckpt import bounds, storage
from distckpt.checksum import (
    BLOCK_SIZE,
    crc32c,
    extend,
    pack_block_crcs,  # noqa: F401  (importable from its old home)
)
from distckpt.core import CheckpointingException

MANIFEST_FNAME = ".distckpt_manifest.json"
FORMAT = "distckpt-manifest"
VERSION = 1


def dtype_name(dtype: Any) -> str:
    """How the manifest names a dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class RangeChecksum:
    """One checksummed byte range of a file."""

    offset: int
    length: int
    crc32c: int
    key: str
    # (chunk offset, chunk size) of the key's chunk the writer stored in this range, when known.
    chunk: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None


@dataclass
class Manifest:
    save_id: str
    backend: str
    files: Dict[str, int] = field(default_factory=dict)
    ranges: Dict[str, List[RangeChecksum]] = field(default_factory=dict)
    # Tensor key -> (dtype name, stored global shape[, original shape of a flattened key]), as
    # the writer declared it.
    keys: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)
    # File -> (block size, the file's CRC32C, packed little-endian CRC32C of each block): see
    # the module docstring; kept packed until a load asks for one file's (:meth:`block_crcs`).
    blocks: Dict[str, Tuple[int, int, bytes]] = field(default_factory=dict)
    # Zarr array key -> its zarr.json but the attributes, as the writer wrote it.
    arrays: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "backend": self.backend,
            "files": self.files,
            "ranges": {
                f: [[r.offset, r.length, r.crc32c, r.key] for r in rs] for f, rs in self.ranges.items()
            },
        }
        if self.keys:
            out["keys"] = {k: [d, *map(list, shapes)] for k, (d, *shapes) in self.keys.items()}
        chunks = {
            f: [[r.offset, list(r.chunk[0]), list(r.chunk[1])] for r in rs if r.chunk is not None]
            for f, rs in self.ranges.items()
        }
        chunks = {f: c for f, c in chunks.items() if c}
        if chunks:
            out["chunks"] = chunks
        if self.blocks:
            out["blocks"] = {f: [b, c, base64.b64encode(p).decode()] for f, (b, c, p) in self.blocks.items()}
        if self.arrays:
            out["arrays"] = self.arrays
        return json.dumps(out, separators=(",", ":")).encode()

    def set_whole(self, name: str, size: int, crc: int, key: Optional[str] = None) -> None:
        """List ``name`` as ``size`` bytes checksummed in one range (replacing what was listed)."""
        self.files[name] = size
        self.ranges[name] = [RangeChecksum(0, size, crc, key or name)]
        self.blocks.pop(name, None)

    def block_crcs(self, name: str) -> Optional[Tuple[int, List[int]]]:
        """(block size, CRC32C of each block) of file ``name`` when the manifest records them
        and they belong to the file as it lists it (one range, of the CRC32C they were computed
        with, as many blocks as its size needs); else None."""
        entry = self.blocks.get(name)
        ranges = self.ranges.get(name)
        if entry is None or not ranges or len(ranges) != 1:
            return None
        block, crc, packed = entry
        r = ranges[0]
        if r.offset != 0 or r.crc32c != crc or len(packed) != 4 * -(-r.length // block):
            return None
        return block, list(struct.unpack(f"<{len(packed) // 4}I", packed))

    def set_bytes(self, name: str, data: bytes) -> None:
        """List file ``name`` holding exactly ``data``."""
        self.set_whole(name, len(data), crc32c(data))

    def drop(self, name: str) -> None:
        """Stop listing ``name`` (no error if it was not listed)."""
        self.files.pop(name, None)
        self.ranges.pop(name, None)
        self.blocks.pop(name, None)

    def range_index(self) -> Dict[Tuple[str, int], RangeChecksum]:
        return {(f, r.offset): r for f, rs in self.ranges.items() for r in rs}

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def build_manifest(
    save_id: str,
    backend: str,
    ranges: Iterable[Tuple[str, int, int, int, str]],
    file_sizes: Dict[str, int],
    keys: Optional[Dict[str, Tuple[Any, ...]]] = None,
    chunks: Optional[Iterable[Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]]] = None,
    blocks: Optional[Dict[str, Tuple[int, int, bytes]]] = None,
    arrays: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Manifest:
    """``ranges`` holds ``(file, offset, length, crc32c, key)`` from every rank; ``keys`` each
    tensor key's (dtype name, stored shape); ``chunks``, aligned with ``ranges``, the (chunk
    offset, chunk size) each range holds (None where it holds no tensor chunk); ``blocks`` the
    block CRC32Cs of files written as one range (see :attr:`Manifest.blocks`); ``arrays`` each
    zarr array's description (:attr:`Manifest.arrays`)."""
    m = Manifest(
        save_id,
        backend,
        dict(sorted(file_sizes.items())),
        keys=dict(keys or {}),
        blocks=dict(blocks or {}),
        arrays=dict(arrays or {}),
    )
    boxes = iter(chunks) if chunks is not None else itertools.repeat(None)
    for (f, offset, length, crc, key), box in zip(ranges, boxes):
        m.ranges.setdefault(f, []).append(RangeChecksum(offset, length, crc, key, box))
    for rs in m.ranges.values():
        rs.sort(key=lambda r: r.offset)
    return m


def _location(checkpoint_dir: storage.Location) -> Union[Path, storage.Store]:
    """Where the manifest's reads and writes go: a local directory (its POSIX paths: atomic
    rename, reads beneath the root), else the store."""
    root = storage.local_root(checkpoint_dir)
    return root if root is not None else storage.open_store(checkpoint_dir)


def write_manifest(checkpoint_dir: storage.Location, manifest: Manifest) -> None:
    """Write the manifest (local: temp file + rename; object store: one atomic put)."""
    storage.write_bytes(_location(checkpoint_dir), MANIFEST_FNAME, manifest.to_json())


def _parsed(
    checkpoint_dir: storage.Location, build: Callable[[dict, Dict[str, int]], Any]
) -> Tuple[Optional[Any], str]:
    """``build`` applied to the checkpoint's manifest JSON (None if it has no manifest), after the
    format check, and the manifest's path; the listed files are checked as names and sizes."""
    location = _location(checkpoint_dir)
    path = storage.join(location, MANIFEST_FNAME)
    try:
        raw = json.loads(storage.read_bytes(location, MANIFEST_FNAME))
    except FileNotFoundError:
        return None, path
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"{path}: unreadable integrity manifest: {e}") from None
    try:
        _member(raw, "the manifest", dict)
        version = raw.get("version")
        if raw.get("format") != FORMAT or not bounds.fits(version, VERSION) or not version:
            raise ValueError(f"unsupported format {raw.get('format')!r:.40} version {version!r:.40}")
        files = _member(raw.get("files"), "files", dict)
        for name, size in files.items():
            if not bounds.fits(size):
                raise ValueError(
                    f"files[{name!r}]: size {size!r:.40} is not an integer in [0, {bounds.MAX_BYTES}]"
                )
        out = build(raw, files)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointingException(f"{path}: malformed integrity manifest: {e}") from None
    for name in files:
        bounds.relative_name(name, path, "listed file")
    return out, path


def _member(value: Any, field: str, kind: type) -> Any:
    """``value`` (the manifest's member ``field``) if it is a ``kind``; else ValueError naming it."""
    if type(value) is not kind:
        raise ValueError(
            f"{field} is {type(value).__name__}, not {'an object' if kind is dict else 'a list'}"
        )
    return value


def _crcs_of(raw: dict, name: str) -> List[int]:
    """The CRC32Cs of file ``name``'s ranges in the manifest's JSON ``raw`` (checked as
    :func:`read_manifest` checks them, for this file only)."""
    ranges = _member(raw.get("ranges"), "ranges", dict)
    return [_range(r, name)[2] for r in _member(ranges.get(name, []), f"ranges[{name!r}]", list)]


def _range(r: Any, name: str) -> Tuple[int, int, int, str]:
    """One entry of ``ranges[name]``: ``[offset, length, crc32c, key]``."""
    if not (
        type(r) is list
        and len(r) == 4
        and bounds.fits(r[0])
        and bounds.fits(r[1])
        and bounds.fits(r[2], 0xFFFFFFFF)
        and type(r[3]) is str
    ):
        raise ValueError(
            f"ranges[{name!r}]: entry {r!r:.100} is not [offset, length, CRC32C, key] (two naturals, a "
            f"32-bit CRC32C and a string)"
        )
    return r[0], r[1], r[2], r[3]


def read_manifest_files(checkpoint_dir: storage.Location) -> Optional[Dict[str, int]]:
    """The files the checkpoint's manifest lists, with their sizes (None if it has no manifest),
    without building its per-range checksums: what a completeness check needs.

    Raises:
        CheckpointingException: the manifest exists but is malformed.
    """
    return _parsed(checkpoint_dir, lambda raw, files: files)[0]


def read_manifest(checkpoint_dir: storage.Location) -> Optional[Manifest]:
    """The checkpoint's manifest (local directory or Store), or None if it has none.

    Raises:
        CheckpointingException: the manifest exists but is malformed.
    """

    def build(raw: dict, files: Dict[str, int]) -> Manifest:
        save_id, backend = raw.get("save_id"), raw.get("backend")
        if type(save_id) is not str or type(backend) is not str:
            raise ValueError(f"save_id {save_id!r:.40} and backend {backend!r:.40} are not both strings")
        m = Manifest(save_id, backend, files)
        boxes = {}
        for f, cs in _member(raw.get("chunks", {}), "chunks", dict).items():
            for c in _member(cs, f"chunks[{f!r}]", list):
                if not (
                    type(c) is list
                    and len(c) == 3
                    and bounds.fits(c[0])
                    and bounds.plain_shape(c[1]) is not None
                    and bounds.plain_shape(c[2]) is not None
                ):
                    raise ValueError(
                        f"chunks[{f!r}]: entry {c!r:.100} is not [offset, chunk offset, chunk size]"
                    )
                boxes[(f, c[0])] = (tuple(c[1]), tuple(c[2]))
        for f, rs in _member(raw.get("ranges"), "ranges", dict).items():
            m.ranges[f] = [
                RangeChecksum(o, n, c, k, boxes.get((f, o)))
                for o, n, c, k in (_range(r, f) for r in _member(rs, f"ranges[{f!r}]", list))
            ]
        m.keys = _declared_keys(raw)
        for f, entry in _member(raw.get("blocks", {}), "blocks", dict).items():
            if not (type(entry) is list and len(entry) == 3 and type(entry[2]) is str):
                raise ValueError(f"blocks[{f!r}]: {entry!r:.80} is not [block size, CRC32C, base64]")
            block, crc, packed = entry
            data = base64.b64decode(packed, validate=True)
            if not bounds.fits(block, 1 << 30) or block < 4096 or block % 16 or len(data) % 4:
                raise ValueError(
                    f"blocks[{f!r}]: block size {block!r:.20} not in [4096, 2^30] or not "
                    f"a multiple of 16, or {len(data)} bytes of CRC32Cs"
                )
            if not bounds.fits(crc, 0xFFFFFFFF):
                raise ValueError(f"blocks[{f!r}]: CRC32C {crc!r:.20} is not a 32-bit natural")
            m.blocks[f] = (block, crc, data)
        for key, description in _member(raw.get("arrays", {}), "arrays", dict).items():
            m.arrays[key] = _member(description, f"arrays[{key!r}]", dict)
        return m

    m, path = _parsed(checkpoint_dir, build)
    if m is None:
        return None
    stray = sorted(set(m.ranges) - set(m.files))
    unchecked = sorted(f for f, size in m.files.items() if size and not m.ranges.get(f))
    if stray or unchecked:
        raise CheckpointingException(
            f"{path}: manifest is inconsistent (checksums for unlisted files {stray}, listed files "
            f"without checksums {unchecked}); it may be corrupted"
        )
    return m


def _declared_keys(raw: dict) -> Dict[str, Tuple[Any, ...]]:
    """The manifest's ``keys`` (raises ValueError/TypeError on a malformed entry)."""
    out: Dict[str, Tuple[Any, ...]] = {}
    for k, entry in _member(raw.get("keys", {}), "keys", dict).items():
        if not (
            type(entry) is list
            and 2 <= len(entry) <= 3
            and type(entry[0]) is str
            and all(bounds.plain_shape(shape) is not None for shape in entry[1:])
        ):
            raise ValueError(
                f"keys[{k!r}]: {entry!r:.100} is not [dtype, shape] or [dtype, shape, original shape]"
            )
        out[k] = (entry[0], *(tuple(shape) for shape in entry[1:]))
    return out


def read_declared_keys(checkpoint_dir: storage.Location) -> Optional[Dict[str, Tuple[Any, ...]]]:
    """The manifest's :attr:`Manifest.keys` alone (None if the checkpoint has no manifest), for
    a metadata query that checks the keys it returns against them.

    Raises:
        CheckpointingException: the manifest exists but is malformed.
    """
    return _parsed(checkpoint_dir, lambda raw, files: _declared_keys(raw))[0]


def add_whole_files(
    checkpoint_dir: storage.Location, entries: Dict[str, Tuple[int, int]], backend: str, save_id: str
) -> None:
    """Merge whole-file checksums ``{name: (size, crc32c)}`` into the manifest (creating it if the
    sharded strategy wrote none). Called on one rank, before ``metadata.json`` is written."""
    manifest = read_manifest(checkpoint_dir) or Manifest(save_id, backend)
    for name, (size, crc) in entries.items():
        manifest.set_whole(name, size, crc)
    write_manifest(checkpoint_dir, manifest)


def check_whole_file(checkpoint_dir: storage.Location, name: str, data: bytes, listed: bool = True) -> None:
    """Raise if the manifest records a checksum for ``name`` and ``data`` does not match it, or
    (``listed``) if a manifest exists but does not list ``name``. Only ``name``'s entry is built
    from the manifest's JSON (metadata queries call this on every read of ``.metadata``)."""
    parsed, _ = _parsed(checkpoint_dir, lambda raw, files: (files, _crcs_of(raw, name)))
    if parsed is not None:
        _compare_whole(checkpoint_dir, name, data, *parsed, listed)


def check_whole_bytes(
    manifest: Optional[Manifest],
    checkpoint_dir: storage.Location,
    name: str,
    data: bytes,
    listed: bool = True,
) -> None:
    """:func:`check_whole_file` against a manifest already read (None: the checkpoint has none),
    for a caller that checks many files of one checkpoint."""
    if manifest is not None:
        _compare_whole(
            checkpoint_dir,
            name,
            data,
            manifest.files,
            [r.crc32c for r in manifest.ranges.get(name, [])],
            listed,
        )


def _compare_whole(
    checkpoint_dir: storage.Location,
    name: str,
    data: bytes,
    files: Dict[str, int],
    expected: List[int],
    listed: bool,
) -> None:
    if not listed and name not in files:
        return
    if name not in files:
        raise CheckpointingException(
            f"{storage.join(_location(checkpoint_dir), name)}: not covered by the integrity manifest; "
            f"cannot verify it"
        )
    if len(data) != files[name] or (len(expected) == 1 and crc32c(data) != expected[0]):
        how = (
            f"{len(data)} bytes, manifest says {files[name]}"
            if len(data) != files[name]
            else "its CRC32C is not the manifest's"
        )
        raise CheckpointingException(
            f"{storage.join(_location(checkpoint_dir), name)}: contents do not match the integrity manifest "
            f"({how}); the file is corrupted"
        )


def _range_problems(name: str, r: RangeChecksum, data, blocks: Optional[Tuple[int, List[int]]]) -> List[str]:
    """What is wrong with range ``r`` of file ``name``, whose bytes are ``data``: its CRC32C and,
    where the manifest has them (``blocks``), the file's block CRC32Cs, computed in the same
    pass (a damaged block CRC32C would fail a partial load of intact data: say so here)."""
    if blocks is None or blocks[0] != BLOCK_SIZE:  # loads use no other block size
        crc, wrong = crc32c(data), []
    else:
        crcs: List[int] = []
        crc = extend(0, data, crcs)
        wrong = [i for i, (a, b) in enumerate(zip(crcs, blocks[1])) if a != b]
    if crc != r.crc32c:
        return [
            f"{name}: key {r.key!r} at offset {r.offset}: CRC32C mismatch "
            f"(stored {r.crc32c:#010x}, computed {crc:#010x})"
        ]
    if wrong:
        return [
            f"{name}: the manifest's block CRC32Cs of blocks {wrong[:8]}{' ...' if len(wrong) > 8 else ''} "
            f"do not match the file, whose whole CRC32C does (the manifest is damaged)"
        ]
    return []


def verify_files(
    checkpoint_dir: storage.Location, manifest: Manifest, *, checksums: bool = True, progress=None
) -> List[str]:
    """Check every file of the manifest: present, right size, and (``checksums``) every range's
    CRC32C. Returns one line per problem, naming file, key and offset; empty if all is well.

    ``progress(nbytes)`` is called as bytes are checked.
    """
    store = storage.open_store(checkpoint_dir)
    problems: List[str] = []
    for name, size in manifest.files.items():
        try:
            if store.local_root is not None:
                bounds.inside(store.local_root, name, store.where(MANIFEST_FNAME), "listed file")
            else:
                bounds.relative_name(name, store.where(MANIFEST_FNAME), "listed file")
        except CheckpointingException as e:
            problems.append(str(e))
            continue
        try:
            actual = store.size(name)
        except FileNotFoundError:
            problems.append(f"{name}: missing (expected {size} bytes)")
            continue
        if actual != size:
            problems.append(f"{name}: size {actual} bytes, expected {size}")
        if not checksums:
            if progress:
                progress(size)
            continue
        covered = 0
        for r in sorted(manifest.ranges.get(name, []), key=lambda r: r.offset):
            if r.offset != covered:
                problems.append(f"{name}: bytes [{covered}, {r.offset}) have no checksum in the manifest")
            covered = max(covered, r.offset + r.length)
        if covered < size:
            problems.append(f"{name}: bytes [{covered}, {size}) have no checksum in the manifest")
        ranges = []
        for r in manifest.ranges.get(name, []):
            if r.offset + r.length > actual:
                problems.append(
                    f"{name}: key {r.key!r} at offset {r.offset}: truncated (the file has "
                    f"{actual} bytes, the range ends at {r.offset + r.length})"
                )
            else:
                ranges.append(r)
        # Read in batches of about 64 MiB: ranged reads (concurrent on object stores), bounded memory.
        batch: List[RangeChecksum] = []
        batches, batch_bytes = [batch], 0
        for r in ranges:
            if batch and batch_bytes + r.length > (64 << 20):
                batch, batch_bytes = [], 0
                batches.append(batch)
            batch.append(r)
            batch_bytes += r.length
        for group in batches:
            lengths = [r.length for r in group]
            for r, data in zip(group, store.get_ranges(name, [r.offset for r in group], lengths)):
                if len(data) != r.length:
                    problems.append(
                        f"{name}: key {r.key!r} at offset {r.offset}: truncated "
                        f"({len(data)} of {r.length} bytes)"
                    )
                else:
                    problems += _range_problems(name, r, data, manifest.block_crcs(name))
                if progress:
                    progress(r.length)
    return problems
