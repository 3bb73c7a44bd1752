"""What the local tier of a tiered checkpoint holds: one marker per owner rank and iteration.

After a rank's part of a tiered save is written and committed locally, the rank writes::

    <local root>/iter_0000100/.distckpt_tier/owner00003.json

    {"format": "distckpt-tier", "version": 1, "token": "<save token>", "iteration": 100,
     "world": 4, "owner": 3, "files": {"__3_0.distcp": 123456, ...}}

naming every file rank 3 wrote for that save, with its size. A peer that holds a replica of rank
3's files (``replication_factor`` > 1) keeps a copy of the marker next to them. The marker is
what makes the local copy count: an iteration can be finished (uploaded and committed remotely)
from the local tier alone when, for every owner ``0 .. world - 1``, some rank holds that owner's
marker with the same token. A rank removes its markers of an iteration before it saves that
iteration again, so a save interrupted half way never leaves a marker claiming it is complete.

A marker is untrusted input like any checkpoint file: its size, JSON, types, counts and every
name (the containment rule, :mod:`distckpt.containment`) are checked before use; a bad marker is
ignored with a warning (that copy does not count), never followed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from distckpt import bounds, containment
from distckpt.core import CheckpointingException, atomic_write_bytes

logger = logging.getLogger(__name__)

FORMAT = "distckpt-tier"
VERSION = 1
MARKER_DIR = ".distckpt_tier"
MAX_MARKER_BYTES = 16 << 20
MAX_FILES = 1 << 20
MAX_WORLD = 1 << 20
_ITER = re.compile(r"^iter_(\d{7,12})$")
_OWNER = re.compile(r"^owner(\d{5,7})\.json$")


def iteration_name(iteration: int) -> str:
    """``iter_0000100``: Megatron-LM's name for the checkpoint of an iteration."""
    return f"iter_{iteration:07d}"


def parse_iteration(name: str) -> Optional[int]:
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def marker_name(owner: int) -> str:
    return f"{MARKER_DIR}/owner{owner:05d}.json"


@dataclass(frozen=True)
class Marker:
    """Rank ``owner``'s files of one tiered save (see the module docstring)."""

    token: str
    iteration: int
    world: int
    owner: int
    files: Dict[str, int]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "token": self.token,
                "iteration": self.iteration,
                "world": self.world,
                "owner": self.owner,
                "files": self.files,
            },
            separators=(",", ":"),
        ).encode()


def write_marker(directory: Path, marker: Marker) -> None:
    """Write ``marker`` into the iteration ``directory`` (atomic: temp file + fsync + rename)."""
    (directory / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / marker_name(marker.owner), marker.to_json())


def read_marker(directory: Path, owner: int) -> Marker:
    """The marker of ``owner`` in ``directory``, checked. Raises FileNotFoundError if there is
    none, CheckpointingException (naming the file) if it is damaged or hostile."""
    name = marker_name(owner)
    where = directory / name
    if containment.size_beneath(directory, name, directory, "tier marker") > MAX_MARKER_BYTES:
        raise CheckpointingException(f"{where}: tier marker larger than {MAX_MARKER_BYTES} bytes")
    raw = bounds.parse_json(
        containment.read_beneath(directory, name, directory, "tier marker"), where, "tier marker"
    )
    # The type too: ``true == 1`` in Python, and a marker's version is the integer.
    version = raw.get("version") if isinstance(raw, dict) else None
    if (
        not isinstance(raw, dict)
        or raw.get("format") != FORMAT
        or type(version) is not int
        or version != VERSION
    ):
        raise CheckpointingException(f"{where}: not a version {VERSION} {FORMAT} marker")
    token = raw.get("token")
    if not isinstance(token, str) or not 0 < len(token) <= 256:
        raise CheckpointingException(f"{where}: bad token {token!r}")
    iteration = bounds.natural(raw.get("iteration"), where, "iteration")
    world = bounds.natural(raw.get("world"), where, "world size", MAX_WORLD)
    got_owner = bounds.natural(raw.get("owner"), where, "owner rank", MAX_WORLD)
    if world < 1 or got_owner != owner or owner >= world:
        raise CheckpointingException(f"{where}: owner {got_owner} / world {world} do not fit the file name")
    files = raw.get("files")
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise CheckpointingException(f"{where}: 'files' must be an object of at most {MAX_FILES} entries")
    checked = {}
    for name_, size in files.items():
        bounds.relative_name(name_, where, "listed file")
        if name_.startswith(MARKER_DIR + "/"):
            raise CheckpointingException(f"{where}: lists a marker as a file ({name_!r})")
        checked[name_] = bounds.natural(size, where, f"size of {name_!r}")
    return Marker(token, iteration, world, owner, checked)


def remove_markers(directory: Path, owners) -> None:
    """Remove the markers of ``owners`` in ``directory`` (missing ones are fine)."""
    for owner in owners:
        try:
            containment.remove_beneath(directory, marker_name(owner), directory, "tier marker")
        except FileNotFoundError:
            pass


def iteration_dirs(root: Path) -> List[Tuple[int, Path]]:
    """The ``iter_NNNNNNN`` directories directly under ``root`` (real directories only: a
    symlink there is not followed), oldest first."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        it = parse_iteration(entry.name)
        if it is not None and stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
            found.append((it, Path(entry.path)))
    return sorted(found)


def owners_in(directory: Path) -> List[int]:
    """The owner ranks whose markers ``directory`` holds (by file name; read them to trust them)."""
    folder = containment.list_beneath(directory, MARKER_DIR, directory, "tier marker folder") or []
    return sorted(int(m.group(1)) for m in map(_OWNER.match, folder) if m)


def read_all(directory: Path) -> Tuple[Dict[int, Marker], List[str]]:
    """Every readable marker of the iteration ``directory`` (owner -> marker), and why each
    unreadable one (or the marker folder) was not read."""
    try:
        owners = owners_in(directory)
    except (OSError, CheckpointingException) as e:
        return {}, [f"{directory / MARKER_DIR}: {e}"]
    found: Dict[int, Marker] = {}
    problems: List[str] = []
    for owner in owners:
        try:
            found[owner] = read_marker(directory, owner)
        except (OSError, CheckpointingException) as e:
            problems.append(str(e))
    return found, problems


def scan(root: Path, newer_than: Optional[int] = None) -> Dict[int, Dict[int, Marker]]:
    """Every readable marker under ``root``: iteration -> owner -> marker (damaged ones are
    skipped with a warning). ``newer_than``: only iterations above it."""
    out: Dict[int, Dict[int, Marker]] = {}
    for it, directory in iteration_dirs(root):
        if newer_than is not None and it <= newer_than:
            continue
        found, problems = read_all(directory)
        for problem in problems:
            logger.warning("ignoring a local tier marker: %s", problem)
        for owner, marker in found.items():
            if marker.iteration != it:
                logger.warning(
                    "ignoring %s: it names iteration %d", directory / marker_name(owner), marker.iteration
                )
                continue
            out.setdefault(it, {})[owner] = marker
    return out
