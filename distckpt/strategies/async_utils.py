"""Background saving: AsyncRequest, AsyncCallsQueue, and the StagingBuffers pool for staged bytes.

Knows nothing of file formats. A strategy splits a save in three parts:

1. *staging* (blocking, in the training thread, done by the strategy): copy the local bytes off
   the device, e.g. with :class:`StagingBuffers`, so training may change the tensors again;
2. ``async_fn(*async_fn_args)`` (a background worker thread): write the staged bytes. It must not
   use any process group;
3. ``finalize_fns`` (the training thread, every rank, in order): e.g. write the index and commit.
   They may use collectives.

An :class:`AsyncCallsQueue` runs part 2 and, when every rank's part 2 is done, part 3::

    queue = AsyncCallsQueue()
    request = AsyncRequest(write_files, (plan,), [write_metadata, commit])
    queue.schedule_async_request(request)         # returns at once; writing starts now
    ...                                           # training goes on
    queue.maybe_finalize_async_calls()            # each step, on every rank: commits what is done
    queue.close()                                 # at exit: waits, finalizes everything

Who calls what: every rank schedules the same requests in the same order and calls
:meth:`AsyncCallsQueue.maybe_finalize_async_calls` the same number of times (each call may run a
collective), e.g. once per training step. ``close(abort=True)`` runs no collective and may be
called on one rank alone (from an exception handler).

Why a thread and not a worker process: the writer spends its time in ``os.pwrite`` and CRC32C,
both C code that releases the GIL, so a thread overlaps with training as well as a process does,
needs no copy of the staged bytes into shared memory, and no process start. The measurement is in
docs/async-and-parallel.md.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from distckpt import dist
from distckpt.core import CheckpointingException

logger = logging.getLogger(__name__)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "StagingBuffers", "StagedBatch"]


# --------------------------------------------------------------------------- requests


@dataclass
class AsyncRequest:
    """One background save: ``async_fn(*async_fn_args)`` in a worker, then ``finalize_fns``.

    Attributes:
        async_fn: runs in the background worker; must not use a process group. None when there
            is nothing to do in the background (only finalization).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: zero-argument functions run in order, in the training thread, on every
            rank, once every rank's ``async_fn`` has returned. They may use collectives; when one
            fails it must fail on every rank alike (as ``SaveShardedStrategy.save`` does).

    A request is frozen when it is scheduled: from then on it cannot be changed.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...] = ()
    finalize_fns: List[Callable[[], None]] = field(default_factory=list)
    _frozen: bool = field(default=False, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise CheckpointingException(f"AsyncRequest is frozen (already scheduled); cannot set {name!r}")
        super().__setattr__(name, value)

    @property
    def is_frozen(self) -> bool:
        return self._frozen

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        """Append a function to run at finalization, after those already there."""
        if self._frozen:
            raise CheckpointingException(
                "AsyncRequest is frozen (already scheduled); cannot add a finalize fn"
            )
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """Make the request immutable (finalize_fns become a tuple); returns it."""
        if not self._frozen:
            self.async_fn_args = tuple(self.async_fn_args)
            self.finalize_fns = tuple(self.finalize_fns)  # type: ignore[assignment]
            super().__setattr__("_frozen", True)
        return self

    def execute_sync(self, no_dist: bool = False) -> None:
        """Run the whole request now, in the calling thread: ``async_fn``, then ``finalize_fns``.

        Every rank calls it. If ``async_fn`` fails on any rank, every rank raises the same
        CheckpointingException and no finalize fn runs anywhere. Costs one tiny all-reduce
        (none with ``no_dist``).
        """
        exc: Optional[BaseException] = None
        try:
            if self.async_fn is not None:
                self.async_fn(*self.async_fn_args)
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            exc = e
        _agree_on_failure("synchronous save", exc, no_dist)
        for fn in self.finalize_fns:
            fn()


def _agree_on_failure(stage: str, exc: Optional[BaseException], no_dist: bool) -> None:
    """Raise the same error on every rank if ``exc`` is set on any; one tiny all-reduce on success."""
    if no_dist:
        if exc is not None:
            _raise_local(stage, exc)
        return
    (failed,) = dist.all_reduce_max([int(exc is not None)], stage=stage)
    if failed:
        dist.sync_errors(stage, exc)


def _raise_local(stage: str, exc: BaseException) -> None:
    if isinstance(exc, CheckpointingException):
        raise exc
    rank = dist.get_rank()
    raise dist.RankErrors(
        stage, {rank: f"{type(exc).__name__}: {exc}"}, {rank: dist.describe_error(exc)}
    ) from exc


# --------------------------------------------------------------------------- workers


class _ThreadWorker:
    """Runs submitted functions in order in background daemon thread(s).

    ``persistent``: one long-lived thread serves every request, one after the other. Otherwise
    each request gets a thread of its own, started at submission (requests then overlap).
    Daemon threads: an aborted queue never keeps the interpreter alive.
    """

    def __init__(self, persistent: bool):
        self.persistent = persistent
        self._jobs: collections.deque[Tuple[Future, Callable[[], Any]]] = collections.deque()
        self._wakeup = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if not self.persistent:
            threading.Thread(
                target=_run_job, args=(future, fn), name="distckpt-async-save", daemon=True
            ).start()
            return future
        with self._wakeup:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="distckpt-async-save", daemon=True)
                self._thread.start()
            self._jobs.append((future, fn))
            self._wakeup.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._jobs and not self._stopping:
                    self._wakeup.wait()
                if not self._jobs:
                    return
                future, fn = self._jobs.popleft()
            _run_job(future, fn)

    def shutdown(self, wait: bool) -> None:
        """Stop the thread once its jobs are done (``wait``: join it). Cancel jobs first to drop them."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
            thread = self._thread
        if wait and thread is not None:
            thread.join()


def _run_job(future: Future, fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - reported at finalization
        future.set_exception(e)


# --------------------------------------------------------------------------- queue


@dataclass
class _Call:
    idx: int
    request: AsyncRequest
    future: Future


class AsyncCallsQueue:
    """Runs AsyncRequests in the background and finalizes them in order once done on all ranks.

    Args:
        persistent: one background thread serves every request in turn (the default), rather
            than one new thread per request.

    Every rank must schedule the same requests in the same order and call
    :meth:`maybe_finalize_async_calls` the same number of times: a call that finds work in the
    queue runs one small all-reduce over the default process group.
    """

    def __init__(self, persistent: bool = True):
        self._worker = _ThreadWorker(persistent)
        self._calls: Deque[_Call] = collections.deque()
        self._next_idx = 0
        self._closed = False

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Freeze ``request`` and start its ``async_fn`` in the background; return its call index.

        Call indices count from 0 in scheduling order, the same on every rank. No collective.
        """
        if self._closed:
            raise CheckpointingException("AsyncCallsQueue is closed; cannot schedule a request")
        request.freeze()
        fn, args = request.async_fn, request.async_fn_args
        if fn is None:
            future: Future = Future()
            future.set_result(None)
        else:
            future = self._worker.submit(lambda: fn(*args))
        call = _Call(self._next_idx, request, future)
        self._next_idx += 1
        self._calls.append(call)
        return call.idx

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not yet finalized (nor dropped after a failure)."""
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, in order, the oldest requests whose background work is done on every rank.

        Args:
            blocking: first wait until this rank's background work is all done (then every
                request is finalized, up to a failed one).
            no_dist: decide from this rank alone, with no collective (single-process use).

        Returns:
            The call indices finalized by this call, in order.

        Raises:
            CheckpointingException (the same on every rank): the background work of the oldest
                unfinalized request failed on some rank; the message names the rank and its
                error. That request is dropped without running its finalize fns; requests
                finalized before it stay finalized and later ones stay queued, unaffected.
        """
        if self._closed:
            raise CheckpointingException("AsyncCallsQueue is closed")
        if not self._calls:
            # Every rank scheduled the same requests, so every rank returns here alike.
            return []
        if blocking:
            for call in self._calls:
                _wait_quietly(call.future)
        done = 0
        for call in self._calls:
            if not call.future.done():
                break
            done += 1
        failed_at = next(
            (i for i, c in enumerate(list(self._calls)[:done]) if c.future.exception() is not None), done
        )
        if no_dist:
            ready, first_failure = done, failed_at
        else:
            # min over ranks as -max(-x): how many are done everywhere, where the first failure is.
            neg_ready, neg_failure = dist.all_reduce_max([-done, -failed_at], stage="async finalize")
            ready, first_failure = -neg_ready, -neg_failure

        finalized: List[int] = []
        for _ in range(min(ready, first_failure)):
            call = self._calls.popleft()
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.idx)
        if first_failure < ready:
            call = self._calls.popleft()
            exc = call.future.exception()
            stage = f"async save (call {call.idx})"
            logger.error("%s failed; its finalization (commit) is skipped", stage)
            _agree_on_failure(stage, exc, no_dist)
        return finalized

    def close(self, abort: bool = False) -> None:
        """Shut the queue down.

        ``abort=False`` (every rank calls it): wait for all background work and finalize every
        request (collectives); if some failed, the first such error is raised, the same on every
        rank, after the rest were finalized.
        ``abort=True`` (any rank alone, no collective): stop waiting. Requests not started are
        cancelled, none is finalized, so nothing is committed; a write already running finishes
        in its daemon thread and is left uncommitted.
        """
        if self._closed:
            return
        if abort:
            self._abort()
            return
        first_error: Optional[CheckpointingException] = None
        try:
            while self._calls:
                try:
                    self.maybe_finalize_async_calls(blocking=True)
                except CheckpointingException as e:
                    first_error = first_error or e
        except BaseException:
            self._abort()
            raise
        self._closed = True
        self._worker.shutdown(wait=True)
        if first_error is not None:
            raise first_error

    def _abort(self) -> None:
        self._closed = True
        dropped = [c.idx for c in self._calls]
        for call in self._calls:
            call.future.cancel()
        self._calls.clear()
        self._worker.shutdown(wait=False)
        if dropped:
            logger.warning(
                "AsyncCallsQueue aborted; calls %s were not finalized (nothing committed)", dropped
            )

    def __del__(self) -> None:
        if getattr(self, "_calls", None) and not self._closed:
            logger.warning(
                "AsyncCallsQueue dropped with %d unfinalized calls; call close()", len(self._calls)
            )


def _wait_quietly(future: Future) -> None:
    try:
        future.exception()
    except BaseException:  # noqa: BLE001 - a cancelled future; handled by the caller
        pass


# --------------------------------------------------------------------------- staging buffers


_PoolKey = Tuple[int, torch.dtype, bool]


# Staging buffers of at least this size are pinned by registering an ordinary allocation (exact
# size); smaller ones come from torch's pinned allocator.
EXACT_PIN_BYTES = 1 << 20


class _Registration:
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


def pinned_empty(numel: int, dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[_Registration]]:
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
    return out, _Registration(out, ptr)


class StagedBatch:
    """The host buffers staged for one save; ``release()`` returns them to their pool."""

    def __init__(self, owner: StagingBuffers, buffers: List[Tuple[_PoolKey, torch.Tensor]]):
        self._owner = owner
        self._buffers = buffers

    @property
    def nbytes(self) -> int:
        return sum(key[0] for key, _ in self._buffers)

    def release(self) -> None:
        """Give the buffers back (idempotent). Call once the writer is done with them."""
        with self._owner._lock:
            buffers, self._buffers = self._buffers, []
        self._owner._give_back(buffers)


class StagingBuffers:
    """A pool of host buffers for staging tensors before a background write, reused across saves.

    Buffers are keyed by ``(nbytes, dtype, pinned)``; CUDA tensors are staged into pinned memory,
    CPU tensors into ordinary memory. A buffer handed out stays out of the pool until it is
    released, so a new save never gets a buffer that a running writer still reads.

    One save::

        copies = [staging.acquire(t) for t in tensors]   # training thread
        batch = staging.seal()                           # one CUDA synchronize, if any
        ... the writer writes ``copies``, then calls ``batch.release()`` ...

    ``release_all()`` releases every buffer handed out so far, sealed or not: use it when no
    writer can still be reading them (e.g. once the previous save was finalized). Thread-safe:
    the writer thread may release while the training thread acquires.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: Dict[_PoolKey, List[torch.Tensor]] = collections.defaultdict(list)
        self._open: List[Tuple[_PoolKey, torch.Tensor]] = []
        self._sealed: List[StagedBatch] = []
        self._cuda_devices: set = set()
        # Copies started ahead of the save's planning (prestage), by the source's identity.
        self._early: Dict[tuple, List[torch.Tensor]] = collections.defaultdict(list)
        # Exactly pinned buffers (see pinned_empty), by address: dropped with their buffer.
        self._registrations: Dict[int, _Registration] = {}
        self.allocated_bytes = 0
        # Bytes handed out and not yet released, and the most of them at any one time.
        self.staged_bytes = 0
        self.peak_staged_bytes = 0

    def reset_peak(self) -> None:
        """Start a new measurement of :attr:`peak_staged_bytes` (from what is out now)."""
        with self._lock:
            self.peak_staged_bytes = self.staged_bytes

    def acquire(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (same shape and dtype, contiguous) in a pooled buffer.

        For a CUDA tensor the copy is asynchronous: call :meth:`seal` before reading it.
        """
        if self._early:
            early = self._early.get(self._identity(tensor))
            if early:
                return early.pop()
        device = tensor.device
        if device.type not in ("cpu", "cuda"):
            raise CheckpointingException(f"cannot stage a tensor on device {device} (only cpu and cuda)")
        on_cuda = device.type == "cuda"
        key = (tensor.numel() * tensor.element_size(), tensor.dtype, on_cuda)
        with self._lock:
            free = self._free.get(key)
            buffer = free.pop() if free else None
        if buffer is None:
            if on_cuda:
                buffer, registration = pinned_empty(tensor.numel(), tensor.dtype)
                if registration is not None:
                    with self._lock:
                        self._registrations[buffer.data_ptr()] = registration
            else:
                buffer = torch.empty(tensor.numel(), dtype=tensor.dtype)
            self.allocated_bytes += key[0]
        out = buffer.view(tensor.shape)
        out.copy_(tensor.detach(), non_blocking=on_cuda)
        with self._lock:
            self._open.append((key, buffer))
            self.staged_bytes += key[0]
            self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        if on_cuda:
            self._cuda_devices.add(device)
        return out

    @staticmethod
    def _identity(tensor: torch.Tensor) -> tuple:
        """Same memory, same view: the same bytes (within one save call)."""
        return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device)

    def prestage(self, tensor: torch.Tensor) -> None:
        """Start the copy of ``tensor`` now; the save's :meth:`acquire` of the same tensor (same
        memory and view) then returns it instead of copying again. A CUDA save issues every
        device-to-host copy first and plans while they run."""
        out = self.acquire(tensor)
        self._early[self._identity(tensor)].append(out)

    def _wait_for_copies(self) -> None:
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)
        self._cuda_devices.clear()

    def discard_unsealed(self) -> None:
        """A save failed before :meth:`seal`: wait for its copies, give its buffers back."""
        self._wait_for_copies()
        with self._lock:
            open_buffers, self._open = self._open, []
            self._early.clear()
        self._give_back(open_buffers)

    def seal(self) -> StagedBatch:
        """End the current save's staging: wait once for CUDA copies; return its buffers' batch
        (prestaged copies the save did not take included)."""
        self._early.clear()
        self._wait_for_copies()
        with self._lock:
            batch = StagedBatch(self, self._open)
            self._open = []
            self._sealed.append(batch)
        return batch

    def release_all(self) -> None:
        """Return every handed-out buffer to the pool (only when no writer is still reading one)."""
        with self._lock:
            batches, self._sealed = self._sealed, []
            open_buffers, self._open = self._open, []
        for batch in batches:
            batch.release()
        self._give_back(open_buffers)

    @property
    def in_use(self) -> int:
        """Buffers handed out and not yet released."""
        with self._lock:
            return len(self._open) + sum(len(b._buffers) for b in self._sealed)

    def keep_only(self, keys: Dict[_PoolKey, int]) -> None:
        """Drop the pooled (free) buffers beyond ``keys`` (pool key -> how many to keep): before a
        wave of a bounded save, so the pool holds no more than the wave needs."""
        with self._lock:
            for key in list(self._free):
                bufs = self._free[key]
                extra = len(bufs) - keys.get(key, 0)
                if extra > 0:
                    for buf in bufs[len(bufs) - extra :]:
                        self._registrations.pop(buf.data_ptr(), None)  # unpinned before it is freed
                    del bufs[len(bufs) - extra :]
                    self.allocated_bytes -= extra * key[0]
                if not bufs:
                    del self._free[key]

    @staticmethod
    def key_of(tensor: torch.Tensor) -> _PoolKey:
        """The pool key a copy of ``tensor`` is staged under."""
        return (tensor.numel() * tensor.element_size(), tensor.dtype, tensor.device.type == "cuda")

    def _give_back(self, buffers: List[Tuple[_PoolKey, torch.Tensor]]) -> None:
        with self._lock:
            for key, buffer in buffers:
                self._free[key].append(buffer)
                self.staged_bytes -= key[0]
            self._sealed = [b for b in self._sealed if b._buffers]
