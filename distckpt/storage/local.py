"""A local POSIX directory as a :class:`~distckpt.storage.base.Store`.

The strategies do not go through these methods for their bulk I/O on a local directory: they
keep their fast paths (``pwritev`` of gathered writes, ``preadv`` into place, strided copies out
of a file mapping) on ``store.root``, which ``supports_mmap`` allows. This class gives the same
protocol as the object stores to everything else (tools, the manifest, tests).

Every name goes through the containment rule (:mod:`distckpt.containment`): reads, sizes and
deletes resolve it beneath the directory without following a symlink out; writes check the
folders above it (the final rename replaces the name itself, never a symlink's target).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from distckpt import containment
from distckpt.core import CheckpointingException, atomic_write_bytes, fsync_dir, write_all
from distckpt.storage.base import Store, Writer


class _FileWriter(Writer):
    """Writes into a temp file beside the target; ``close`` fsyncs and renames it into place."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{id(self)}")
        self.fd: Optional[int] = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        write_all(self.fd, view)
        return len(view)

    def close(self) -> None:
        if self.fd is None:
            return
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass


class LocalStore(Store):
    """A directory on a POSIX file system (``/path``, ``./rel`` or ``file:///path``)."""

    supports_rename = True
    supports_mmap = True
    supports_conditional_put = True  # link(2) of a complete temp file fails if the name exists
    supports_ranged_read = True

    def __init__(self, root):
        self.root = Path(root)

    @property
    def local_root(self) -> Path:
        return self.root

    @property
    def url(self) -> str:
        return str(self.root)

    def where(self, name: str) -> str:
        return str(self.root / name)

    def child(self, name: str) -> LocalStore:
        return LocalStore(containment.path_beneath(self.root, name, self.root, "folder name"))

    def _target(self, name: str) -> Path:
        """Where a write of ``name`` goes, its folders created beneath the root."""
        path = containment.path_beneath(self.root, name, self.root, "object name")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, name: str, data) -> None:
        atomic_write_bytes(self._target(name), bytes(data))

    def put_if_absent(self, name: str, data) -> bool:
        path = self._target(name)
        writer = _FileWriter(path)
        try:
            writer.write(data)
            os.fsync(writer.fd)
            os.close(writer.fd)
            writer.fd = None
            try:
                os.link(writer.tmp, path)
            except FileExistsError:
                return False
            fsync_dir(path.parent)
            return True
        finally:
            writer.abort()

    def get(self, name: str) -> bytes:
        return containment.read_beneath(self.root, name, self.root, "object name")

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        path = self.root / name
        fd = containment.open_beneath(self.root, name, self.root, "object name")
        try:
            out = []
            for start, length in zip(starts, lengths):
                data = os.pread(fd, length, start)
                if len(data) != length:
                    raise CheckpointingException(
                        f"{path}: object is truncated (range [{start}, {start + length}) past its end)"
                    )
                out.append(memoryview(data))
            return out
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        return containment.size_beneath(self.root, name, self.root, "object name")

    def delete(self, name: str) -> None:
        containment.remove_beneath(self.root, name, self.root, "object name")

    def list(self, prefix: str = "") -> Dict[str, int]:
        out = {}
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                rel = (Path(dirpath) / f).relative_to(self.root).as_posix()
                if rel.startswith(prefix):
                    out[rel] = (Path(dirpath) / f).stat().st_size
        return dict(sorted(out.items()))

    def open_writer(self, name: str) -> Writer:
        return _FileWriter(self._target(name))

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        """Local directories keep today's behaviour: a new save replaces an earlier checkpoint
        (its commit files go first) unless ``overwrite=False``."""
        self.root.mkdir(parents=True, exist_ok=True)
        if overwrite is False and (self.root / commit_names[0]).exists():
            raise CheckpointingException(
                f"{self.root} already holds a committed checkpoint and overwrite=False"
            )
        removed = False
        for name in commit_names:
            try:
                os.remove(self.root / name)
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            fsync_dir(self.root)

    def commit(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self._target(name), data)
