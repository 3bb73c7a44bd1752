"""The background half of a tiered save: one rank's files, local copy -> remote, with retries.

An :class:`Upload` runs in a daemon thread and uses no process group (the ranks agree on the
outcome later, in :meth:`TieredCheckpointManager.finalize`). It sends the files of one
iteration that this rank is responsible for, ``threads`` at a time: a small file with one put,
a large one streamed through the store's writer (a multipart upload on object stores, parts of
the store's ``part_size``), read from the local copy ``chunk_bytes`` at a time, so a rank holds
at most ``threads * (chunk_bytes + part buffers)`` in memory whatever the checkpoint's size.

A file whose upload fails with an error that another try may cure — the store's transient
errors (throttling, 5xx, no answer: :mod:`distckpt.storage.failures`, after the client's own
retries) and local I/O errors — is tried again after ``backoff_s * 2**k`` seconds (with jitter, at
most 60 s), ``retries`` times; then the upload is failed, and says which file and why. An error
no retry can cure fails it at once: a missing bucket, refused access, a local file that is gone,
a name the containment rule refuses (a local copy whose file is a symlink out of it). ``cancel()``
stops it between chunks (an object store's multipart upload is aborted, nothing half-written is
left visible). Before anything else, ``stale`` names are deleted (commit files of an earlier,
uncommitted upload to the same place that this save does not write) and the ``first`` objects
put (the save token).
"""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional, Sequence

from distckpt import containment
from distckpt.core import CheckpointingException
from distckpt.storage.base import Store
from distckpt.storage.failures import is_transient

RUNNING, DONE, FAILED = 0, 1, 2
SMALL_BYTES = 8 << 20
CHUNK_BYTES = 16 << 20
MAX_BACKOFF_S = 60.0


class Cancelled(CheckpointingException):
    """The upload was cancelled (the manager is closing without waiting)."""


def copy_file(local: Path, remote: Store, name: str, chunk_bytes: int = CHUNK_BYTES, cancelled=None) -> int:
    """Copy ``local/name`` to ``remote`` under the same name; returns the bytes copied.

    The local file is opened beneath ``local`` (the containment rule: no ``..``, no symlink out).
    """
    fd = containment.open_beneath(local, name, local, "file to upload")
    try:
        size = os.fstat(fd).st_size
        if size <= SMALL_BYTES:
            data = os.pread(fd, size, 0)
            if len(data) != size:
                raise CheckpointingException(f"{local / name}: changed while being uploaded")
            remote.put(name, data)
            return size
        with remote.open_writer(name) as writer:
            done = 0
            while done < size:
                if cancelled is not None and cancelled.is_set():
                    raise Cancelled(f"upload of {local / name} cancelled")
                data = os.pread(fd, min(chunk_bytes, size - done), done)
                if not data:
                    raise CheckpointingException(f"{local / name}: shorter than its {size} bytes")
                writer.write(data)
                done += len(data)
        return size
    finally:
        os.close(fd)


class Upload:
    """Uploads ``names`` from the local directory ``local`` to ``remote`` in the background."""

    def __init__(
        self,
        iteration: int,
        local: Path,
        remote: Store,
        names: Sequence[str],
        *,
        threads: int = 4,
        retries: int = 5,
        backoff_s: float = 1.0,
        chunk_bytes: int = CHUNK_BYTES,
        first: Optional[Dict[str, bytes]] = None,
        stale: Sequence[str] = (),
    ):
        self.iteration, self.local, self.remote = iteration, local, remote
        self.first = dict(first or {})
        self.stale = list(stale)
        self.names = list(names)
        self.threads, self.retries, self.backoff_s = max(1, threads), max(0, retries), backoff_s
        self.chunk_bytes = chunk_bytes
        self.state = RUNNING
        self.error: Optional[BaseException] = None
        self._cancel = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> Upload:
        self._thread = threading.Thread(
            target=self.run, name=f"distckpt-upload-{self.iteration}", daemon=True
        )
        self._thread.start()
        return self

    def run(self) -> None:
        """Upload every file (in this thread); sets ``state`` and ``error``."""
        try:
            for name in self.stale:
                self._with_retries(name, lambda n=name: self.remote.delete(n))
            for name, data in self.first.items():
                self._with_retries(name, lambda n=name, d=data: self.remote.put(n, d))
            if self.names:
                with ThreadPoolExecutor(min(self.threads, len(self.names))) as pool:
                    for _ in pool.map(self._one, self.names):
                        pass
            self.state = DONE
        except BaseException as e:  # noqa: BLE001 - reported to every rank at finalize
            self.error = e
            self.state = FAILED

    def _one(self, name: str) -> None:
        self._with_retries(
            name, lambda: copy_file(self.local, self.remote, name, self.chunk_bytes, self._cancel)
        )

    def _with_retries(self, name: str, send) -> None:
        for attempt in range(self.retries + 1):
            if self._cancel.is_set():
                raise Cancelled(f"upload of {self.local / name} cancelled")
            try:
                send()
                return
            except Cancelled:
                raise
            except FileNotFoundError as e:
                # The local copy is gone (the store reports its own missing objects and buckets
                # as StoreErrors): retrying cannot help.
                raise CheckpointingException(
                    f"upload of {self.local / name} failed: the local file is missing ({e})"
                ) from e
            except Exception as e:  # noqa: BLE001 - retried when it may help, reported with the file
                if isinstance(e, CheckpointingException) and not is_transient(e):
                    raise CheckpointingException(
                        f"upload of {self.local / name} to {self.remote.where(name)} failed: {e}"
                    ) from e
                if attempt == self.retries:
                    raise CheckpointingException(
                        f"upload of {self.local / name} to {self.remote.where(name)} failed after "
                        f"{attempt + 1} attempts: {e}"
                    ) from e
                delay = min(MAX_BACKOFF_S, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
                if self._cancel.wait(delay):
                    raise Cancelled(f"upload of {self.local / name} cancelled") from e

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the upload to end; True if it did."""
        if self._thread is None:
            return self.state != RUNNING
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self) -> None:
        self._cancel.set()
