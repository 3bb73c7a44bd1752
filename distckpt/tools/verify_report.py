"""What ``distckpt verify`` reports (:class:`VerifyReport`) and the file facts its checks share.

The checks of :mod:`distckpt.tools.verify` (and its per-backend halves
:mod:`distckpt.tools.verify_torch_dist` and :mod:`distckpt.tools.verify_zarr`) add one line per
problem to a report; they ask for a file's size through :func:`file_size`, which on a local
directory goes through the containment rule and on an object store answers from one listing of
the checkpoint (:func:`listing`, cached per store).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

from distckpt import containment, storage

CheckpointRoot = Union[Path, storage.Store]
"""A resolved checkpoint location (:func:`distckpt.storage.resolve`): a local directory or a store."""


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


def listing(root: storage.Store) -> Dict[str, int]:
    """Object store: every object of the checkpoint with its size (one LIST per store object)."""
    found = _LISTINGS.get(root)
    if found is None:
        found = _LISTINGS[root] = root.list()
    return found


_LISTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def file_size(root: CheckpointRoot, name: str) -> Optional[int]:
    """The size of file ``name`` of the checkpoint, or None if it is missing."""
    local = storage.local_root(root)
    if local is not None:
        try:
            # The containment rule: a symlink out of the checkpoint is an error, not a size.
            return containment.size_beneath(local, name, local)
        except FileNotFoundError:
            return None
    return listing(root).get(name)
