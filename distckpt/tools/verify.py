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

from typing import Dict, List, Optional

from distckpt import storage
from distckpt.core import CONFIG_FNAME, CheckpointingException
from distckpt.dcp_native import DCP_METADATA_FNAME, checkpoint_config, is_dcp_native
from distckpt.formats import blockcrc
from distckpt.formats.manifest import MANIFEST_FNAME, read_manifest, verify_files
from distckpt.mapping import ShardedObject
from distckpt.queries import load_strategies, read_common_state
from distckpt.strategies.base import StrategyAction, get_default_strategy
from distckpt.strategies.tiling import coverage_problem
from distckpt.tools.sources.base import NoProgress, Progress
from distckpt.tools.sources.checkpoint import CheckpointSource
from distckpt.tools.verify_report import CheckpointRoot, VerifyReport, listing
from distckpt.tools.verify_torch_dist import check_torch_dist
from distckpt.tools.verify_zarr import check_zarr

# VerifyReport lived here before the checks were split by backend; coverage_problem is the tiling
# check (distckpt.strategies.tiling) that the tests import from here too.
__all__ = ["VerifyReport", "coverage_problem", "manifest_coverage_problems", "verify_checkpoint"]


def verify_checkpoint(
    path: storage.Location,
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
    if storage.local_root(root) is not None:
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
    if backend == "torch_dist":
        check_torch_dist(root, trusted, report, manifest)
    elif backend == "zarr":
        check_zarr(root, report, manifest)
    elif backend is not None:
        report.notes.append(f"backend {backend!r}: no structural checks available")
    if config is not None and not report.problems:
        # (After a structural problem a load fails on it first: its reads would repeat it.)
        _check_loaded_state(root, trusted, report)

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


def _check_block_tables(root: CheckpointRoot, manifest, report: VerifyReport) -> None:
    """Every block CRC table the manifest lists (``<data file>.crc``, torch_dist) against the
    items it describes: each entry must name an item the manifest checksums, with the same length
    and CRC32C, and its block CRCs must add up to that CRC32C. A load trusts a table that passes
    these checks for ranged reads of single blocks, so a table that fails them (written wrong, or
    carried over wrongly by a tool) is a problem even when its own bytes match the manifest."""
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


def _guess_backend(root: CheckpointRoot) -> Optional[str]:
    local = storage.local_root(root)
    if local is None:
        names = listing(root)
        if ".metadata" in names or any(n.endswith(".distcp") for n in names):
            return "torch_dist"
        if "zarr.json" in names or any(n.endswith(("/.zarray", "/zarr.json")) for n in names):
            return "zarr"
        return None
    if (local / ".metadata").exists() or any(local.glob("*.distcp")):
        return "torch_dist"
    if (local / "zarr.json").exists() or any(local.glob("*/.zarray")) or any(local.glob("*/zarr.json")):
        return "zarr"
    return None


# --------------------------------------------------------------------------- common state, objects


def _check_loaded_state(root: CheckpointRoot, trusted: bool, report: VerifyReport) -> None:
    """The common state (``common.pt`` and a ``dcp.save``'s values) and every ShardedObject, read
    and unpickled as a load reads them, by the load's own code (:func:`read_common_state`, the
    strategies' object loads): what a load refuses there (a common state that is a list, an
    object that needs a class outside the allowlist) is a problem here. Their checksums are
    :func:`verify_files`'s (not compared twice)."""
    try:
        sharded, common = load_strategies(root, None, None)
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
    for strategy in (sharded, common):
        if trusted and hasattr(strategy, "trusted"):
            strategy.trusted = True
        if hasattr(strategy, "checksums"):
            strategy.checksums = False
    try:
        read_common_state(root, sharded, common, check=False)
    except CheckpointingException as e:
        report.problems.append(str(e))
    objects: Dict[str, ShardedObject] = {}
    try:
        owner = sharded if sharded.can_handle_sharded_objects else common
        found = owner.load_sharded_metadata(root)
        objects = {k: v for k, v in found.items() if isinstance(v, ShardedObject)}
        if objects and owner is sharded:
            sharded.load(objects, root)
        elif objects:
            common.load_sharded_objects(objects, root)
    except CheckpointingException as e:
        report.problems.append(str(e))
    report.checked.append(f"the common state and {len(objects)} objects, read as a load reads them")


def _unlisted_data_files(root: CheckpointRoot, listed: Dict[str, int], backend: Optional[str]) -> List[str]:
    if backend != "torch_dist":
        return []
    local = storage.local_root(root)
    if local is None:
        return sorted(n for n in listing(root) if n.endswith(".distcp") and "/" not in n and n not in listed)
    return sorted(p.name for p in local.glob("*.distcp") if p.name not in listed)


# --------------------------------------------------------------------------- deep read


def _deep_read(root: CheckpointRoot, trusted: bool, progress: Progress, report: VerifyReport) -> None:
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
