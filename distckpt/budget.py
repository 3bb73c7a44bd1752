"""The host memory budget: how many bytes one rank may stage at once (docs/reliability.md).

One setting bounds what distckpt holds in host memory besides the caller's own tensors: the
staging copies of an async save, the pieces a fully parallel load reads for other ranks before
the exchange, and the groups a conversion reads. Each path works in waves of at most the budget.

The setting describes the whole **host**; each rank gets an equal share::

    rank budget = host budget / ranks on this host

* ``DISTCKPT_HOST_MEMORY_BUDGET`` (environment) or :func:`set_host_memory_budget` (wins over the
  environment): a number of bytes (``1073741824``, or with a unit: ``512MiB``, ``4GiB``, ``2GB``),
  or a fraction of the host's RAM (``0.25``: any value with a decimal point, in (0, 1]).
* Default: :data:`DEFAULT_FRACTION` of the host's RAM (psutil's ``virtual_memory().total``).
* Ranks on this host: the ``LOCAL_WORLD_SIZE`` environment variable (torchrun and most launchers
  set it), else the world size of the default process group (as if every rank ran on this host:
  never a larger share than the real one), else 1. No collective is used, so the budget can be
  read at any moment by any rank alone.

A bad value raises :class:`~distckpt.core.CheckpointingException` naming the setting.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
from typing import Iterator, Optional, Union

from distckpt.core import CheckpointingException

__all__ = [
    "ENV_VAR",
    "DEFAULT_FRACTION",
    "host_memory_budget",
    "set_host_memory_budget",
    "parse_budget",
    "local_world_size",
    "cores_per_rank",
    "ranks_doing_io",
]

ENV_VAR = "DISTCKPT_HOST_MEMORY_BUDGET"
DEFAULT_FRACTION = 0.25
MIN_BUDGET = 1 << 16  # a rank's share never goes below 64 KiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

_override: Optional[Union[int, float, str]] = None
# Ranks of this host doing I/O in the current save (set by ``ranks_doing_io``), or None: all of them.
_ranks_doing_io: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "distckpt_ranks_doing_io", default=None
)


@functools.lru_cache(maxsize=1)
def host_ram_bytes() -> int:
    """The host's RAM (read once: it does not change, and reading /proc/meminfo costs ~50 µs,
    which a staging pool asking once per tensor paid thousands of times per save)."""
    import psutil

    return int(psutil.virtual_memory().total)


def parse_budget(value: Union[int, float, str], what: str = ENV_VAR) -> int:
    """The host budget in bytes for a setting: bytes (int, or a string with an optional unit) or a
    fraction of the host's RAM (a float, or a string with a decimal point, in (0, 1])."""
    if isinstance(value, bool):
        raise CheckpointingException(f"{what}={value!r}: not a byte count or a fraction of RAM")
    if isinstance(value, int):
        if value <= 0:
            raise CheckpointingException(f"{what}={value!r}: a memory budget must be positive")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise CheckpointingException(
                f"{what}={value!r}: a fraction of the host's RAM must be in (0, 1]; give bytes as an integer"
            )
        return max(1, int(host_ram_bytes() * value))
    if isinstance(value, str):
        m = _NUMBER.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise CheckpointingException(
                f"{what}={value!r}: expected bytes (e.g. 1073741824, 512MiB, 4GiB) or a fraction of "
                f"the host's RAM (e.g. 0.25)"
            )
        number = m.group(1)
        if "." in number and unit == "":
            return parse_budget(float(number), what)
        amount = float(number) * _UNITS[unit] if "." in number else int(number) * _UNITS[unit]
        return parse_budget(int(amount), what)
    raise CheckpointingException(f"{what}={value!r}: not a byte count or a fraction of RAM")


def local_world_size() -> int:
    """Ranks sharing this host: LOCAL_WORLD_SIZE, else the world size, else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise CheckpointingException(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
        if n < 1:
            raise CheckpointingException(f"LOCAL_WORLD_SIZE={raw!r} must be >= 1")
        return n
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size()
    return 1


def cores_per_rank() -> int:
    """The cores this rank may count on: its CPU affinity if a launcher pinned it to part of the
    host, else the host's cores divided by the ranks on it (:func:`local_world_size`), or by the
    ranks doing I/O when a save said how many of them write (:func:`ranks_doing_io`); at least 1."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    if usable < (os.cpu_count() or usable):
        return max(1, usable)  # pinned: the affinity is this rank's share already
    sharing = local_world_size()
    busy = _ranks_doing_io.get()
    if busy is not None:
        sharing = max(1, min(sharing, busy))
    return max(1, usable // sharing)


@contextlib.contextmanager
def ranks_doing_io(count: Optional[int]) -> Iterator[None]:
    """Within the block, ``count`` ranks of this host do I/O (None: every rank on it). A save
    where only some ranks hold main replicas (data-parallel replicas without a fully parallel
    save) lets its writers share the idle ranks' cores. The count only ever lowers the divisor
    of :func:`cores_per_rank`, never raises it above :func:`local_world_size`."""
    token = _ranks_doing_io.set(count)
    try:
        yield
    finally:
        _ranks_doing_io.reset(token)


def set_host_memory_budget(value: Optional[Union[int, float, str]]) -> None:
    """Set the host's budget (bytes, or a fraction of RAM); None goes back to the environment
    variable or the default. Validated at once."""
    global _override
    if value is not None:
        parse_budget(value, "set_host_memory_budget")
    _override = value


def host_budget_bytes() -> int:
    """The whole host's budget in bytes (before the split between its ranks)."""
    if _override is not None:
        return parse_budget(_override, "set_host_memory_budget")
    raw = os.environ.get(ENV_VAR)
    if raw is not None and raw.strip():
        return parse_budget(raw, ENV_VAR)
    return max(1, int(host_ram_bytes() * DEFAULT_FRACTION))


def host_memory_budget() -> int:
    """Bytes this rank may stage at once: the host's budget divided by the ranks on this host."""
    return max(MIN_BUDGET, host_budget_bytes() // local_world_size())
