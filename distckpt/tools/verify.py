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

from distckpt import storage
from distckpt.core import CONFIG_FNAME, CheckpointingException, PathLike
from distckpt.dcp_native import DCP_METADATA_FNAME, checkpoint_config, is_dcp_native
from distckpt.manifest import MANIFEST_FNAME, read_manifest, verify_files
from distckpt.tools.inspect import CheckpointSource, NoProgress, Progress


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``ok`` iff ``problems`` is empty."""

    path: str
    backend: Optional[str] = None
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    checked: List[str] = field(default_factory=list)   # what was checked, for the summary
    manifest: bool = False
    bytes_checksummed: int = 0   # bytes whose CRC32C was checked against the manifest
    bytes_read: int = 0          # tensor bytes read back (``deep``)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"path": self.path, "backend": self.backend, "ok": self.ok, "problems": self.problems,
                "notes": self.notes, "checked": self.checked, "manifest": self.manifest,
                "bytes_checksummed": self.bytes_checksummed, "bytes_read": self.bytes_read}


def verify_checkpoint(path: PathLike, *, checksums: bool = True, deep: bool = False, trusted: bool = False,
                      progress: Optional[Progress] = None) -> VerifyReport:
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
            report.notes.append(f"plain PyTorch DCP checkpoint: no {CONFIG_FNAME}, {DCP_METADATA_FNAME} is "
                                f"its commit marker; read as torch_dist (read-only)")
    except CheckpointingException as e:
        report.problems.append(str(e))
        config = None
    if config is None and not report.problems:
        report.problems.append(f"{CONFIG_FNAME}: missing: the checkpoint was never committed "
                               f"(an interrupted save) or this is not a checkpoint")
    if config is not None:
        report.backend = config.sharded_backend
        report.checked.append(f"commit marker ({DCP_METADATA_FNAME if is_dcp_native(root) else CONFIG_FNAME})")
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
        dcp_values = _check_torch_dist(root, trusted, report)
    elif backend == "zarr":
        _check_zarr(root, report)
    elif backend is not None:
        report.notes.append(f"backend {backend!r}: no structural checks available")
    if config is not None and config.common_backend == "torch":
        _check_common_files(root, config.sharded_backend, report, dcp_values)

    if manifest is not None:
        if manifest.backend != backend and backend is not None:
            report.problems.append(f"{MANIFEST_FNAME}: written for backend {manifest.backend!r}, "
                                   f"checkpoint is {backend!r}")
        total = manifest.total_bytes if not checksums else sum(
            r.length for rs in manifest.ranges.values() for r in rs)
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
        report.checked.append(f"{len(manifest.files)} files against the manifest"
                              + (" (sizes and CRC32C)" if checksums else " (sizes only)"))
        unlisted = _unlisted_data_files(root, manifest.files, backend)
        if unlisted:
            report.notes.append(f"{len(unlisted)} data file(s) not in the manifest (left over from an "
                                f"earlier save?): {', '.join(unlisted[:5])}{' ...' if len(unlisted) > 5 else ''}")
    elif config is not None:
        report.notes.append("no integrity manifest (Megatron-Core or an older distckpt wrote it): "
                            "structure and sizes checked, contents not"
                            + ("" if deep else "; --deep reads every tensor back"))

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
            problems.append(f"{name}: {MANIFEST_FNAME} has no checksum for bytes {pos}..{size} "
                            f"(a damaged manifest; those bytes were not checked)")
    for name in manifest.ranges:
        if name not in manifest.files:
            problems.append(f"{MANIFEST_FNAME}: checksums for {name!r}, a file it does not list (damaged manifest)")
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
        data = name[:-len(blockcrc.SUFFIX)]
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

    for action, backend, version in ((StrategyAction.LOAD_SHARDED, config.sharded_backend,
                                      config.sharded_backend_version),
                                     (StrategyAction.LOAD_COMMON, config.common_backend,
                                      config.common_backend_version)):
        try:
            get_default_strategy(action, backend, version)
        except CheckpointingException as e:
            report.problems.append(f"{CONFIG_FNAME}: {e}")
        except Exception as e:  # noqa: BLE001 - e.g. a version of the wrong type in the JSON
            report.problems.append(f"{CONFIG_FNAME}: backend {backend!r} version {version!r} is unusable: {e}")


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
            return (root / name).stat().st_size
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


def _check_torch_dist(root: Path, trusted: bool, report: VerifyReport) -> int:
    """Structural checks of ``.metadata`` and the data files; returns the number of DCP values
    (non-tensor values of a ``dcp.save``, the common state of such a checkpoint)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from distckpt.strategies.torch import METADATA_FNAME, check_claims, plain_byte_items, read_metadata

    try:
        md = read_metadata(root, trusted)
        # Names, offsets, lengths and shapes first: a hostile one is reported, never used.
        check_claims(md, storage.join(root, METADATA_FNAME))
    except CheckpointingException as e:
        report.problems.append(str(e))
        return 0
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
                f"{info.offset + info.length}, file has {actual} (truncated)")
        if index.fqn not in md.state_dict_metadata:
            report.problems.append(f"{METADATA_FNAME}: storage record for unknown key {index.fqn!r}")
    for name, keys in sorted(missing_files.items()):
        keys = sorted(set(keys))
        report.problems.append(f"{name}: missing (holds {len(keys)} key(s): "
                               f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''})")

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
                report.problems.append(f"{METADATA_FNAME}: key {fqn!r}: chunk at {list(c.offsets)} "
                                       f"has no storage record")
        problem = coverage_problem(tuple(meta.size), [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks])
        if problem:
            report.problems.append(f"{METADATA_FNAME}: key {fqn!r}: {problem}")
    files = len({info.relative_path for info in md.storage_data.values()})
    dcp_values = f", {len(values)} DCP values" if values else ""
    report.checked.append(f"{n_tensors} tensors{dcp_values} and {n_objects} objects in {METADATA_FNAME}: chunk "
                          f"coverage, storage records and the extents of {files} data files")
    return len(values)


def coverage_problem(shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[str]:
    """Why ``boxes`` (offset, size) do not tile ``shape`` exactly once, or None if they do."""
    total = math.prod(shape)
    volume = 0
    for off, size in boxes:
        if len(off) != len(shape) or len(size) != len(shape):
            return f"chunk at {list(off)} has {len(off)} axes, the tensor {len(shape)}"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(off, size, shape)):
            return f"chunk at {list(off)} of size {list(size)} lies outside the global shape {list(shape)}"
        volume += math.prod(size)
    nonempty = sorted((tuple(o), tuple(s)) for o, s in boxes if math.prod(s) > 0)
    if shape:
        # sweep along axis 0: only boxes whose axis-0 ranges intersect can overlap
        active: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        for off, size in nonempty:
            active = [b for b in active if b[0][0] + b[1][0] > off[0]]
            for o2, s2 in active:
                if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(off, size, o2, s2)):
                    return f"chunks at {list(o2)} and {list(off)} overlap"
            active.append((off, size))
    elif len(nonempty) > 1:
        return f"{len(nonempty)} chunks of a scalar"
    if volume < total:
        return f"chunks cover {volume} of {total} elements (missing data)"
    return None


# --------------------------------------------------------------------------- zarr


def _check_zarr(root: Path, report: VerifyReport) -> None:
    from distckpt.strategies import zarr as zarr_strategy

    try:
        keys = zarr_strategy.list_array_keys(root)
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
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
        grid = [range(-(-s // c)) if c else range(0) for s, c in zip(meta.shape, meta.chunks)]
        missing, wrong = [], []
        for index in _product(grid):
            chunk_files += 1
            rel = meta.chunk_relpath(index)
            if isinstance(root, Path):
                try:
                    actual = meta.chunk_path(index).stat().st_size
                except (FileNotFoundError, NotADirectoryError):
                    actual = None
            else:
                actual = _file_size(root, rel)
            if actual is None:
                missing.append(rel)
                continue
            if meta.raw and actual != meta.chunk_nbytes:
                wrong.append(f"{rel} ({actual} bytes, expected {meta.chunk_nbytes})")
        if missing:
            report.problems.append(f"{key}: {len(missing)} chunk file(s) missing: "
                                   f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if wrong:
            report.problems.append(f"{key}: {len(wrong)} chunk file(s) of the wrong size (truncated?): "
                                   f"{', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}")
    report.checked.append(f"{len(keys)} arrays: metadata and {chunk_files} chunk files (presence, size)")


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
        objects = sorted(n for n in _listing(root) if n.rsplit("/", 1)[-1].startswith("shard_") and n.endswith(".pt"))
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
    report.checked.append(f"read back {len(metas)} tensors ({bad} failed), {len(src.objects())} objects "
                          f"and the common state")
