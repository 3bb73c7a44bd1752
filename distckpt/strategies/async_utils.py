"""Background saving: AsyncRequest and AsyncCallsQueue (the staging pool is in :mod:`distckpt.io.staging`).

Knows nothing of file formats. A strategy splits a save in three parts:

1. *staging* (blocking, in the training thread, done by the strategy): copy the local bytes off
   the device, e.g. with :class:`~distckpt.io.staging_buffers.StagingBuffers` over the
   process-wide pool, so training may change the tensors again;
2. ``async_fn(*async_fn_args)`` (a background worker thread): write the staged bytes. It must not
   use any process group;
3. ``finalize_fns`` (the training thread, every rank, in order): e.g. write the index and commit.
   They may use collectives.

When part 2 fails on some rank, every rank learns it from the same all-reduce. What happens next
depends on who wrote each finalize fn (see :func:`is_distckpt_finalize_fn`):

* a finalize fn written outside distckpt (Megatron-LM's, NVRx's local checkpoint manager's, a
  user's) still runs, as Megatron-Core's queue runs it: such a request's finalize fns are its own
  failure handling (NVRx's checks that every rank wrote, cleans up and raises its own error);
* distckpt's own finalize fns (a strategy's index write, ``save``'s commit of ``metadata.json``)
  never run after a failed write: the chain stops at the first of them with the agreed
  :class:`~distckpt.dist.RankErrors`, so nothing is committed and a finalize fn added after them
  (e.g. Megatron-LM's tracker update) does not run either.

An exception raised by a finalize fn is what the caller gets, on the rank(s) where it is raised;
every other rank gets the agreed error (also when no finalize fn raised at all).

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
import functools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Tuple

from distckpt import dist
from distckpt.core import CheckpointingException

# The staging buffers lived here before distckpt.io.staging; their names still import.
from distckpt.io.staging import EXACT_PIN_BYTES, PinnedRegistration, pinned_empty  # noqa: F401
from distckpt.io.staging_buffers import StagedBatch, StagingBuffers  # noqa: F401

logger = logging.getLogger(__name__)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "StagingBuffers", "StagedBatch", "is_distckpt_finalize_fn"]


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
            fails it must fail on every rank alike (as ``SaveShardedStrategy.save`` does). After a
            failed ``async_fn`` an :class:`AsyncCallsQueue` still runs those not written in
            distckpt (Megatron-Core's contract: they find out and clean up themselves), up to the
            first of distckpt's own; see the module docstring.

        failure_fns: zero-argument functions run on every rank, in order, when the background
            work failed on some rank (before the finalize fns above that still run): local
            clean-up of distckpt's own, which must not use a process group. An exception they
            raise is logged, not raised.

    A request is frozen when it is scheduled: from then on it cannot be changed.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...] = ()
    finalize_fns: List[Callable[[], None]] = field(default_factory=list)
    failure_fns: List[Callable[[], None]] = field(default_factory=list)
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

    def add_failure_fn(self, fn: Callable[[], None]) -> None:
        """Append a local clean-up to run if the background work fails on any rank."""
        if self._frozen:
            raise CheckpointingException(
                "AsyncRequest is frozen (already scheduled); cannot add a failure fn"
            )
        self.failure_fns.append(fn)

    def run_failure_fns(self) -> None:
        """Run the failure fns (each one's exception logged, the others still run)."""
        for fn in self.failure_fns:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - clean-up after a failure must not mask it
                logger.error("a failure fn of an async request raised %s: %s", type(e).__name__, e)

    def freeze(self) -> AsyncRequest:
        """Make the request immutable (finalize_fns become a tuple); returns it."""
        if not self._frozen:
            self.async_fn_args = tuple(self.async_fn_args)
            self.finalize_fns = tuple(self.finalize_fns)  # type: ignore[assignment]
            self.failure_fns = tuple(self.failure_fns)  # type: ignore[assignment]
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
        try:
            _agree_on_failure("synchronous save", exc, no_dist)
        except CheckpointingException:
            self.run_failure_fns()
            raise
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


_PACKAGE = __name__.split(".")[0]


def is_distckpt_finalize_fn(fn: Callable[[], Any]) -> bool:
    """Whether ``fn`` was written in distckpt itself (decided by the module that defines it).

    Those are the finalize fns distckpt's strategies and ``save`` build: index writes and the
    commit. They assume the background write succeeded, so a queue never runs them after a failed
    one. Any other finalize fn (Megatron-LM's, NVRx's, a user's) is the request owner's own and
    still runs then. ``functools.partial`` and bound methods count as the function they wrap.
    """
    for _ in range(16):  # a partial of a partial of ...: bounded
        if not isinstance(fn, functools.partial):
            break
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str):
        module = type(fn).__module__ or ""
    return module == _PACKAGE or module.startswith(_PACKAGE + ".")


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
            The background work of the oldest unfinalized request failed on some rank. That
                request is dropped: its finalize fns written outside distckpt run in order up to
                the first one of distckpt's (which, like every later one, does not run: nothing
                is committed). An exception one of them raises is raised on the rank(s) where it
                was raised; every other rank raises the same CheckpointingException
                (:class:`~distckpt.dist.RankErrors`, naming the failed rank and its error).
                Requests finalized before it stay finalized and later ones stay queued,
                unaffected.
        """
        finalized, error = self._finalize_ready(blocking, no_dist)
        if error is not None:
            raise error
        return finalized

    def _finalize_ready(self, blocking: bool, no_dist: bool) -> Tuple[List[int], Optional[BaseException]]:
        """:meth:`maybe_finalize_async_calls`, but a failed call's error is returned, not raised
        (whatever its type): :meth:`close` then finalizes the rest on every rank alike."""
        if self._closed:
            raise CheckpointingException("AsyncCallsQueue is closed")
        if not self._calls:
            # Every rank scheduled the same requests, so every rank returns here alike.
            return [], None
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
            return finalized, _finalize_failed(self._calls.popleft(), no_dist)
        return finalized, None

    def close(self, abort: bool = False) -> None:
        """Shut the queue down.

        ``abort=False`` (every rank calls it): wait for all background work and finalize every
        request (collectives); if some failed, the first such error is raised after the rest were
        finalized (as :meth:`maybe_finalize_async_calls` would have raised it on this rank).
        ``abort=True`` (any rank alone, no collective): stop waiting. Requests not started are
        cancelled, none is finalized, so nothing is committed; a write already running finishes
        in its daemon thread and is left uncommitted.
        """
        if self._closed:
            return
        if abort:
            self._abort()
            return
        first_error: Optional[BaseException] = None
        try:
            while self._calls:
                try:
                    _, error = self._finalize_ready(blocking=True, no_dist=False)
                except CheckpointingException as e:
                    error = e
                first_error = first_error or error
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


def _finalize_failed(call: _Call, no_dist: bool) -> BaseException:
    """Finalize a call whose background work failed on some rank; return what to raise here.

    Every rank runs the same collectives: the error gather (every rank learns the failed ranks'
    messages), then the request's own finalize fns, which are the same on every rank.
    """
    stage = f"async save (call {call.idx})"
    agreed: Optional[BaseException] = None
    try:
        _agree_on_failure(stage, call.future.exception(), no_dist)
    except CheckpointingException as e:
        agreed = e
    if agreed is None:  # not reached: the all-reduce said that some rank failed
        agreed = CheckpointingException(f"{stage} failed on another rank")
    call.request.run_failure_fns()
    fns = list(call.request.finalize_fns)
    for i, fn in enumerate(fns):
        if is_distckpt_finalize_fn(fn):
            logger.error(
                "%s failed; distckpt's finalization (commit) and the %d finalize fn(s) after it are "
                "skipped: %s",
                stage,
                len(fns) - i - 1,
                agreed,
            )
            return agreed
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the request's own verdict on its failure
            if e.__context__ is None:
                e.__context__ = agreed
            logger.error("%s failed; a finalize fn of the request raised %s: %s", stage, type(e).__name__, e)
            return e
    logger.error("%s failed; the request's %d finalize fn(s) ran: %s", stage, len(fns), agreed)
    return agreed


def _wait_quietly(future: Future) -> None:
    try:
        future.exception()
    except BaseException:  # noqa: BLE001 - a cancelled future; handled by the caller
        pass
