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

import bisect
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from distckpt.checksum import crc32c
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import MANIFEST_FNAME, Manifest, RangeChecksum, verify_files
from distckpt.storage.base import Store, Writer
from distckpt.storage.local import LocalStore

LOCAL = "local"
REMOTE = "remote"
CANDIDATE = "candidate"  # a local copy of the right size, its bytes checked as they are read


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

    @property
    def direct_root(self) -> Optional[Path]:
        # A strategy may write its data files here by path (the local fast path); it reports
        # each with ``created``, which records it like any other write.
        self.local.root.mkdir(parents=True, exist_ok=True)
        return self.local.root

    def created(self, name: str) -> None:
        self._record(name)

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
        # The remote decides whether this save may replace what is there. One HEAD when it may
        # not: nothing is uploaded before the save is committed locally, and rank 0's upload
        # removes stale commit files before the commit. With ``overwrite`` the remote checkpoint
        # is un-committed now, before any rank can start uploading into it. The local directory
        # loses its commit files so that an interrupted save never looks complete there either.
        if overwrite:
            self.remote.begin_save(commit_names, overwrite)
        elif self.remote.exists(commit_names[0]):
            raise CheckpointingException(
                f"{self.remote.url} already holds a committed checkpoint ({commit_names[0]} exists); "
                f"a tiered save never replaces it silently: save another iteration, remove it, or pass "
                f"overwrite=True"
            )
        self.local.begin_save(commit_names, None)

    def commit(self, name: str, data: bytes) -> None:
        self.local.commit(name, data)
        self._record(name)


class ReadTier(Store):
    """Reads each file from the local copy when it checks out against ``manifest``, else from
    ``remote``. ``local`` None: everything from the remote.

    A load pays one read of the local bytes, not two: a file whose local copy exists with the
    manifest's size is a *candidate*, and the ranges a load asks of it are checked as they are
    read (each against the CRC32C the manifest records for exactly that range; a whole-file
    ``get`` against all of them). The first mismatch rejects the file: that read and every later
    one go to the remote. A request that does not line up with the manifest's ranges (blocks of a
    resharded read) checks the whole local file first. :meth:`source` always checks the whole
    file (the CLI's question: would a load use it?)."""

    supports_rename = False
    supports_mmap = False
    supports_conditional_put = False
    supports_ranged_read = True

    def __init__(self, local: Optional[LocalStore], remote: Store, manifest: Optional[Manifest]):
        self.local, self.remote, self.manifest = local, remote, manifest
        self._state: Dict[str, str] = {}
        self.rejected: Dict[str, str] = {}
        self.bytes_read = {LOCAL: 0, REMOTE: 0}
        self._lock = threading.Lock()
        self._file_locks: Dict[str, threading.Lock] = {}
        self._sorted: Dict[str, Tuple[List[int], List[RangeChecksum]]] = {}

    @property
    def url(self) -> str:
        return self.remote.url

    def where(self, name: str) -> str:
        return self.remote.where(name)

    def child(self, name: str) -> Store:
        raise CheckpointingException(f"{self.url}: a tiered checkpoint has no sub-checkpoints ({name})")

    @property
    def sources(self) -> Dict[str, str]:
        """Each file read (or asked about) so far: ``"local"`` or ``"remote"``."""
        with self._lock:
            return {n: REMOTE if st == REMOTE else LOCAL for n, st in self._state.items()}

    # ------------------------------------------------------------------ which copy

    def _reject(self, name: str, why: str) -> str:
        with self._lock:
            self.rejected.setdefault(name, why)
            self._state[name] = REMOTE
        return REMOTE

    def _first_look(self, name: str) -> str:
        """REMOTE, or CANDIDATE when a local copy of the manifest's size exists (cheap)."""
        with self._lock:
            known = self._state.get(name)
        if known is not None:
            return known
        m = self.manifest
        if self.local is None or m is None or name not in m.files or name == MANIFEST_FNAME:
            state = REMOTE
        else:
            try:
                size = self.local.size(name)
                state = CANDIDATE if size == m.files[name] else None
                if state is None:
                    return self._reject(name, f"{name}: size {size} bytes, expected {m.files[name]}")
            except FileNotFoundError:
                state = REMOTE  # not on this node: nothing to reject
            except (OSError, CheckpointingException) as e:
                return self._reject(name, f"{name}: {e}")
        with self._lock:
            return self._state.setdefault(name, state)

    def source(self, name: str) -> str:
        """Where ``name`` is read from, after checking every byte of its local copy."""
        if self._first_look(name) != CANDIDATE:
            return self._state[name]
        with self._lock:
            lock = self._file_locks.setdefault(name, threading.Lock())
        with lock:
            if self._state[name] != CANDIDATE:
                return self._state[name]
            m = self.manifest
            single = Manifest(m.save_id, m.backend, {name: m.files[name]}, {name: m.ranges.get(name, [])})
            if name in m.blocks:
                single.blocks[name] = m.blocks[name]
            try:
                problems = verify_files(self.local, single)
            except (OSError, CheckpointingException) as e:
                problems = [f"{name}: {e}"]
            if problems:
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                return self._reject(name, problems[0] + more)
            with self._lock:
                self._state[name] = LOCAL
            return LOCAL

    def _ranges_of(self, name: str) -> Tuple[List[int], List[RangeChecksum]]:
        """The manifest's ranges of ``name`` sorted by offset, and their offsets (cached)."""
        with self._lock:
            known = self._sorted.get(name)
        if known is None:
            ranges = sorted(self.manifest.ranges.get(name, []), key=lambda r: r.offset)
            known = ([r.offset for r in ranges], ranges)
            with self._lock:
                self._sorted[name] = known
        return known

    def _mismatch(self, name: str, starts: Sequence[int], data: Sequence) -> Optional[str]:
        """Why the local bytes read do not match the manifest (None: they do). Each request must
        be exactly a run of consecutive checksummed ranges (one item, or several a reader
        coalesced), each then checked against its CRC32C; "unaligned" when it is not."""
        offsets, ranges = self._ranges_of(name)
        for start, view in zip(starts, data):
            view = memoryview(view).cast("B")
            end, i = start + len(view), bisect.bisect_left(offsets, start)
            if len(view) == 0:
                continue
            if i == len(offsets) or offsets[i] != start:
                return "unaligned"
            at = start
            while at < end:
                if i == len(ranges) or ranges[i].offset != at or at + ranges[i].length > end:
                    return "unaligned"
                r = ranges[i]
                got = crc32c(view[at - start : at - start + r.length])
                if got != r.crc32c:
                    return (
                        f"{name}: key {r.key!r} at offset {r.offset}: CRC32C mismatch "
                        f"(stored {r.crc32c:#010x}, computed {got:#010x})"
                    )
                at += r.length
                i += 1
        return None

    def _count(self, source: str, n: int) -> None:
        with self._lock:
            self.bytes_read[source] += n

    # ------------------------------------------------------------------ reads

    def get(self, name: str) -> bytes:
        if self._first_look(name) == CANDIDATE:
            data = self.local.get(name)
            why = self._mismatch(name, [0], [data])
            if why is None:
                with self._lock:
                    self._state[name] = LOCAL
                self._count(LOCAL, len(data))
                return data
            self._reject(
                name, why if why != "unaligned" else f"{name}: the manifest does not checksum every byte"
            )
        source = self.source(name)
        data = (self.local if source == LOCAL else self.remote).get(name)
        self._count(source, len(data))
        return data

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        if self._first_look(name) == CANDIDATE:
            out = self.local.get_ranges(name, starts, lengths)
            why = self._mismatch(name, starts, out)
            if why is None:
                self._count(LOCAL, sum(len(v) for v in out))
                return out
            if why != "unaligned":
                self._reject(name, why)
        source = self.source(name)
        out = (self.local if source == LOCAL else self.remote).get_ranges(name, starts, lengths)
        self._count(source, sum(len(v) for v in out))
        return out

    def size(self, name: str) -> int:
        if self._first_look(name) == CANDIDATE:
            return self.manifest.files[name]
        return (self.local if self._state.get(name) == LOCAL else self.remote).size(name)

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
        files = {LOCAL: 0, REMOTE: 0}
        for src in self.sources.values():
            files[src] += 1
        with self._lock:
            return {
                "local files": files[LOCAL],
                "local bytes": self.bytes_read[LOCAL],
                "remote files": files[REMOTE],
                "remote bytes": self.bytes_read[REMOTE],
                "rejected": dict(self.rejected),
            }
