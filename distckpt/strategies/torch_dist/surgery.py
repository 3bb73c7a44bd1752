"""Removing keys from a ``torch_dist`` checkpoint in place (``remove_sharded_tensors``).

One code path for every location, over the :class:`~distckpt.storage.Store` interface (a local
directory is a ``LocalStore``): kept items that shared a data file with removed ones are copied
into a new file (their block CRC32Cs carried over), then ``.metadata``, the manifest and the
sidecar index are replaced, and only then are the old files deleted. A crash at any point leaves
a checkpoint that loads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from distckpt import bounds, containment, storage
from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats import blockcrc
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_write import index_from_metadata
from distckpt.formats.manifest import MANIFEST_FNAME, RangeChecksum, read_manifest, write_manifest
from distckpt.strategies.torch_dist.metadata import DATA_SUFFIX, METADATA_FNAME, Resolved
from distckpt.strategies.torch_dist.partial import block_table
from distckpt.strategies.torch_dist.stored import checked_metadata

logger = logging.getLogger(__name__)

# Bytes of kept items read at once while they are copied into a new file.
COPY_BATCH = 64 << 20


def remove_sharded_tensors(checkpoint_dir: storage.Location, key_prefix: str, trusted: bool = False) -> None:
    """Drop every key starting with ``key_prefix`` (tensors and objects) from the checkpoint.

    Crash-safe order: data files that mix kept and removed items are first rewritten under new
    names, then ``.metadata`` is replaced atomically, and only then are the old files deleted.
    Damage found in a kept item leaves the checkpoint as it was (the new files are removed).
    """
    location = storage.resolve(checkpoint_dir)
    store = storage.open_store(location)
    md, doomed, by_file, new_storage = _removal_plan(location, key_prefix, trusted)
    manifest = read_manifest(location)
    old = manifest.range_index() if manifest is not None else {}
    to_delete: List[str] = []
    created: List[str] = []  # new data files and tables, removed again if a carried item is damaged
    tables: Dict[str, bytes] = {}  # block tables of the rewritten files
    moved: List[Tuple[MetadataIndex, _StorageInfo, _StorageInfo]] = []
    sizes: Dict[str, int] = {}  # the new data files' sizes
    rewritten_bytes = 0
    try:
        for name, entries in sorted(by_file.items()):
            kept = sorted(
                [(i, info) for i, info in entries if i.fqn not in doomed], key=lambda e: e[1].offset
            )
            if len(kept) == len(entries):
                continue
            to_delete.append(name)
            if not kept:
                continue
            new_name = _fresh_name(store, name)
            created.append(new_name)
            offsets, sizes[new_name] = _copy_kept(store, name, new_name, kept, old, new_storage, moved)
            rewritten_bytes += sizes[new_name]
            table_name = blockcrc.table_name(new_name)
            store.delete(table_name)
            table = _carried_table(store, name, offsets)
            if table is not None:
                created.append(table_name)
                tables[table_name] = table
                store.put(table_name, table)
    except BaseException:
        for new in created:
            store.delete(new)
        raise
    if rewritten_bytes:
        logger.warning(
            "%s: rewrote %d bytes of kept tensors that shared files with keys under %r; "
            "save with separation_hint=%r to make removal free",
            location,
            rewritten_bytes,
            key_prefix,
            key_prefix,
        )
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k not in doomed}
    md.storage_data = new_storage
    mcore = getattr(md, "mcore_data", None)
    if mcore:
        md.mcore_data = {k: v for k, v in mcore.items() if k not in doomed}
    md_bytes = pickle.dumps(md)
    if manifest is not None:
        manifest.keys = {k: v for k, v in manifest.keys.items() if k not in doomed}
        for name in to_delete:
            manifest.drop(name)
            manifest.drop(blockcrc.table_name(name))
        for tname, data in tables.items():
            manifest.set_bytes(tname, data)
        for index, old_info, new_info in moved:
            prev = old.get((old_info.relative_path, old_info.offset))
            if prev is not None:
                manifest.ranges.setdefault(new_info.relative_path, []).append(
                    RangeChecksum(new_info.offset, new_info.length, prev.crc32c, index.fqn, prev.chunk)
                )
        manifest.files.update(sizes)
        manifest.set_bytes(METADATA_FNAME, md_bytes)
    index_bytes = _reindex(md, md_bytes, manifest)
    if manifest is not None:
        write_manifest(location, manifest)
    store.delete(INDEX_FNAME)
    store.put(METADATA_FNAME, md_bytes)
    if index_bytes is not None:
        store.put(INDEX_FNAME, index_bytes)
    for name in to_delete:
        # Each name passed the containment rule in _removal_plan; removal resolves it again
        # beneath the checkpoint (a symlink is removed itself, never its target).
        store.delete(name)
        store.delete(blockcrc.table_name(name))


def _copy_kept(
    store: storage.Store,
    name: str,
    new_name: str,
    kept: List[Tuple[MetadataIndex, _StorageInfo]],
    old: Dict,
    new_storage: Dict[MetadataIndex, _StorageInfo],
    moved: List[Tuple[MetadataIndex, _StorageInfo, _StorageInfo]],
) -> Tuple[List[Tuple[int, int]], int]:
    """Copy the ``kept`` items (in offset order) of data file ``name`` into the new file
    ``new_name``, a batch of ranged reads at a time, each checked against its manifest CRC32C
    (``old``) while it is in memory: damage is refused, not moved. Returns the items' (old, new)
    offsets and the new file's size."""
    offsets: List[Tuple[int, int]] = []
    position = 0
    writer = store.open_writer(new_name)
    try:
        for batch in _batches(kept):
            views = store.get_ranges(
                name, [info.offset for _, info in batch], [info.length for _, info in batch]
            )
            for (index, info), view in zip(batch, views):
                if len(view) != info.length:
                    raise CheckpointingException(
                        f"{store.where(name)}: truncated at item {index.fqn!r}; nothing was changed"
                    )
                # The carried bytes keep their manifest checksum in the new file.
                prev = old.get((name, info.offset))
                if prev is not None and crc32c(view) != prev.crc32c:
                    raise CheckpointingException(
                        f"{store.where(name)}: key {index.fqn!r} at offset {info.offset}: CRC32C mismatch "
                        f"against {MANIFEST_FNAME} (corrupted data); nothing was changed"
                    )
                new_storage[index] = _StorageInfo(new_name, position, info.length)
                moved.append((index, info, new_storage[index]))
                offsets.append((info.offset, position))
                writer.write(view)
                position += info.length
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return offsets, position


def _batches(
    kept: List[Tuple[MetadataIndex, _StorageInfo]],
) -> List[List[Tuple[MetadataIndex, _StorageInfo]]]:
    """``kept`` cut into runs of at most :data:`COPY_BATCH` bytes (an item larger is a run of its own)."""
    out: List[List[Tuple[MetadataIndex, _StorageInfo]]] = []
    size = 0
    for entry in kept:
        if not out or (size and size + entry[1].length > COPY_BATCH):
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry[1].length
    return out


def _removal_plan(location: Resolved, key_prefix: str, trusted: bool):
    """What ``remove_sharded_tensors`` works from: the metadata, the doomed keys, every file's
    (index, storage info) records, and the storage records that stay."""
    md = checked_metadata(location, trusted)
    doomed = {k for k in md.state_dict_metadata if k.startswith(key_prefix)}
    if not doomed:
        raise CheckpointingException(f"{location}: no key starts with {key_prefix!r}")
    by_file: Dict[str, List[Tuple[MetadataIndex, _StorageInfo]]] = defaultdict(list)
    source = storage.join(location, METADATA_FNAME)
    for index, info in md.storage_data.items():
        by_file[info.relative_path].append((index, info))
    # Every file the metadata names is checked before anything is rewritten or deleted: a
    # hostile name refuses the whole removal, leaving the checkpoint as it was.
    for name in by_file:
        containment.check_name(name, source, f"storage record of {by_file[name][0][0].fqn!r}: file name")
    # So is every file it will read, replace or delete: a missing, short or non-regular one
    # is refused now, not half-way through.
    for name, entries in sorted(by_file.items()):
        kept = [(i, info) for i, info in entries if i.fqn not in doomed]
        if len(kept) == len(entries):
            continue
        size = _surgery_file_size(location, name, source)
        need = max((info.offset + info.length for _, info in kept), default=0)
        if size is None and kept:
            raise CheckpointingException(
                f"{storage.join(location, name)}: data file is missing (holds kept keys "
                f"{sorted({i.fqn for i, _ in kept})[:5]}); nothing was changed"
            )
        if size is not None and size < need:
            raise CheckpointingException(
                f"{storage.join(location, name)}: truncated ({size} bytes, kept items need {need}); "
                f"nothing was changed"
            )
    new_storage = {i: info for i, info in md.storage_data.items() if i.fqn not in doomed}
    return md, doomed, by_file, new_storage


def _surgery_file_size(location: Resolved, name: str, source: Any) -> Optional[int]:
    """Size of a data file surgery reads or deletes, None when it is missing; refuses (naming it)
    what is not a regular file beneath the checkpoint, as a read would."""
    root = storage.local_root(location)
    if root is None:
        try:
            return location.size(bounds.relative_name(name, source))
        except FileNotFoundError:
            return None
    try:
        fd = containment.open_beneath(root, name, source)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _fresh_name(store: storage.Store, name: str) -> str:
    """``<stem>.r<n>.distcp``, the first such name nothing is stored under (locally: no entry at
    all, a dangling link or a folder included)."""
    stem = name[: -len(DATA_SUFFIX)] if name.endswith(DATA_SUFFIX) else name
    root = store.local_root
    n = 1
    while (
        os.path.lexists(root / f"{stem}.r{n}{DATA_SUFFIX}")
        if root is not None
        else store.exists(f"{stem}.r{n}{DATA_SUFFIX}")
    ):
        n += 1
    return f"{stem}.r{n}{DATA_SUFFIX}"


def _carried_table(store: storage.Store, name: str, offsets: List[Tuple[int, int]]) -> Optional[bytes]:
    """The block table of a file rewritten by surgery, whose items moved from the first to the
    second offset of each pair of ``offsets``: the old table's entries of those items, moved (the
    bytes of an item, so its block CRCs, do not change). None when the old file had no usable
    table, or none of the moved items had an entry."""
    table, _ = block_table(store, name)
    if table is None:
        return None
    entries = []
    for old_offset, new_offset in offsets:
        e = table.entries.get(old_offset)
        if e is not None:
            entries.append(dataclasses.replace(e, item_offset=new_offset))
    return blockcrc.encode(entries, table.block) if entries else None


def _reindex(md: Metadata, md_bytes: bytes, manifest: Optional[Any]) -> Optional[bytes]:
    """After surgery on ``.metadata``: the new sidecar index, entered into ``manifest``; None
    (the sidecar is dropped and loads read ``.metadata``) when there is no manifest to take the
    items' checksums from."""
    if manifest is None:
        return None
    manifest.drop(INDEX_FNAME)
    try:
        data = index_from_metadata(md, manifest.range_index(), len(md_bytes))
    except CheckpointingException as e:
        logger.info("not rebuilding the sidecar index: %s", e)
        return None
    manifest.set_bytes(INDEX_FNAME, data)
    return data
