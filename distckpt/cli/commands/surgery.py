"""``distckpt rm-prefix`` and ``distckpt rename``: crash-safe edits of a checkpoint's keys.

A thin face over :mod:`distckpt.tools.surgery`; in place, or into a new checkpoint with ``--out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click
from rich.markup import escape
from rich.table import Table

from distckpt.cli.app import (
    PATH,
    RichProgress,
    count_text,
    open_locations,
    out_console,
    storage_options_option,
    trust_option,
)
from distckpt.tools.surgery import parse_pairs, remove_prefix, rename_keys


@click.command("rm-prefix")
@click.argument("ckpt", type=PATH)
@click.argument("prefix")
@click.option("--out", type=PATH, help="Write the result as a new checkpoint here; CKPT stays untouched.")
@storage_options_option
def rm_prefix(ckpt: Path, prefix: str, out: Optional[Path], storage_options) -> None:
    """Remove every tensor (and object) whose key starts with PREFIX from CKPT.

    In place the removal is crash-safe (files are rewritten under new names, the index is
    replaced atomically, old files are deleted last). With --out, CKPT is copied first.

    \b
    Examples:
      distckpt rm-prefix ckpt/ optimizer.                 # drop the optimizer state in place
      distckpt rm-prefix ckpt/ optimizer. --out model/    # keep ckpt/, write a model-only copy
    """
    ckpt = open_locations("--storage-option", storage_options, ckpt)
    with RichProgress() as progress:
        removed = remove_prefix(ckpt, prefix, out, progress=progress)
    out_console().print(
        f"removed {count_text(len(removed), 'key')} starting with {escape(repr(prefix))} "
        f"from {escape(str(out or ckpt))}"
    )


@click.command()
@click.argument("ckpt", type=PATH)
@click.option("--map", "maps", multiple=True, metavar="OLD=NEW", help="Rename key OLD to NEW (repeatable).")
@click.option(
    "--regex",
    "regexes",
    multiple=True,
    metavar="PATTERN=REPL",
    help="re.sub(PATTERN, REPL, key) on every key (repeatable; applied in order, after --map; "
    "split at the last '=').",
)
@click.option("--out", type=PATH, help="Write the result as a new checkpoint here; CKPT stays untouched.")
@click.option("--dry-run", is_flag=True, help="Show what would be renamed; change nothing.")
@trust_option
@storage_options_option
def rename(
    ckpt: Path, maps, regexes, out: Optional[Path], dry_run: bool, trust: bool, storage_options
) -> None:
    """Rename tensor (and ShardedObject) keys of CKPT; no tensor bytes are rewritten.

    torch_dist: only .metadata and the manifest change. zarr: array folders move. In place, the
    renamed checkpoint is assembled beside CKPT with hard links and swapped in atomically.

    \b
    Examples:
      distckpt rename ckpt/ --map embedding.weight=embedding.word_embeddings.weight
      distckpt rename ckpt/ --regex '^decoder\\.=model.decoder.' --dry-run
      distckpt rename ckpt/ --regex 'layers\\.(\\d+)\\.=blocks.\\1.' --out renamed/
    """
    if not maps and not regexes:
        raise click.UsageError("give at least one --map OLD=NEW or --regex PATTERN=REPL")
    ckpt = open_locations("--storage-option", storage_options, ckpt)
    mapping = parse_pairs(maps, "--map")
    patterns = parse_pairs(regexes, "--regex", split_last=True)
    with RichProgress() as progress:
        plan = rename_keys(ckpt, mapping, patterns, out, trusted=trust, dry_run=dry_run, progress=progress)
    console = out_console()
    table = Table(box=None, pad_edge=False)
    table.add_column("old key", overflow="fold")
    table.add_column("", no_wrap=True)
    table.add_column("new key", overflow="fold")
    for old, new in list(plan.tensors.items()) + list(plan.objects.items()):
        table.add_row(escape(old), "->", escape(new))
    console.print(table)
    n = len(plan.tensors) + len(plan.objects)
    if dry_run:
        console.print(f"{count_text(n, 'key')} would be renamed (dry run: nothing changed)")
    else:
        console.print(f"renamed {count_text(n, 'key')} in {escape(str(out or ckpt))}")
