"""``distckpt verify``'s structural checks of a ``torch_dist`` checkpoint.

``.metadata`` is read and its claims checked first (names, offsets, lengths, shapes), then: every
chunk of every key has a storage record, the chunks tile each key's global shape exactly once,
every record's file exists and holds its bytes, no two records claim the same bytes, and, where
there is one, the sidecar index agrees with ``.metadata`` and the manifest with both.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from distckpt import storage
from distckpt.core import CheckpointingException
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_format import dtype_name as sidecar_dtype_name
from distckpt.formats.index_read import IndexReader
from distckpt.formats.manifest import MANIFEST_FNAME
from distckpt.strategies.tiling import coverage_problem
from distckpt.strategies.torch_dist.claims import (
    check_declared,
    cross_check,
    extent_problem,
    orig_shapes,
    record_name,
)
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, plain_byte_items, read_metadata
from distckpt.strategies.torch_dist.stored import (
    StoredKey,
    directory_tensors,
    index_from_sidecar,
    index_metadata,
)
from distckpt.tools.verify_report import CheckpointRoot, VerifyReport, file_size


def check_torch_dist(root: CheckpointRoot, trusted: bool, report: VerifyReport, manifest=None) -> None:
    """Structural checks of ``.metadata`` and the data files, and (with a ``manifest``) its
    claims against what the manifest says was written."""
    source = storage.join(root, METADATA_FNAME)
    try:
        md = read_metadata(root, trusted)
        # What a load checks before it reads (the schema, the claims, every chunk's record and
        # every record's key): the same function, so what a load refuses is a problem here.
        index_metadata(md, source)
    except CheckpointingException as e:
        report.problems.append(str(e))
        md = None
    try:
        # Opened once for both sidecar checks (None: none, or stale, built for another
        # .metadata: loads read .metadata then).
        reader = IndexReader.open(root)
    except CheckpointingException as e:
        report.problems.append(str(e))
        reader = None
    if reader is not None:
        _sidecar_as_loads_read_it(reader, manifest, report)
    if md is None:
        return
    if manifest is not None:
        report.problems.extend(cross_check(md, manifest, METADATA_FNAME, MANIFEST_FNAME))
        report.checked.append(
            f"storage records and key declarations of {METADATA_FNAME} against {MANIFEST_FNAME}"
        )
    if reader is not None:
        _check_sidecar(reader, md, report)
    sizes: Dict[str, Optional[int]] = {}
    refused: set = set()  # data files the containment rule refused (a symlink out), reported once

    def size_of(name: str) -> Optional[int]:
        if name not in sizes:
            try:
                sizes[name] = file_size(root, name)
            except CheckpointingException as e:
                report.problems.append(str(e))
                refused.add(name)
                sizes[name] = None
        return sizes[name]

    recorded = set()
    missing_files: Dict[str, List[str]] = {}
    for index, info in md.storage_data.items():
        recorded.add(index.fqn)
        actual = size_of(info.relative_path)
        if actual is None:
            if info.relative_path not in refused:
                missing_files.setdefault(info.relative_path, []).append(index.fqn)
            continue
        problem = extent_problem(
            METADATA_FNAME,
            record_name(index.fqn, index.offset),
            info.relative_path,
            info.offset,
            info.length,
            actual,
            None if manifest is None else manifest.files.get(info.relative_path),
            MANIFEST_FNAME,
        )
        if problem is not None:
            report.problems.append(problem)
    for name, keys in sorted(missing_files.items()):
        keys = sorted(set(keys))
        report.problems.append(
            f"{name}: missing (holds {len(keys)} key(s): "
            f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''})"
        )
    report.problems.extend(_shared_bytes(md, METADATA_FNAME))

    values = plain_byte_items(md)  # non-tensor values of a dcp.save: common state
    n_tensors = n_objects = 0
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            n_objects += fqn not in values
            if fqn not in recorded:
                what = "value" if fqn in values else "object"
                report.problems.append(f"{METADATA_FNAME}: {what} {fqn!r} has no storage record")
            continue
        n_tensors += 1
        problem = coverage_problem(
            tuple(meta.size), [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        )
        if problem:
            report.problems.append(f"{METADATA_FNAME}: key {fqn!r}: {problem}")
    files = len({info.relative_path for info in md.storage_data.values()})
    dcp_values = f", {len(values)} DCP values" if values else ""
    report.checked.append(
        f"{n_tensors} tensors{dcp_values} and {n_objects} objects in {METADATA_FNAME}: chunk "
        f"coverage, storage records and the extents of {files} data files"
    )


def _shared_bytes(md, source: str) -> List[str]:
    """Storage records that claim bytes of a data file another record claims, one line per file.
    A writer gives every record its own range, so this is damaged metadata: the same bytes would
    load as several chunks (20,000 rows from one stored row), which nothing else catches where
    there is no manifest. Sorting by offset keeps it n log n."""
    spans: Dict[str, List[Tuple[int, int, object]]] = {}
    for index, info in md.storage_data.items():
        if info.length:
            spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index))
    problems = []
    for name, items in sorted(spans.items()):
        items.sort(key=lambda s: (s[0], s[1]))
        shared, first, end, last = 0, None, -1, None
        for start, stop, index in items:
            if start < end:
                shared += 1
                first = first or (last, index, start)
            if stop > end:
                end, last = stop, index
        if shared:
            a, b, at = first
            problems.append(
                f"{source}: {shared} storage record(s) claim bytes of {name} that another record "
                f"claims (first: {record_name(b.fqn, b.offset)} and {record_name(a.fqn, a.offset)}, "
                f"at offset {at}): damaged metadata"
            )
    return problems


def _check_sidecar(reader: IndexReader, md, report: VerifyReport) -> None:
    """The checkpoint's current sidecar index (loads read it instead of ``.metadata``): its
    directory parses and every entry is well-formed, it declares the keys ``.metadata`` declares
    with the same dtype, shape and original shape, and its records are ``.metadata``'s storage
    records (file, offset, length, chunk box). Its CRC32Cs are the manifest's business (checked
    with the files)."""
    try:
        reader.check_all()
        problems: List[str] = []
        orig_shape = orig_shapes(md)
        records: Dict[str, set] = {}
        for index, info in md.storage_data.items():
            records.setdefault(index.fqn, set()).add(
                (
                    tuple(index.offset) if index.offset is not None else (),
                    info.relative_path,
                    info.offset,
                    info.length,
                )
            )
        boxes = {}
        for fqn, meta in md.state_dict_metadata.items():
            e = reader.entry(fqn)
            if e is None:
                problems.append(f"{INDEX_FNAME}: declares no key {fqn!r} ({METADATA_FNAME} does)")
                continue
            if isinstance(meta, BytesStorageMetadata):
                item = e.get("item")
                got = {((), *item[:3])} if e.get("bytes") and item else set()
                if got != records.get(fqn, set()):
                    problems.append(
                        f"{INDEX_FNAME}: object {fqn!r}: its item {item!r} is not the storage record "
                        f"of {METADATA_FNAME}"
                    )
                continue
            orig = orig_shape.get(fqn)  # (a tensor: check_claims refused any other class)
            want = (
                sidecar_dtype_name(meta.properties.dtype),
                list(meta.size),
                list(orig) if orig is not None else None,
            )
            got = (e.get("dtype"), e.get("size"), e.get("orig_shape"))
            if e.get("bytes") or got != want:
                problems.append(
                    f"{INDEX_FNAME}: key {fqn!r} is declared as {got}, {METADATA_FNAME} says {want}"
                )
                continue
            boxes[fqn] = [((0,) * len(meta.size), tuple(meta.size))]
        stray = sorted(set(reader.keys) - set(md.state_dict_metadata))
        if stray:
            problems.append(f"{INDEX_FNAME}: declares keys {METADATA_FNAME} does not: {stray[:5]}")
        chunk_sizes = {
            (fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn in boxes
            for c in md.state_dict_metadata[fqn].chunks
        }
        for fqn, rows in reader.query(boxes).items():
            got = {(tuple(off), path, foff, length) for off, size, path, foff, length, _crc in rows}
            bad_size = [
                list(off) for off, size, *_ in rows if chunk_sizes.get((fqn, tuple(off))) != tuple(size)
            ]
            if got != records.get(fqn, set()) or bad_size:
                problems.append(
                    f"{INDEX_FNAME}: key {fqn!r}: its {len(rows)} chunk records are not the "
                    f"{len(records.get(fqn, ()))} storage records of {METADATA_FNAME}"
                )
    except CheckpointingException as e:
        if str(e) not in report.problems:  # (an entry or node the loads' read refused already)
            report.problems.append(str(e))
        return
    report.problems.extend(problems)
    report.checked.append(
        f"{INDEX_FNAME} against {METADATA_FNAME}: {len(reader.keys)} keys and their records"
    )


def _sidecar_as_loads_read_it(reader: IndexReader, manifest, report: VerifyReport) -> None:
    """The checkpoint's current sidecar as a load served by it reads it (such a load never reads
    ``.metadata``): every key's records through the load's own function
    (:func:`index_from_sidecar`: entries, file names, offsets, lengths, chunk sizes), the chunks
    covering each key exactly once, and its declarations against the writer's in the manifest.
    Run whether or not ``.metadata`` passed its checks; :func:`_check_sidecar` compares the two."""
    try:
        # The directory as load_tensors_metadata and the tools read it (names, dtypes, shapes),
        # requested whole.
        stored = index_from_sidecar(reader, directory_tensors(reader), None)
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
    for fqn, key in stored.items():
        if not isinstance(key, StoredKey):
            continue
        problem = coverage_problem(key.size, [(c.offset, c.size) for c in key.chunks])
        if problem:
            report.problems.append(f"{INDEX_FNAME}: key {fqn!r}: {problem}")
        if manifest is not None and fqn in manifest.keys:
            try:
                check_declared(
                    fqn, key.dtype, key.size, key.orig_shape, manifest.keys, INDEX_FNAME, MANIFEST_FNAME
                )
            except CheckpointingException as e:
                report.problems.append(str(e))
