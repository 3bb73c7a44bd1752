"""``distckpt verify``'s structural checks of a ``zarr`` checkpoint.

The root group's key listing is a claim, checked against the folders first; then every array's
metadata is read (and compared with the manifest where there is one) and every chunk of its grid
must have a file, of the exact size where chunks are stored raw. The work is bounded by what the
checkpoint holds, not by what its metadata claims.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional, Sequence

from distckpt import containment, storage
from distckpt.core import CheckpointingException
from distckpt.strategies.zarr import layout as zarr_layout
from distckpt.strategies.zarr.engines import Engines
from distckpt.strategies.zarr.meta import listing_disagreement, manifest_disagreement
from distckpt.tools.verify_report import CheckpointRoot, VerifyReport, file_size, listing


def check_zarr(root: CheckpointRoot, report: VerifyReport, manifest=None) -> None:
    """Every listed array's metadata and chunk files (presence; size where stored raw)."""
    local = storage.local_root(root)
    try:
        keys = zarr_layout.list_array_keys(root)
    except CheckpointingException as e:
        report.problems.append(str(e))
        return
    problem = listing_disagreement(keys, manifest, storage.join(root, "zarr.json"))
    if problem:
        report.problems.append(problem)
    # The listing is a claim: checked against the folders first, so a listing of 100,000 keys
    # over a checkpoint of 3 arrays is one problem naming it, found in a blink, not 100,000
    # reads of metadata that is not there.
    missing = _keys_without_array_meta(root, keys)
    if missing:
        report.problems.append(
            f"{storage.join(root, 'zarr.json')}: lists {len(missing)} of its {len(keys)} array keys "
            f"with no array "
            f"metadata (missing): {', '.join(map(repr, missing[:3]))}{' ...' if len(missing) > 3 else ''}"
        )
        absent = set(missing)
        keys = [key for key in keys if key not in absent]
    chunk_files = 0
    engines = Engines("auto", 1)
    for key in keys:
        try:
            meta = zarr_layout.read_array_meta(root, key)
        except CheckpointingException as e:
            report.problems.append(str(e))
            continue
        if meta is None:
            report.problems.append(f"{key}/: listed in the root group but has no array metadata (missing)")
            continue
        problem = manifest_disagreement(meta, manifest)
        if problem:
            report.problems.append(problem)
        try:
            # An encoded array is opened by tensorstore as a load opens it (it parses the
            # zarr.json itself); an engine that cannot read the array at all says so here.
            engines.check_readable(meta)
        except CheckpointingException as e:
            report.problems.append(str(e))
            continue
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
            if local is not None:
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
                actual = file_size(root, rel)
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


def _keys_without_array_meta(root: CheckpointRoot, keys: Sequence[str]) -> List[str]:
    """The listed ``keys`` (names the listing check already accepted) whose folder holds neither
    ``zarr.json`` nor ``.zarray``: set look-ups in the listings of the real folders on their
    paths, each folder listed once, so the work is bounded by what the checkpoint holds, not by
    what the listing claims (on a store: look-ups in its one listing). Only a presence test:
    reading the file goes through the containment rule."""
    names = ("zarr.json", ".zarray")
    local = storage.local_root(root)
    if local is None:
        return [k for k in keys if not any(f"{k}/{n}" in listing(root) for n in names)]
    folders: Dict[str, Optional[set]] = {}

    def entries(folder: str) -> Optional[set]:
        if folder not in folders:
            try:
                found = containment.list_beneath(local, folder, local / "zarr.json")
            except (OSError, CheckpointingException):
                found = None  # not a folder, or one a symlink leads out to
            folders[folder] = None if found is None else set(found)
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


def _chunk_files_at_most(root: CheckpointRoot, meta, limit: int) -> int:
    """The files of array ``meta`` besides its metadata, counted up to ``limit``."""
    count = 0
    local = storage.local_root(root)
    if local is not None:
        for filenames in containment.walk_beneath(local, meta.key, local / "zarr.json", "array key"):
            count += sum(1 for n in filenames if n not in (".zarray", ".zattrs", "zarr.json"))
            if count >= limit:
                return limit
        return count
    prefix = f"{meta.key}/"
    return min(
        limit,
        sum(
            1
            for n in listing(root)
            if n.startswith(prefix) and n.rsplit("/", 1)[-1] not in (".zarray", ".zattrs", "zarr.json")
        ),
    )


def _product(ranges):
    return itertools.product(*ranges)
