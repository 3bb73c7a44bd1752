"""One save's view of the staging pool: tensors copied into pooled host buffers, sealed, given back.

:class:`StagingBuffers` hands a save its copies out of a :class:`~distckpt.io.staging.StagingPool`
(the process-wide :func:`~distckpt.io.staging.pool` when a strategy saves): CUDA tensors into
pinned memory, copied on the caller's current stream, CPU tensors into ordinary memory. Copies
may start before the save plans (:meth:`StagingBuffers.prestage`), and are found again by the
bytes they hold (:func:`identity` and the version counter). :meth:`StagingBuffers.seal` ends the
save's staging with one CUDA synchronize and returns its :class:`StagedBatch`, which the writer
gives back when it is done (or which gives its buffers back when it is collected).
``StagingBuffers()`` without a pool makes a private pool.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from distckpt.core import CheckpointingException
from distckpt.io.staging import PoolKey, StagingPool, key_of

__all__ = ["StagedBatch", "StagingBuffers", "identity"]


class StagedBatch:
    """The host buffers staged for one save; ``release()`` returns them to their pool.

    A batch dropped without ``release()`` (its save abandoned) gives its buffers back when it is
    collected."""

    def __init__(self, owner: StagingBuffers, buffers: List[Tuple[PoolKey, torch.Tensor]]):
        self._pool = owner.pool
        self._owner = weakref.ref(owner)
        self._lock = threading.Lock()
        self._buffers = buffers

    @property
    def nbytes(self) -> int:
        return sum(key[0] for key, _ in self._buffers)

    def release(self) -> None:
        """Give the buffers back (idempotent). Call once the writer is done with them."""
        with self._lock:
            buffers, self._buffers = self._buffers, []
        if buffers:
            self._pool.give_back(buffers)
        owner = self._owner()
        if owner is not None:
            owner.forget(self)

    def __del__(self) -> None:
        try:
            buffers, self._buffers = self._buffers, []
            if buffers:
                self._pool.give_back_later(buffers)
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


class _Early:
    """A copy started by :meth:`StagingBuffers.prestage`: the source (kept alive, so no other
    tensor can take its memory) and its version counter when the copy began."""

    __slots__ = ("source", "copy", "version")

    def __init__(self, source: torch.Tensor, copy: torch.Tensor, version: int):
        self.source = source
        self.copy = copy
        self.version = version


def _version_of(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def identity(tensor: torch.Tensor) -> tuple:
    """What a prestaged copy is found by: the storage (its object, address and size), the view
    on it (offset, shape, strides) and the dtype. Two tensors with the same identity whose
    version counter has not moved hold the same bytes."""
    storage = tensor.untyped_storage()
    return (
        storage._cdata,
        storage.data_ptr(),
        storage.nbytes(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.device,
    )


class StagingBuffers:
    """One saver's view of a :class:`StagingPool`: copies tensors into pooled host buffers.

    Args:
        pool: the pool to take buffers from; None: a private pool of its own (strategies pass
            :func:`pool`, the process-wide one).

    CUDA tensors are staged into pinned memory (``copy_(non_blocking=True)`` on the caller's
    current stream), CPU tensors into ordinary memory. One save::

        copies = [staging.acquire(t) for t in tensors]   # training thread
        batch = staging.seal()                           # one CUDA synchronize, if any
        ... the writer writes ``copies``, then calls ``batch.release()`` ...

    ``release_all()`` releases every buffer handed out through this object, sealed or not: use it
    when no writer can still be reading them. Thread-safe: the writer thread may release while
    the training thread acquires.
    """

    def __init__(self, pool: Optional[StagingPool] = None) -> None:
        self.pool = pool if pool is not None else StagingPool()
        self._lock = threading.Lock()
        self._open: List[Tuple[PoolKey, torch.Tensor]] = []
        self._open_bytes = 0
        self._sealed: List[StagedBatch] = []
        self._cuda_devices: set = set()
        # Copies started ahead of the save's planning (prestage), by the source's identity.
        self._early: Dict[tuple, List[_Early]] = {}

    key_of = staticmethod(key_of)

    @property
    def allocated_bytes(self) -> int:
        return self.pool.allocated_bytes

    @property
    def peak_staged_bytes(self) -> int:
        return self.pool.peak_staged_bytes

    def reset_peak(self) -> None:
        self.pool.reset_peak()

    def keep_only(self, keys: Dict[PoolKey, int]) -> None:
        """Drop the pool's free buffers beyond ``keys`` (see :meth:`StagingPool.keep_only`)."""
        self.pool.keep_only(keys)

    def acquire(self, tensor: torch.Tensor, wait: bool = True) -> Optional[torch.Tensor]:
        """A host copy of ``tensor`` (same shape and dtype, contiguous) in a pooled buffer.

        For a CUDA tensor the copy is asynchronous: call :meth:`seal` before reading it. A
        prestaged copy of the same bytes is taken instead of copying again. ``wait=False``:
        return None instead of waiting for another save's buffers.
        """
        if self._early:
            early = self._take_early(tensor)
            if early is not None:
                return early
        return self._copy(tensor, wait)

    def _copy(self, tensor: torch.Tensor, wait: bool) -> Optional[torch.Tensor]:
        device = tensor.device
        if device.type not in ("cpu", "cuda"):
            raise CheckpointingException(f"cannot stage a tensor on device {device} (only cpu and cuda)")
        on_cuda = device.type == "cuda"
        key = key_of(tensor)
        buffer = self.pool.take(key, self._open_bytes, wait)
        if buffer is None:
            return None
        out = buffer.view(tensor.shape)
        try:
            out.copy_(tensor.detach(), non_blocking=on_cuda)
        except BaseException:
            self.pool.give_back([(key, buffer)])
            raise
        with self._lock:
            self._open.append((key, buffer))
            self._open_bytes += key[0]
        if on_cuda:
            self._cuda_devices.add(device)
        return out

    def _take_early(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The prestaged copy of exactly ``tensor``'s current bytes, or None. A copy whose source
        changed since (in place: its version counter moved) is given back, never handed out."""
        entries = self._early.get(identity(tensor))
        if not entries:
            return None
        early = entries.pop()
        if early.version == _version_of(tensor):
            return early.copy
        self._give_back_open(early.copy)  # stale: the caller copies anew
        return None

    def _give_back_open(self, copy: torch.Tensor) -> None:
        if self._cuda_devices:
            self._wait_for_copies()  # the stale copy may still be running
        with self._lock:
            for i, (key, buffer) in enumerate(self._open):
                if buffer.data_ptr() == copy.data_ptr():
                    del self._open[i]
                    self._open_bytes -= key[0]
                    break
            else:
                return
        self.pool.give_back([(key, buffer)])

    def prestage(self, tensor: torch.Tensor, wait: bool = True) -> bool:
        """Start the copy of ``tensor`` now; the save's :meth:`acquire` of the same tensor (same
        storage, view and dtype, unchanged since: see :func:`identity`) then returns it instead
        of copying again. A CUDA save issues every device-to-host copy first and plans while they
        run. Returns whether a copy was started (not for an inference tensor, which has no
        version counter, nor, with ``wait=False``, when the budget has no room now)."""
        version = _version_of(tensor)
        if version is None:
            return False
        source = tensor.detach()
        out = self._copy(source, wait)
        if out is None:
            return False
        self._early.setdefault(identity(source), []).append(_Early(source, out, version))
        return True

    def _wait_for_copies(self) -> None:
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)
        self._cuda_devices.clear()

    def discard_unsealed(self) -> None:
        """A save failed before :meth:`seal`: wait for its copies, give its buffers back."""
        self._wait_for_copies()
        with self._lock:
            open_buffers, self._open = self._open, []
            self._open_bytes = 0
            self._early.clear()
        if open_buffers:
            self.pool.give_back(open_buffers)

    def seal(self) -> StagedBatch:
        """End the current save's staging: wait once for CUDA copies; return its buffers' batch
        (prestaged copies the save did not take included)."""
        self._early.clear()
        self._wait_for_copies()
        with self._lock:
            batch = StagedBatch(self, self._open)
            self._open = []
            self._open_bytes = 0
            self._sealed.append(batch)
        return batch

    def forget(self, batch: StagedBatch) -> None:  # ``batch`` was released: stop counting it
        with self._lock:
            self._sealed = [b for b in self._sealed if b is not batch]

    def release_all(self) -> None:
        """Return every buffer handed out here to the pool (only when no writer still reads one)."""
        with self._lock:
            batches, self._sealed = self._sealed, []
        for batch in batches:
            batch.release()
        self.discard_unsealed()

    @property
    def in_use(self) -> int:
        """Buffers handed out through this object and not yet released."""
        with self._lock:
            return len(self._open) + sum(len(b._buffers) for b in self._sealed)

    def __del__(self) -> None:
        try:
            buffers, self._open = self._open, []
            if buffers:
                self._wait_for_copies()
                self.pool.give_back_later(buffers)
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass
