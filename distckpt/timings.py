"""Where this rank's last save and load spent their time, phase by phase.

Every :func:`distckpt.save` and :func:`distckpt.load` splits its wall-clock time on the calling
rank into consecutive phases (local checks, global validation, planning, writing or reading,
commit ...) and keeps the split of the most recent one of each kind:

    >>> distckpt.save(state, "/ckpt")
    >>> print(distckpt.last_timings("save"))
    save 0.113 s on rank 0: local checks 1.9 ms, global validation 1.1 ms, common state 0.6 ms, ...

The phases cover the whole call (their sum is ``total_s``), so a phase that waits for other
ranks (a collective) shows that wait: a rank that finished its writes early spends the
difference in ``commit``. The same split is logged at DEBUG level on the ``distckpt.timings``
logger. Recording costs a clock read per phase (well under a microsecond each).

Only the calling thread's operation is recorded (a save and a load on two threads each get their
own record); an async save records its blocking part as ``"async save"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

from distckpt import dist

logger = logging.getLogger("distckpt.timings")

__all__ = ["Timings", "last_timings"]


@dataclass(frozen=True)
class Timings:
    """The phases of one operation on one rank.

    Attributes:
        op: ``"save"``, ``"async save"`` (the part before ``save`` returns) or ``"load"``.
        rank: the rank that recorded it.
        total_s: wall-clock seconds of the whole call.
        phases: seconds per phase, in the order the phases first ran; they add up to
            ``total_s``. A phase that ran several times (one per wave) holds the sum.
        failed: the call raised (the phases stop where it did).
    """

    op: str
    rank: int
    total_s: float
    phases: Dict[str, float] = field(default_factory=dict)
    failed: bool = False
    sources: Dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in self.phases.items())
        text = (
            f"{self.op} {self.total_s:.3f} s on rank {self.rank}{' (failed)' if self.failed else ''}: {parts}"
        )
        if self.sources:
            text += "; read from: " + ", ".join(f"{k} {v}" for k, v in self.sources.items() if v != {})
        return text


class _Recorder:
    def __init__(self, first: str):
        self.current = first
        self.start = self.last = time.perf_counter()
        self.phases: Dict[str, float] = {first: 0.0}

    def begin(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[self.current] += now - self.last
        self.phases.setdefault(phase, 0.0)
        self.current, self.last = phase, now


_local = threading.local()
_last: Dict[str, Timings] = {}
_last_lock = threading.Lock()


@contextlib.contextmanager
def recording(op: str, first: str) -> Iterator[None]:
    """Record the phases of ``op`` on this thread, starting with phase ``first``, until the
    block ends (:func:`begin` moves on to the next phase). A nested recording (a load inside a
    save's callback, say) is recorded on its own and resumes the outer one after."""
    outer = getattr(_local, "recorder", None)
    rec = _local.recorder = _Recorder(first)
    failed = True
    try:
        yield
        failed = False
    finally:
        _local.recorder = outer
        end = time.perf_counter()
        rec.phases[rec.current] += end - rec.last  # a failure is charged to the phase it hit
        result = Timings(op, dist.get_rank(), end - rec.start, rec.phases, failed)
        with _last_lock:
            _last[op] = result
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", result)


def begin(phase: str) -> None:
    """End the current phase of the operation this thread records and begin ``phase`` (a
    phase begun again adds to its time). No-op outside a recording."""
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.begin(phase)


def begin_unless_timed(strategy, phase: str) -> None:
    """Begin ``phase`` for a call into ``strategy``, unless the strategy begins its own phases
    (its class sets ``records_phases = True``)."""
    if not getattr(strategy, "records_phases", False):
        begin(phase)


def annotate(op: str, sources: Dict[str, Any]) -> None:
    """Attach ``sources`` (where the data came from: files and bytes per tier, say) to this
    process's most recent ``op``; shown by its ``str``."""
    with _last_lock:
        last = _last.get(op)
        if last is not None:
            _last[op] = dataclasses.replace(last, sources=dict(sources))


def last_timings(op: str = "save") -> Optional[Timings]:
    """The phases of this process's most recent ``op`` (``"save"``, ``"async save"`` or
    ``"load"``), or None before the first one."""
    with _last_lock:
        return _last.get(op)
