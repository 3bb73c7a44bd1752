"""Spawn gloo ranks on this machine, run one function on each, and collect what they return.

``launch(world_size, fn, *args)`` starts ``world_size`` processes with the ``spawn`` method
(``OMP_NUM_THREADS=1``), joins them into a gloo process group over 127.0.0.1 on a free port,
runs ``fn(*args)`` on every rank and returns the values by rank. ``fn`` must be defined at module
level of an importable module and its arguments and result must pickle.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

GRACE_AFTER_FAILURE_S = 5.0
"""After a rank failed, how long the others get to finish before they are killed."""


class LaunchError(RuntimeError):
    """One or more ranks raised, died or did not finish in time; the message has their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        tdist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        try:
            value = fn(*args)
        finally:
            tdist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared memory tied to this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def launch(world_size: int, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh gloo ranks; return the per-rank values.

    Raises:
        LaunchError: a rank raised (tracebacks included), died, or the run took over ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children, read when they import torch
    try:
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, results), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and rank not in values and rank not in errors:
                        errors[rank] = f"rank {rank} died with exit code {p.exitcode}"
            else:
                if ok:
                    values[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            if errors:
                # The others may be blocked in a collective with the failed rank.
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()) if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(range(world_size)) - set(values) - set(errors))
    if errors or missing:
        lines = [
            f"{len(errors)} of {world_size} ranks failed"
            + (f", ranks {missing} did not finish within {timeout:g} s" if missing else "")
        ]
        for rank in sorted(errors):
            lines += [f"---------- rank {rank} ----------", errors[rank].rstrip()]
        raise LaunchError("\n".join(lines))
    return [values[rank] for rank in range(world_size)]
