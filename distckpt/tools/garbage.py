"""``distckpt gc``: finish what an interrupted save left half done, and remove what no checkpoint uses.

One process, any location:

- **object store** (:mod:`distckpt.commit_store`): an overwrite committed but not published
  (the commit record says ``staged``) is published: its staged objects are copied to their plain
  names and the record marked ``published``; then the objects of saves that are not the committed
  checkpoint and can no longer become it are removed (earlier generations, and saves that began
  before the committed one). Objects of a later generation may belong to a save still running and
  are kept, unless ``uncommitted`` says none is.
- **local directory** (:mod:`distckpt.commit`): a swap a crash interrupted is finished, and the
  hidden ``.<name>.distckpt-{staging,old,trash}-*`` siblings of interrupted saves are removed (what
  the next save to it would do).

Never touched: the committed checkpoint, objects that are not a save's (a ``README`` beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from distckpt import commit, storage
from distckpt.commit_store import collect_garbage, publish
from distckpt.storage.record import PUBLISHED, STAGED

__all__ = ["GarbageReport", "collect"]


@dataclass
class GarbageReport:
    """What :func:`collect` did (or, ``dry_run``, would do)."""

    location: str
    published: Optional[str] = None  # the token of the save whose publication was finished
    removed: List[str] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> Dict[str, Any]:
        return {
            "location": self.location,
            "published": self.published,
            "removed": list(self.removed),
            "dry_run": self.dry_run,
        }


def collect(
    location: storage.Location,
    dry_run: bool = False,
    uncommitted: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
) -> GarbageReport:
    """Publish a committed but unpublished overwrite, then remove the objects of earlier and failed
    saves at ``location`` (see the module docstring). ``dry_run``: change nothing, report."""
    target = commit.resolve_target(storage.resolve(location, storage_options))
    report = GarbageReport(str(target), dry_run=dry_run)
    root = storage.local_root(target)
    if root is not None:
        if dry_run:
            found = [p for _, _, p in commit.leftovers_of(root)]
        else:
            found = commit.RenameCommit().cleanup_leftovers(root)
        report.removed = [str(p) for p in found]
        return report
    if target.supports_versioned_put:
        record = target.committed_version(refresh=True)
        if record is not None and record.state == STAGED:
            report.published = record.token
            if not dry_run:
                after = publish(target)
                if after is None or after.state != PUBLISHED or after.token != record.token:
                    report.published = None
    report.removed = collect_garbage(target, dry_run=dry_run, uncommitted=uncommitted)
    return report
