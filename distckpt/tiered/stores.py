"""The two stores a tiered checkpoint goes through: one to save, one to load.

:class:`SaveTier` is what ``distckpt.save`` writes to in a tiered save. Every object lands in
this rank's local directory (node-local disk or tmpfs) and its name is recorded, so that the
upload later sends exactly what this rank wrote. It is an in-place store (no rename commit): each
rank writes its own files into its own node's directory, which need not be shared between
nodes. ``begin_save`` checks the remote (a committed checkpoint there is refused unless
``overwrite``) and clears the local commit files; ``commit`` writes ``metadata.json`` locally
only: the remote commit waits until every rank's upload is done.

:class:`ReadTier` is what ``distckpt.load`` reads from. Each file comes from the local copy when
that copy belongs to the same save and every byte of it matches the remote manifest (size and
the CRC32C of every range), checked once per file on first use; otherwise, and for every file
the manifest does not list (``metadata.json``, the manifest itself), from the remote. It counts
what it read from where.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence

from distckpt.core import CheckpointingException
from distckpt.manifest import MANIFEST_FNAME, Manifest, verify_files
from distckpt.storage.base import Store, Writer
from distckpt.storage.local import LocalStore

LOCAL = "local"
REMOTE = "remote"


class _Recorded(Writer):
    """A local writer that records its name when the object is complete."""

    def __init__(self, inner: Writer, on_close):
        self.inner, self.on_close = inner, on_close

    def write(self, data) -> int:
        return self.inner.write(data)

    def close(self) -> None:
        self.inner.close()
        self.on_close()

    def abort(self) -> None:
        self.inner.abort()


class SaveTier(Store):
    """Writes go to ``local`` (recorded by name); the remote is asked only in ``begin_save``."""

    supports_rename = False
    supports_mmap = False
    supports_conditional_put = True
    supports_ranged_read = True

    def __init__(self, local: LocalStore, remote: Store, prefix: str = "", written: Optional[dict] = None):
        self.local, self.remote, self.prefix = local, remote, prefix
        self._written: Dict[str, None] = {} if written is None else written
        self._lock = threading.Lock()

    @property
    def written(self) -> List[str]:
        """The names this rank wrote (relative to the checkpoint), in the order they completed."""
        with self._lock:
            return list(self._written)

    def _record(self, name: str) -> None:
        with self._lock:
            self._written[self.prefix + name] = None

    @property
    def url(self) -> str:
        return self.local.url

    def where(self, name: str) -> str:
        return self.local.where(name)

    def child(self, name: str) -> SaveTier:
        return SaveTier(
            self.local.child(name), self.remote.child(name), f"{self.prefix}{name}/", self._written
        )

    def put(self, name: str, data) -> None:
        self.local.put(name, data)
        self._record(name)

    def put_if_absent(self, name: str, data) -> bool:
        done = self.local.put_if_absent(name, data)
        if done:
            self._record(name)
        return done

    def get(self, name: str) -> bytes:
        return self.local.get(name)

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        return self.local.get_ranges(name, starts, lengths)

    def size(self, name: str) -> int:
        return self.local.size(name)

    def delete(self, name: str) -> None:
        self.local.delete(name)
        with self._lock:
            self._written.pop(self.prefix + name, None)

    def list(self, prefix: str = "") -> Dict[str, int]:
        return self.local.list(prefix)

    def open_writer(self, name: str) -> Writer:
        return _Recorded(self.local.open_writer(name), lambda: self._record(name))

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        # The remote decides whether this save may replace what is there; the local directory
        # loses its commit files so that an interrupted save never looks complete there either.
        self.remote.begin_save(commit_names, overwrite)
        self.local.begin_save(commit_names, None)

    def commit(self, name: str, data: bytes) -> None:
        self.local.commit(name, data)
        self._record(name)


class ReadTier(Store):
    """Reads each file from the local copy when it checks out against ``manifest``, else from
    ``remote``. ``local`` None: everything from the remote."""

    supports_rename = False
    supports_mmap = False
    supports_conditional_put = False
    supports_ranged_read = True

    def __init__(self, local: Optional[LocalStore], remote: Store, manifest: Optional[Manifest]):
        self.local, self.remote, self.manifest = local, remote, manifest
        self.sources: Dict[str, str] = {}
        self.rejected: Dict[str, str] = {}
        self.bytes_read = {LOCAL: 0, REMOTE: 0}
        self._lock = threading.Lock()
        self._file_locks: Dict[str, threading.Lock] = {}

    @property
    def url(self) -> str:
        return self.remote.url

    def where(self, name: str) -> str:
        return self.remote.where(name)

    def child(self, name: str) -> Store:
        raise CheckpointingException(f"{self.url}: a tiered checkpoint has no sub-checkpoints ({name})")

    # ------------------------------------------------------------------ which copy

    def source(self, name: str) -> str:
        """Where ``name`` is read from: checked once (first use), then remembered."""
        with self._lock:
            known = self.sources.get(name)
            if known is not None:
                return known
            lock = self._file_locks.setdefault(name, threading.Lock())
        with lock:
            with self._lock:
                known = self.sources.get(name)
            if known is None:
                known = self._decide(name)
                with self._lock:
                    self.sources[name] = known
        return known

    def _decide(self, name: str) -> str:
        m = self.manifest
        if self.local is None or m is None or name not in m.files or name == MANIFEST_FNAME:
            return REMOTE
        try:
            if not self.local.exists(name):
                return REMOTE  # not on this node: nothing to reject
        except (OSError, CheckpointingException) as e:
            with self._lock:
                self.rejected[name] = f"{name}: {e}"
            return REMOTE
        single = Manifest(m.save_id, m.backend, {name: m.files[name]}, {name: m.ranges.get(name, [])})
        if name in m.blocks:
            single.blocks[name] = m.blocks[name]
        try:
            problems = verify_files(self.local, single)
        except (OSError, CheckpointingException) as e:
            problems = [f"{name}: {e}"]
        if problems:
            with self._lock:
                self.rejected[name] = problems[0] + (
                    f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                )
            return REMOTE
        return LOCAL

    def _store(self, name: str) -> Store:
        return self.local if self.source(name) == LOCAL else self.remote

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.bytes_read[self.sources[name]] += n

    # ------------------------------------------------------------------ reads

    def get(self, name: str) -> bytes:
        data = self._store(name).get(name)
        self._count(name, len(data))
        return data

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        out = self._store(name).get_ranges(name, starts, lengths)
        self._count(name, sum(len(v) for v in out))
        return out

    def size(self, name: str) -> int:
        return self._store(name).size(name)

    def list(self, prefix: str = "") -> Dict[str, int]:
        return self.remote.list(prefix)

    # ------------------------------------------------------------------ read-only

    def _refuse(self, name: str):
        raise CheckpointingException(f"{self.where(name)}: a tiered checkpoint is read-only when loading")

    def put(self, name: str, data) -> None:
        self._refuse(name)

    def put_if_absent(self, name: str, data) -> bool:
        self._refuse(name)

    def delete(self, name: str) -> None:
        self._refuse(name)

    def open_writer(self, name: str) -> Writer:
        self._refuse(name)

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        self._refuse(commit_names[0])

    def commit(self, name: str, data: bytes) -> None:
        self._refuse(name)

    def summary(self) -> Dict[str, object]:
        """Files and bytes per source, and the local files that were rejected (with why)."""
        with self._lock:
            files = {LOCAL: 0, REMOTE: 0}
            for src in self.sources.values():
                files[src] += 1
            return {
                "local files": files[LOCAL],
                "local bytes": self.bytes_read[LOCAL],
                "remote files": files[REMOTE],
                "remote bytes": self.bytes_read[REMOTE],
                "rejected": dict(self.rejected),
            }
