"""The checkpoint's Zarr tree: finding, reading and writing the arrays' ``zarr.json`` and the root group.

A checkpoint location reaches this package as a :data:`Root`: a local directory as a ``Path``
(the POSIX fast paths apply) or an object store as its :class:`~distckpt.storage.Store`; which
one is asked with :func:`distckpt.storage.local_root`, never by testing a type. Every function
here does its work once for both, and only the I/O call differs.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

import torch

from distckpt import bounds, containment, dist, storage
from distckpt.checksum import crc32c, pack_block_crcs
from distckpt.core import CheckpointingException, atomic_write_bytes
from distckpt.formats import blockcrc
from distckpt.formats.manifest import check_whole_bytes
from distckpt.storage import Store
from distckpt.strategies.zarr.meta import (
    ARRAY_META,
    BACKEND,
    FORMAT_VERSION,
    LEGACY_ARRAY_META,
    ArrayMeta,
    Shape,
    array_metadata_json,
    checked_meta,
    manifest_disagreement,
    meta_from_v2,
    meta_from_v3,
)

# A local checkpoint directory, or the object store holding the checkpoint (chunks, zarr.json and
# objects are then objects under its prefix).
Root = Union[Path, Store]

# A file written by a rank, for the integrity manifest: (relative path, size, crc32c, key, block
# CRC32Cs): the last, for a chunk file of at least blockcrc.MIN_PAYLOAD bytes, the CRC32C of each
# of its blockcrc.BLOCK_SIZE blocks, packed (manifest.pack_block_crcs); else empty.
FileRecord = Tuple[str, int, int, str, bytes]

# Names that would collide with the checkpoint's own files at the top level.
_RESERVED_TOP = {"zarr.json", "metadata.json", "common.pt", ".metadata", ".distckpt_manifest.json"}


def open_root(location: storage.Location) -> Root:
    """The :data:`Root` of a checkpoint location: its local directory where it has one (a path,
    a ``file://`` URL, a local store), else its store."""
    local = storage.local_root(location)
    return local if local is not None else storage.open_store(location)


def chunk_checksums(data) -> Tuple[int, bytes]:
    """The CRC32C of a chunk file's bytes and, when the file is large, its block CRC32Cs packed;
    one pass over the bytes (the file's CRC32C is combined from its blocks')."""
    if len(data) < blockcrc.MIN_PAYLOAD:
        return crc32c(data), b""
    crcs: List[int] = []
    crc = blockcrc.extend(0, data, crcs)
    return crc, pack_block_crcs(crcs)


def block_entries(records: Iterable[FileRecord]) -> Dict[str, Tuple[int, int, bytes]]:
    """The manifest's ``blocks`` entries (:mod:`distckpt.formats.manifest`) for the chunk files in
    ``records``."""
    return {path: (blockcrc.BLOCK_SIZE, crc, blocks) for path, _, crc, _, blocks in records if blocks}


def write_json(rel: str, md: Dict[str, Any], root: Root, key: str, atomic: bool = False) -> FileRecord:
    """Store ``md`` as JSON at ``rel`` below ``root`` and return its record (an object store's put
    is atomic by itself; a local file is replaced atomically only with ``atomic``)."""
    data = json.dumps(md).encode()
    local = storage.local_root(root)
    if local is None:
        root.put(rel, data)
    elif atomic:
        atomic_write_bytes(local / rel, data)
    else:
        (local / rel).write_bytes(data)
    return rel, len(data), crc32c(data), key, b""


# --------------------------------------------------------------------------- reading


def read_array_meta(
    root: storage.Location, key: str, manifest: Any = None, listed: bool = False
) -> Optional[ArrayMeta]:
    """The metadata of array ``key`` below ``root``: its ``zarr.json``, else a legacy ``.zarray``,
    parsed by schema (:func:`~distckpt.strategies.zarr.meta.meta_from_v3`). With the checkpoint's
    ``manifest``, the file is compared with it first (``listed``: it must be listed).

    Returns None if neither exists.

    Raises:
        CheckpointingException: the metadata file exists but cannot be read, is not supported, or
        differs from what the manifest records for it.
    """
    root = open_root(root)
    local = storage.local_root(root)
    store: Optional[Store] = None
    if local is None:
        store = root
        key = bounds.relative_name(key, root.where(ARRAY_META), "array key")
        path = Path(key)
    else:
        path = bounds.inside(local, key, local / ARRAY_META, "array key")
    for name, parse in ((ARRAY_META, meta_from_v3), (LEGACY_ARRAY_META, meta_from_v2)):
        try:
            if store is not None:
                text = bytes(store.get(f"{key}/{name}"))
            else:  # beneath the checkpoint folder, never through a symlink out of it
                text = containment.read_beneath(local, f"{key}/{name}", local / ARRAY_META, "array key")
        except (FileNotFoundError, NotADirectoryError):
            continue
        source = path / name if store is None else store.where(f"{key}/{name}")

        try:
            check_whole_bytes(manifest, root, f"{key}/{name}", text, listed)
        except CheckpointingException as e:
            # What the edited file now claims, as torch_dist's .metadata says it (what differs).
            try:
                differs = manifest_disagreement(_parsed(parse, key, path, text, source, store), manifest)
            except CheckpointingException as unreadable:
                differs = str(unreadable)
            raise CheckpointingException(f"{e}" + (f"; {differs}" if differs else "")) from None
        return _parsed(parse, key, path, text, source, store)
    return None


def _parsed(
    parse: Callable[[str, Path, Any], ArrayMeta], key: str, path: Path, text: bytes, source: Any, store: Any
) -> ArrayMeta:
    """``text``, the array metadata file ``source`` of ``key``, parsed by schema and checked."""
    try:
        return replace(checked_meta(parse(key, path, json.loads(text)), source), store=store)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointingException(
            f"{source}: unreadable Zarr metadata of key {key!r} (rank {dist.get_rank()}): {e}"
        ) from None


def root_keys(root: Root, manifest: Any = None, listed: bool = False) -> Optional[List[str]]:
    """The tensor keys the root group's ``zarr.json`` lists (None when it lists none); with the
    checkpoint's ``manifest``, the file compared with it first (``listed``: it must be listed)."""
    where = storage.join(root, ARRAY_META)
    try:
        data = storage.read_bytes(root, ARRAY_META)
        check_whole_bytes(manifest, root, ARRAY_META, data, listed)
        md = json.loads(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"{where}: unreadable root group metadata: {e}") from None
    if not isinstance(md, dict):
        raise CheckpointingException(
            f"{where}: root group metadata is a JSON {type(md).__name__}, not an object"
        )
    attributes = md.get("attributes")
    ours = attributes.get("distckpt") if isinstance(attributes, dict) else None
    if ours is None:
        return None  # not written by distckpt: the arrays are found by walking the tree
    keys = ours.get("keys") if isinstance(ours, dict) else None
    if not isinstance(keys, list):
        raise CheckpointingException(
            f"{where}: root group metadata lists its array keys as {type(keys).__name__}, "
            f"not a list (damaged)"
        )
    names = [bounds.relative_name(k, where, "array key") for k in keys]
    if len(set(names)) != len(names):
        # Each listed key is one array folder: a key listed again would be read, checked and
        # walked again per mention (100,000 mentions of one array: minutes of every tool's time).
        seen: set = set()
        twice = next(k for k in names if k in seen or seen.add(k))
        raise CheckpointingException(f"{where}: lists array key {twice!r} more than once (damaged)")
    return names


def _is_array_meta(data: bytes) -> bool:
    """Whether ``data``, a ``zarr.json`` found while walking the tree, describes an array; one that
    cannot be parsed does not (its key is then absent, and a request for it says so)."""
    try:
        md = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(md, dict) and md.get("node_type") == "array"


def _folders(root: Root) -> Iterator[Tuple[str, Set[str], Callable[[], None]]]:
    """Each folder below ``root``, parents first: (its relative name, the names of the files in it,
    a callable that skips every folder beneath it). Megatron's ``*.sync`` lock folders (holding an
    empty ``.zarray``) are left out."""
    local = storage.local_root(root)
    if local is not None:
        for dirpath, dirnames, filenames in os.walk(local):
            dirnames[:] = sorted(d for d in dirnames if not d.endswith(".sync"))
            here = Path(dirpath)
            if here != local:
                yield here.relative_to(local).as_posix(), set(filenames), dirnames.clear
        return
    files: Dict[str, Set[str]] = {}
    for name in root.list():  # a legacy checkpoint without a root listing: one LIST
        folder, _, base = name.rpartition("/")
        if folder and not any(part.endswith(".sync") for part in folder.split("/")):
            files.setdefault(folder, set()).add(base)
    skipped: Set[str] = set()
    for folder in sorted(files):  # a folder sorts before the folders inside it
        parts = folder.split("/")
        if not any("/".join(parts[:i]) in skipped for i in range(1, len(parts))):
            yield folder, files[folder], lambda f=folder: skipped.add(f)


def scan_keys(root: Root) -> List[str]:
    """The arrays found by walking the tree (the legacy layout, without a root listing): folders
    holding the ``zarr.json`` of an array or a ``.zarray``; nothing inside an array is one."""
    keys = []
    for folder, names, skip_below in _folders(root):
        if LEGACY_ARRAY_META in names or (
            ARRAY_META in names and _is_array_meta(storage.read_bytes(root, f"{folder}/{ARRAY_META}"))
        ):
            keys.append(folder)
            skip_below()
    return sorted(keys)


def list_array_keys(root: storage.Location) -> List[str]:
    """The tensor keys stored in checkpoint ``root``."""
    root = open_root(root)
    keys = root_keys(root)
    return keys if keys is not None else scan_keys(root)


# --------------------------------------------------------------------------- writing


def check_key_path(key: str) -> None:
    """Refuse a tensor key that cannot name an array folder inside the checkpoint."""
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or "\\" in key
        or any(p in ("", ".", "..") for p in parts)
        or parts[0] in _RESERVED_TOP
    ):
        raise CheckpointingException(
            f"ShardedTensor key {key!r} cannot name a Zarr array folder in the checkpoint (empty "
            f"segments, '.', '..', a leading '/', or a reserved top-level name {sorted(_RESERVED_TOP)})"
        )


def check_key_paths(keys: Iterable[str]) -> None:
    """:func:`check_key_path` for each key, and refuse two keys whose folders would nest."""
    keys = sorted(keys)
    for key in keys:
        check_key_path(key)
    for a, b in zip(keys, keys[1:]):
        if b.startswith(a + "/"):
            raise CheckpointingException(
                f"ShardedTensor keys {a!r} and {b!r} cannot both be stored by the zarr backend: the "
                f"array folder of one would contain the other"
            )


def key_prefixes(path: str) -> List[str]:
    """``"a/b/c"`` -> ``["a", "a/b", "a/b/c"]``."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def write_root_group(root: Root, keys: Iterable[str]) -> List[FileRecord]:
    """Write the root group, which lists ``keys``, and a group node for each folder between it
    and an array."""
    local = storage.local_root(root)
    keys = sorted(keys)
    parents = {str(Path(k).parent.as_posix()) for k in keys} - {"."}
    records = []
    for g in sorted({p for parent in parents for p in key_prefixes(parent)}):
        if local is not None:
            (local / g).mkdir(parents=True, exist_ok=True)
        records.append(write_json(f"{g}/{ARRAY_META}", {"zarr_format": 3, "node_type": "group"}, root, g))
    md = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"distckpt": {"format": BACKEND, "format_version": FORMAT_VERSION, "keys": keys}},
    }
    records.append(write_json(ARRAY_META, md, root, ARRAY_META, atomic=True))
    return records


def array_meta_at(root: Root, key: str, md: Dict[str, Any]) -> ArrayMeta:
    """The :class:`ArrayMeta` of array ``key`` below ``root`` whose ``zarr.json`` is ``md``."""
    local = storage.local_root(root)
    if local is not None:
        return meta_from_v3(key, local / key, md)
    return replace(meta_from_v3(key, Path(key), md), store=root)


def create_array(
    root: Root, key: str, shape: Shape, chunks: Shape, dtype: torch.dtype, compression: Optional[str] = None
) -> Tuple[ArrayMeta, FileRecord]:
    """Write ``<root>/<key>/zarr.json``; return the array's metadata and the file's record."""
    md = array_metadata_json(key, shape, chunks, dtype, compression)
    local = storage.local_root(root)
    if local is not None:
        (local / key).mkdir(parents=True, exist_ok=True)
    record = write_json(f"{key}/{ARRAY_META}", md, root, key)
    return array_meta_at(root, key, md), record
