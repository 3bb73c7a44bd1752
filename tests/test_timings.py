"""Per-phase timings of a save and a load (distckpt/timings.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt.strategies.async_utils import AsyncCallsQueue
from tests.support.harness import run_ranks

SAVE_PHASES = ["local checks", "global validation", "common state", "planning", "writing", "commit"]
LOAD_PHASES = [
    "common state",
    "local checks",
    "global validation",
    "index",
    "planning",
    "reading",
    "merge",
    "closing check",
]


def _state(rank: int, world: int, fill: float = 1.0) -> dict:
    return {
        "step": 3,
        **{
            f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((64, 8), fill + i), (0, rank, world))
            for i in range(4)
        },
    }


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def save_and_load_late_rank(ckpt: str, late_rank: int, delay: float) -> dict:
    """Every rank saves and loads; ``late_rank`` enters each call ``delay`` seconds late."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for op, call in (
        ("save", lambda: distckpt.save(_state(rank, world), ckpt)),
        ("load", lambda: distckpt.load(_state(rank, world, 0.0), ckpt)),
    ):
        torch.distributed.barrier()
        if rank == late_rank:
            time.sleep(delay)
        wall = _timed(call)
        out[op] = (dataclasses.asdict(distckpt.last_timings(op)), wall)
    return out


def test_every_phase_of_a_save_and_a_load_is_timed_and_a_late_rank_shows_as_a_wait(tmp_path):
    delay = 0.4
    results = run_ranks(2, save_and_load_late_rank, str(tmp_path / "ckpt"), 1, delay)
    for rank, result in enumerate(results):
        for op, expected in (("save", SAVE_PHASES), ("load", LOAD_PHASES)):
            timings, wall = result[op]
            assert timings["op"] == op and timings["rank"] == rank and not timings["failed"]
            assert list(timings["phases"]) == expected, (rank, op, timings)
            # The phases tile the call: they add up to the total, which is the call's wall time.
            assert sum(timings["phases"].values()) == pytest.approx(timings["total_s"], abs=1e-9)
            assert 0 < timings["total_s"] <= wall
            assert timings["total_s"] > wall - 0.05
    # Rank 0 waited for the late rank in the first collective of each call, and nowhere else.
    for op in ("save", "load"):
        early = results[0][op][0]["phases"]
        late = results[1][op][0]["phases"]
        assert early["global validation"] >= delay - 0.05, (op, early)
        assert late["global validation"] < delay / 2, (op, late)
        assert max(v for k, v in early.items() if k != "global validation") < delay / 2, (op, early)


def test_a_failed_save_is_recorded_as_failed_up_to_where_it_stopped(tmp_path, caplog):
    good = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(8))}
    distckpt.save(good, tmp_path / "ok")
    assert not distckpt.last_timings("save").failed
    # Two pieces claim the same block: global validation fails; nothing is written.
    bad = {
        "a": ShardedTensor.from_rank_offsets("w", torch.ones(8)),
        "b": ShardedTensor.from_rank_offsets("w", torch.ones(8)),
    }
    with caplog.at_level(logging.DEBUG, logger="distckpt.timings"):
        with pytest.raises(CheckpointingException):
            distckpt.save(bad, tmp_path / "bad")
    t = distckpt.last_timings("save")
    assert t.failed
    assert list(t.phases) == ["local checks", "global validation"], t
    assert sum(t.phases.values()) == pytest.approx(t.total_s, abs=1e-9)
    assert any(
        r.name == "distckpt.timings" and "save" in r.getMessage() and "(failed)" in r.getMessage()
        for r in caplog.records
    )


def test_an_async_save_records_its_blocking_part_apart_from_a_plain_save(tmp_path):
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(1024.0))}
    distckpt.save(sd, tmp_path / "plain")
    plain = distckpt.last_timings("save")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(distckpt.save(sd, tmp_path / "async", async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    blocking = distckpt.last_timings("async save")
    assert distckpt.last_timings("save") is plain
    assert list(blocking.phases) == [
        "local checks",
        "global validation",
        "common state",
        "planning",
        "staging",
    ]
    assert str(blocking).startswith("async save ") and "staging" in str(blocking)
    out = distckpt.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1024))}, Path(tmp_path / "async")
    )
    assert torch.equal(out["w"], torch.arange(1024.0))
