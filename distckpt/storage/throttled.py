"""A store with a bandwidth limit: any :class:`Store` whose reads and writes are paced.

Two uses: keep checkpoint uploads from taking a node's whole network (the tiered manager's
remote, say, at a fraction of the link), and stand in for a slow remote tier in benchmarks and
tests, on top of a real server (moto's S3, a directory)::

    remote = ThrottledStore(open_store("s3://bucket/run"), write_bytes_per_s=200e6)

The limit holds for the store and every :meth:`child` of it together, across threads (one token
bucket each way, with a burst of at most 1/10 s worth of bytes). Metadata calls (``size``,
``list``, ``delete``, the commit, server-side copies) pass unpaced.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distckpt.storage.base import Store, Writer


class Bucket:
    """A token bucket over a shared schedule: each transfer of ``n`` bytes reserves ``n / rate``
    seconds of it, and the caller, once its transfer is done, waits until the end of its slot.
    The transfer's own time counts towards the slot (a link slower than the limit is not slowed
    further), and credit left unused for more than 0.1 s is dropped (no long bursts)."""

    def __init__(self, rate: Optional[float]):
        self.rate = None if not rate else float(rate)
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def reserve(self, n: int) -> Optional[float]:
        """Reserve a slot for ``n`` bytes; returns when it ends (None: no limit)."""
        if self.rate is None or n <= 0:
            return None
        with self._lock:
            self._next = max(self._next, time.monotonic() - 0.1) + n / self.rate
            return self._next

    @staticmethod
    def settle(until: Optional[float]) -> None:
        """Wait until the end of a reserved slot."""
        if until is not None:
            wait = until - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    def take(self, n: int) -> None:
        """Reserve and wait (for a transfer already done)."""
        self.settle(self.reserve(n))


class _PacedWriter(Writer):
    def __init__(self, inner: Writer, bucket: Bucket):
        self.inner, self.bucket = inner, bucket

    def write(self, data) -> int:
        slot = self.bucket.reserve(memoryview(data).nbytes)
        written = self.inner.write(data)
        self.bucket.settle(slot)
        return written

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class ThrottledStore(Store):
    """``inner`` with reads and writes paced to the given rates (bytes/s; None: unlimited)."""

    def __init__(
        self,
        inner: Store,
        write_bytes_per_s: Optional[float] = None,
        read_bytes_per_s: Optional[float] = None,
        *,
        _buckets=None,
    ):
        self.inner = inner
        self.writes, self.reads = _buckets or (Bucket(write_bytes_per_s), Bucket(read_bytes_per_s))
        self.supports_rename = False
        self.supports_mmap = False  # every byte must pass through the pacing
        self.supports_conditional_put = inner.supports_conditional_put
        self.supports_ranged_read = inner.supports_ranged_read
        self.supports_versioned_put = inner.supports_versioned_put
        self.file_token = inner.file_token

    @property
    def local_root(self) -> Optional[Path]:
        return None

    @property
    def url(self) -> str:
        return self.inner.url

    def where(self, name: str) -> str:
        return self.inner.where(name)

    def child(self, name: str) -> ThrottledStore:
        return ThrottledStore(self.inner.child(name), _buckets=(self.writes, self.reads))

    def put(self, name: str, data) -> None:
        slot = self.writes.reserve(memoryview(data).nbytes)
        self.inner.put(name, data)
        self.writes.settle(slot)

    def put_if_absent(self, name: str, data) -> bool:
        slot = self.writes.reserve(memoryview(data).nbytes)
        done = self.inner.put_if_absent(name, data)
        self.writes.settle(slot)
        return done

    def get(self, name: str) -> bytes:
        data = self.inner.get(name)
        self.reads.take(len(data))
        return data

    def get_ranges(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> List[memoryview]:
        slot = self.reads.reserve(sum(lengths))
        out = self.inner.get_ranges(name, starts, lengths)
        self.reads.settle(slot)
        return out

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Dict[str, int]:
        return self.inner.list(prefix)

    def list_objects(self, prefix: str = "") -> Dict[str, int]:
        return self.inner.list_objects(prefix)

    def is_empty(self) -> bool:
        return self.inner.is_empty()

    def open_writer(self, name: str) -> Writer:
        return _PacedWriter(self.inner.open_writer(name), self.writes)

    def get_versioned(self, name: str) -> Tuple[bytes, Any]:
        return self.inner.get_versioned(name)

    def put_versioned(self, name: str, data, expected: Any) -> bool:
        return self.inner.put_versioned(name, data, expected)

    def copy(self, src: str, dst: str) -> None:
        self.inner.copy(src, dst)

    def committed_version(self, refresh: bool = False) -> Any:
        return self.inner.committed_version(refresh)

    def begin_save(self, commit_names: Sequence[str], overwrite: Optional[bool]) -> None:
        self.inner.begin_save(commit_names, overwrite)

    def commit(self, name: str, data: bytes) -> None:
        self.inner.commit(name, data)
