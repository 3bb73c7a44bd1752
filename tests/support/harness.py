"""A pool of ``torch.distributed`` (gloo) worker processes that tests run functions on.

Spawning a rank means importing torch (seconds on a small machine), so the pool for a world size
is spawned once per test session, on first use, and reused by every test::

    from tests.support.harness import run_ranks

    def _sum_of_ranks():                      # module level: workers import it by reference
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        return int(t)

    def test_sum(run_ranks):                  # the session fixture from tests/conftest.py
        assert run_ranks(4, _sum_of_ranks) == [6, 6, 6, 6]

Each worker is a ``spawn``-ed process with ``OMP_NUM_THREADS=1`` and no visible CUDA device that
joins a gloo process group (``init_process_group`` over a TCPStore that the parent process hosts,
as ``torchrun`` hosts one for its ranks) and then runs tasks
``(task_id, fn, args, kwargs)`` from its own pipe, answering ``(task_id, rank, ok, value)`` where
``value`` is the return value or the formatted traceback. ``run`` returns the values by rank, or
raises:

- :class:`RankFailure` when a rank raised or its process died; ``.errors`` maps every failing rank
  to its traceback text;
- :class:`RankTimeout` when ranks did not answer in time; the message holds their Python stacks.

A pool survives a run in which ranks raised, as long as its process group is still in step
afterwards (checked with an all-reduce after every run); a timeout, a dead worker or a group out
of step kills it, and the next run on that world size spawns a fresh one.

Worker output goes to the inherited stdout/stderr: pytest shows it among a test's captured
output, or live with ``-s``.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any

PROCESS_GROUP_TIMEOUT_S = 45
"""Timeout of the workers' gloo process group: a collective whose peers never come fails then."""

START_TIMEOUT_S = 180
"""Time allowed for a whole pool to import torch and join its process group."""

SYNC_CHECK_TIMEOUT_S = 15
"""Time allowed for the all-reduce that checks, after a run, that all ranks are still in step."""

GRACE_AFTER_DEATH_S = 5
"""After a worker died, how long the other ranks get to answer before the pool is killed."""

_STACK_SIGNAL = signal.SIGUSR1


class RankPoolError(AssertionError):
    """A run on the rank pool did not return normally on every rank."""


class RankFailure(RankPoolError):
    """One or more ranks raised (or their worker process died) while running a function.

    ``errors`` maps each failing rank to its traceback text; ``results`` maps each rank that
    returned to its value; ``missing`` lists ranks that never answered (possible only when a
    worker died and the pool was killed while the others were still running).
    """

    def __init__(self, message: str, errors: dict[int, str], results: dict[int, Any], missing: list[int]):
        super().__init__(message)
        self.errors = errors
        self.results = results
        self.missing = missing


class RankTimeout(RankPoolError):
    """Ranks did not answer within the timeout; the pool was killed.

    ``missing`` lists the ranks that did not answer, ``stacks`` maps each of them to the Python
    stacks of its threads, dumped just before the kill (empty where the dump did not arrive).
    """

    def __init__(
        self,
        message: str,
        missing: list[int],
        stacks: dict[int, str],
        errors: dict[int, str],
        results: dict[int, Any],
    ):
        super().__init__(message)
        self.missing = missing
        self.stacks = stacks
        self.errors = errors
        self.results = results


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _ranks(ranks) -> str:
    """``"rank 3"``, ``"ranks 0, 2"`` or ``"no rank"``."""
    ranks = sorted(ranks)
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "its pipe closed while the process was still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _check_in_step(expected: int) -> int:
    """Run on every rank after each task: one all-reduce that must see every rank."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("the default process group was destroyed by the task; the pool must be respawned")
    t = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
    dist.all_reduce(t)
    if int(t) != expected:
        raise RuntimeError(
            f"all-reduce of rank+1 gave {int(t)}, expected {expected}: collectives are out of step"
        )
    return os.getpid()


def _worker_main(rank: int, world_size: int, store_port: int, conn, stack_file: str) -> None:
    # Before torch is imported: it reads these once, at import.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's traffic on the loopback interface
    # Ctrl-C belongs to the parent, which then shuts the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    stacks = open(stack_file, "w")  # stays open: faulthandler writes to it on _STACK_SIGNAL
    faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
        )
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
    except BaseException:
        conn.send_bytes(pickle.dumps(("ready", rank, False, traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", rank, True, os.getpid())))

    home = os.getcwd()
    while True:
        try:
            task_id, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if task_id is None:
            break
        environ = dict(os.environ)
        default_dtype = torch.get_default_dtype()
        try:
            fn, args, kwargs, *env = pickle.loads(payload)
            if env:
                os.environ.update(env[0])
            answer = (task_id, rank, True, fn(*args, **kwargs))
        except BaseException:
            answer = (task_id, rank, False, traceback.format_exc())
        finally:
            # Keep tests apart: what one task changed in the process must not leak into the next.
            os.chdir(home)
            os.environ.clear()
            os.environ.update(environ)
            torch.set_default_dtype(default_dtype)
        try:
            reply = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            reply = pickle.dumps(
                (task_id, rank, False, f"the return value cannot be pickled:\n{traceback.format_exc()}")
            )
        conn.send_bytes(reply)

    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class RankPool:
    """``world_size`` worker processes in one gloo process group, spawned once and reused.

    ``run(fn, *args, **kwargs)`` calls ``fn`` on every rank and returns the values by rank. A pool
    that was killed (timeout, dead worker, collectives out of step) respawns on its next ``run``.
    Not thread-safe: one run at a time.
    """

    def __init__(self, world_size: int, start_timeout: float = START_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._ctx = get_context("spawn")
        self._task_ids = itertools.count()
        self._procs: list = []
        self._conns: list = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._store = None
        self._start()

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._tmp.name, f"stacks.rank{rank}.txt")

    def _start(self) -> None:
        from torch.distributed import TCPStore

        self._tmp = tempfile.TemporaryDirectory(prefix=f"distckpt-rankpool-w{self.world_size}-")
        # The rendezvous store lives here, on a port the system picked (no race for one); it
        # outlives any worker, and the next pool gets a fresh one.
        self._store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        for rank in range(self.world_size):
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self._store.port, child_end, self._stack_file(rank)),
                name=f"rankpool-w{self.world_size}-r{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        try:
            self._collect("ready", "start-up (import torch, init_process_group)", self.start_timeout)
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        """Terminate, then kill, every worker; close pipes; remove the temp dir."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 3
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._close()

    def _close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            if proc.exitcode is not None:
                proc.close()
        self._procs, self._conns = [], []
        self._store = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def shutdown(self, timeout: float = 5) -> None:
        """Ask the workers to leave their process group and exit; kill those that do not."""
        if not self._procs:
            return
        goodbye = pickle.dumps((None, None))
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send_bytes(goodbye)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    # -- running ------------------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: float = 60, breaks_group: bool = False, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the values, index = rank.

        ``fn`` must be a module-level function of an importable module (workers unpickle it by
        reference). Raises :class:`RankFailure` if any rank raised or died, :class:`RankTimeout`
        if not every rank answered within ``timeout`` seconds. ``breaks_group``: the task leaves
        the process group out of step on purpose (it abandons a collective); the pool is killed
        after it instead of checked, and the next run spawns a fresh one.
        """
        if not self.alive:
            self._kill()
            self._start()
        try:
            payload = pickle.dumps((fn, args, kwargs, dict(WORKER_ENV)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"cannot send {_describe(fn)} and its arguments to the ranks ({e}); the function must be "
                "defined at module level of an importable module, and its arguments must pickle"
            ) from e
        try:
            results = self._dispatch(payload, _describe(fn), timeout)
        except RankFailure:
            if breaks_group:
                self._kill()
            else:
                self._check_in_step_or_kill(after_failure=True)
            raise
        except BaseException:
            # A timeout, or an interrupt (Ctrl-C, pytest-timeout) while ranks are mid-task.
            self._kill()
            raise
        if breaks_group:
            self._kill()
        else:
            self._check_in_step_or_kill(after_failure=False)
        return results

    def _dispatch(self, payload: bytes, what: str, timeout: float) -> list:
        task_id = next(self._task_ids)
        message = pickle.dumps((task_id, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(task_id, what, timeout)

    def _check_in_step_or_kill(self, after_failure: bool) -> None:
        """Kill the pool unless one all-reduce over every rank works; after a success, also raise."""
        if not self.alive:
            return  # already killed (a worker died); the next run respawns the pool
        expected = self.world_size * (self.world_size + 1) // 2
        payload = pickle.dumps((_check_in_step, (expected,), {}))
        try:
            self._dispatch(payload, "the post-run all-reduce check", SYNC_CHECK_TIMEOUT_S)
        except RankPoolError as e:
            self._kill()
            if after_failure:
                return
            raise RankFailure(
                "every rank returned, but afterwards the ranks' process group is out of step (the "
                "ranks ran different collectives, or the task destroyed the group); the pool was "
                f"killed and will be respawned.\n{e}",
                errors=getattr(e, "errors", {}),
                results={},
                missing=getattr(e, "missing", []),
            ) from e

    def _collect(self, task_id, what: str, timeout: float) -> list:
        """Wait for every rank's answer to ``task_id``; watch for workers that die meanwhile."""
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        dead: set[int] = set()
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self._procs[rank].sentinel] = rank
            for rank in {waitables[obj] for obj in connection.wait(list(waitables), timeout=remaining)}:
                conn, proc = self._conns[rank], self._procs[rank]
                # An answer already in the pipe counts even if the process has exited since.
                message = None
                if conn.poll():
                    try:
                        message = conn.recv_bytes()
                    except (EOFError, OSError):
                        pass
                if message is not None:
                    answer_id, _, ok, value = pickle.loads(message)
                    if answer_id == task_id:
                        (results if ok else errors)[rank] = value
                        pending.discard(rank)
                    continue
                proc.join(1)
                errors[rank] = (
                    f"the worker process of rank {rank} (pid {proc.pid}) died while running {what}: "
                    f"{_exit_description(proc.exitcode)} (whatever it printed went to stderr)"
                )
                dead.add(rank)
                pending.discard(rank)
            if dead and pending:
                # Survivors blocked in a collective with a dead rank cannot finish; give those doing
                # independent work a moment, then stop waiting.
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_DEATH_S)

        if dead:
            self._kill()
        elif pending:
            stacks = self._dump_stacks(sorted(pending))
            self._kill()
            raise RankTimeout(
                self._timeout_message(what, timeout, sorted(pending), stacks, errors, results),
                missing=sorted(pending),
                stacks=stacks,
                errors=errors,
                results=results,
            )
        if errors:
            raise RankFailure(
                self._failure_message(what, errors, results, sorted(pending)),
                errors=errors,
                results=results,
                missing=sorted(pending),
            )
        return [results[rank] for rank in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each hung rank to write its Python stacks (faulthandler), and read them back."""
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, _STACK_SIGNAL)
            except OSError:
                pass
        # faulthandler writes a dump in one go from its signal handler: done once the file stops growing.
        stacks: dict[int, str] = {}
        seen: dict[int, str] = {}
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            time.sleep(0.1)
            for rank in ranks:
                try:
                    with open(self._stack_file(rank)) as f:
                        text = f.read()
                except OSError:
                    continue
                if text and text == seen.get(rank):
                    stacks[rank] = text
                seen[rank] = text
        return stacks

    def _failure_message(self, what, errors, results, missing) -> str:
        lines = [
            f"{_ranks(errors)} of {self.world_size} failed in {what}; "
            f"{_ranks(results)} returned" + (f"; {_ranks(missing)} did not answer" if missing else "") + "."
        ]
        for rank in sorted(errors):
            lines += [f"---------- rank {rank} ----------", errors[rank].rstrip()]
        return "\n".join(lines)

    def _timeout_message(self, what, timeout, missing, stacks, errors, results) -> str:
        lines = [
            f"{_ranks(missing)} of {self.world_size} did not answer within {timeout:g} s in {what}; "
            f"{_ranks(results)} returned, {_ranks(errors)} raised. The pool was killed and will be "
            "respawned by the next run."
        ]
        for rank in missing:
            stack = stacks.get(rank, "(no stack dump arrived)")
            lines += [f"---------- rank {rank}: stacks at the timeout ----------", stack.rstrip()]
        for rank in sorted(errors):
            lines += [f"---------- rank {rank} raised ----------", errors[rank].rstrip()]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Session-wide pools
# --------------------------------------------------------------------------------------------

_POOLS: dict[int, RankPool] = {}

WORKER_ENV: dict[str, str] = {}
"""Environment variables set in the workers for every task (e.g. the test S3 endpoint): a pool
spawned before a fixture set them still sees them, and a task's changes never outlive it."""


def get_pool(world_size: int) -> RankPool:
    """The session's pool for ``world_size``, spawned on first use."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


def shutdown_pools() -> None:
    """Shut down every pool of this session (pytest session end, or interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)


def run_ranks(
    world_size: int, fn: Callable, *args, timeout: float = 60, breaks_group: bool = False, **kwargs
) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of the session's pool for ``world_size``.

    Returns the per-rank values (index = rank). See :meth:`RankPool.run` for what it raises and
    for ``breaks_group``.
    """
    return get_pool(world_size).run(fn, *args, timeout=timeout, breaks_group=breaks_group, **kwargs)


def expect_all_ranks_raise(
    world_size: int, fn: Callable, *args, match: str, timeout: float = 60, **kwargs
) -> RankFailure:
    """Assert that EVERY rank raised, each with a traceback that matches the regex ``match``.

    Returns the :class:`RankFailure` so that a test can look further into ``.errors``.
    """
    try:
        values = run_ranks(world_size, fn, *args, timeout=timeout, **kwargs)
    except RankFailure as failure:
        not_raised = sorted(set(range(world_size)) - set(failure.errors))
        mismatched = sorted(r for r, text in failure.errors.items() if not re.search(match, text))
        if not_raised or mismatched:
            raise AssertionError(
                f"expected every rank to raise an error matching {match!r}; "
                + (f"{_ranks(not_raised)} did not raise; " if not_raised else "")
                + (f"{_ranks(mismatched)} raised something else; " if mismatched else "")
                + f"the run reported:\n{failure}"
            ) from failure
        return failure
    raise AssertionError(
        f"expected every rank to raise an error matching {match!r}, but every rank returned: {values!r}"
    )
