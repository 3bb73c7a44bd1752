"""Check that a checkpoint is complete and intact, without loading it into a model.

Checks, in order (each problem is one line naming the file and, where known, the key):

1. commit marker: ``metadata.json`` exists and is a valid config (else the save was
   interrupted, or this is not a checkpoint);
2. structure, from the checkpoint's own index:
   - ``torch_dist``: ``.metadata`` is readable; every chunk of every key has a storage record;
     the chunks of each key lie inside its global shape and cover it exactly once; every
     storage record's file exists and ``offset + length`` fits in it;
   - ``zarr``: every listed key has array metadata; every chunk of its grid has a file, of the
     exact size where chunks are stored raw;
   - ``common.pt`` and every ShardedObject file are present;
3. integrity, from the manifest (``.distckpt_manifest.json``) where there is one: every file
   it lists has its recorded size and (unless ``checksums=False``) every byte range its CRC32C,
   and every block CRC table (``torch_dist``) agrees with the items it describes;
4. with ``deep=True``: every tensor, object and the common state are read back through the
   library (the only content check for checkpoints without a manifest, e.g. Megatron's).

Nothing is modified. :func:`verify_checkpoint` returns a :class:`VerifyReport`; the
``distckpt verify`` command exits 1 when it lists problems.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from distckpt import containment, storage
from distckpt.core import CONFIG_FNAME, CheckpointingException, PathLike
from distckpt.dcp_native import DCP_METADATA_FNAME, checkpoint_config, is_dcp_native
from distckpt.manifest import MANIFEST_FNAME, read_manifest, verify_files
from distckpt.strategies.tiling import coverage_problem
from distckpt.tools.inspect import CheckpointSource, NoProgress, Progress


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``ok`` iff ``problems`` is empty."""

    path: str
    backend: Optional[str] = None
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    checked: List[str] = field(default_factory=list)  # what was checked, for the summary
    manifest: bool = False
    bytes_checksummed: int = 0  # bytes whose CRC32C was checked against the manifest
    bytes_read: int = 0  # tensor bytes read back (``deep``)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "backend": self.backend,
            "ok": self.ok,
            "problems": self.problems,
            "notes": self.notes,
            "checked": self.checked,
            "manifest": self.manifest,
            "bytes_checksummed": self.bytes_checksummed,
            "bytes_read": self.bytes_read,
        }


def verify_checkpoint(
    path: PathLike,
    *,
    checksums: bool = True,
    deep: bool = False,
    trusted: bool = False,
    progress: Optional[Progress] = None,
) -> VerifyReport:
    """Verify checkpoint ``path`` (see the module docstring for what is checked).

    ``progress`` gets one phase per byte-heavy step (checksums, deep read) with its byte total.

    Raises:
        CheckpointingException: ``path`` does not exist or is not a directory (nothing to verify).
    """
    root = storage.resolve(path)
    progress = progress or NoProgress()
    if isinstance(root, Path):
        if not root.exists():
            raise CheckpointingException(f"{root}: no such file or directory")
        if not root.is_dir():
            raise CheckpointingException(f"{root}: not a checkpoint directory")
    report = VerifyReport(str(root))

    try:
        config = checkpoint_config(root)
        if config is not None and is_dcp_native(root):
            report.notes.append(
                f"plain PyTorch DCP checkpoint: no {CONFIG_FNAME}, {DCP_METADATA_FNAME} is "
                f"its commit marker; read as torch_dist (read-only)"
            )
    except CheckpointingException as e:
        report.problems.append(str(e))
        config = None
    if config is None and not report.problems:
        report.problems.append(
            f"{CONFIG_FNAME}: missing: the checkpoint was never committed "
            f"(an interrupted save) or this is not a checkpoint"
        )
    if config is not None:
        report.backend = config.sharded_backend
        report.checked.append(
            f"commit marker ({DCP_METADATA_FNAME if is_dcp_native(root) else CONFIG_FNAME})"
        )
        _check_backends_known(config, report)

    try:
        manifest = read_manifest(root)
    except CheckpointingException as e:
        report.problems.append(str(e))
        manifest = None
    report.manifest = manifest is not None

    backend = config.sharded_backend if config else (manifest.backend if manifest else _guess_backend(root))
    report.backend = backend
    dcp_values = 0
    if backend == "torch_dist":
        dcp_values = _check_torch_dist(root, trusted, report, manifest)
    elif backend == "zarr":
        _check_zarr(root, report, manifest)
    elif backend is not None:
        report.notes.append(f"backend {backend!r}: no structural checks available")
    if config is not None and config.common_backend == "torch":
        _check_common_files(root, config.sharded_backend, report, dcp_values)

    if manifest is not None:
        if manifest.backend != backend and backend is not None:
            report.problems.append(
                f"{MANIFEST_FNAME}: written for backend {manifest.backend!r}, checkpoint is {backend!r}"
            )
        total = (
            manifest.total_bytes
            if not checksums
            else sum(r.length for rs in manifest.ranges.values() for r in rs)
        )
        progress.start(total, "checksums" if checksums else "sizes")
        counted = [0]

        def advance(n: int) -> None:
            counted[0] += n
            progress.advance(n)

        report.problems.extend(verify_files(root, manifest, checksums=checksums, progress=advance))
        if checksums:
            report.problems.extend(manifest_coverage_problems(manifest))
            _check_block_tables(root, manifest, report)
        report.bytes_checksummed += counted[0] if checksums else 0
        report.checked.append(
            f"{len(manifest.files)} files against the manifest"
            + (" (sizes and CRC32C)" if checksums else " (sizes only)")
        )
        unlisted = _unlisted_data_files(root, manifest.files, backend)
        if unlisted:
            report.notes.append(
                f"{len(unlisted)} data file(s) not in the manifest (left over from an "
                f"earlier save?): {', '.join(unlisted[:5])}{' ...' if len(unlisted) > 5 else ''}"
            )
    elif config is not None:
        report.notes.append(
            "no integrity manifest (Megatron-Core or an older distckpt wrote it): "
            "structure and sizes checked, contents not" + ("" if deep else "; --deep reads every tensor back")
        )

    if deep and config is not None and not report.problems:
        _deep_read(root, trusted, progress, report)
    return report


def manifest_coverage_problems(manifest) -> List[str]:
    """Byte ranges a manifest lists but does not checksum: distckpt writes every file as
    consecutive checksummed ranges from offset 0 to its end, so a gap (or a file with no ranges,
    or ranges for a file it does not list) means a damaged manifest and unchecked bytes."""
    problems = []
    for name, size in manifest.files.items():
        pos = 0
        for r in sorted(manifest.ranges.get(name, []), key=lambda r: r.offset):
            if r.offset > pos:
                break
            pos = max(pos, r.offset + r.length)
        if pos < size:
            problems.append(
                f"{name}: {MANIFEST_FNAME} has no checksum for bytes {pos}..{size} "
                f"(a damaged manifest; those bytes were not checked)"
            )
    for name in manifest.ranges:
        if name not in manifest.files:
            problems.append(
                f"{MANIFEST_FNAME}: checksums for {name!r}, a file it does not list (damaged manifest)"
            )
    return problems


def _check_block_tables(root, manifest, report: VerifyReport) -> None:
    """Every block CRC table the manifest lists (``<data file>.crc``, torch_dist) against the
    items it describes: each entry must name an item the manifest checksums, with the same length
    and CRC32C, and its block CRCs must add up to that CRC32C. A load trusts a table that passes
    these checks for ranged reads of single blocks, so a table that fails them (written wrong, or
    carried over wrongly by a tool) is a problem even when its own bytes match the manifest."""
    from distckpt.strategies import blockcrc

    names = sorted(n for n in manifest.files if n.endswith(".distcp" + blockcrc.SUFFIX))
    if not names:
        return
    ranges = manifest.range_index()
    items = 0
    for name in names:
        data = name[: -len(blockcrc.SUFFIX)]
        try:
            table = blockcrc.decode(storage.read_bytes(root, name), storage.join(root, name))
        except FileNotFoundError:
            continue  # already reported missing by the manifest check
        except CheckpointingException as e:
            report.problems.append(str(e))
            continue
        for offset, e in sorted(table.entries.items()):
            items += 1
            what = f"{name}: block table entry of the item at offset {offset} of {data}"
            expected = ranges.get((data, offset))
            if expected is None:
                report.problems.append(f"{what}: {MANIFEST_FNAME} checksums no item there")
                continue
            problem = e.problem(table.block, expected.length, expected.crc32c)
            if problem is not None:
                key = f" (key {expected.key!r})" if expected.key else ""
                report.problems.append(f"{what}{key}: {problem}")
    report.checked.append(f"{len(names)} block CRC tables ({items} items) against the manifest")


def _check_backends_known(config, report: VerifyReport) -> None:
    from distckpt.strategies.base import StrategyAction, get_default_strategy

    for action, backend, version in (
        (StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version),
        (StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version),
    ):
        try:
            get_default_strategy(action, backend, version)
        except CheckpointingException as e:
            report.problems.append(f"{CONFIG_FNAME}: {e}")
        except Exception as e:  # noqa: BLE001 - e.g. a version of the wrong type in the JSON
            report.problems.append(
                f"{CONFIG_FNAME}: backend {backend!r} version {version!r} is unusable: {e}"
            )


def _listing(root) -> Dict[str, int]:
    """Object store: every object of the checkpoint with its size (one LIST per store object)."""
    listing = _LISTINGS.get(root)
    if listing is None:
        listing = _LISTINGS[root] = root.list()
    return listing


_LISTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _file_size(root, name: str) -> Optional[int]:
    if isinstance(root, Path):
        try:
            # The containment rule: a symlink out of the checkpoint is an error, not a size.
            return containment.size_beneath(root, name, root)
        except FileNotFoundError:
            return None
    return _listing(root).get(name)


def _guess_backend(root) -> Optional[str]:
    if not isinstance(root, Path):
        names = _listing(root)
        if ".metadata" in names or any(n.endswith(".distcp") for n in names):
            return "torch_dist"
        if "zarr.json" in names or any(n.endswith(("/.zarray", "/zarr.json")) for n in names):
            return "zarr"
        return None
    if (root / ".metadata").exists() or any(root.glob("*.distcp")):
        return "torch_dist"
    if (root / "zarr.json").exists() or any(root.glob("*/.zarray")) or any(root.glob("*/zarr.json")):
        return "zarr"
    return None


# --------------------------------------------------------------------------- torch_dist


def _check_torch_dist(root: Path, trusted: bool, report: VerifyReport, manifest=None) -> int:
    """Structural checks of ``.metadata`` and the data files, and (with a ``manifest``) its
    claims against what the manifest says was written; returns the number of DCP values
    (non-tensor values of a ``dcp.save``, the common state of such a checkpoint)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from distckpt.strategies.torch import (
        METADATA_FNAME,
        check_claims,
        cross_check,
        plain_byte_items,
        read_metadata,
    )

    try:
        md = read_metadata(root, trusted)
        # Names, offsets, lengths and shapes first: a hostile one is reported, never used.
        check_claims(md, storage.join(root, METADATA_FNAME))
    except CheckpointingException as e:
        report.problems.append(str(e))
        return 0
    if manifest is not None:
        report.problems.extend(cross_check(md, manifest, METADATA_FNAME, MANIFEST_FNAME))
        report.checked.append(
            f"storage records and key declarations of {METADATA_FNAME} against {MANIFEST_FNAME}"
        )
    _check_sidecar(root, md, report)
    sizes: Dict[str, Optional[int]] = {}

    def size_of(name: str) -> Optional[int]:
        if name not in sizes:
            sizes[name] = _file_size(root, name)
        return sizes[name]

    records: Dict[str, Dict[Tuple[int, ...], object]] = {}
    missing_files: Dict[str, List[str]] = {}
    for index, info in md.storage_data.items():
        offset = tuple(index.offset) if index.offset is not None else ()
        records.setdefault(index.fqn, {})[offset] = info
        actual = size_of(info.relative_path)
        if actual is None:
            missing_files.setdefault(info.relative_path, []).append(index.fqn)
        elif info.offset + info.length > actual:
            report.problems.append(
                f"{info.relative_path}: key {index.fqn!r} at offset {info.offset}: needs bytes up to "
                f"{info.offset + info.length}, file has {actual} (truncated)"
            )
        if index.fqn not in md.state_dict_metadata:
            report.problems.append(f"{METADATA_FNAME}: storage record for unknown key {index.fqn!r}")
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
            if fqn not in records:
                what = "value" if fqn in values else "object"
                report.problems.append(f"{METADATA_FNAME}: {what} {fqn!r} has no storage record")
            continue
        if not isinstance(meta, TensorStorageMetadata):
            continue
        n_tensors += 1
        stored = records.get(fqn, {})
        for c in meta.chunks:
            if tuple(c.offsets) not in stored:
                report.problems.append(
                    f"{METADATA_FNAME}: key {fqn!r}: chunk at {list(c.offsets)} has no storage record"
                )
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
    return len(values)


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
                f"claims (first: {_record(b)} and {_record(a)}, at offset {at}): damaged metadata"
            )
    return problems


def _record(index) -> str:
    return f"key {index.fqn!r}" + (f" chunk at {list(index.offset)}" if index.offset is not None else "")


def _check_sidecar(root, md, report: VerifyReport) -> None:
    """The sidecar index, when the checkpoint has a current one (loads read it instead of
    ``.metadata``): its directory parses and every entry is well-formed, it declares the keys
    ``.metadata`` declares with the same dtype, shape and original shape, and its records are
    ``.metadata``'s storage records (file, offset, length, chunk box). Its CRC32Cs are the
    manifest's business (checked with the files)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from distckpt.strategies.index import INDEX_FNAME, IndexReader, _dtype_name
    from distckpt.strategies.torch import METADATA_FNAME

    try:
        reader = IndexReader.open(root)
        if reader is None:
            return  # none, or stale (built for another .metadata): loads read .metadata then
        reader.check_all()
        problems: List[str] = []
        mcore = getattr(md, "mcore_data", None) or {}
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
            if not isinstance(meta, TensorStorageMetadata):
                continue
            orig = (
                mcore.get(fqn, {}).get("nd_reformulated_orig_global_shape")
                if isinstance(mcore.get(fqn), dict)
                else None
            )
            want = (
                _dtype_name(meta.properties.dtype),
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
        report.problems.append(str(e))
        return
    report.problems.extend(problems)
    report.checked.append(
        f"{INDEX_FNAME} against {METADATA_FNAME}: {len(reader.keys)} keys and their records"
    )


# --------------------------------------------------------------------------- zarr


def _check_zarr(root: Path, report: VerifyReport, manifest=None) -> None:
    from distckpt.strategies import zarr as zarr_strategy

    try:
        keys = zarr_strategy.list_array_keys(root)
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
    # The listing is a claim: checked against the folders first, so a listing of 100,000 keys
    # over a checkpoint of 3 arrays is one problem naming it, found in a blink, not 100,000
    # reads of metadata that is not there.
    missing = _keys_without_array_meta(root, keys)
    if missing:
        report.problems.append(
            f"{storage.join(root, 'zarr.json')}: lists {len(missing)} of its {len(keys)} array keys with no array "
            f"metadata (missing): {', '.join(map(repr, missing[:3]))}{' ...' if len(missing) > 3 else ''}"
        )
        absent = set(missing)
        keys = [key for key in keys if key not in absent]
    chunk_files = 0
    for key in keys:
        try:
            meta = zarr_strategy.read_array_meta(root, key)
        except CheckpointingException as e:
            report.problems.append(str(e))
            continue
        if meta is None:
            report.problems.append(f"{key}/: listed in the root group but has no array metadata (missing)")
            continue
        if manifest is not None:
            problem = zarr_strategy.manifest_disagreement(meta, manifest)
            if problem:
                report.problems.append(problem)
        grid = [range(-(-s // c)) if c else range(0) for s, c in zip(meta.shape, meta.chunks)]
        cells = math.prod(len(r) for r in grid)
        present = _chunk_files_at_most(root, meta, cells) if cells > _GRID_WALK else cells
        if present < cells:
            # Each chunk of the grid needs a file: count the files rather than loop over a grid
            # that a hostile zarr.json can make 2^40 chunks large.
            report.problems.append(
                f"{key}: its grid of {cells} chunks has only {present} chunk files "
                f"({cells - present} missing)"
            )
            continue
        missing, wrong = [], []
        for index in _product(grid):
            chunk_files += 1
            rel = meta.chunk_relpath(index)
            if isinstance(root, Path):
                try:
                    actual = containment.size_beneath(
                        meta.path, meta.chunk_name(index), meta.path / "zarr.json", "chunk file"
                    )
                except (FileNotFoundError, NotADirectoryError):
                    actual = None
                except CheckpointingException as e:  # a chunk file that is a symlink out
                    report.problems.append(str(e))
                    continue
            else:
                actual = _file_size(root, rel)
            if actual is None:
                missing.append(rel)
                continue
            if meta.raw and actual != meta.chunk_nbytes:
                wrong.append(f"{rel} ({actual} bytes, expected {meta.chunk_nbytes})")
        if missing:
            report.problems.append(
                f"{key}: {len(missing)} chunk file(s) missing: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )
        if wrong:
            report.problems.append(
                f"{key}: {len(wrong)} chunk file(s) of the wrong size (truncated?): "
                f"{', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}"
            )
    report.checked.append(f"{len(keys)} arrays: metadata and {chunk_files} chunk files (presence, size)")


def _keys_without_array_meta(root, keys: Sequence[str]) -> List[str]:
    """The listed ``keys`` (names the listing check already accepted) whose folder holds neither
    ``zarr.json`` nor ``.zarray``: set look-ups in the listings of the real folders on their
    paths, each folder listed once, so the work is bounded by what the checkpoint holds, not by
    what the listing claims (on a store: look-ups in its one listing). Only a presence test:
    reading the file goes through the containment rule."""
    names = ("zarr.json", ".zarray")
    if not isinstance(root, Path):
        return [k for k in keys if not any(f"{k}/{n}" in _listing(root) for n in names)]
    folders: Dict[str, Optional[set]] = {}

    def entries(folder: str) -> Optional[set]:
        if folder not in folders:
            try:
                listing = containment.list_beneath(root, folder, root / "zarr.json")
            except (OSError, CheckpointingException):
                listing = None  # not a folder, or one a symlink leads out to
            folders[folder] = None if listing is None else set(listing)
        return folders[folder]

    def present(key: str) -> bool:
        folder = ""
        for part in key.split("/"):  # stops at the first segment that is not there
            inside = entries(folder)
            if inside is None or part not in inside:
                return False
            folder = f"{folder}/{part}" if folder else part
        inside = entries(folder)
        return inside is not None and any(n in inside for n in names)

    return [key for key in keys if not present(key)]


# Grids up to this many chunks are checked chunk by chunk at once; larger ones only after their
# chunk files were counted (each chunk is a file, so the files bound the loop).
_GRID_WALK = 1 << 16


def _chunk_files_at_most(root, meta, limit: int) -> int:
    """The files of array ``meta`` besides its metadata, counted up to ``limit``."""
    count = 0
    if isinstance(root, Path):
        for filenames in containment.walk_beneath(root, meta.key, root / "zarr.json", "array key"):
            count += sum(1 for n in filenames if n not in (".zarray", ".zattrs", "zarr.json"))
            if count >= limit:
                return limit
        return count
    prefix = f"{meta.key}/"
    return min(
        limit,
        sum(
            1
            for n in _listing(root)
            if n.startswith(prefix) and n.rsplit("/", 1)[-1] not in (".zarray", ".zattrs", "zarr.json")
        ),
    )


def _product(ranges):
    import itertools

    return itertools.product(*ranges)


# --------------------------------------------------------------------------- common state, objects


def _check_common_files(root: Path, backend: str, report: VerifyReport, dcp_values: int = 0) -> None:
    from distckpt.strategies.common import COMMON_STATE_FNAME

    # A dcp.save keeps its common state as byte items (DCP values) and writes no common.pt.
    if _file_size(root, COMMON_STATE_FNAME) is None and not dcp_values and not is_dcp_native(root):
        report.problems.append(f"{COMMON_STATE_FNAME}: missing (the common state)")
    if backend == "torch_dist":
        return  # objects are byte items of the .distcp files, checked with the records
    if isinstance(root, Path):
        objects = sorted(p.relative_to(root).as_posix() for p in root.rglob("shard_*.pt"))
    else:
        objects = sorted(
            n for n in _listing(root) if n.rsplit("/", 1)[-1].startswith("shard_") and n.endswith(".pt")
        )
    empty = [o for o in objects if _file_size(root, o) == 0]
    if empty:
        report.problems.append(f"{len(empty)} object file(s) are empty: {', '.join(empty[:3])}")
    report.checked.append(f"{COMMON_STATE_FNAME} and {len(objects)} object files present")


def _unlisted_data_files(root: Path, listed: Dict[str, int], backend: Optional[str]) -> List[str]:
    if backend != "torch_dist":
        return []
    if not isinstance(root, Path):
        return sorted(n for n in _listing(root) if n.endswith(".distcp") and "/" not in n and n not in listed)
    return sorted(p.name for p in root.glob("*.distcp") if p.name not in listed)


# --------------------------------------------------------------------------- deep read


def _deep_read(root: Path, trusted: bool, progress: Progress, report: VerifyReport) -> None:
    try:
        src = CheckpointSource(root, trusted)
        metas = src.tensors()
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
    progress.start(sum(m.nbytes for m in metas.values()), "reading tensors")
    bad = 0
    for group in src.group_keys():
        try:
            for _, tensor in src.iter_tensors(group, progress=progress):
                del tensor
            continue
        except CheckpointingException:
            pass
        for key in group:  # find the culprit(s) of a failed group
            try:
                src.read(key)
            except CheckpointingException as e:
                bad += 1
                report.problems.append(f"key {key!r}: {e}")
    report.bytes_read += sum(m.nbytes for m in metas.values())
    for uk in src.objects():
        try:
            src.read_object(uk)
        except CheckpointingException as e:
            report.problems.append(f"object {uk!r}: {e}")
    try:
        src.common()
    except CheckpointingException as e:
        report.problems.append(f"common state: {e}")
    report.checked.append(
        f"read back {len(metas)} tensors ({bad} failed), {len(src.objects())} objects and the common state"
    )
