"""The one place that talks to torch.distributed; every helper also works with no process group.

Without an initialized process group the world is a single rank 0 and every collective is the
identity, so the whole library runs in one plain process too.

Error agreement: a stage of a save or load ends with :func:`sync_errors`, which gathers every
rank's exception (or None) and raises the *same* :class:`CheckpointingException` on every rank
when any rank failed. No rank is ever left waiting in a collective that a failed rank skipped,
because each rank reaches the same ``sync_errors`` call whether its own work failed or not.

No collective waits forever: before each stage's collective every rank checks in on a side
channel that survives a dead peer — the default process group's key-value store (TCPStore,
FileStore), which ``store.wait`` can wait on with a timeout, unlike an NCCL or gloo collective.
A rank that died or stopped answering makes every surviving rank raise the same
:class:`CollectiveTimeout` (a CheckpointingException naming the stage and the ranks that did not
arrive) within :func:`collective_timeout` seconds. Set it with the environment variable
``DISTCKPT_COLLECTIVE_TIMEOUT`` (seconds) or :func:`set_collective_timeout`; by default the
smaller of 300 s and the process group's own timeout. On a TCPStore a dead rank is named sooner:
every process beats on the store once a second (a daemon thread started at import), and a rank
awaited at a stage whose heartbeat stood still for :func:`heartbeat_grace` seconds (default 10;
``DISTCKPT_HEARTBEAT_GRACE``) is dead; a live but slow rank gets the whole timeout (see the
heartbeat section below).
The first rank to time out words the verdict into the store, and every rank — also one that
arrives late — raises that same message. Cost: four store round trips per stage (never per
tensor), plus deleting the previous stage's keys. The collective itself is bounded too: on
gloo (and any backend but NCCL, whose watchdog owns its timeouts) every rank waits for it at most
:func:`collective_timeout` seconds, so a rank that checked in and then stalled, or a survivor left
waiting on a peer that gave up, cannot hold the others to the process group's own timeout (30
minutes by default). A collective that fails
after every rank checked in (a peer died inside it; gloo notices a closed connection; the bounded
wait ran out) is turned
into a CollectiveTimeout naming the stage, and its message is posted to the group's next
check-in, so that the ranks the failure did not reach raise the same message at their next stage. A rank
that raised a verdict re-raises it at once at any later stage of the same operation (a failure is
shared at the next stage; that stage must not wait for ranks that gave up).

On a store that wakes its waiters (TCPStore) the object stages — :func:`gather_and_decide`,
:func:`all_gather_or_raise` (and so :func:`sync_errors`), :func:`all_reduce_max` — run through the
store alone (:func:`store_rounds`, :func:`_store_round`): each rank posts its payload under the
stage's number, rank 0 waits for them all with the timeout, decides and posts the outcome, the
others wait for that with the timeout. Check-in and stage are one; no rank is ever inside a
collective of the process group, so a stage that timed out leaves the group usable.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pickle
import re
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as tdist

from distckpt.core import CheckpointingException

T = TypeVar("T")
ProcessGroup = Optional["tdist.ProcessGroup"]


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    return tdist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    return tdist.get_world_size(group) if is_initialized() else 1


def global_rank_of(group_rank: int, group: ProcessGroup = None) -> int:
    if not is_initialized() or group is None:
        return group_rank
    return tdist.get_global_rank(group, group_rank)


# --------------------------------------------------------------------------- timeouts

TIMEOUT_ENV = "DISTCKPT_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_timeout_override: Optional[float] = None


def collective_timeout(group: ProcessGroup = None) -> float:
    """Seconds a stage of ``group`` waits for every rank: :func:`set_collective_timeout`, else
    ``$DISTCKPT_COLLECTIVE_TIMEOUT``, else the smaller of 300 and the process group's own timeout
    (``init_process_group(timeout=...)``, ``new_group(timeout=...)``)."""
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        own = _group_timeout(group)
        return DEFAULT_TIMEOUT_S if own is None else min(DEFAULT_TIMEOUT_S, own)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointingException(f"{TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return value


def _group_timeout(group: ProcessGroup) -> Optional[float]:
    """The timeout ``group`` was created with (its backend's options), or None when unknown."""
    if not is_initialized():
        return None
    try:
        pg = tdist.group.WORLD if group is None else group
        seconds = pg._get_backend(collective_device(group)).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a backend without options: the library's default alone
        return None
    return seconds if seconds > 0 else None


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Set the timeout of every checkpointing collective in this process (None: back to the
    environment variable or the default). Every rank should use the same value."""
    global _timeout_override
    if seconds is not None and not float(seconds) > 0:
        raise CheckpointingException(f"collective timeout must be positive, got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)


class CollectiveTimeout(CheckpointingException):
    """Raised on every surviving rank when some rank did not reach a stage in time.

    Attributes:
        stage: the stage the ranks were entering.
        missing: global ranks that did not arrive (empty if the store itself became unreachable).
    """

    def __init__(
        self,
        stage: str,
        missing: List[int],
        timeout: float,
        detail: str = "",
        silent_for: Optional[float] = None,
    ):
        self.stage = stage
        self.missing = missing
        if missing and silent_for is not None:
            # Named by the heartbeat watch (``timeout`` is then the wait it cut short).
            super().__init__(
                f"{stage}: rank(s) {', '.join(map(str, missing))} did not arrive: no heartbeat "
                f"from its process for {silent_for:g} s (dead, or stuck holding the GIL; "
                f"{HEARTBEAT_GRACE_ENV} sets the bound)"
            )
            return
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not arrive"
            if missing
            else "the rendezvous store did not answer (its host, rank 0's process, may have died)"
        )
        super().__init__(
            f"{stage}: {who} within {timeout:g} s (dead or hung; {TIMEOUT_ENV} sets the "
            f"timeout){': ' + detail if detail else ''}"
        )

    @classmethod
    def from_verdict(cls, stage: str, verdict: str) -> CollectiveTimeout:
        """The exception another rank worded (its message, verbatim)."""
        exc = cls.__new__(cls)
        CheckpointingException.__init__(exc, verdict)
        exc.stage = stage
        found = re.match(r"^.*?: rank\(s\) ([0-9, ]+) did not arrive", verdict)
        exc.missing = [int(r) for r in found.group(1).split(",")] if found else []
        return exc


# Per group (its global ranks): how many check-ins this process made. Every rank makes the same
# sequence of check-ins, so the counters agree and name the same keys.
_check_ins: Dict[str, int] = {}
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


def _break(group_id: str, verdict: str) -> None:
    _broken[group_id] = (time.monotonic() + collective_timeout(), verdict)


def _group_name(group: ProcessGroup) -> str:
    return (tdist.group.WORLD if group is None else group).group_name


def _raise_if_broken(stage: str, group: ProcessGroup) -> None:
    # The verdict of the operation under way first: a failure shared at its later stages keeps
    # the words every rank raised.
    if _broken:
        until, verdict = _broken.get(_group_id(_group_ranks(group)), (0.0, ""))
        if time.monotonic() < until:
            raise CollectiveTimeout.from_verdict(stage, verdict)
    if _out_of_step:
        verdict = _out_of_step.get(_group_name(group))
        if verdict is not None:
            raise CollectiveTimeout.from_verdict(
                stage,
                f"{stage}: refused, the process group is out of step since a collective was abandoned "
                f"(re-create the group or restart the job); it was abandoned because {verdict}",
            )


def _store():
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: collectives go on unguarded
        return None


def _group_ranks(group: ProcessGroup) -> List[int]:
    if group is None:
        return list(range(get_world_size()))
    return list(tdist.get_process_group_ranks(group))


def _enter(stage: str, group: ProcessGroup) -> Tuple[List[int], str, int, str]:
    """Number this rank's next stage of ``group``: (its global ranks, the group's id, the stage
    number, the prefix of the stage's keys)."""
    _raise_if_broken(stage, group)
    heartbeat_grace()  # a bad setting is reported here, before any wait
    ranks = _group_ranks(group)
    gid = _group_id(ranks)
    n = _check_ins.get(gid, 0) + 1
    _check_ins[gid] = n
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
    store = _store()
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
            with _watching(store, stage, done, {r: f"{prefix}/r{r}" for r in watched}, fill=False):
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
# In the store, a stage's outcome posted by rank 0 starts with ``_DECIDED`` (and so does each
# rank's payload); a verdict is text. ``_FOLLOWS``: the outcome is larger than ``_OUTCOME_LIMIT``
# and follows as a broadcast of the process group (which every rank is known to have reached).
_DECIDED = b"\x00"
_FOLLOWS = b"\x01"
_OUTCOME_LIMIT = 64 << 10


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
    store = _store()
    if store is None or raw not in ("", "auto"):
        return store
    inner = store
    while isinstance(inner, tdist.PrefixStore):
        inner = inner.underlying_store
    return store if isinstance(inner, (tdist.TCPStore, tdist.HashStore)) else None


def _store_round(
    store, stage: str, group: ProcessGroup, blob: bytes, decide: Callable[[List[bytes]], bytes]
) -> bytes:
    """One stage carried by the store alone: every rank of ``group`` posts ``blob``; the group's
    rank 0 waits for all of them, runs ``decide`` over them (its own first, then by group rank)
    and posts the outcome, which every rank returns. Bounded like :func:`check_in`: a rank that
    does not come makes every other rank raise the same :class:`CollectiveTimeout`, naming it,
    within :func:`collective_timeout` seconds. Four store round trips per rank, and no collective
    of the process group (the outcome follows as a broadcast only when it is large)."""
    ranks, gid, n, prefix = _enter(stage, group)
    timeout = collective_timeout(group)
    done = f"{prefix}/done"
    me, root = tdist.get_rank(), ranks[0]
    others = [f"{prefix}/r{r}" for r in ranks[1:]]
    result = b""
    try:
        if me == root:
            try:
                with _watching(store, stage, done, dict(zip(ranks[1:], others)), fill=True):
                    store.wait(others, timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - timed out: a verdict naming the absent ranks
                outcome = _word_verdict(store, done, stage, _missing(store, prefix, ranks[1:]), timeout, e)
            else:
                blobs = store.multi_get(others)
                # A rank whose stage before failed posts the verdict it raised instead of a payload.
                words = [b for b in blobs if b[:1] != _DECIDED]
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
                        posting = f"{stage}: rank {root} failed to decide the stage: {_one_line(e)}".encode()
                    else:
                        posting = _DECIDED + result if len(result) <= _OUTCOME_LIMIT else _FOLLOWS
                outcome = store.compare_set(done, "", posting)
        else:
            store.set(f"{prefix}/r{me}", _DECIDED + blob)
            try:
                # Rank 0 posts no key of its own: its heartbeat is watched for the whole wait.
                with _watching(store, stage, done, {root: None}, fill=False):
                    store.wait([done], timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - timed out: rank 0 still waits, or is absent itself
                absent = _missing(store, prefix, ranks[1:]) or [root]
                outcome = _word_verdict(store, done, stage, absent, timeout, e)
            else:
                outcome = store.get(done)
    except Exception as e:  # noqa: BLE001 - the store itself is gone (its host's process died)
        outcome = str(CollectiveTimeout(stage, [], timeout, f"{type(e).__name__}: {e}".strip())).encode()
    kind = outcome[:1]
    if kind != _DECIDED and kind != _FOLLOWS:
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
    if kind == _FOLLOWS:
        return _guarded(stage, lambda: _broadcast_object(bytes(result), 0, group), group)
    return result if me == root else outcome[1:]


def _word_verdict(
    store, done: str, stage: str, missing: List[int], timeout: float, error: Exception
) -> bytes:
    """Post the verdict of a stage this rank gave up on (unless another rank posted first);
    returns what the stage's outcome key holds then."""
    verdict = str(CollectiveTimeout(stage, missing, timeout, f"{type(error).__name__}: {error}".strip()))
    return store.compare_set(done, "", verdict)


def _group_id(ranks: Sequence[int]) -> str:
    return hashlib.blake2b(repr(list(ranks)).encode(), digest_size=6).hexdigest()


def _post_verdict(group: ProcessGroup, verdict: str) -> str:
    """After a collective failed on this rank: word ``verdict`` into the next check-in of the
    group (unless another rank did first) and return the verdict that stands, so that the ranks
    the failure did not reach raise it at their next stage, at once and verbatim."""
    store = _store()
    if store is None or not is_initialized():
        return verdict
    try:
        gid = _group_id(_group_ranks(group))
        # Not counted as this rank's check-in: a stage that failed inside its collective is still
        # shared (``sync_errors`` and the like), and that next check-in then finds the verdict.
        n = _check_ins.get(gid, 0) + 1
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


# --------------------------------------------------------------------------- heartbeat
#
# Every process that imported distckpt refreshes a counter of its own in the default store once
# a second, from a daemon thread, for as long as it has a process group over a TCPStore (other
# stores keep no heartbeat: a FileStore would grow by a record per rank per second). A wait of
# longer than a second at a stage is looked at by that thread too: an awaited rank whose counter
# did not move for the grace bound (or that never posted one in as long since the wait began) is
# dead, and the thread posts the verdict naming it where the waiting ranks wake up. A live but
# slow rank keeps beating and gets the full collective timeout. The thread works on a clone of
# the store: a wait on the main thread's client holds that client for the whole wait.

HEARTBEAT_GRACE_ENV = "DISTCKPT_HEARTBEAT_GRACE"
DEFAULT_HEARTBEAT_GRACE_S = 10.0
_BEAT_S = 1.0
"""How often a process refreshes its heartbeat, and how often the ranks a wait awaits are looked at."""
_grace_override: Optional[float] = None


def heartbeat_grace() -> float:
    """Seconds an awaited rank may go without a heartbeat before it counts as dead:
    :func:`set_heartbeat_grace`, else ``$DISTCKPT_HEARTBEAT_GRACE``, else 10. 0 turns the
    heartbeat off (a dead rank is then noticed at the collective timeout). Every rank should use
    the same value."""
    if _grace_override is not None:
        return _grace_override
    raw = os.environ.get(HEARTBEAT_GRACE_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_HEARTBEAT_GRACE_S
    return _checked_grace(raw, f"{HEARTBEAT_GRACE_ENV}={raw!r}")


def set_heartbeat_grace(seconds: Optional[float]) -> None:
    """Set the heartbeat grace of this process (None: back to the environment variable or the
    default; 0: off)."""
    global _grace_override
    _grace_override = None if seconds is None else _checked_grace(seconds, f"heartbeat grace {seconds!r}")


def _checked_grace(value: Any, what: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    # Two beats at least: one late beat of a busy process must not make it dead.
    if not (seconds == 0 or seconds >= 2 * _BEAT_S):
        raise CheckpointingException(f"{what}: must be 0 (off) or at least {2 * _BEAT_S:g} seconds")
    return seconds


def _beat_key(rank: int) -> str:
    return f"distckpt/heartbeat/{rank}"


def _tcp_store():
    """The default store when a TCPStore carries it, else None."""
    if not is_initialized():
        return None
    store = inner = _store()
    while isinstance(inner, tdist.PrefixStore):
        inner = inner.underlying_store
    return store if isinstance(inner, tdist.TCPStore) else None


class _Watch:
    """A wait of this process for some ranks (global) to reach a stage, looked at by the heartbeat
    thread; ``pending`` maps each rank to the key its arrival posts (None: watched for the whole
    wait). ``fill``: the waiter waits for those keys, so a verdict is posted under them as well."""

    def __init__(self, stage: str, done: str, pending: Dict[int, Optional[str]], fill: bool):
        self.stage, self.done, self.pending, self.fill = stage, done, pending, fill
        self.since = time.monotonic()
        # rank -> (its heartbeat count, since when it has not moved)
        self.seen: Dict[int, Tuple[int, float]] = {}

    def look(self, client, grace: float) -> bool:
        """Post the verdict and return True when a rank still awaited is dead."""
        now = time.monotonic()
        if now - self.since < _BEAT_S:
            return False  # most waits end before this: no store traffic for them
        for rank, key in list(self.pending.items()):
            if key is not None and client.check([key]):
                del self.pending[rank]
        dead = []
        for rank in self.pending:
            beats = client.add(_beat_key(rank), 0)
            last = self.seen.get(rank)
            if last is None or last[0] != beats:
                # A rank that never beat has been silent for as long as this wait, at least.
                last = self.seen[rank] = (beats, now if beats else self.since)
            if now - last[1] > grace:
                dead.append(rank)
        if not dead:
            return False
        verdict = str(CollectiveTimeout(self.stage, sorted(dead), 0.0, silent_for=grace))
        standing = client.compare_set(self.done, "", verdict)
        if self.fill and standing[:1] not in (_DECIDED, _FOLLOWS):
            for key in self.pending.values():
                if key is not None:
                    client.compare_set(key, "", standing)
        return True


# id -> a wait of the main thread in progress; the heartbeat thread drops a watch it decided.
_watches: Dict[int, _Watch] = {}


class _Heartbeat(threading.Thread):
    """Beats and looks at the watches (see above) every ``_BEAT_S`` seconds. A daemon: it never
    keeps the interpreter alive, and ``atexit`` stops it before the interpreter goes down."""

    def __init__(self, inherited: Optional[int]):
        super().__init__(name="distckpt-heartbeat", daemon=True)
        self.halt = threading.Event()
        self.pid = os.getpid()
        # Default stores (by id) not to beat on: one a forked child inherited (its parent rank's
        # heartbeat, not its own) and one that failed (gone; the waits report that themselves).
        self.skip = {inherited}

    def run(self) -> None:
        client, on, rank = None, None, 0
        while True:
            try:
                grace = heartbeat_grace()
            except CheckpointingException:
                grace = DEFAULT_HEARTBEAT_GRACE_S  # the main thread reports the bad setting
            store = _tcp_store() if grace else None
            sid = None if store is None else id(store)
            if sid != on:
                client, on = None, None
                if sid is not None and sid not in self.skip:
                    try:
                        client, on, rank = store.clone(), sid, tdist.get_rank()
                    except Exception:  # noqa: BLE001 - a store that cannot be cloned: no heartbeat
                        self.skip.add(sid)
            if client is not None:
                try:
                    client.add(_beat_key(rank), 1)
                    for key, watch in list(_watches.items()):
                        if watch.look(client, grace):
                            _watches.pop(key, None)
                except Exception:  # noqa: BLE001 - the store is gone with its host: not retried
                    self.skip.add(on)
                    client, on = None, None
            if self.halt.wait(_BEAT_S):
                return


_beat: Optional[_Heartbeat] = None


def _heartbeat(inherited: Optional[int] = None) -> _Heartbeat:
    """This process's heartbeat thread, started if it is not running."""
    global _beat
    if _beat is None or _beat.pid != os.getpid() or not _beat.is_alive():
        _beat = _Heartbeat(inherited)
        _beat.start()
    return _beat


@contextlib.contextmanager
def _watching(store, stage: str, done: str, pending: Dict[int, Optional[str]], fill: bool):
    """Have the heartbeat thread look at the ``pending`` ranks while this process waits on
    ``store`` (the default store) at ``stage``; a dead one gets the verdict posted in ``done``."""
    if not pending or heartbeat_grace() == 0 or _tcp_store() is not store:
        yield
        return
    _heartbeat()
    watch = _Watch(stage, done, pending, fill)
    _watches[id(watch)] = watch
    try:
        yield
    finally:
        _watches.pop(id(watch), None)


def _stop_heartbeat() -> None:
    if _beat is not None and _beat.pid == os.getpid():
        _beat.halt.set()
        _beat.join(timeout=2 * _BEAT_S)


def _restart_heartbeat_in_child() -> None:
    global _beat
    _watches.clear()
    _beat = None
    _heartbeat(id(_store()) if is_initialized() else None)


# Started at import, so that a rank beats from the moment its process group exists (a rank not
# yet in any distckpt call is alive, not dead), also in a child forked later.
_heartbeat()
atexit.register(_stop_heartbeat)
os.register_at_fork(after_in_child=_restart_heartbeat_in_child)


class _Unfinished(RuntimeError):
    """A collective this rank started did not complete within the collective timeout."""


def _bounded(works: Sequence[Any], group: ProcessGroup) -> None:
    """Wait for the works of collectives started with ``async_op=True``. On NCCL a plain wait
    (what the blocking call does; the NCCL watchdog enforces the group's own timeout); on gloo
    and the other CPU backends at most :func:`collective_timeout` seconds for all of them
    together, then :class:`_Unfinished`. An abandoned operation stays queued in the backend, so
    :func:`_guarded` marks the group out of step for distckpt."""
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


def _run(collective: Callable, /, *args, group: ProcessGroup = None, **kwargs) -> None:
    """One torch.distributed collective, waited for as :func:`_bounded` says."""
    work = collective(*args, group=group, async_op=True, **kwargs)
    if work is not None:  # None: this rank is not in ``group``
        _bounded([work], group)


def _guarded(stage: str, fn: Callable[[], T], group: ProcessGroup = None) -> T:
    """Run a collective; a failure inside it (a peer died mid-way, or it did not complete in
    time) becomes a CollectiveTimeout, the same on every rank (see :func:`_post_verdict`)."""
    _raise_if_broken(stage, group)
    try:
        return fn()
    except CheckpointingException:
        raise
    except Exception as e:  # noqa: BLE001 - gloo reports a lost peer as RuntimeError
        detail = str(e) if isinstance(e, _Unfinished) else f"{type(e).__name__}: {e}"
        verdict = _post_verdict(
            group,
            f"{stage}: a collective failed (a rank died or stopped answering), "
            f"first seen on rank {get_rank()}: {detail}",
        )
        if isinstance(e, _Unfinished):
            _out_of_step[_group_name(group)] = verdict
        _break(_group_id(_group_ranks(group)), verdict)
        raise CollectiveTimeout.from_verdict(stage, verdict) from e


def collective_device(group: ProcessGroup = None) -> torch.device:
    """Device for tensors fed to collectives: follows the backend (CPU for gloo, CUDA for NCCL)."""
    if not is_initialized():
        return torch.device("cpu")
    backend = tdist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Object collectives and ``all_reduce_max`` check in first (``checked``) under the name of their
# ``stage``; the tensor collectives ``broadcast`` and ``all_gather`` are called per piece by the
# fully parallel exchange, which checks in once before it starts.


def barrier(group: ProcessGroup = None, stage: str = "barrier", checked: bool = True) -> None:
    if is_initialized():
        if checked:
            check_in(stage, group)
        _guarded(stage, lambda: _run(tdist.barrier, group=group), group)


# Object collectives send each rank's pickle in a fixed slot of ``_slot_bytes(world)`` bytes (an
# 8-byte length, then the pickle when it fits): the small payloads of most stages (no error, a
# digest, a staging path) take one collective instead of torch's two (sizes first, then the
# padded pickles). A payload too large for its slot goes in a second round, as torch does.
_LEN = 8


def _slot_bytes(world: int) -> int:
    return max(64, min(1024, (1 << 20) // max(1, world)))


def _pack(obj: Any, slot: int, device: torch.device) -> Tuple[torch.Tensor, bytes]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = bytearray(slot)
    buf[:_LEN] = len(data).to_bytes(_LEN, "little")
    if len(data) <= slot - _LEN:
        buf[_LEN : _LEN + len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8).to(device), data


def _length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_LEN].cpu().numpy().tobytes(), "little")


def _unpack(slot_bytes: bytes, length: int) -> Any:
    return pickle.loads(slot_bytes[_LEN : _LEN + length])


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    buf = bytearray(size)
    buf[: len(data)] = data
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


def _slot_round(obj: Any, group: ProcessGroup):
    """The first round of both object collectives: every rank's pickle (or, when it does not fit
    the fixed slot, its length) all-gathered in slots. Returns the world size, the collective
    device, the slot size, this rank's pickle, every rank's slot bytes and pickle length."""
    world, device = get_world_size(group), collective_device(group)
    slot = _slot_bytes(world)
    mine, data = _pack(obj, slot, device)
    slots = [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(world)]
    _run(tdist.all_gather, slots, mine, group=group)
    raw = [t.cpu().numpy().tobytes() for t in slots]
    return world, device, slot, data, raw, [int.from_bytes(r[:_LEN], "little") for r in raw]


def _all_gather_object(obj: Any, group: ProcessGroup) -> List[Any]:
    world, device, slot, data, raw, lengths = _slot_round(obj, group)
    longest = max(lengths)
    if longest <= slot - _LEN:
        return [_unpack(r, n) for r, n in zip(raw, lengths)]
    full = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    _run(tdist.all_gather, full, _padded(data, longest, device), group=group)
    return [pickle.loads(t.cpu().numpy().tobytes()[:n]) for t, n in zip(full, lengths)]


def _gather_object(obj: Any, dst: int, group: ProcessGroup) -> Optional[List[Any]]:
    """Every rank learns the lengths (first round, an all-gather of the slots); payloads that do
    not fit their slot then go to ``dst`` alone in a second round (a gather)."""
    world, device, slot, data, raw, lengths = _slot_round(obj, group)
    longest = max(lengths)
    me = get_rank(group)
    if longest <= slot - _LEN:
        return [_unpack(r, n) for r, n in zip(raw, lengths)] if me == dst else None
    full = (
        [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if me == dst else None
    )
    _run(tdist.gather, _padded(data, longest, device), full, dst=global_rank_of(dst, group), group=group)
    if me != dst:
        return None
    return [
        _unpack(r, n) if n <= slot - _LEN else pickle.loads(t.cpu().numpy().tobytes()[:n])
        for r, n, t in zip(raw, lengths, full)
    ]


def _broadcast_object(obj: Any, src: int, group: ProcessGroup) -> Any:
    world, device = get_world_size(group), collective_device(group)
    slot = _slot_bytes(world)
    me = get_rank(group)
    if me == src:
        buf, data = _pack(obj, slot, device)
    else:
        buf, data = torch.empty(slot, dtype=torch.uint8, device=device), b""
    _run(tdist.broadcast, buf, src=global_rank_of(src, group), group=group)
    length = _length(buf)
    if length <= slot - _LEN:
        return obj if me == src else _unpack(buf.cpu().numpy().tobytes(), length)
    full = (
        _padded(data, length, device) if me == src else torch.empty(length, dtype=torch.uint8, device=device)
    )
    _run(tdist.broadcast, full, src=global_rank_of(src, group), group=group)
    return obj if me == src else pickle.loads(full.cpu().numpy().tobytes())


def all_gather_object(
    obj: T, group: ProcessGroup = None, stage: str = "all-gather", checked: bool = True
) -> List[T]:
    if not is_initialized():
        return [obj]
    if checked:
        check_in(stage, group)
    return _guarded(stage, lambda: _all_gather_object(obj, group), group)


def gather_object(
    obj: T, dst: int = 0, group: ProcessGroup = None, stage: str = "gather", checked: bool = True
) -> Optional[List[T]]:
    """Gather to group rank ``dst``; returns the list there and None elsewhere."""
    if not is_initialized():
        return [obj]
    if checked:
        check_in(stage, group)
    return _guarded(stage, lambda: _gather_object(obj, dst, group), group)


def broadcast_object(
    obj: T, src: int = 0, group: ProcessGroup = None, stage: str = "broadcast", checked: bool = True
) -> T:
    if not is_initialized():
        return obj
    if checked:
        check_in(stage, group)
    return _guarded(stage, lambda: _broadcast_object(obj, src, group), group)


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup = None) -> None:
    """Broadcast ``tensor`` in place from group rank ``src``; identity without a process group."""
    if is_initialized():
        _guarded(
            "broadcast",
            lambda: _run(tdist.broadcast, tensor, src=global_rank_of(src, group), group=group),
            group,
        )


def all_gather(outputs: List[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None) -> None:
    """All-gather ``tensor`` into ``outputs`` (one per group rank)."""
    if not is_initialized():
        outputs[0].copy_(tensor)
        return
    _guarded("all-gather", lambda: _run(tdist.all_gather, outputs, tensor, group=group), group)


def all_reduce_max(
    values: Sequence[int], group: ProcessGroup = None, stage: str = "all-reduce", checked: bool = True
) -> List[int]:
    """Element-wise max of small int vectors over the group (one tiny collective)."""
    if not is_initialized():
        return list(values)
    store = store_rounds(group)
    if store is not None:

        def decide(blobs: List[memoryview]) -> bytes:
            vectors = [pickle.loads(b) for b in blobs]
            return pickle.dumps([max(column) for column in zip(*vectors)])

        return pickle.loads(_store_round(store, stage, group, pickle.dumps([int(v) for v in values]), decide))
    if checked:
        check_in(stage, group)
    t = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    _guarded(stage, lambda: _run(tdist.all_reduce, t, op=tdist.ReduceOp.MAX, group=group), group)
    return t.tolist()


def describe_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


class RankErrors(CheckpointingException):
    """Raised on every rank when at least one rank failed a stage.

    Attributes:
        stage: which stage failed (e.g. "validation", "write", "commit").
        errors: rank -> one-line error message of that rank.
        tracebacks: rank -> full traceback text of that rank.
    """

    def __init__(self, stage: str, errors: dict, tracebacks: dict):
        self.stage = stage
        self.errors = errors
        self.tracebacks = tracebacks
        if len(set(errors.values())) == 1:
            ranks = ", ".join(map(str, sorted(errors)))
            msg = f"{stage} failed on rank(s) {ranks}: {next(iter(errors.values()))}"
        else:
            lines = [f"rank {r}: {m}" for r, m in sorted(errors.items())]
            msg = f"{stage} failed on {len(errors)} rank(s):\n  " + "\n  ".join(lines)
        super().__init__(msg)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, RankErrors):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, CheckpointingException) else text


def _error_record(exc: Optional[BaseException], group: ProcessGroup) -> Optional[tuple]:
    return None if exc is None else (get_rank(group), _one_line(exc), describe_error(exc))


class _Pickled:
    """A payload pickled once: pickling it again copies the bytes, unpickling gives the payload."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return pickle.loads, (self.data,)


def _checked_payload(exc: Optional[BaseException], payload: Any) -> tuple:
    """Turn an unpicklable payload into this rank's error *before* any collective, so the
    collective itself cannot fail on one rank and leave the others waiting. The pickle made
    for the check is the one sent."""
    if exc is None and payload is not None and is_initialized():
        try:
            return exc, _Pickled(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
            return e, None
    return exc, payload


def all_gather_or_raise(
    stage: str, exc: Optional[BaseException], payload: Any = None, group: ProcessGroup = None
) -> List[Any]:
    """All-gather ``payload``; raise the same exception on every rank if any rank passed ``exc``.

    Every rank of ``group`` must call this at the same point, whether or not it failed.
    """
    if store_rounds(group) is not None:
        # Rank 0 gathers and hands every rank the list (or None when every payload is None, as
        # for ``sync_errors``: the outcome stays a few bytes).
        payloads = gather_and_decide(
            stage, exc, payload, lambda ps: ps if any(p is not None for p in ps) else None, group
        )
        return payloads if payloads is not None else [None] * get_world_size(group)
    exc, payload = _checked_payload(exc, payload)
    record = (_error_record(exc, group), None if exc is not None else payload)
    gathered = all_gather_object(record, group, stage)
    failures = [err for err, _ in gathered if err is not None]
    if failures:
        _raise_failures(stage, failures, exc, get_world_size(group))
    return [p for _, p in gathered]


def sync_errors(stage: str, exc: Optional[BaseException], group: ProcessGroup = None) -> None:
    """Raise the same exception on every rank if ``exc`` is set on any rank; else return."""
    all_gather_or_raise(stage, exc, None, group)


def gather_and_decide(
    stage: str,
    exc: Optional[BaseException],
    payload: Any,
    decide: Callable[[List[Any]], Any],
    group: ProcessGroup = None,
) -> Any:
    """Gather ``payload`` (or this rank's error) to rank 0, run ``decide`` there, share the outcome.

    ``decide(payloads)`` runs on group rank 0 only, and only if no rank failed; its return value
    is broadcast and returned on every rank. If any rank failed, or ``decide`` raised, every rank
    raises the same :class:`RankErrors`. Costs one gather and one broadcast.
    """
    exc, payload = _checked_payload(exc, payload)
    record = (_error_record(exc, group), None if exc is not None else payload)

    def outcome_of(gathered: List[tuple]) -> tuple:
        failures = [err for err, _ in gathered if err is not None]
        if not failures:
            try:
                return "ok", decide([p for _, p in gathered])
            except Exception as e:  # noqa: BLE001 - reported to every rank
                failures = [(get_rank(group), _one_line(e), describe_error(e))]
        return "failed", failures

    store = store_rounds(group)
    if store is not None:
        outcome = _round_of_records(store, stage, group, record, outcome_of)
    else:
        gathered = gather_object(record, dst=0, group=group, stage=stage)
        outcome = None if gathered is None else outcome_of(gathered)
        outcome = broadcast_object(outcome, src=0, group=group, stage=stage, checked=False)
    if outcome[0] == "ok":
        return outcome[1]
    _raise_failures(stage, outcome[1], exc, get_world_size(group))


def _round_of_records(
    store, stage: str, group: ProcessGroup, record: tuple, outcome_of: Callable[[List[tuple]], tuple]
) -> tuple:
    """A :func:`_store_round` of picklable records: rank 0 unpickles them (a record it cannot
    unpickle is that rank's failure) and every rank gets ``outcome_of(records)`` (a tuple whose
    first item is "ok" or "failed"). A failure to pickle the outcome is rank 0's failure."""
    ranks = _group_ranks(group)

    def decide(blobs: List[memoryview]) -> bytes:
        records, failures = [], []
        for r, b in enumerate(blobs):
            try:
                records.append(pickle.loads(b))
            except Exception as e:  # noqa: BLE001 - e.g. a class rank 0 cannot import
                failures.append(
                    (
                        r,
                        f"its payload cannot be unpickled on rank {ranks[0]}: {_one_line(e)}",
                        describe_error(e),
                    )
                )
        outcome = ("failed", failures) if failures else outcome_of(records)
        try:
            return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            return pickle.dumps(
                ("failed", [(0, f"the outcome cannot be pickled: {_one_line(e)}", describe_error(e))]),
                protocol=pickle.HIGHEST_PROTOCOL,
            )

    mine = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads(_store_round(store, stage, group, mine, decide))


def _raise_failures(stage: str, failures: list, exc: Optional[BaseException], world: int) -> None:
    errors = {r: m for r, m, _ in failures}
    tracebacks = {r: t for r, _, t in failures}
    if exc is not None and isinstance(exc, CheckpointingException):
        # Already the same error everywhere (e.g. a strategy that synced its own failure), or a
        # single process: raise it as it is rather than wrapped once more.
        if not is_initialized() or (
            len(failures) == world and isinstance(exc, RankErrors) and len(set(errors.values())) == 1
        ):
            raise exc
    raise RankErrors(stage, errors, tracebacks) from exc


# --------------------------------------------------------------------------- point to point


def send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], group: ProcessGroup = None) -> None:
    """Post every send and receive at once, then wait for all of them.

    ``sends`` and ``recvs`` hold ``(tensor, peer)`` pairs, ``peer`` a rank of ``group``. Tensors
    live on :func:`collective_device` (CPU for gloo, CUDA for NCCL). Messages between two ranks
    are matched in the order they were posted, so both sides must list their exchanges with one
    another in the same order. Posting everything before waiting is what makes a ring or any
    other pattern of simultaneous exchanges free of deadlock. Without a process group only the
    empty exchange is allowed.
    """
    if not sends and not recvs:
        return
    if not is_initialized():
        raise CheckpointingException("point-to-point transfer needs an initialized process group")
    ops = [tdist.P2POp(tdist.isend, t, global_rank_of(peer, group), group) for t, peer in sends]
    ops += [tdist.P2POp(tdist.irecv, t, global_rank_of(peer, group), group) for t, peer in recvs]
    _guarded("point-to-point exchange", lambda: _bounded(tdist.batch_isend_irecv(ops), group), group)
