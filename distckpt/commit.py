"""How a save becomes the checkpoint at its location: the commit (atomicity) protocol.

A save never writes into the directory it replaces. It goes like this (the ranks named are the
ones that call each method; ``distckpt.serialization.save`` is the only caller):

1. ``cleanup_leftovers(target)`` then ``begin(target, save_id)`` — **rank 0**, inside the
   validation collective (so only a save that passed validation touches anything). ``begin``
   returns a :class:`Staging`: the directory every rank writes the new checkpoint into. rank 0
   picks ``save_id``; the staging path reaches the other ranks in the validation broadcast.
2. Every rank writes its files into ``staging.path`` (the strategies see it as the checkpoint
   directory, so every file sits where Megatron-Core reads it once the tree is in place).
3. ``commit(staging)`` — **rank 0**, after the last collective showed that every rank finished,
   and after ``metadata.json`` was written *inside* the staging directory. It makes the staged
   tree the checkpoint at ``target`` in one atomic step.
4. ``abort(staging)`` — **rank 0**, best effort, when the save failed on any rank (leftovers of a
   save that could not even abort are removed by ``cleanup_leftovers`` of the next save).

Loaders call ``recover(target)`` (every rank, no collective) before they read, which finishes a
swap that a crash interrupted half way (only possible with the fallback below).

:class:`RenameCommit` — local and shared POSIX file systems
----------------------------------------------------------

* The staging directory is a hidden sibling of the target, ``.<name>.distckpt-staging-<save_id>``:
  same parent, so the same file system, so a rename can move it into place.
* Fresh target (absent, or an empty directory): one ``rename(staging, target)``.
* Existing target: Linux ``renameat2(RENAME_EXCHANGE)`` (via ctypes) swaps the two directories
  atomically; the old tree, now under the staging name, is renamed to
  ``.<name>.distckpt-old-<save_id>`` and removed. A reader sees the old tree or the new one,
  whole. Where the exchange is unavailable (not Linux, or a file system without it, e.g. some
  NFS servers) the fallback is two renames, ``target -> .<name>.distckpt-old-<save_id>`` then
  ``staging -> target``; a crash between them leaves no ``target``, and the next load or save
  finishes the swap (the staging tree is complete: it has its ``metadata.json``).
* Files in the target that are not checkpoint files (anything the old checkpoint's manifest does
  not list and that does not look like a checkpoint file: ``metadata.json``, ``.metadata``,
  ``common.pt``, ``*.distcp`` and their block tables ``*.distcp.crc``, zarr nodes, object
  folders, the commit record and staged tree of an object-store checkpoint that was downloaded)
  are **carried over** into the new tree (hard links; copies where links are refused) before the
  swap, and logged. A user's
  ``README`` or ``run_config.yaml`` in a checkpoint folder survives an overwrite; stale data of
  the old checkpoint does not.
* The staging directory's inode and a token file holding the save id (removed just before the
  swap) are written by ``begin`` and checked by ``commit``, and every
  file the manifest lists must be there with its size: a staging directory removed by another
  job's ``cleanup_leftovers`` (two jobs saving to one location) and re-created by a late
  ``mkdir`` can never be committed half-filled.
* Leftovers (``.<name>.distckpt-{staging,old,trash}-*``) are hidden, never read by a loader, and
  removed by the next save to the same target (renamed to ``-trash-`` first, so that another
  job's commit racing with the removal fails cleanly instead of committing a half-removed tree).

Trade-offs: the target's parent must be writable (the staging directory is created there);
an overwrite needs room for two checkpoints until the commit; a symlinked target is resolved
and the real directory replaced (the link keeps pointing at it); two saves to one target at
once: the last commit wins whole, the other one fails or is replaced whole — never a mix.

Object stores have no rename: :class:`distckpt.commit_store.StoreCommit` plugs in behind the
same methods (plus ``after_commit``, rank 0's publication once the save is committed). A save to
a fresh prefix writes in place and commits with a conditional put of ``metadata.json``; an
overwrite writes under names of its own and commits by replacing a small commit record with a
versioned put, so the old checkpoint stays whole until that put. See its module docstring and
docs/storage.md.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Set, Tuple, Union

from distckpt import storage
from distckpt.commit_store import COMMIT_NAMES, StoreCommit  # noqa: F401 - re-exported (their home before)
from distckpt.core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    PathLike,
    fsync_dir,
    maybe_load_config,
    save_config,
)
from distckpt.formats.manifest import read_manifest_files
from distckpt.storage.record import RECORD_NAME, token_in

logger = logging.getLogger(__name__)

STAGING_MARK = "distckpt-staging"
OLD_MARK = "distckpt-old"
TRASH_MARK = "distckpt-trash"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>distckpt-(?:staging|old|trash))-(?P<id>[0-9A-Za-z_-]+)$")

# Names a checkpoint writes at its top level (besides what its manifest lists).
STAGING_TOKEN = ".distckpt_staging"
_CHECKPOINT_FILES = frozenset(
    {
        CONFIG_FNAME,
        ".metadata",
        ".distckpt_manifest.json",
        "common.pt",
        "zarr.json",
        ".zgroup",
        ".zattrs",
        STAGING_TOKEN,
        RECORD_NAME,
    }
)
_TEMP_FILE = re.compile(r"^\..+\.tmp\.\d+$")


@dataclass(frozen=True)
class Staging:
    """One save in progress, broadcast by rank 0 to every rank (so plain, picklable data):
    ``path`` is where the ranks write (None: in place, an object store's prefix), the rest is
    what rank 0 needs to commit."""

    target: Optional[Path]
    path: Optional[Path]
    save_id: str
    inode: Optional[Tuple[int, int]]


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def resolve_target(checkpoint_dir: storage.Location) -> Union[Path, storage.Store]:
    """The location a save replaces. A local directory with its symlinks resolved, so the staging
    sibling sits beside the real directory, on its file system; a URL as its store."""
    location = storage.resolve(checkpoint_dir)
    root = storage.local_root(location)
    if root is None:
        return location
    return Path(os.path.realpath(os.fspath(root)))


def leftover_name(target: Path, kind: str, save_id: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{save_id}"


def is_leftover(path: PathLike) -> bool:
    """True for a staging / old / trash directory of an interrupted save."""
    return _LEFTOVER.match(Path(path).name) is not None


def leftovers_of(target: Path) -> List[Tuple[str, str, Path]]:
    """``(kind, save id, path)`` of every leftover of interrupted saves to ``target``."""
    out = []
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return out
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if m and m["name"] == target.name:
            out.append((m["kind"], m["id"], Path(entry.path)))
    return sorted(out)


class RenameCommit:
    """Staging sibling + atomic directory exchange (see the module docstring)."""

    def where(self, staging: Staging) -> Path:
        """Every rank: the directory the save writes into."""
        return staging.path

    def begin(self, target: Path, save_id: str, overwrite: Optional[bool] = None) -> Staging:
        """rank 0: create the staging directory for ``save_id`` beside ``target``. ``overwrite``
        False refuses a target that holds a committed checkpoint (None and True replace it)."""
        if overwrite is False and _committed(target):
            raise CheckpointingException(f"{target} already holds a committed checkpoint and overwrite=False")
        target.parent.mkdir(parents=True, exist_ok=True)
        path = leftover_name(target, STAGING_MARK, save_id)
        path.mkdir()
        (path / STAGING_TOKEN).write_text(save_id)
        st = path.stat()
        try:
            os.chmod(path, stat.S_IMODE(target.stat().st_mode))
        except OSError:
            pass
        return Staging(target, path, save_id, (st.st_dev, st.st_ino))

    def commit(self, staging: Staging, config: CheckpointingConfig) -> None:
        """rank 0, after every rank finished writing: write ``metadata.json`` inside the staged
        tree, then make it the checkpoint at ``staging.target``."""
        target, path = staging.target, staging.path
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CheckpointingException(
                f"{path}: the staging directory of this save is gone (another save to {target} "
                f"removed it?); nothing was committed"
            ) from None
        try:
            token = (path / STAGING_TOKEN).read_text()
        except FileNotFoundError:
            token = None
        if (st.st_dev, st.st_ino) != staging.inode or token != staging.save_id:
            raise CheckpointingException(
                f"{path}: the staging directory was replaced while this save wrote into it (another "
                f"save to {target} at the same time?); nothing was committed"
            )
        save_config(config, path)
        _check_complete(path)
        os.remove(path / STAGING_TOKEN)
        if target.is_dir() and any(os.scandir(target)):
            _carry_over_foreign_entries(target, path)
        _fsync_tree(path)
        if _is_empty_dir_or_absent(target):
            os.rename(path, target)
            fsync_dir(target.parent)
            return
        old = leftover_name(target, OLD_MARK, staging.save_id)
        if exchange_directories(path, target):
            os.rename(path, old)
        else:
            os.rename(target, old)
            fsync_dir(target.parent)
            os.rename(path, target)
        fsync_dir(target.parent)
        remove_tree(old)

    def abort(self, staging: Staging) -> None:
        """rank 0, best effort: drop the staging directory of a failed save."""
        try:
            remove_tree(_to_trash(staging.path))
        except OSError as e:
            logger.warning(
                "%s: could not remove the staging directory of a failed save (%s); the next "
                "save to %s removes it",
                staging.path,
                e,
                staging.target,
            )

    def after_commit(self, staging: Staging) -> None:
        """rank 0, after the commit: nothing is left to do on a file system."""

    def cleanup_leftovers(self, target: Path) -> List[Path]:
        """rank 0, before a save: finish a half-done swap, then remove every leftover of earlier
        saves to ``target``. Returns the removed paths."""
        self.recover(target)
        removed = []
        for _, _, path in leftovers_of(target):
            try:
                trash = _to_trash(path)
            except FileNotFoundError:
                continue  # another process removed or committed it meanwhile
            remove_tree(trash)
            removed.append(path)
        if removed:
            logger.info(
                "%s: removed %d leftover(s) of interrupted saves: %s",
                target,
                len(removed),
                ", ".join(p.name for p in removed),
            )
        return removed

    def recover(self, target: Path) -> bool:
        """Any rank, before reading ``target``: if a fallback swap stopped between its two renames
        (no ``target``, the old tree at ``-old-<id>``, the committed new one at
        ``-staging-<id>``), put the new tree in place. True if it did."""
        if os.path.lexists(target):
            return False
        found = leftovers_of(target)
        olds = {sid for kind, sid, _ in found if kind == OLD_MARK}
        for kind, sid, path in found:
            if kind == STAGING_MARK and sid in olds and _committed(path):
                try:
                    os.rename(path, target)
                except FileNotFoundError:
                    return False  # another rank or process finished it first
                except OSError as e:
                    if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        return False
                    raise
                fsync_dir(target.parent)
                logger.warning("%s: finished the swap of an interrupted save (%s)", target, path.name)
                return True
        return False


def _committed(path: Path) -> bool:
    try:
        return maybe_load_config(path) is not None
    except CheckpointingException:
        return False


def _check_complete(path: Path) -> None:
    files = read_manifest_files(path)
    if files is None:
        return
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointingException(
                f"{path / name}: missing from the staging directory at commit; nothing was committed"
            ) from None
        if actual != size:
            raise CheckpointingException(
                f"{path / name}: {actual} bytes in the staging directory, the manifest says {size}; "
                f"nothing was committed"
            )


def _is_empty_dir_or_absent(target: Path) -> bool:
    if not os.path.lexists(target):
        return True
    return target.is_dir() and not any(os.scandir(target))


def _checkpoint_entries(root: Path) -> Set[str]:
    """Top-level names of ``root`` that belong to the checkpoint stored there."""
    names = set(_CHECKPOINT_FILES)
    try:
        files = read_manifest_files(root)
    except CheckpointingException:
        files = None
    if files is not None:
        names.update(name.split("/", 1)[0] for name in files)
    return names


def _looks_like_checkpoint_entry(entry: os.DirEntry) -> bool:
    if entry.name.endswith((".distcp", ".distcp.crc")) or _TEMP_FILE.match(entry.name):
        return True
    if token_in(entry.name) is not None:  # an object-store save's staged tree, downloaded
        return True
    if entry.is_dir(follow_symlinks=False):
        try:
            inner = [e.name for e in os.scandir(entry.path)]
        except OSError:
            return False
        return any(n in ("zarr.json", ".zarray", ".zgroup") for n in inner) or (
            bool(inner) and all(n.startswith("shard_") and n.endswith(".pt") for n in inner)
        )
    return False


def foreign_entries(target: Path) -> List[str]:
    """Top-level names in ``target`` that are not part of a checkpoint (kept across overwrites)."""
    known = _checkpoint_entries(target)
    return sorted(
        e.name for e in os.scandir(target) if e.name not in known and not _looks_like_checkpoint_entry(e)
    )


def _carry_over_foreign_entries(target: Path, staging: Path) -> None:
    for name in foreign_entries(target):
        src, dst = target / name, staging / name
        if os.path.lexists(dst):
            logger.warning("%s: not carried over into the new checkpoint, which has its own %r", src, name)
            continue
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)
        logger.info("%s: kept across the overwrite (not a checkpoint file)", src)


def _link_or_copy(src, dst) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fsync_tree(root: Path) -> None:
    """Make every directory entry of the staged tree durable before it is swapped in."""
    for dirpath, _, _ in os.walk(root):
        fsync_dir(dirpath)


def _to_trash(path: Path) -> Path:
    m = _LEFTOVER.match(path.name)
    name = m["name"] if m else path.name
    trash = path.parent / f".{name}.{TRASH_MARK}-{new_save_id()}"
    os.rename(path, trash)
    return trash


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- directory exchange

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2 = None


def _libc_renameat2():
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    return _renameat2


def exchange_directories(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system does not support it (nothing was changed then)."""
    fn = _libc_renameat2()
    if not fn:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


# --------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class TreeIdentity:
    """What identifies the tree at a path: the directory's inode and change time, and the
    commit marker's. An overwrite swaps a new directory in; an in-place edit changes the ctime."""

    directory: Tuple[int, int, int]
    marker: Optional[Tuple[int, int]]


@dataclass(frozen=True)
class RecordIdentity:
    """An object-store checkpoint's identity: the save its commit record names (None: a
    checkpoint without a record). An overwrite replaces the record; nothing else replaces objects
    a reader of the record reads."""

    token: Optional[str]


def tree_identity(path: Union[Path, storage.Store]) -> Union[TreeIdentity, RecordIdentity, None]:
    """A file system checkpoint's identity (directory inode, commit marker), or an object-store
    checkpoint's (the commit record this operation reads through); None where neither applies."""
    root = storage.local_root(path)
    if root is None:
        if not isinstance(path, storage.Store) or not path.supports_versioned_put:
            return None
        record = path.committed_version()
        return RecordIdentity(record.token if record is not None else None)
    try:
        st = os.stat(root)
    except OSError:
        return None
    try:
        mst = os.stat(root / CONFIG_FNAME)
        marker = (mst.st_ino, mst.st_mtime_ns)
    except OSError:
        marker = None
    return TreeIdentity((st.st_dev, st.st_ino, st.st_ctime_ns), marker)


def check_unchanged(path: Union[Path, storage.Store], before: Optional[TreeIdentity]) -> None:
    """Raise if the checkpoint at ``path`` was replaced or edited since ``before`` was taken
    (another job overwrote it during this load: what was read may mix the two saves)."""
    if isinstance(before, RecordIdentity):
        record = path.committed_version(refresh=True)
        now = RecordIdentity(record.token if record is not None else None)
    else:
        now = tree_identity(path) if before is not None else None
    if before is not None and now != before:
        raise CheckpointingException(
            f"{path}: the checkpoint was replaced or modified while it was being loaded (another job "
            f"saved to it?); what was read may mix two saves, so it is discarded — load again"
        )


_DEFAULT = RenameCommit()


def protocol_for(target: Union[Path, storage.Store]) -> Union[RenameCommit, StoreCommit]:
    """The commit protocol for ``target`` (as :func:`resolve_target` returns it): rename-based
    on file systems, the commit record's on object stores."""
    if storage.local_root(target) is None:
        return StoreCommit(target)
    return _DEFAULT


def recover(location: Union[Path, storage.Store]) -> bool:
    """Any rank, before reading ``location``: finish a swap a crash interrupted (see
    :meth:`RenameCommit.recover`). True if it did."""
    target = resolve_target(location)
    return protocol_for(target).recover(target)
