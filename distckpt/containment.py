"""The containment rule: every name a checkpoint holds stays inside the checkpoint.

A checkpoint is data from elsewhere, and it names files: storage records of ``.metadata``,
object keys, zarr array keys and chunk paths, manifest entries, block-table (``.crc``) sidecars,
ShardedObject keys that become file names, local-tier pieces. This module owns the one rule every
such name goes through before distckpt reads, writes or deletes anything by it:

1. **The name** (:func:`check_name`) is a non-empty relative ``/``-separated path: no ``..``,
   ``.`` or empty segments, not absolute, no backslash, no NUL, no Windows drive prefix
   (``C:``). On an object store this is the whole rule: a key that passes it, joined below the
   store's prefix, stays below that prefix.
2. **Locally** (:func:`open_beneath` and the helpers built on it) the name is resolved one
   component at a time from a descriptor of the root directory (``os.open(part, O_NOFOLLOW,
   dir_fd=parent)``), so the kernel never follows a symlink on distckpt's behalf and a file
   renamed or relinked between a check and the open cannot lead out either: the open itself is
   the check. A symlink met on the way is read (``readlink``) and followed by this walk only if
   it is *relative* and its target stays beneath the root, the semantics of Linux's
   ``openat2(RESOLVE_BENEATH)``; an absolute symlink, or one whose ``..`` climbs above the root,
   is refused (so are more than 40 links in one name). The walk is used everywhere, rather than
   ``openat2`` where the kernel has it, so that one code path with one behaviour serves reads,
   writes (which also create parent folders) and deletes; a name is one to three components, so
   it costs a few ``openat`` calls per file opened. Reads also refuse what is not a regular file
   (a directory, a FIFO that would block, a device).
3. The checkpoint root itself, and a conversion's destination, are the caller's: they may be
   symlinks (``latest -> iter_0001000``), which are followed as usual.

Where ``os.open`` has no ``dir_fd`` (not on Linux or macOS), a checked ``realpath`` is the last
resort: it refuses what resolves outside the root, but a concurrent relink can race it.

Failures are CheckpointingExceptions naming the file that held the name (``source``) and the
name; a name that is merely absent raises FileNotFoundError, as ``open`` would.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

from distckpt.errors import CheckpointingException, PathLike

# At most this many symlinks are followed while resolving one name (Linux's own limit).
MAX_LINKS = 40

_DRIVE = re.compile(r"^[A-Za-z]:")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WALK = os.open in os.supports_dir_fd and bool(_NOFOLLOW) and os.readlink in os.supports_dir_fd


def check_name(name: Any, source: PathLike, what: str = "file name") -> str:
    """``name`` if it is a plain relative path inside the checkpoint; else raise naming ``source``
    (the file that held the name) and the name."""
    if not isinstance(name, str) or not name:
        raise CheckpointingException(f"{source}: {what} {name!r} is not a non-empty string")
    if (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or _DRIVE.match(name)
        or os.path.isabs(name)
        or any(p in ("", ".", "..") for p in name.split("/"))
    ):
        raise CheckpointingException(
            f"{source}: {what} {name!r} points outside the checkpoint (absolute, '..', empty segments, "
            f"a backslash, NUL or a drive prefix); refusing to use it"
        )
    return name


def _escape(root: PathLike, name: str, source: PathLike, why: str) -> CheckpointingException:
    path = Path(root) / name
    real = os.path.realpath(path)
    return CheckpointingException(
        f"{path}: named by {source}, resolves to {real}, outside the checkpoint {root} ({why}); "
        f"refusing to use it"
    )


def _open_dir(parent: int, part: str) -> int:
    return os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent)


def _link_target(parent: int, part: str) -> Optional[str]:
    """The target of symlink ``part`` in folder ``parent``; None when it is no symlink."""
    try:
        return os.readlink(part, dir_fd=parent)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise


def _resolve(
    root: PathLike, name: str, source: PathLike, final: Callable[[int, str], Any], make_parents: bool = False
) -> Any:
    """Walk ``name`` beneath ``root`` one component at a time and return ``final(folder_fd,
    last_component)``. ``final`` must not follow a symlink: it raises OSError(ELOOP) on one, and
    the walk then reads the link and goes on with its target (see the module docstring)."""
    todo = name.split("/")
    todo.reverse()
    fds = [os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)]
    links = 0
    try:
        while todo:
            part = todo.pop()
            if part in ("", ".", ".."):
                if part == "..":
                    if len(fds) == 1:
                        raise _escape(root, name, source, "a symlink climbs above it")
                    os.close(fds.pop())
                if todo:
                    continue
                part = "."
            if not todo:
                try:
                    return final(fds[-1], part)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.EMLINK):
                        raise
                    target = _link_target(fds[-1], part)
                    if target is None:
                        raise
            else:
                try:
                    fds.append(_open_dir(fds[-1], part))
                    continue
                except FileNotFoundError:
                    if not make_parents:
                        raise
                    try:
                        os.mkdir(part, 0o755, dir_fd=fds[-1])
                    except FileExistsError:
                        pass
                    todo.append(part)
                    continue
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise
                target = _link_target(fds[-1], part)
                if target is None:  # a file where a folder should be: the name does not exist
                    raise FileNotFoundError(
                        errno.ENOTDIR, "Not a directory", str(Path(root) / name)
                    ) from None
            if target.startswith("/") or os.path.isabs(target):
                raise _escape(root, name, source, "an absolute symlink")
            links += 1
            if links > MAX_LINKS:
                raise CheckpointingException(
                    f"{Path(root) / name}: named by {source}: more than {MAX_LINKS} symlinks; "
                    f"refusing to use it"
                )
            todo.extend(reversed(target.split("/")))
        raise AssertionError("unreachable: the walk returns at the last component")
    except FileNotFoundError as e:
        raise FileNotFoundError(e.errno, e.strerror, str(Path(root) / name)) from None
    finally:
        for fd in fds:
            os.close(fd)


def _is_regular(fd: int) -> Tuple[bool, str]:
    mode = os.fstat(fd).st_mode
    return stat.S_ISREG(mode), "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def _open(root: PathLike, name: str, source: PathLike, flags: int, mode: int, make_parents: bool) -> int:
    reading = flags & (os.O_WRONLY | os.O_RDWR) == 0
    if not _WALK:
        path = Path(root) / name
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        _check_realpath(root, name, source, path)
        return os.open(path, flags | _CLOEXEC | (os.O_NONBLOCK if reading else 0), mode)
    # O_NONBLOCK: opening a FIFO to read must not block (a read opener clears it again).
    extra = _NOFOLLOW | _CLOEXEC | (os.O_NONBLOCK if reading else 0)
    return _resolve(
        root, name, source, lambda d, part: os.open(part, flags | extra, mode, dir_fd=d), make_parents
    )


def _check_realpath(root: PathLike, name: str, source: PathLike, path: Path) -> None:
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise _escape(root, name, source, "a symlink")


def open_beneath(
    root: PathLike,
    name: Any,
    source: PathLike,
    what: str = "file name",
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    make_parents: bool = False,
) -> int:
    """A descriptor of ``name`` opened beneath ``root`` with ``flags``, never through a symlink
    that leaves ``root`` (see the module docstring); a read-only open must find a regular file.
    ``make_parents``: create missing folders on the way (writes). Raises FileNotFoundError for a
    missing name, CheckpointingException naming ``source`` and the name for one not allowed."""
    check_name(name, source, what)
    fd = _open(root, name, source, flags, mode, make_parents)
    if flags & (os.O_WRONLY | os.O_RDWR) == 0:
        regular, kind = _is_regular(fd)
        if not regular:
            os.close(fd)
            raise CheckpointingException(
                f"{Path(root) / name}: named by {source}, is {kind}; refusing to read it"
            )
        os.set_blocking(fd, True)
    return fd


def create_beneath(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> int:
    """A descriptor of ``name`` beneath ``root``, created (or truncated) for writing, its missing
    folders created on the way (see :func:`open_beneath`)."""
    return open_beneath(
        root, name, source, what, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_parents=True
    )


def read_beneath(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> bytes:
    """The whole regular file ``name`` beneath ``root`` (see :func:`open_beneath`)."""
    fd = open_beneath(root, name, source, what)
    try:
        chunks = []
        want = max(os.fstat(fd).st_size, 1 << 16)
        while True:
            data = os.read(fd, want)
            if not data:
                return b"".join(chunks)
            chunks.append(data)
    finally:
        os.close(fd)


def size_beneath(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> int:
    """The size of regular file ``name`` beneath ``root``; FileNotFoundError when it is missing or
    not a regular file."""
    check_name(name, source, what)
    fd = _open(root, name, source, os.O_RDONLY, 0, False)
    try:
        regular, _ = _is_regular(fd)
        if not regular:
            raise FileNotFoundError(errno.ENOENT, "Not a regular file", str(Path(root) / name))
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _probe(folder: int, part: str) -> None:
    """``final`` of :func:`path_beneath`: hand a symlink back to the walk, accept anything else."""
    try:
        st = os.stat(part, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "symlink", part)


def path_beneath(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> Path:
    """``root / name`` once ``name`` passes :func:`check_name` and resolves beneath ``root`` (a
    file or a folder; a missing name passes as far as it exists). For code that must open the
    path itself (tensorstore, ``os.walk``) or name it in messages; :func:`open_beneath` leaves no
    window between the check and the open and is preferred."""
    check_name(name, source, what)
    path = Path(root) / name
    if not _WALK:
        _check_realpath(root, name, source, path)
        return path
    try:
        _resolve(root, name, source, _probe)
    except FileNotFoundError:
        pass
    return path


def _open_folder(root: PathLike, folder: str, source: PathLike, what: str) -> Optional[int]:
    """A descriptor of ``folder`` beneath ``root`` (``""``: the root itself), opened as
    :func:`open_beneath` opens files; None when it is missing or no folder."""
    if folder in ("", "."):
        return os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    check_name(folder, source, what)
    try:
        if not _WALK:
            path = Path(root) / folder
            _check_realpath(root, folder, source, path)
            return os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        return _resolve(root, folder, source, _open_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None


def list_beneath(root: PathLike, folder: str, source: PathLike, what: str = "folder") -> Optional[List[str]]:
    """The entry names of ``folder`` beneath ``root`` (``""``: the root), never listing a folder
    that a symlink leads out to; None when it is missing or no folder."""
    fd = _open_folder(root, folder, source, what)
    if fd is None:
        return None
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def walk_beneath(root: PathLike, folder: str, source: PathLike, what: str = "folder") -> Iterator[List[str]]:
    """The file names of each folder of the tree ``folder`` beneath ``root``, folder by folder
    (as ``os.walk`` gives them), never descending through a symlink; nothing when ``folder`` is
    missing or no folder."""
    fd = _open_folder(root, folder, source, what)
    if fd is None:
        return
    try:
        for _dirpath, _dirnames, filenames, _fd in os.fwalk(".", dir_fd=fd):
            yield filenames
    finally:
        os.close(fd)


def remove_beneath(root: PathLike, name: Any, source: PathLike, what: str = "file name") -> bool:
    """Unlink ``name`` beneath ``root`` (a symlink itself, never its target); False when it was
    missing. The folders on the way are resolved as :func:`open_beneath` resolves them."""
    check_name(name, source, what)
    try:
        if not _WALK:
            _check_realpath(root, name.rpartition("/")[0] or ".", source, (Path(root) / name).parent)
            os.remove(Path(root) / name)
        else:
            _resolve(root, name, source, lambda d, part: os.unlink(part, dir_fd=d))
        return True
    except FileNotFoundError:
        return False
