"""``distckpt demo``: ranks save a small sharded model and load it back (:mod:`distckpt.demo`)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import click

from distckpt.cli.app import EXIT_PROBLEMS


@click.command()
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Number of ranks (gloo processes on this machine) to save and load with.",
)
@click.option(
    "--dir",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory for the checkpoints. Default: a fresh temporary directory, removed afterwards.",
)
@click.option("--keep", is_flag=True, help="Keep the temporary directory (and print where it is).")
def demo(world_size: int, out_dir: Path | None, keep: bool) -> None:
    """Run the end-to-end demo: WORLD-SIZE ranks save a small sharded model and load it back.

    \b
    Examples:
      distckpt demo                          # 4 ranks, temporary directory
      distckpt demo --world-size 2 --keep    # keep the checkpoints to look at
      distckpt demo --dir ./demo-ckpt        # write into ./demo-ckpt (never removed)
    """
    # Deferred: the demo brings the example model, optimizers and training loop
    # (distckpt.examples), which only this command needs (~40 ms on every start otherwise).
    from distckpt import demo as demo_module

    temporary = out_dir is None
    if temporary:
        out_dir = Path(tempfile.mkdtemp(prefix="distckpt-demo-"))
    try:
        rc = demo_module.main(world_size=world_size, out_dir=out_dir)
    finally:
        if temporary and keep:
            click.echo(f"checkpoints kept in {out_dir}", err=True)
        elif temporary:
            shutil.rmtree(out_dir, ignore_errors=True)
    if rc:
        sys.exit(EXIT_PROBLEMS)
