"""Which tiered checkpoints to keep: the newest few per tier, never the newest complete one.

Remote (rank 0, after a commit): the committed iterations (those with ``metadata.json``) beyond
the newest ``keep`` are removed, ``metadata.json`` first so that a removal interrupted half way
leaves an uncommitted prefix, never a damaged checkpoint that looks complete. Uncommitted
iterations older than the newest committed one (uploads that failed or were cut off) are
removed too; newer ones may be uploads in flight and are left alone.

Local (every rank, after a commit): each rank removes, in its own local directory, the files
and markers it is responsible for (its own, and its clique peers' replicas) of every iteration
beyond its newest ``keep`` copies that is older than the newest remote commit and not still
uploading. A copy whose upload did not commit is never removed while it may be the newest
complete copy of anything.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Set

from distckpt import containment
from distckpt.core import CONFIG_FNAME, CheckpointingException
from distckpt.storage.base import Store
from distckpt.tiered import markers

logger = logging.getLogger(__name__)

_COMMITTED = re.compile(r"^(iter_\d{7,12})/" + re.escape(CONFIG_FNAME) + "$")


def iterations(remote: Store) -> dict:
    """Iteration -> whether it is committed, for every ``iter_*`` prefix on the remote (one LIST)."""
    out: dict = {}
    for name in remote.list():
        head = name.split("/", 1)[0]
        it = markers.parse_iteration(head)
        if it is None:
            continue
        out[it] = out.get(it, False) or bool(_COMMITTED.match(name))
    return out


def committed(remote: Store) -> List[int]:
    """The committed iterations on the remote, oldest first."""
    return sorted(it for it, done in iterations(remote).items() if done)


def remove_remote(remote: Store, iteration: int) -> None:
    """Un-commit, then remove every object of ``iteration``."""
    prefix = markers.iteration_name(iteration)
    store = remote.child(prefix)
    store.delete(CONFIG_FNAME)
    for name in store.list():
        store.delete(name)


def trim_remote(remote: Store, keep: Optional[int], pending: Set[int], state: dict) -> List[int]:
    """Rank 0: apply the remote retention rule to ``state`` (:func:`iterations` of ``remote``);
    returns the iterations removed."""
    if keep is None:
        return []
    done = sorted(it for it, ok in state.items() if ok)
    if not done:
        return []
    newest = done[-1]
    doomed = set(done[:-keep]) if len(done) > keep else set()
    doomed |= {it for it, ok in state.items() if not ok and it < newest}
    doomed -= pending
    doomed.discard(newest)
    removed = []
    for it in sorted(doomed):
        try:
            remove_remote(remote, it)
            removed.append(it)
        except (OSError, CheckpointingException) as e:
            logger.warning("retention: could not remove %s: %s", remote.where(markers.iteration_name(it)), e)
    return removed


def trim_local(
    root: Path, keep: int, owners: Iterable[int], newest_committed: Optional[int], pending: Set[int]
) -> List[int]:
    """Every rank: apply the local retention rule to the files of ``owners`` under ``root``."""
    owners = set(owners)
    held = []
    for it, directory in markers.iteration_dirs(root):
        try:
            mine = [o for o in markers.owners_in(directory) if o in owners]
        except (OSError, CheckpointingException):
            continue
        if mine:
            held.append((it, directory, mine))
    removed = []
    for it, directory, mine in held[:-keep] if len(held) > keep else []:
        if it in pending or newest_committed is None or it >= newest_committed:
            continue
        for owner in mine:
            try:
                marker = markers.read_marker(directory, owner)
            except (OSError, CheckpointingException):
                marker = None
            markers.remove_markers(directory, [owner])
            for name in marker.files if marker is not None else ():
                try:
                    containment.remove_beneath(directory, name, directory, "local copy")
                except (OSError, CheckpointingException):
                    pass
        for folder in (directory / markers.MARKER_DIR, directory):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        removed.append(it)
    return removed
