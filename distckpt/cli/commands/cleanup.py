"""``distckpt gc``: finish an interrupted save's publication and remove the leftovers of earlier
and failed saves (a thin face over :mod:`distckpt.tools.garbage`)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from distckpt.cli.app import (
    PATH,
    count_text,
    json_option,
    json_out,
    open_locations,
    out_console,
    storage_options_option,
)
from distckpt.tools.garbage import collect

# Names `distckpt gc` prints (the rest are counted; --json lists them all).
_SHOWN = 20


@click.command("gc")
@click.argument("ckpt", type=PATH)
@click.option("--dry-run", is_flag=True, help="Say what would be published and removed; change nothing.")
@click.option(
    "--uncommitted",
    is_flag=True,
    help="Also remove the objects of saves that may still be running (a later generation than the "
    "committed one): only when no save to CKPT is running.",
)
@json_option
@storage_options_option
def gc(ckpt: Path, dry_run: bool, uncommitted: bool, as_json: bool, storage_options) -> None:
    """Finish what interrupted saves left and remove what no checkpoint uses.

    On an object store: publish an overwrite that committed but was cut before its objects were
    copied to their plain names, then remove the objects of earlier saves and of saves that
    failed. On a local directory: remove the hidden staging / old / trash siblings of interrupted
    saves. The committed checkpoint and files that are not a save's are never touched.

    \b
    Examples:
      distckpt gc s3://bucket/run/latest --dry-run
      distckpt gc s3://bucket/run/latest
      distckpt gc ckpt/iter_0001000
    """
    location = open_locations("--storage-option", storage_options, ckpt)
    report = collect(location, dry_run=dry_run, uncommitted=uncommitted)
    if as_json:
        json_out(report.to_json())
        return
    console = out_console()
    if report.published:
        done = "would be published" if dry_run else "published"
        console.print(f"save {escape(report.published)} {done} (copied to its plain names)")
    done = "would be removed" if dry_run else "removed"
    console.print(f"{count_text(len(report.removed), 'leftover')} of earlier or failed saves {done}")
    for name in report.removed[:_SHOWN]:
        console.print(f"  {escape(name)}")
    if len(report.removed) > _SHOWN:
        console.print(f"  ... and {len(report.removed) - _SHOWN} more")
