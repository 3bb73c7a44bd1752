"""The storage protocol: where a checkpoint's bytes live, and what that place can do.

A :class:`Store` is rooted at one checkpoint location (a directory, or a key prefix in a bucket)
and addresses objects by their name relative to it (``"__0_0.distcp"``, ``"metadata.json"``).
Callers ask for *capabilities* instead of testing types:

============================  =============================================================
``supports_rename``           an atomic rename exists (local: temp file + ``rename`` commits)
``supports_mmap``             objects are files that can be mapped and ``pread`` (the local
                              fast paths: ``pwritev`` writes, strided copies out of a mapping)
``supports_conditional_put``  :meth:`Store.put_if_absent` is atomic against concurrent writers
                              (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure
                              ``If-None-Match``; local ``link`` of a complete temp file)
``supports_ranged_read``      :meth:`Store.get_ranges` reads byte ranges without the whole
                              object
``supports_versioned_put``    :meth:`Store.put_versioned` replaces an object only if it is
                              still the version read (S3/Azure ``If-Match``, GCS generation
                              match) and :meth:`Store.copy` copies server side: what an
                              overwrite without a window needs (:mod:`distckpt.commit_store`)
============================  =============================================================

Which rank calls what (the strategies and ``serialization`` follow this):

- every rank: :meth:`put`/:meth:`open_writer` for *its own* objects only (its ``.distcp`` files,
  its object files); :meth:`get`/:meth:`get_ranges`/:meth:`size` for what a load addresses from
  the metadata. No rank lists a checkpoint to load it.
- rank 0 only: :meth:`begin_save` (before any rank writes), the strategy index and manifest
  (:meth:`put`), and :meth:`commit` last. :meth:`list` is for tools and at most rank 0, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple


class Writer(ABC):
    """A streaming writer of one object with bounded memory. The object appears (durably, whole)
    only on :meth:`close`; :meth:`abort` (or an exception inside ``with``) leaves nothing behind —
    an object store's multipart upload is aborted, a local temp file removed."""

    @abstractmethod
    def write(self, data) -> int:
        """Append a bytes-like ``data``. The caller may reuse or change its buffer as soon as
        this returns: a writer that keeps bytes until a part is full keeps a copy (or the
        immutable ``bytes`` object itself)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the object: every byte written is stored durably when this returns."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the object being written."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Store(ABC):
    """One checkpoint location. Names are ``/``-separated and relative to the location."""

    supports_rename: bool = False
    supports_mmap: bool = False
    supports_conditional_put: bool = False
    supports_ranged_read: bool = True
    supports_versioned_put: bool = False

    file_token: Optional[str] = None
    """A token the data files of the save being written carry in their names (``<token>__R_B``),
    so that an overwrite never writes over the files of the checkpoint it replaces; None: the
    plain names. Set by the store a commit protocol hands the strategies
    (:class:`distckpt.storage.record.StagedStore`)."""

    @property
    def local_root(self) -> Optional[Path]:
        """The directory holding this store's objects as plain files, where there is one.

        A capability, not a type test: code with a POSIX fast path (mmap, ``pread``, ``O_DIRECT``,
        rename) asks for it and takes the general path when it is None (object stores)."""
        return None

    @property
    def direct_root(self) -> Optional[Path]:
        """A local directory where a strategy may create this store's data objects itself, as
        plain files written by path (``pwritev``, no temp file), telling the store each one with
        :meth:`created` once it is complete. Only that: the rest (commit, small objects, reads)
        still goes through the store. None for most stores (a :class:`LocalStore` offers the
        whole POSIX path through :attr:`local_root` instead); the tiered save's store offers it,
        so that its local writes take the fast path."""
        return None

    def created(self, name: str) -> None:
        """A strategy wrote ``name`` under :attr:`direct_root` itself, completely and durably."""
        return None

    @property
    @abstractmethod
    def url(self) -> str:
        """The location as a URL (or a plain path for local directories)."""

    def where(self, name: str) -> str:
        """``name`` as a full location, for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def child(self, name: str) -> Store:
        """The store rooted at ``name`` below this one."""

    # ---------------------------------------------------------------- whole objects

    @abstractmethod
    def put(self, name: str, data) -> None:
        """Store ``data`` (bytes-like) as ``name``, replacing it; atomic and durable on return. The
        caller may reuse its buffer then: a store that keeps the bytes keeps a copy."""

    @abstractmethod
    def put_if_absent(self, name: str, data) -> bool:
        """Store ``data`` as ``name`` only if no object of that name exists; False if one did.
        Atomic against concurrent callers where ``supports_conditional_put``."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The whole object. Raises FileNotFoundError if it does not exist."""

    @abstractmethod
    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        """The byte ranges ``[start, start + length)`` of ``name``; close ranges are coalesced and
        requests run concurrently. Raises FileNotFoundError, or CheckpointingException when the
        object is shorter than a range."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes. Raises FileNotFoundError."""

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
            return True
        except FileNotFoundError:
            return False

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing object is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> Dict[str, int]:
        """Every object under ``prefix`` (relative names -> sizes). One listing; tools and at most
        rank 0 call it."""

    def is_empty(self) -> bool:
        """True when no object at all is stored under this location (a wrong prefix); for
        messages on an error path."""
        return not self.list_objects()

    def list_objects(self, prefix: str = "") -> Dict[str, int]:
        """Every object under ``prefix``, whatever a commit record says (:meth:`list` shows the
        checkpoint the record names): what the commit protocol itself lists."""
        return self.list(prefix)

    @abstractmethod
    def open_writer(self, name: str) -> Writer:
        """A streaming :class:`Writer` for ``name`` (multipart upload on object stores)."""

    # ---------------------------------------------------------------- versions (overwrites)

    def get_versioned(self, name: str) -> Tuple[bytes, Any]:
        """The whole object and its version (an opaque value for :meth:`put_versioned`).
        Raises FileNotFoundError."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned puts")

    def put_versioned(self, name: str, data, expected: Any) -> bool:
        """Store ``data`` as ``name`` only if ``name`` is still at version ``expected`` (None:
        only if there is no such object); False if it is not."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned puts")

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to ``dst`` (replacing it) without moving its bytes through this
        process where the store can (a server-side copy)."""
        raise NotImplementedError(f"{type(self).__name__} has no server-side copy")

    def committed_version(self, refresh: bool = False) -> Any:
        """The commit record this store reads the checkpoint through (an object-store
        checkpoint that was overwritten names its current save in one; see
        :mod:`distckpt.storage.record`), None without one. ``refresh``: read it again."""
        return None

    # ---------------------------------------------------------------- commit protocol

    @abstractmethod
    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        """Rank 0, before any rank writes: make sure no earlier checkpoint here can be mistaken for
        the one being written. ``commit_names[0]`` is the commit marker (``metadata.json``)."""

    @abstractmethod
    def commit(self, name: str, data: bytes) -> None:
        """Rank 0, last: write the commit marker. Afterwards the checkpoint is complete."""


def coalesce(
    ranges: Sequence[Tuple[int, int]], gap: int, max_span: Optional[int] = None
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int, int]]]:
    """Merge byte ranges ``(offset, length)`` (sorted by offset) whose gap is at most ``gap``
    bytes into requests of at most ``max_span`` bytes (None: any); returns the requests and, per
    range, (request index, offset in it, length)."""
    requests: List[List[int]] = []
    places = []
    for offset, length in ranges:
        last = requests[-1] if requests else None
        if (
            last is not None
            and offset - last[1] <= gap
            and offset >= last[0]
            and (max_span is None or max(last[1], offset + length) - last[0] <= max_span)
        ):
            last[1] = max(last[1], offset + length)
        else:
            requests.append([offset, offset + length])
        places.append((len(requests) - 1, offset - requests[-1][0], length))
    return [(a, b - a) for a, b in requests], places
