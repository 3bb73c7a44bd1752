"""The process group as distckpt sees it: ranks, the default store, the bounds on waiting and the
two exceptions every rank agrees on.

Without an initialized process group the world is a single rank 0. The settings here (the
collective timeout, the heartbeat grace) are read by :mod:`distckpt.heartbeat`,
:mod:`distckpt.checkin` and :mod:`distckpt.dist`; :mod:`distckpt.dist` re-exports every public
name.
"""

from __future__ import annotations

import hashlib
import os
import re
import traceback
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as tdist

from distckpt.core import CheckpointingException

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


def collective_device(group: ProcessGroup = None) -> torch.device:
    """Device for tensors fed to collectives: follows the backend (CPU for gloo, CUDA for NCCL)."""
    if not is_initialized():
        return torch.device("cpu")
    backend = tdist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_ranks(group: ProcessGroup) -> List[int]:
    """The global ranks of ``group`` (every rank without a group)."""
    if group is None:
        return list(range(get_world_size()))
    return list(tdist.get_process_group_ranks(group))


def group_id(ranks: Sequence[int]) -> str:
    """A short name of a group of global ranks: the store keys of its stages start with it."""
    return hashlib.blake2b(repr(list(ranks)).encode(), digest_size=6).hexdigest()


def group_name(group: ProcessGroup) -> str:
    """torch's name of ``group`` (the default group for None)."""
    return (tdist.group.WORLD if group is None else group).group_name


def default_store():
    """The default process group's key-value store, or None when there is none."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: collectives go on unguarded
        return None


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


# --------------------------------------------------------------------------- heartbeat grace

HEARTBEAT_GRACE_ENV = "DISTCKPT_HEARTBEAT_GRACE"
DEFAULT_HEARTBEAT_GRACE_S = 10.0
BEAT_S = 1.0
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
    if not (seconds == 0 or seconds >= 2 * BEAT_S):
        raise CheckpointingException(f"{what}: must be 0 (off) or at least {2 * BEAT_S:g} seconds")
    return seconds


# In the store, a stage's outcome posted by the group's rank 0 starts with ``DECIDED`` (and so
# does each rank's payload); a verdict is text. ``FOLLOWS``: the outcome is too large for the
# store and follows as a broadcast of the process group (which every rank is known to have
# reached). The heartbeat watch and the store rounds (:mod:`distckpt.checkin`) both read it.
DECIDED = b"\x00"
FOLLOWS = b"\x01"


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


def one_line(exc: BaseException) -> str:
    if isinstance(exc, RankErrors):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, CheckpointingException) else text


# Named by their documented home, as tracebacks and pickles have always named them.
CollectiveTimeout.__module__ = "distckpt.dist"
RankErrors.__module__ = "distckpt.dist"
