#!/usr/bin/env python3
"""Train the example GPT under one parallel layout, save, resume under another, compare losses.

    python examples/train.py                                    # TP2xPP2xDP2 -> TP1xPP1xDP1
    python examples/train.py --layout TP2xPP1xDP2 --resume-layout TP4xPP1xDP2 \\
        --optimizer distributed --resume-optimizer adam

Run 1 (the uninterrupted run) trains ``--steps`` steps under ``--layout``, saves a checkpoint
and trains ``--resume-steps`` more. Run 2 starts under ``--resume-layout`` from that checkpoint
and trains ``--resume-steps`` steps. Their losses must agree: bitwise when the layouts (and
optimizers) are the same, else within a relative 1e-5 (TP and DP change the order of
floating-point sums). Each run spawns its own gloo ranks on this machine (CPU).
Exit status: 0 when the losses agree, 1 when they do not.

With ``--local-every N`` it shows fast recovery instead (docs/local-recovery.md): the run saves
to the local tier (node-local directories, each piece replicated to a peer on another node)
every N iterations and a persistent checkpoint every ``--persistent-every`` M, "crashes" at
``--crash-at``, optionally loses a node's local directory (``--lose-node``), and restarts under
the same layout from the newer of the two tiers; the losses from there on must match an
uninterrupted run bitwise::

    python examples/train.py --layout TP2xPP1xDP2 --local-every 2 --persistent-every 5 \
        --crash-at 7 --node-size 2 --lose-node 1

With ``--tiered-every N`` it saves tiered checkpoints (docs/tiered.md): each to the node-local
directories first, uploaded to ``--remote`` (an object store URL, or a directory) in the
background; it "crashes" at ``--crash-at`` with uploads in flight, optionally loses a node, and
resumes under ``--resume-layout`` from the nearest intact copy of each file::

    python examples/train.py --layout TP2xPP1xDP2 --resume-layout TP2xPP1xDP2 --tiered-every 2 \
        --crash-at 7 --lose-node 1
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from distckpt.examples.launch import launch
from distckpt.examples.parallel import Layout
from distckpt.examples.training import (
    LOSS_RTOL,
    CheckpointPlan,
    TieredPlan,
    TrainConfig,
    last_stage_losses,
    losses_match,
    run,
    run_tiered,
    run_with_recovery,
)

OPTIMIZERS = {"adam": False, "distributed": True}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layout",
        type=Layout.parse,
        default=Layout(2, 2, 2),
        help="layout of the uninterrupted run, e.g. TP2xPP2xDP2 or 2,2,2 (default: %(default)s)",
    )
    parser.add_argument(
        "--resume-layout",
        type=Layout.parse,
        default=Layout(1, 1, 1),
        help="layout to resume under (default: %(default)s)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="distributed",
        help="optimizer of the uninterrupted run (default: %(default)s)",
    )
    parser.add_argument(
        "--resume-optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="optimizer of the resumed run (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="steps before the checkpoint (default: %(default)s)"
    )
    parser.add_argument("--resume-steps", type=int, default=3, help="steps after it (default: %(default)s)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="checkpoint directory (default: a temporary one, removed afterwards)",
    )
    local = parser.add_argument_group("fast recovery (local tier + persistent checkpoints, same layout)")
    local.add_argument(
        "--local-every",
        type=int,
        default=0,
        help="save to the local tier every N iterations (turns this mode on)",
    )
    local.add_argument(
        "--persistent-every",
        type=int,
        default=0,
        help="persistent checkpoint every M iterations (default: off)",
    )
    local.add_argument(
        "--crash-at", type=int, default=None, help="iteration at which the first run stops (default: --steps)"
    )
    local.add_argument(
        "--node-size", type=int, default=1, help="ranks per simulated node (default: %(default)s)"
    )
    local.add_argument(
        "--replication-factor",
        type=int,
        default=2,
        help="copies of every rank's piece, own included (default: %(default)s)",
    )
    local.add_argument(
        "--lose-node",
        type=int,
        default=None,
        help="delete this node's local directory before restarting (a replaced node)",
    )
    tiered = parser.add_argument_group("tiered checkpoints (node-local first, uploaded in the background)")
    tiered.add_argument(
        "--tiered-every",
        type=int,
        default=0,
        help="tiered checkpoint every N iterations (turns this mode on)",
    )
    tiered.add_argument(
        "--remote",
        default=None,
        help="the remote tier: an s3://, gs://, az:// URL or a directory (default: DIR/remote)",
    )
    tiered.add_argument("--async-save", action="store_true", help="tiered saves with async_sharded_save=True")
    return parser.parse_args(argv)


def lose_node(local_root: str, node: int | None) -> None:
    """Delete one simulated node's local directory (a replaced node)."""
    if node is not None:
        shutil.rmtree(Path(local_root) / f"node{node}", ignore_errors=True)
        print(f"node {node} replaced: its local directory is gone")


def compare_losses(after: list[float], resumed: list[float], first: int, tolerant: bool) -> int:
    """Print the losses side by side; 0 when they match (bitwise, or within LOSS_RTOL when
    ``tolerant``: the layouts differ), else 1."""
    print(f"\n{'step':>4}  {'uninterrupted':>14}  {'resumed':>14}")
    for i, (a, b) in enumerate(zip(after, resumed)):
        print(f"{first + i + 1:>4}  {a:>14.9f}  {b:>14.9f}")
    if after == resumed:
        print("losses match bitwise")
        return 0
    if tolerant and losses_match(after, resumed, LOSS_RTOL):
        print(f"losses match within a relative {LOSS_RTOL:g}")
        return 0
    print("MISMATCH: the resumed losses differ from the uninterrupted run")
    return 1


def main_tiered(args: argparse.Namespace) -> int:
    """Train, crash with uploads in flight, optionally lose a node, resume (under
    --resume-layout) from the nearest intact copy, compare the losses."""
    layout, total = args.layout, args.steps + args.resume_steps
    crash_at = args.steps if args.crash_at is None else args.crash_at
    cfg = TrainConfig(distributed_optimizer=OPTIMIZERS[args.optimizer])
    resume_cfg = TrainConfig(distributed_optimizer=OPTIMIZERS[args.resume_optimizer])
    with tempfile.TemporaryDirectory(prefix="distckpt-train-") as tmp:
        root = args.dir if args.dir is not None else Path(tmp)
        remote = args.remote or str(root / "remote")
        plan = TieredPlan(
            remote, str(root / "local"), args.tiered_every, args.node_size, async_save=args.async_save
        )
        reference = last_stage_losses(launch(layout.world_size, run, layout, total, cfg))
        print(f"{layout}: {total} steps uninterrupted")
        launch(layout.world_size, run_tiered, layout, total, cfg, plan, crash_at)
        print(
            f"{layout}: tiered checkpoint every {args.tiered_every} to {remote}; "
            f"crashed at iteration {crash_at}"
        )
        lose_node(plan.local_root, args.lose_node)
        start = time.perf_counter()
        resume = args.resume_layout
        results = launch(resume.world_size, run_tiered, resume, total, resume_cfg, plan)
        first = results[0].first_iteration
        print(
            f"{resume}: restarted at iteration {first} (rank 0 read {results[0].resumed_from or 'nothing'}), "
            f"trained to {total} ({time.perf_counter() - start:.1f} s)"
        )
    return compare_losses(reference[first:], last_stage_losses(results), first, str(resume) != str(layout))


def main_local(args: argparse.Namespace) -> int:
    """Train, crash, lose a node, restart from the newest checkpoint of either tier, compare."""
    layout, total = args.layout, args.steps + args.resume_steps
    crash_at = args.steps if args.crash_at is None else args.crash_at
    cfg = TrainConfig(distributed_optimizer=OPTIMIZERS[args.optimizer])
    with tempfile.TemporaryDirectory(prefix="distckpt-train-") as tmp:
        root = args.dir if args.dir is not None else Path(tmp)
        plan = CheckpointPlan(
            str(root / "local"),
            args.local_every,
            str(root / "persistent"),
            args.persistent_every,
            args.node_size,
            args.replication_factor,
        )
        reference = last_stage_losses(
            launch(layout.world_size, run_with_recovery, layout, total, cfg, CheckpointPlan())
        )
        print(f"{layout}: {total} steps uninterrupted")
        launch(layout.world_size, run_with_recovery, layout, total, cfg, plan, crash_at)
        print(
            f"{layout}: local tier every {args.local_every}, "
            f"persistent every {args.persistent_every or '-'}; "
            f"crashed at iteration {crash_at}"
        )
        lose_node(plan.local_root, args.lose_node)
        start = time.perf_counter()
        results = launch(layout.world_size, run_with_recovery, layout, total, cfg, plan)
        first, source = results[0].first_iteration, results[0].resumed_from
        print(
            f"restarted from the {source or 'no'} checkpoint at iteration {first}, trained to {total} "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return compare_losses(reference[first:], last_stage_losses(results), first, tolerant=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_every:
        return main_local(args)
    if args.tiered_every:
        return main_tiered(args)
    with tempfile.TemporaryDirectory(prefix="distckpt-train-") as tmp:
        ckpt = str(args.dir if args.dir is not None else Path(tmp) / "ckpt")
        save_cfg = TrainConfig(distributed_optimizer=OPTIMIZERS[args.optimizer])
        resume_cfg = TrainConfig(distributed_optimizer=OPTIMIZERS[args.resume_optimizer])

        start = time.perf_counter()
        reference = last_stage_losses(
            launch(
                args.layout.world_size,
                run,
                args.layout,
                args.steps + args.resume_steps,
                save_cfg,
                None,
                ckpt,
                args.steps,
            )
        )
        print(
            f"{args.layout} ({args.optimizer}): {args.steps + args.resume_steps} steps, saved after "
            f"{args.steps} to {ckpt} ({time.perf_counter() - start:.1f} s)"
        )
        start = time.perf_counter()
        resumed = last_stage_losses(
            launch(
                args.resume_layout.world_size, run, args.resume_layout, args.resume_steps, resume_cfg, ckpt
            )
        )
        print(
            f"{args.resume_layout} ({args.resume_optimizer}): resumed, {args.resume_steps} steps "
            f"({time.perf_counter() - start:.1f} s)"
        )

    after = reference[args.steps :]
    print(f"\n{'step':>4}  {'uninterrupted':>14}  {'resumed':>14}  {'relative diff':>13}")
    for i, (a, b) in enumerate(zip(after, resumed)):
        print(f"{args.steps + i + 1:>4}  {a:>14.9f}  {b:>14.9f}  {abs(a - b) / abs(a):>13.2e}")
    if after == resumed:
        print("losses match bitwise")
        return 0
    if losses_match(after, resumed, LOSS_RTOL):
        print(f"losses match within a relative {LOSS_RTOL:g}")
        return 0
    print(f"MISMATCH: losses differ by more than a relative {LOSS_RTOL:g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
