"""Staging memory: the one process-wide pool of host buffers that async saves copy tensors into.

An async save copies the tensors it writes into host memory (pinned for CUDA tensors) before it
returns. Allocating and pinning that memory is the expensive part of a first save, so the
buffers are kept and reused (docs/async-and-parallel.md):

* :func:`pool` is the process's :class:`StagingPool`: every save strategy that stages (the
  ``torch_dist`` and ``zarr`` async saves, through the fully parallel wrapper too, and the local
  tier's async save) takes its buffers from it, whichever strategy object saves. Thread-safe.
* A buffer is reused only for a copy of the same byte count, dtype and pinnedness
  (:data:`PoolKey`); one handed out stays out until its save's writer gives it back.
* The pool never holds more than the host memory budget
  (:func:`distckpt.budget.host_memory_budget`): free buffers that a request does not need are
  dropped first; when buffers of another save still in flight hold the rest, the request waits
  for them to come back, at most the collective timeout, then raises a
  :class:`~distckpt.core.CheckpointingException`. One copy larger than the budget is allowed
  when nothing else is held (a bounded save stages such an item in a wave of its own).
* Each save trims the free buffers to what it needs (:meth:`StagingPool.keep_only`), so the
  pool shrinks with the state; :func:`release_staging_memory` frees them all (also at
  interpreter exit) and :func:`~distckpt.strategies.staging.prepare_staging` allocates them
  ahead of the first save (it reads a sharded state dict, so it sits with the strategies).

:class:`~distckpt.io.staging_buffers.StagingBuffers` is one save's view of a pool (its copies not
yet sealed, its prestaged copies).
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from distckpt import dist
from distckpt.budget import host_memory_budget
from distckpt.core import CheckpointingException
from distckpt.io.device_io import release_slots

# Its name from before the move to distckpt.io, so that log filters set for it keep working.
logger = logging.getLogger("distckpt.strategies.staging")

__all__ = [
    "EXACT_PIN_BYTES",
    "PinnedRegistration",
    "PoolKey",
    "StagingPool",
    "key_of",
    "pinned_empty",
    "pool",
    "release_staging_memory",
]

# A buffer's pool key: (bytes, dtype, pinned).
PoolKey = Tuple[int, torch.dtype, bool]

# Staging buffers of at least this size are pinned by registering an ordinary allocation (exact
# size); smaller ones come from torch's pinned allocator.
EXACT_PIN_BYTES = 1 << 20


class PinnedRegistration:
    """Keeps ``tensor``'s memory page-locked (``cudaHostRegister``) until this object goes. It
    holds the tensor, so the memory is unregistered before it can be freed."""

    __slots__ = ("tensor", "ptr")

    def __init__(self, tensor: torch.Tensor, ptr: int):
        self.tensor = tensor
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass


def pinned_empty(numel: int, dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[PinnedRegistration]]:
    """A CPU tensor of ``numel`` elements in page-locked memory, pinned to its exact size, and
    the registration to keep while it is used (None: torch's allocator owns the pinning).

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
    rounds every block up to a power of two: a 48 MiB tensor holds 64 MiB of pinned memory, and a
    staging pool of a model's tensors up to twice the model. Here an ordinary allocation is
    registered with CUDA instead; small buffers, and any whose registration fails, use torch's
    allocator.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < EXACT_PIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True), None
    out = torch.empty(numel, dtype=dtype)
    cudart = torch.cuda.cudart()
    ptr = out.data_ptr()
    if cudart.cudaHostRegister(ptr, nbytes, 0) != cudart.cudaError.success:
        logger.debug("cudaHostRegister of %d bytes failed; torch's pinned allocator instead", nbytes)
        return torch.empty(numel, dtype=dtype, pin_memory=True), None
    return out, PinnedRegistration(out, ptr)


def key_of(tensor: torch.Tensor) -> PoolKey:
    """The pool key a copy of ``tensor`` is staged under."""
    return (tensor.numel() * tensor.element_size(), tensor.dtype, tensor.device.type == "cuda")


# --------------------------------------------------------------------------- the pool


class StagingPool:
    """Host buffers by :data:`PoolKey`, at most ``budget()`` bytes of them (free and handed out).

    Args:
        budget: bytes the pool may hold, asked at each allocation (default:
            :func:`distckpt.budget.host_memory_budget`).
        timeout: seconds a request waits for buffers of a save in flight (default:
            :func:`distckpt.dist.collective_timeout`).

    Attributes (read them, do not set them): ``allocated_bytes`` (free and handed out),
    ``staged_bytes`` (handed out), ``peak_staged_bytes`` and ``peak_allocated_bytes`` (the most
    at any one time since :meth:`reset_peak`), ``allocations`` (buffers allocated so far).
    """

    def __init__(
        self, budget: Optional[Callable[[], int]] = None, timeout: Optional[Callable[[], float]] = None
    ):
        self._budget = budget or host_memory_budget
        self._timeout = timeout or dist.collective_timeout
        # A plain lock (not reentrant): a finalizer that runs while this thread holds it hands its
        # buffers over through _orphans instead of re-entering (give_back_later).
        self._cond = threading.Condition(threading.Lock())
        self._orphans: List[List[Tuple[PoolKey, torch.Tensor]]] = []
        self._free: Dict[PoolKey, List[torch.Tensor]] = collections.defaultdict(list)
        # Exactly pinned buffers (see pinned_empty), by address: dropped with their buffer.
        self._registrations: Dict[int, PinnedRegistration] = {}
        self._out = 0
        self.allocated_bytes = 0
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.peak_allocated_bytes = 0
        self.allocations = 0  # buffers allocated so far (a save that reuses the pool adds none)

    key_of = staticmethod(key_of)

    @property
    def in_use(self) -> int:
        """Buffers handed out and not yet given back."""
        with self._cond:
            self._adopt()
            return self._out

    @property
    def pinned_registrations(self) -> int:
        """Buffers pinned to their exact size (``cudaHostRegister``) that the pool holds."""
        with self._cond:
            return len(self._registrations)

    def reset_peak(self) -> None:
        """Start a new measurement of the peaks (from what is held now)."""
        with self._cond:
            self.peak_staged_bytes = self.staged_bytes
            self.peak_allocated_bytes = self.allocated_bytes

    # ------------------------------------------------------------------ handing out

    def take(self, key: PoolKey, own_bytes: int = 0, wait: bool = True) -> Optional[torch.Tensor]:
        """A 1-D buffer for ``key``, free or newly allocated (pinned when ``key`` says so).

        ``own_bytes``: bytes the asking save holds already (waiting for those would never end).
        Within the budget, free buffers of other keys are dropped first; then, if buffers of
        other saves are out, the request waits for them (``wait``; else returns None), at most
        the timeout. Raises CheckpointingException when the budget cannot hold the buffer.
        """
        nbytes, dtype, pinned = key
        deadline = None
        with self._cond:
            while True:
                self._adopt()
                free = self._free.get(key)
                if free:
                    buffer = free.pop()
                    if not free:
                        del self._free[key]
                    self._hand_out(nbytes)
                    return buffer
                budget = self._budget()
                self._drop_free(budget - nbytes)
                # One copy larger than the budget may be staged when nothing else is held.
                if self.allocated_bytes + nbytes <= budget or self.allocated_bytes == 0:
                    self.allocated_bytes += nbytes
                    self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
                    self._hand_out(nbytes)
                    break
                others = self.staged_bytes - own_bytes
                if not wait:
                    return None
                if others <= 0:
                    raise CheckpointingException(
                        f"rank {dist.get_rank()}: staging {nbytes} more bytes for this save would exceed "
                        f"the host memory budget of {budget} bytes ({own_bytes} staged by it already): "
                        "raise DISTCKPT_HOST_MEMORY_BUDGET"
                    )
                timeout = self._timeout()
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CheckpointingException(
                        f"rank {dist.get_rank()}: staging {nbytes} bytes for this save would exceed the "
                        f"host memory budget of {budget} bytes while {others} bytes are held by "
                        f"another save in flight; waited {timeout:g} s (the collective timeout) for "
                        f"them to be written: finalize the earlier async save first"
                    )
                self._cond.wait(min(remaining, _POLL_S))
        try:
            return self._allocate(key)
        except BaseException:
            with self._cond:
                self.allocated_bytes -= nbytes
                self.staged_bytes -= nbytes
                self._out -= 1
                self._cond.notify_all()
            raise

    def _hand_out(self, nbytes: int) -> None:
        self._out += 1
        self.staged_bytes += nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _allocate(self, key: PoolKey) -> torch.Tensor:
        nbytes, dtype, pinned = key
        numel = nbytes // dtype.itemsize
        self.allocations += 1
        if not pinned:
            return torch.empty(numel, dtype=dtype)
        buffer, registration = pinned_empty(numel, dtype)
        if registration is not None:
            with self._cond:
                self._registrations[buffer.data_ptr()] = registration
        return buffer

    def give_back(self, buffers: Iterable[Tuple[PoolKey, torch.Tensor]]) -> None:
        """Return handed-out buffers to the free lists (a waiting request may take them)."""
        with self._cond:
            self._adopt()
            self._return(buffers)
            self._cond.notify_all()

    def _return(self, buffers: Iterable[Tuple[PoolKey, torch.Tensor]]) -> None:
        for key, buffer in buffers:
            self._free[key].append(buffer)
            self.staged_bytes -= key[0]
            self._out -= 1

    def give_back_later(self, buffers: List[Tuple[PoolKey, torch.Tensor]]) -> None:
        """:meth:`give_back` from a finalizer: never blocks and never re-enters the lock (the
        buffers wait in a list for the next call that holds it, if it is taken now)."""
        self._orphans.append(buffers)
        if self._cond.acquire(blocking=False):
            try:
                self._adopt()
                self._cond.notify_all()
            finally:
                self._cond.release()

    def _adopt(self) -> None:
        """Take in the buffers finalizers gave back (lock held)."""
        while self._orphans:
            self._return(self._orphans.pop())

    # ------------------------------------------------------------------ shrinking

    def _drop(self, key: PoolKey, count: int) -> None:
        """Drop ``count`` free buffers of ``key`` (lock held)."""
        bufs = self._free[key]
        for buf in bufs[len(bufs) - count :]:
            self._registrations.pop(buf.data_ptr(), None)  # unpinned before it is freed
        del bufs[len(bufs) - count :]
        self.allocated_bytes -= count * key[0]
        if not bufs:
            del self._free[key]

    def _drop_free(self, target: int) -> None:
        """Drop free buffers, largest first, until at most ``target`` bytes are held (lock held)."""
        for key in sorted(self._free, key=lambda k: -k[0]):
            if self.allocated_bytes <= target:
                return
            excess = self.allocated_bytes - target
            self._drop(key, min(len(self._free[key]), -(-excess // max(1, key[0]))))

    def keep_only(self, keys: Dict[PoolKey, int]) -> None:
        """Drop the free buffers beyond ``keys`` (pool key -> how many to keep): a save keeps what
        it needs, so the pool shrinks when the state does."""
        with self._cond:
            self._adopt()
            for key in list(self._free):
                extra = len(self._free[key]) - keys.get(key, 0)
                if extra > 0:
                    self._drop(key, extra)

    def release_free(self) -> int:
        """Free every free buffer; returns the bytes freed."""
        with self._cond:
            self._adopt()
            before = self.allocated_bytes
            for key in list(self._free):
                self._drop(key, len(self._free[key]))
            return before - self.allocated_bytes

    def wait_until_returned(self, timeout: float) -> bool:
        """Wait until no buffer is handed out (at most ``timeout`` s); whether none is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._adopt()
                if not self._out:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, _POLL_S))

    def reserve(self, keys: List[PoolKey]) -> int:
        """Make free buffers ready for ``keys`` (one per entry), largest first, within the budget;
        other free buffers are dropped. Returns the bytes of free buffers now held for them."""
        wanted = collections.Counter(keys)
        self.keep_only(wanted)
        for key in sorted(wanted, key=lambda k: -k[0]):
            while True:
                with self._cond:
                    if len(self._free.get(key, ())) >= wanted[key]:
                        break
                    if self.allocated_bytes + key[0] > self._budget():
                        break
                    self.allocated_bytes += key[0]
                    self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
                try:
                    buffer = self._allocate(key)
                except BaseException:
                    with self._cond:
                        self.allocated_bytes -= key[0]
                    raise
                with self._cond:
                    self._free[key].append(buffer)
                    self._cond.notify_all()
        with self._cond:
            return sum(min(n, len(self._free.get(k, ()))) * k[0] for k, n in wanted.items())


# How often a wait looks for buffers that finalizers gave back (they do not notify).
_POLL_S = 0.1

_POOL: Optional[StagingPool] = None
_POOL_LOCK = threading.Lock()


def pool() -> StagingPool:
    """The process-wide staging pool (created on first use)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = StagingPool()
    return _POOL


def release_staging_memory(timeout: Optional[float] = None) -> int:
    """Free every staging buffer of the process-wide pool; returns the bytes freed.

    Buffers held by an async save in flight are waited for (at most ``timeout`` s, default the
    collective timeout) and freed when they come back; free ones are freed at once. Raises
    CheckpointingException if some are still held after the timeout (finalize the save first).
    Pinned memory from torch's host allocator (buffers under 1 MiB) is returned to the system
    too. Called at interpreter exit (without waiting).
    """
    p = pool()
    freed = p.release_free()
    returned = p.wait_until_returned(dist.collective_timeout() if timeout is None else timeout)
    freed += p.release_free() + release_slots()  # and the load/save pipelines' pinned slots
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # torch's cached pinned blocks
    if empty_host_cache is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty_host_cache()
    if not returned:
        raise CheckpointingException(
            f"rank {dist.get_rank()}: release_staging_memory: {p.staged_bytes} bytes of staging "
            f"memory are still held by an async save in flight; finalize it first "
            f"({freed} free bytes were released)"
        )
    return freed


@atexit.register
def _release_at_exit() -> None:
    if _POOL is not None:
        try:
            _POOL.release_free()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass
