"""The generated hostile suite (tests/support/hostile_fuzz.py) in the default run, and proof that it can fail.

The default run takes ``DISTCKPT_FUZZ_CASES`` cases (30: the control cases, then byte classes
and mutators in a seeded order) against every entry point, in one worker process; the ``slow``
run 300 more in another order. Thousands, another order, or longer limits::

    DISTCKPT_FUZZ_CASES=3000 DISTCKPT_FUZZ_SEED=7 pytest -q -s tests/untrusted/test_fuzz_hostile.py
    python -m tests.support.hostile_fuzz run --cases 3000 --report fuzz.md     # the same, tables only

A failure prints the table of outcomes and one reproducer per distinct failure
(``python -m tests.support.hostile_fuzz case --base ... --file ... --mutator ... --seed ...``).
"""

from __future__ import annotations

import os

import pytest

from tests.support import hostile_fuzz as hf

CASES = int(os.environ.get("DISTCKPT_FUZZ_CASES", "30"))
SLOW_CASES, SLOW_SEED = 300, 1
SEED = int(os.environ.get("DISTCKPT_FUZZ_SEED", "0"))
TIME_LIMIT = float(os.environ.get("DISTCKPT_FUZZ_TIME_LIMIT", "5"))


def _check(cases: int, seed: int) -> None:
    rows = hf.run_cases(cases, seed=seed, time_limit=TIME_LIMIT)
    table = hf.summarize(rows)
    print(table)
    assert {r["ep"] for r in rows} == set(hf.ENTRY_POINTS)
    controls = [r for r in rows if r["mutator"] == "none"]
    assert controls and all(r["outcome"] in ("ok", "ok-exact", "skipped") for r in controls), table
    bad = [r for r in rows if r["outcome"] in hf.FAILURES]
    assert not bad, f"{len(bad)} failing runs\n{table}"


def test_generated_hostile_checkpoints_are_refused_or_read_exactly():
    _check(CASES, SEED)


@pytest.mark.slow
def test_many_more_generated_hostile_checkpoints_are_refused_or_read_exactly():
    _check(SLOW_CASES, SLOW_SEED)


def test_the_fuzzer_classifies_planted_failures():
    """A runner that cannot see a failure passes everything: plant one of each kind in the worker
    and check that each is reported as such (the control case is otherwise clean)."""
    # (zarr first: the planted hang of the other case ends its worker.)
    cases = [hf.Case("zarr", "metadata.json", "none", 1), hf.Case("torch_dist", "metadata.json", "none", 0)]
    eps = (
        "load",
        "cli-verify",
        "check_is_distributed_checkpoint",
        "load_common_state_dict",
        "load_tensors_metadata",
        "cli-inspect",
    )
    rows = hf.run_cases(0, cases=cases, eps=eps, plant="all", time_limit=2.0)
    print(hf.summarize(rows))
    disagreeing = {r["ep"]: r["outcome"] for r in rows if r["base"] == "zarr" and r["ep"] in eps[:2]}
    assert disagreeing == {
        "load": "refused",  # a refusal naming common.pt ...
        "cli-verify": "DISAGREE",  # ... that verify did not share
    }, disagreeing
    got = {r["ep"]: r["outcome"] for r in rows if r["base"] == "torch_dist"}
    assert got == {
        "load": "SILENT-WRONG",  # compared against wrong expected values
        "cli-verify": "SILENT-WRONG",  # said intact while a load returned wrong values
        "check_is_distributed_checkpoint": "escaped",  # read a canary outside the checkpoint
        "load_common_state_dict": "crash",  # a raw exception
        "load_tensors_metadata": "oom",  # allocated past the address-space limit
        "cli-inspect": "hang",  # slept past the time limit (in a fresh worker)
    }, got
