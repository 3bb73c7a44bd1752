"""Stages every rank checks in to, bounded: no wait of distckpt on its peers lasts forever.

Before each stage's collective every rank checks in on the default store (:func:`check_in`),
which survives a dead peer; the collectives themselves are waited for with the collective
timeout (:func:`guarded`, :func:`run_bounded`). A rank that gave up words the verdict into the
store, and every rank raises it. On a store that wakes its waiters, :func:`store_round` runs a
whole object stage through the store alone. :mod:`distckpt.dist` builds its collectives on these.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch.distributed as tdist

from distckpt.core import CheckpointingException
from distckpt.heartbeat import watching
from distckpt.process_group import (
    DECIDED,
    FOLLOWS,
    TIMEOUT_ENV,
    CollectiveTimeout,
    ProcessGroup,
    collective_timeout,
    default_store,
    get_rank,
    get_world_size,
    group_id,
    group_name,
    group_ranks,
    heartbeat_grace,
    is_initialized,
    one_line,
)

T = TypeVar("T")

# Per group (its global ranks): how many check-ins this process made. Every rank makes the same
# sequence of check-ins, so the counters agree and name the same keys.
check_ins: Dict[str, int] = {}
# Per group: the verdict this rank raised and until when it stands (the next ``save``/``load``
# clears it, else it lapses after one timeout). A stage that failed is still shared at the next
# stage (``sync_errors`` and the like); in a broken group that stage re-raises the same verdict
# at once instead of waiting for ranks that will not come.
_broken: Dict[str, Tuple[float, str]] = {}
# Per process group (its name): the verdict of a collective this rank abandoned when its bounded
# wait ran out. The abandoned operation stays queued in the backend, so this rank's sequence of
# collectives may no longer match its peers'; distckpt never issues another one on that group
# (``reset_failures`` does not clear it). Re-create the group, or restart, to go on.
_out_of_step: Dict[str, str] = {}
# Per group: the store keys this rank left at its last stage; it deletes them once every rank has
# reached its next stage (nobody waits on them any more).
_leftovers: Dict[str, List[str]] = {}


def reset_failures() -> None:
    """Forget the verdicts of earlier operations; ``save`` and ``load`` call it when they start."""
    _broken.clear()


def _break(gid: str, verdict: str) -> None:
    _broken[gid] = (time.monotonic() + collective_timeout(), verdict)


def _raise_if_broken(stage: str, group: ProcessGroup) -> None:
    # The verdict of the operation under way first: a failure shared at its later stages keeps
    # the words every rank raised.
    if _broken:
        until, verdict = _broken.get(group_id(group_ranks(group)), (0.0, ""))
        if time.monotonic() < until:
            raise CollectiveTimeout.from_verdict(stage, verdict)
    if _out_of_step:
        verdict = _out_of_step.get(group_name(group))
        if verdict is not None:
            raise CollectiveTimeout.from_verdict(
                stage,
                f"{stage}: refused, the process group is out of step since a collective was abandoned "
                f"(re-create the group or restart the job); it was abandoned because {verdict}",
            )


def _enter(stage: str, group: ProcessGroup) -> Tuple[List[int], str, int, str]:
    """Number this rank's next stage of ``group``: (its global ranks, the group's id, the stage
    number, the prefix of the stage's keys)."""
    _raise_if_broken(stage, group)
    heartbeat_grace()  # a bad setting is reported here, before any wait
    ranks = group_ranks(group)
    gid = group_id(ranks)
    n = check_ins.get(gid, 0) + 1
    check_ins[gid] = n
    return ranks, gid, n, f"distckpt/{gid}/{n}"


def _passed(store, gid: str, keys: List[str]) -> None:
    """Every rank reached this rank's current stage of the group: nobody reads the keys this rank
    left at its stage before, so they go; ``keys`` are the ones to delete after the next stage."""
    for key in _leftovers.pop(gid, ()):
        _delete(store, key)
    if keys:
        _leftovers[gid] = keys


def check_in(stage: str, group: ProcessGroup = None, timeout: Optional[float] = None) -> None:
    """Return once every rank of ``group`` has checked in for ``stage``; raise
    :class:`CollectiveTimeout` naming the missing ranks after ``timeout`` seconds. Every rank of
    the group calls it at the same point, as it would the collective it guards."""
    if not is_initialized() or get_world_size(group) == 1:
        return
    store = default_store()
    if store is None:
        return
    ranks, gid, n, prefix = _enter(stage, group)
    timeout = collective_timeout(group) if timeout is None else timeout
    done = f"{prefix}/done"
    me, root = tdist.get_rank(), ranks[0]
    # The group's first rank watches every other rank; the others watch it, and learn of a dead
    # rank from its verdict in ``done``.
    watched = ranks[1:] if me == root else [root]
    try:
        store.set(f"{prefix}/r{me}", stage)
        if store.add(f"{prefix}/count", 1) == len(ranks):
            store.compare_set(done, "", "ok")
        try:
            with watching(store, stage, done, {r: f"{prefix}/r{r}" for r in watched}, fill=False):
                store.wait([done], timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - timed out: the first rank to give up words the verdict
            verdict = str(
                CollectiveTimeout(
                    stage, _missing(store, prefix, ranks), timeout, f"{type(e).__name__}: {e}".strip()
                )
            )
            store.compare_set(done, "", verdict)
        outcome = store.get(done).decode()
    except Exception as e:  # noqa: BLE001 - the store itself is gone (rank 0's process died)
        outcome = str(CollectiveTimeout(stage, [], timeout, f"{type(e).__name__}: {e}".strip()))
    if outcome != "ok":
        # Every rank raises the verdict of the first one that timed out, also a late arrival.
        _break(gid, outcome)
        raise CollectiveTimeout.from_verdict(stage, outcome)
    _passed(store, gid, [f"{prefix}/r{me}"] + ([f"{prefix}/count", done] if me == ranks[0] else []))


STORE_ROUNDS_ENV = "DISTCKPT_STORE_ROUNDS"
# The largest outcome a store round posts in the store; a larger one follows as a broadcast.
OUTCOME_LIMIT = 64 << 10


def store_rounds(group: ProcessGroup = None):
    """The store that carries the object stages of ``group`` (gather and decide, error agreement,
    small all-reduces) by itself, or None when they run as collectives of the process group.

    ``$DISTCKPT_STORE_ROUNDS``: ``auto`` (default) uses a store that wakes its waiters (a
    TCPStore, what ``torchrun`` and ``env://`` give, or a HashStore; not a FileStore, whose waits
    poll every 10 ms, nor a store of unknown kind); ``1`` always uses the store; ``0`` never does.
    Every rank must see the same setting. None as well without a process group, or for a group
    of one rank (nothing to exchange)."""
    raw = os.environ.get(STORE_ROUNDS_ENV, "").strip().lower()
    if raw not in ("", "auto", "1", "on", "true", "yes", "0", "off", "false", "no"):
        raise CheckpointingException(f"{STORE_ROUNDS_ENV}={raw!r}: must be auto, 1 or 0")
    if raw in ("0", "off", "false", "no") or not is_initialized() or get_world_size(group) == 1:
        return None
    store = default_store()
    if store is None or raw not in ("", "auto"):
        return store
    inner = store
    while isinstance(inner, tdist.PrefixStore):
        inner = inner.underlying_store
    return store if isinstance(inner, (tdist.TCPStore, tdist.HashStore)) else None


def store_round(
    store, stage: str, group: ProcessGroup, blob: bytes, decide: Callable[[List[bytes]], bytes]
) -> Tuple[bool, bytes]:
    """One stage carried by the store alone: every rank of ``group`` posts ``blob``; the group's
    rank 0 waits for all of them, runs ``decide`` over them (its own first, then by group rank)
    and posts the outcome, which every rank returns. Bounded like :func:`check_in`: a rank that
    does not come makes every other rank raise the same :class:`CollectiveTimeout`, naming it,
    within :func:`collective_timeout` seconds. Four store round trips per rank, and no collective
    of the process group. Returns ``(follows, outcome)``: ``follows`` is True when the outcome is
    larger than :data:`OUTCOME_LIMIT`, and the caller then broadcasts it from rank 0 (whose
    ``outcome`` it is; the other ranks get b"")."""
    ranks, gid, n, prefix = _enter(stage, group)
    timeout = collective_timeout(group)
    done = f"{prefix}/done"
    me, root = tdist.get_rank(), ranks[0]
    others = [f"{prefix}/r{r}" for r in ranks[1:]]
    result = b""
    try:
        if me == root:
            try:
                with watching(store, stage, done, dict(zip(ranks[1:], others)), fill=True):
                    store.wait(others, timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - timed out: a verdict naming the absent ranks
                outcome = _word_verdict(store, done, stage, _missing(store, prefix, ranks[1:]), timeout, e)
            else:
                blobs = store.multi_get(others)
                # A rank whose stage before failed posts the verdict it raised instead of a payload.
                words = [b for b in blobs if b[:1] != DECIDED]
                if words:
                    posting = words[0]
                elif store.check([done]):
                    # Another rank gave up on this rank before it came: no decision (a commit)
                    # behind the back of ranks that already raised.
                    posting = store.get(done)
                else:
                    try:
                        result = decide([blob] + [memoryview(b)[1:] for b in blobs])
                    except Exception as e:  # noqa: BLE001 - decide reports its own failures; this is a bug
                        result = b""
                        posting = f"{stage}: rank {root} failed to decide the stage: {one_line(e)}".encode()
                    else:
                        posting = DECIDED + result if len(result) <= OUTCOME_LIMIT else FOLLOWS
                outcome = store.compare_set(done, "", posting)
        else:
            store.set(f"{prefix}/r{me}", DECIDED + blob)
            try:
                # Rank 0 posts no key of its own: its heartbeat is watched for the whole wait.
                with watching(store, stage, done, {root: None}, fill=False):
                    store.wait([done], timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - timed out: rank 0 still waits, or is absent itself
                absent = _missing(store, prefix, ranks[1:]) or [root]
                outcome = _word_verdict(store, done, stage, absent, timeout, e)
            else:
                outcome = store.get(done)
    except Exception as e:  # noqa: BLE001 - the store itself is gone (its host's process died)
        outcome = str(CollectiveTimeout(stage, [], timeout, f"{type(e).__name__}: {e}".strip())).encode()
    kind = outcome[:1]
    if kind != DECIDED and kind != FOLLOWS:
        # A late rank 0 still finds every payload and so the verdict at once: the keys stay
        # until this rank's next stage that every rank reaches.
        _leftovers.setdefault(gid, []).append(f"{prefix}/r{me}")
        verdict = outcome.decode(errors="replace")
        _break(gid, verdict)
        raise CollectiveTimeout.from_verdict(stage, verdict)
    if me == root:
        _passed(store, gid, [done])
    else:
        _passed(store, gid, [])
        _delete(store, f"{prefix}/r{me}")  # a payload may be large: it does not wait for the next stage
    if kind == FOLLOWS:
        return True, result  # the caller broadcasts rank 0's outcome (it is b"" elsewhere)
    return False, result if me == root else outcome[1:]


def _word_verdict(
    store, done: str, stage: str, missing: List[int], timeout: float, error: Exception
) -> bytes:
    """Post the verdict of a stage this rank gave up on (unless another rank posted first);
    returns what the stage's outcome key holds then."""
    verdict = str(CollectiveTimeout(stage, missing, timeout, f"{type(error).__name__}: {error}".strip()))
    return store.compare_set(done, "", verdict)


def post_verdict(group: ProcessGroup, verdict: str) -> str:
    """After a collective failed on this rank: word ``verdict`` into the next check-in of the
    group (unless another rank did first) and return the verdict that stands, so that the ranks
    the failure did not reach raise it at their next stage, at once and verbatim."""
    store = default_store()
    if store is None or not is_initialized():
        return verdict
    try:
        gid = group_id(group_ranks(group))
        # Not counted as this rank's check-in: a stage that failed inside its collective is still
        # shared (``sync_errors`` and the like), and that next check-in then finds the verdict.
        n = check_ins.get(gid, 0) + 1
        standing = store.compare_set(f"distckpt/{gid}/{n}/done", "", verdict).decode()
        # This rank will not come to that stage: its key there says so, so that the group's
        # rank 0, waiting for every rank's key at a stage run through the store, stops waiting.
        store.set(f"distckpt/{gid}/{n}/r{tdist.get_rank()}", standing)
        return standing
    except Exception:  # noqa: BLE001 - the store is gone as well: this rank's own words
        return verdict


def _missing(store, prefix: str, ranks: Sequence[int]) -> List[int]:
    try:
        return [r for r in ranks if not store.check([f"{prefix}/r{r}"])]
    except Exception:  # noqa: BLE001 - the store is gone too
        return []


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001 - a store without deletion keeps a few bytes per stage
        pass


class _Unfinished(RuntimeError):
    """A collective this rank started did not complete within the collective timeout."""


def wait_bounded(works: Sequence[Any], group: ProcessGroup) -> None:
    """Wait for the works of collectives started with ``async_op=True``. On NCCL a plain wait
    (what the blocking call does; the NCCL watchdog enforces the group's own timeout); on gloo
    and the other CPU backends at most :func:`collective_timeout` seconds for all of them
    together, then :class:`_Unfinished`. An abandoned operation stays queued in the backend, so
    :func:`guarded` marks the group out of step for distckpt."""
    if tdist.get_backend(group) == "nccl":
        for work in works:
            work.wait()
        return
    timeout = collective_timeout(group)
    deadline = time.monotonic() + timeout
    for work in works:
        try:
            work.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as e:
            error = e
            if work.is_completed():  # it completed as the wait ran out, or failed on its own
                try:
                    work.wait()
                    continue
                except RuntimeError as own:
                    error = own
            text = str(error).lower()
            # gloo words a timed-out point-to-point wait "Application timeout caused pair closure".
            if not work.is_completed() or "timed out" in text or "timeout" in text:
                raise _Unfinished(
                    f"it did not complete within {timeout:g} s (a rank died or hung inside it; "
                    f"{TIMEOUT_ENV} sets the timeout)"
                ) from error
            raise error from None  # the error itself, not the wait that reported it


def run_bounded(collective: Callable, /, *args, group: ProcessGroup = None, **kwargs) -> None:
    """One torch.distributed collective, waited for as :func:`wait_bounded` says."""
    work = collective(*args, group=group, async_op=True, **kwargs)
    if work is not None:  # None: this rank is not in ``group``
        wait_bounded([work], group)


def guarded(stage: str, fn: Callable[[], T], group: ProcessGroup = None) -> T:
    """Run a collective; a failure inside it (a peer died mid-way, or it did not complete in
    time) becomes a CollectiveTimeout, the same on every rank (see :func:`post_verdict`)."""
    _raise_if_broken(stage, group)
    try:
        return fn()
    except CheckpointingException:
        raise
    except Exception as e:  # noqa: BLE001 - gloo reports a lost peer as RuntimeError
        detail = str(e) if isinstance(e, _Unfinished) else f"{type(e).__name__}: {e}"
        verdict = post_verdict(
            group,
            f"{stage}: a collective failed (a rank died or stopped answering), "
            f"first seen on rank {get_rank()}: {detail}",
        )
        if isinstance(e, _Unfinished):
            _out_of_step[group_name(group)] = verdict
        _break(group_id(group_ranks(group)), verdict)
        raise CollectiveTimeout.from_verdict(stage, verdict) from e
