"""The dead-rank heartbeat: a rank awaited at a stage that stopped beating is named dead.

Every process that imported distckpt refreshes a counter of its own in the default store once
a second, from a daemon thread, for as long as it has a process group over a TCPStore (other
stores keep no heartbeat: a FileStore would grow by a record per rank per second). A wait of
longer than a second at a stage is looked at by that thread too: an awaited rank whose counter
did not move for the grace bound (or that never posted one in as long since the wait began) is
dead, and the thread posts the verdict naming it where the waiting ranks wake up. A live but
slow rank keeps beating and gets the full collective timeout. The thread works on a clone of
the store: a wait on the main thread's client holds that client for the whole wait.

The thread starts when this module is imported (:mod:`distckpt.dist` imports it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from typing import Dict, Optional, Tuple

import torch.distributed as tdist

from distckpt.core import CheckpointingException
from distckpt.process_group import (
    BEAT_S,
    DECIDED,
    DEFAULT_HEARTBEAT_GRACE_S,
    FOLLOWS,
    CollectiveTimeout,
    default_store,
    heartbeat_grace,
    is_initialized,
)


def _beat_key(rank: int) -> str:
    return f"distckpt/heartbeat/{rank}"


def _tcp_store():
    """The default store when a TCPStore carries it, else None."""
    if not is_initialized():
        return None
    store = inner = default_store()
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
        if now - self.since < BEAT_S:
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
        if self.fill and standing[:1] not in (DECIDED, FOLLOWS):
            for key in self.pending.values():
                if key is not None:
                    client.compare_set(key, "", standing)
        return True


# id -> a wait of the main thread in progress; the heartbeat thread drops a watch it decided.
_watches: Dict[int, _Watch] = {}


class _Heartbeat(threading.Thread):
    """Beats and looks at the watches (see above) every ``BEAT_S`` seconds. A daemon: it never
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
            if self.halt.wait(BEAT_S):
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
def watching(store, stage: str, done: str, pending: Dict[int, Optional[str]], fill: bool):
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
        _beat.join(timeout=2 * BEAT_S)


def _restart_heartbeat_in_child() -> None:
    global _beat
    _watches.clear()
    _beat = None
    _heartbeat(id(default_store()) if is_initialized() else None)


# Started at import, so that a rank beats from the moment its process group exists (a rank not
# yet in any distckpt call is alive, not dead), also in a child forked later.
_heartbeat()
atexit.register(_stop_heartbeat)
os.register_at_fork(after_in_child=_restart_heartbeat_in_child)
