"""Randomised SIGKILL trials on real processes: ``python -m tests.support.fault_trials launcher ...``.

One *launcher* process per rank imports torch once and runs the trials in sequence. For each
trial every launcher forks a *rank child* that joins a fresh gloo group (rendezvous on a TCPStore
that the test process hosts, under a per-trial prefix: a FileStore is not safe against SIGKILL, a
rank killed inside a store write leaves a torn record the other ranks spin on) and saves; the
launcher of the trial's victim waits until its child is *armed* (the watched save began), sleeps
a random fraction (0 to 1.25) of the time the same save took just before in that child, and
SIGKILLs it — whatever the child is doing then. When all four children ended, launcher 0 forks
a *checker* that classifies what the target folder holds:

``new``   the complete new checkpoint (loads bit-exactly with ``verify=True``);
``old``   the complete old one (bytes identical to before the save; or, for a fresh target,
          nothing at all);
``mixed`` anything else (a committed tree that is neither, an old checkpoint lost, a load error).

Scenarios: ``sync`` (a fresh target), ``async`` (a fresh target, killed during the background
persist or the finalize) and ``overwrite`` (the target holds generation 1; the killed save
writes generation 2). The survivors' outcome and how long after the kill they raised are
recorded too. Trials are derived from ``--seed``, the same in every launcher.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

SCENARIOS = ("sync", "async", "overwrite")


def trial_plan(seed: int, trials: int, world: int, max_fraction: float) -> List[Dict[str, Any]]:
    """Per trial: the victim, and when to kill it as a fraction of the duration of the same save
    just before (beyond 1: after the save, which must then be the complete new checkpoint)."""
    rng = random.Random(seed)
    return [
        {"victim": rng.randrange(world), "fraction": round(rng.uniform(0.0, max_fraction), 4)}
        for _ in range(trials)
    ]


def _wait_for(paths: Sequence[Path], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.005)
    return False


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- rank child


def _rank_child(
    scenario: str, rank: int, world: int, trial_dir: Path, collective_timeout: float, store_port: int
) -> None:
    import torch

    import distckpt
    from distckpt import dist as ddist
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from tests.support import faults

    torch.set_num_threads(1)
    # A child still alive after 45 s is stuck (a trial takes seconds): its threads' stacks go to
    # the launcher's log, which the test shows when it fails.
    faulthandler.dump_traceback_later(45)
    store = torch.distributed.PrefixStore(
        f"{trial_dir.name}/",
        torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60)),
    )
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    distckpt.set_collective_timeout(60)  # the healthy first save, cold, on a busy machine
    target = trial_dir / "target"

    def run_save(path: Path, generation: int, armed: Optional[Path]) -> None:
        state = faults.generation_state(rank, world, generation)
        if armed is not None:
            armed.write_text(str(time.time()))
        if scenario == "async":
            request = distckpt.save(state, str(path), async_sharded_save=True)
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        else:
            distckpt.save(state, str(path))

    # Two healthy saves of the same kind first: a cold one, then one that times the save that
    # gets killed (and is the old checkpoint of the overwrite scenario).
    new = 2 if scenario == "overwrite" else 1
    run_save(trial_dir / "warm-up", 1, None)
    start = time.monotonic()
    run_save(target if scenario == "overwrite" else trial_dir / "timed", 1, None)
    _write_json(trial_dir / f"duration.{rank}", time.monotonic() - start)
    ddist.barrier()
    if scenario == "overwrite" and rank == 0:
        _write_json(trial_dir / "old.json", faults.tree_digest(target))
    ddist.barrier()
    result: Dict[str, Any] = {"rank": rank}
    distckpt.set_collective_timeout(collective_timeout)
    try:
        run_save(target, new, trial_dir / f"armed.{rank}")
        result.update(outcome="returned", at=time.time())
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result.update(
            outcome="raised",
            at=time.time(),
            type=type(e).__name__,
            message=str(e)[:500],
            checkpointing=isinstance(e, distckpt.CheckpointingException),
        )
    _write_json(trial_dir / f"result.{rank}.json", result)


# --------------------------------------------------------------------------- checker


def _classify(scenario: str, trial_dir: Path) -> Dict[str, Any]:
    import distckpt
    from distckpt import commit
    from tests.support import faults

    target = trial_dir / "target"
    old_gen, new_gen = (1, 2) if scenario == "overwrite" else (None, 1)
    leftovers = sorted(p.name for p in trial_dir.iterdir() if commit.is_leftover(p))

    def matches(generation: int) -> bool:
        sd = faults.generation_state(0, 1, generation, with_data=False)
        return faults.generation_mismatches(distckpt.load(sd, target, verify=True), 0, 1, generation) == []

    out: Dict[str, Any] = {"leftovers": leftovers}
    try:
        if not distckpt.check_is_distributed_checkpoint(target):
            fresh_and_empty = old_gen is None and (not target.exists() or not any(target.iterdir()))
            out["outcome"] = "old" if fresh_and_empty else "mixed"
            out["why"] = "no committed checkpoint"
        elif matches(new_gen):
            out["outcome"] = "new"
        elif old_gen is not None and faults.tree_digest(target) == json.loads(
            (trial_dir / "old.json").read_text()
        ):
            out["outcome"] = "old" if matches(old_gen) else "mixed"
        else:
            out["outcome"] = "mixed"
            out["why"] = "a committed tree that is neither generation"
    except Exception as e:  # noqa: BLE001 - a load error is a failed trial
        out["outcome"] = "mixed"
        out["why"] = f"{type(e).__name__}: {e}"[:500]
    return out


# --------------------------------------------------------------------------- launcher


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - the child must never return into the launcher
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _check_trial(scenario: str, trial_dir: Path, plan: Dict[str, Any], world: int) -> None:
    result = _classify(scenario, trial_dir)
    killed = trial_dir / "killed"
    killed_at = float(killed.read_text()) if killed.exists() else None
    result.update(
        victim=plan["victim"], fraction=plan["fraction"], killed=killed_at is not None, survivors={}
    )
    for rank in range(world):
        if rank == plan["victim"] and killed_at is not None:
            continue
        path = trial_dir / f"result.{rank}.json"
        rec = json.loads(path.read_text()) if path.exists() else {"outcome": "vanished"}
        if killed_at is not None and "at" in rec:
            rec["after_kill_s"] = round(rec["at"] - killed_at, 3)
        result["survivors"][str(rank)] = rec
    _write_json(trial_dir / "trial.json", result)


def _launcher(args: argparse.Namespace) -> int:
    import torch  # noqa: F401 - imported once here, inherited by every forked child

    import distckpt  # noqa: F401
    import tests.support.faults  # noqa: F401

    root = Path(args.root)
    plan = trial_plan(args.seed, args.trials, args.world, args.max_fraction)
    for k, trial in enumerate(plan):
        trial_dir = root / f"trial{k:03d}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        pid = _fork(
            _rank_child,
            args.scenario,
            args.rank,
            args.world,
            trial_dir,
            args.collective_timeout,
            args.store_port,
        )
        status = None
        if args.rank == trial["victim"]:
            armed = trial_dir / f"armed.{args.rank}"
            while not armed.exists():
                reaped, code = os.waitpid(pid, os.WNOHANG)
                if reaped:
                    status = code
                    break
                time.sleep(0.002)
            if armed.exists():
                duration = json.loads((trial_dir / f"duration.{args.rank}").read_text())
                time.sleep(trial["fraction"] * duration)
                reaped, code = os.waitpid(pid, os.WNOHANG)
                if reaped:
                    status = code  # it had finished already: nothing to kill
                else:
                    os.kill(pid, signal.SIGKILL)
                    _write_json(trial_dir / "killed", time.time())
        if status is None:
            _, status = os.waitpid(pid, 0)
        (trial_dir / f"exited.{args.rank}").write_text(str(status))
        if args.rank == 0:
            if not _wait_for([trial_dir / f"exited.{r}" for r in range(args.world)], args.trial_timeout):
                stuck = [r for r in range(args.world) if not (trial_dir / f"exited.{r}").exists()]
                _write_json(
                    trial_dir / "trial.json", {"outcome": "stuck", "victim": trial["victim"], "stuck": stuck}
                )
                print(
                    f"trial {k} ({trial}): the children of rank(s) {stuck} did not end within "
                    f"{args.trial_timeout:g} s of rank 0's",
                    flush=True,
                )
                return 2
            checker = _fork(_check_trial, args.scenario, trial_dir, trial, args.world)
            os.waitpid(checker, 0)
            (trial_dir / "checked").write_text("")
        elif not _wait_for([trial_dir / "checked"], args.trial_timeout + 60):
            print(f"trial {k}: rank 0's launcher did not check it in time", flush=True)
            return 2
    return 0


# --------------------------------------------------------------------------- concurrent jobs


def _writer_job(args: argparse.Namespace) -> int:
    """A single-process job that saves ``--generation`` into ``--target`` again and again."""
    import distckpt
    from tests.support import faults

    outcomes: Dict[str, int] = {}
    errors: List[str] = []
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            faults.save_with_fault(args.target, args.generation, None)
            outcomes["saved"] = outcomes.get("saved", 0) + 1
        except distckpt.CheckpointingException as e:
            outcomes["error"] = outcomes.get("error", 0) + 1
            errors.append(str(e)[:300])
    _write_json(Path(args.out), {"outcomes": outcomes, "errors": errors[:20]})
    return 0


def _reader_job(args: argparse.Namespace) -> int:
    """A single-process job that loads ``--target`` again and again and says what each load got:
    exactly one of ``--generations``, a CheckpointingException, or a silent mix."""
    import distckpt
    from tests.support import faults

    gens = [int(g) for g in args.generations.split(",")]
    outcomes: Dict[str, int] = {}
    samples: List[str] = []
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        try:
            loaded = distckpt.load(faults.generation_state(0, 1, gens[0], with_data=False), args.target)
            exact = [g for g in gens if faults.generation_mismatches(loaded, 0, 1, g) == []]
            kind = f"generation {exact[0]}" if len(exact) == 1 else "mixed"
        except distckpt.CheckpointingException as e:
            kind = "error"
            if len(samples) < 10:
                samples.append(str(e)[:300])
        except Exception as e:  # noqa: BLE001 - anything else is a failure of the promise
            kind = "raw error"
            samples.append(f"{type(e).__name__}: {e}"[:300])
        outcomes[kind] = outcomes.get(kind, 0) + 1
    _write_json(Path(args.out), {"outcomes": outcomes, "errors": samples})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fault_trials")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launcher", help="one rank's launcher of the SIGKILL trials")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--root", required=True)
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-fraction", type=float, default=1.25)
    p.add_argument("--collective-timeout", type=float, default=3.0)
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--store-port", type=int, required=True, help="a TCPStore server on 127.0.0.1")
    for name, help_text in (
        ("writer", "a job saving one generation again and again"),
        ("reader", "a job loading again and again"),
    ):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("--target", required=True)
        q.add_argument("--out", required=True)
        q.add_argument("--seconds", type=float, default=8.0)
        q.add_argument("--generation", type=int, default=1)
        q.add_argument("--generations", default="1,2")
    args = parser.parse_args(argv)
    return {"launcher": _launcher, "writer": _writer_job, "reader": _reader_job}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
