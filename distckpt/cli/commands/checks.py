"""``distckpt verify`` and ``distckpt diff``: is a checkpoint intact, do two sides differ.

Both exit 1 when they find something (problems, differences) and print it as tables, or as one
JSON document with ``--json``; the work is :mod:`distckpt.tools.verify` and
:mod:`distckpt.tools.diff`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click
from rich.markup import escape
from rich.table import Table

from distckpt.cli.app import (
    EXIT_PROBLEMS,
    PATH,
    RichProgress,
    count_text,
    json_option,
    json_out,
    open_locations,
    out_console,
    size_text,
    storage_option,
    storage_options_option,
    trust_option,
)
from distckpt.cli.commands.tiers import check_local_copy, local_copy_option, print_local_report
from distckpt.storage import open_store
from distckpt.tools.diff import diff_sources
from distckpt.tools.verify import verify_checkpoint

# --------------------------------------------------------------------------- verify

# Problems `distckpt verify` prints (the rest are counted; --json lists them all).
_PROBLEMS_SHOWN = 100


@click.command()
@click.argument("ckpt", type=PATH)
@click.option("--no-checksums", is_flag=True, help="Check the manifest's file sizes only, not CRC32C (fast).")
@click.option(
    "--deep",
    is_flag=True,
    help="Also read every tensor, object and the common state back (checks content where there is "
    "no manifest, e.g. Megatron checkpoints).",
)
@json_option
@trust_option
@storage_options_option
@local_copy_option
def verify(
    ckpt: Path,
    no_checksums: bool,
    deep: bool,
    as_json: bool,
    trust: bool,
    storage_options,
    local_copy: Optional[Path],
) -> None:
    """Check that CKPT is complete and intact; exit 1 if anything is wrong.

    Checks the commit marker (metadata.json), the structure (torch_dist: every chunk has a storage
    record whose file exists and holds offset+length bytes, chunks tile every tensor; zarr: every
    chunk file present, of the right size), the common state and object files, and every file
    and byte range of the integrity manifest (sizes and CRC32C) where there is one.

    \b
    Examples:
      distckpt verify ckpt/
      distckpt verify ckpt/ --no-checksums      # sizes only
      distckpt verify megatron-ckpt/ --deep     # no manifest: read everything back
      distckpt verify s3://bucket/run/iter_0000100 --local-copy /local_nvme/run/iter_0000100

    With --local-copy (a tiered save's node-local copy of CKPT), also checks every file the copy
    holds against CKPT's manifest (ok / damaged / absent) and that its markers carry CKPT's save
    token; exit 1 also when a local file is damaged or the copy is not this save's.
    """
    ckpt = open_locations("--storage-option", storage_options, ckpt)
    local = None
    with RichProgress() as progress:
        report = verify_checkpoint(
            ckpt, checksums=not no_checksums, deep=deep, trusted=trust, progress=progress
        )
        if local_copy is not None:
            local = check_local_copy(
                open_store(ckpt), local_copy, checksums=not no_checksums, progress=progress
            )
    if as_json:
        doc = report.to_json()
        if local is not None:
            doc["local_copy"] = local.to_json()
            doc["ok"] = report.ok and local.ok
        json_out(doc)
    else:
        out = out_console()
        out.print(f"[bold]{escape(report.path)}[/]  ({report.backend or 'unknown backend'})")
        for line in report.checked:
            out.print(f"  [green]checked[/]  {escape(line)}")
        for line in report.notes:
            out.print(f"  [yellow]note[/]     {escape(line)}")
        # A damaged checkpoint can have a problem per claimed chunk (20,000 lines take a terminal
        # seconds); the first ones say what is wrong, --json has them all.
        for line in report.problems[:_PROBLEMS_SHOWN]:
            out.print(f"  [red]PROBLEM[/]  {escape(line)}")
        if len(report.problems) > _PROBLEMS_SHOWN:
            more = len(report.problems) - _PROBLEMS_SHOWN
            out.print(f"  [red]PROBLEM[/]  ... and {more} more (--json lists them all)")
        done = [
            f"{size_text(n)} {what}"
            for n, what in (
                (report.bytes_checksummed, "checksummed"),
                (report.bytes_read, "of tensors read back"),
            )
            if n
        ]
        if report.ok:
            out.print("[bold green]OK[/]" + (f" ({', '.join(done)})" if done else ""))
        else:
            out.print(f"[bold red]{len(report.problems)} problem(s)[/]")
        if local is not None:
            print_local_report(local)
    if not report.ok or (local is not None and not local.ok):
        sys.exit(EXIT_PROBLEMS)


# --------------------------------------------------------------------------- diff


@click.command()
@click.argument("a", type=PATH)
@click.argument("b", type=PATH)
@click.option(
    "--atol", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Absolute tolerance."
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Relative tolerance: elements differ when |a-b| > atol + rtol*|b|.",
)
@click.option(
    "--keys", metavar="REGEX", help="Compare only keys matching this regular expression (skips common state)."
)
@click.option("--exclude", metavar="REGEX", help="Skip keys matching this regular expression.")
@click.option(
    "--no-values", is_flag=True, help="Compare keys, shapes and dtypes only (reads no tensor data)."
)
@json_option
@trust_option
@storage_option(
    "-o",
    "--storage-option",
    dest="storage_options",
    what="at A and B (URLs only; B takes --b-storage-option instead when given)",
)
@storage_option("--b-storage-option", dest="b_storage_options", what="at B (URL only), instead of -o")
def diff(
    a: Path,
    b: Path,
    atol: float,
    rtol: float,
    keys: Optional[str],
    exclude: Optional[str],
    no_values: bool,
    as_json: bool,
    trust: bool,
    storage_options,
    b_storage_options,
) -> None:
    """Compare A and B key by key; exit 1 if they differ.

    Reports keys only in one side, shape and dtype differences, value differences (max |a-b|,
    max relative difference, number of differing elements), ShardedObjects, common state and
    content metadata. One key at a time is in memory. A and B may be checkpoints, safetensors
    files/folders or torch.save files (e.g. to check a conversion).

    \b
    Examples:
      distckpt diff ckpt-a/ ckpt-b/
      distckpt diff ckpt/ converted/ --atol 1e-2 --exclude '^optimizer\\.'
      distckpt diff ckpt/ model.safetensors --keys 'embedding'
      distckpt diff s3://bucket/a az://container/b -o region=eu-west-1 --b-storage-option account_name=acct
    """
    if b_storage_options:
        a = open_locations("--storage-option", storage_options, a)
        b = open_locations("--b-storage-option", b_storage_options, b)
    else:
        a, b = open_locations("--storage-option", storage_options, a, b)
    with RichProgress() as progress:
        report = diff_sources(
            a,
            b,
            atol=atol,
            rtol=rtol,
            keys=keys,
            exclude=exclude,
            values=not no_values,
            trusted=trust,
            progress=progress,
        )
    if as_json:
        json_out(report.to_json())
    else:
        out = out_console()
        out.print(f"[bold]A[/] {escape(report.a)}\n[bold]B[/] {escape(report.b)}")
        keys = report.only_a + report.only_b + [t.key for t in report.tensors] + report.objects_different
        table = Table(box=None, pad_edge=False)
        table.add_column(
            "key", overflow="fold", min_width=min(max(map(len, keys), default=3), out.width // 2)
        )
        table.add_column("difference", no_wrap=True)
        table.add_column("max |a-b|", justify="right", no_wrap=True)
        table.add_column("max rel", justify="right", no_wrap=True)
        table.add_column("details", overflow="fold")
        for k in report.only_a:
            table.add_row(escape(k), "[yellow]only in A[/]", "", "", "")
        for k in report.only_b:
            table.add_row(escape(k), "[yellow]only in B[/]", "", "", "")
        for t in report.tensors:
            detail = t.detail
            if t.kind == "dtype" and t.numel is not None:
                detail += (
                    f"; {t.mismatched} of {t.numel} values differ"
                    if t.mismatched
                    else "; all values within tolerance"
                )
            table.add_row(
                escape(t.key),
                f"[red]{t.kind}[/]",
                "" if t.max_abs is None else f"{t.max_abs:.4g}",
                "" if t.max_rel is None else f"{t.max_rel:.4g}",
                escape(detail),
            )
        for k in report.objects_only_a:
            table.add_row(escape(k), "[yellow]object only in A[/]", "", "", "")
        for k in report.objects_only_b:
            table.add_row(escape(k), "[yellow]object only in B[/]", "", "", "")
        for k in report.objects_different:
            table.add_row(escape(k), "[red]object payload[/]", "", "", "")
        for line in report.common:
            table.add_row("(common state)", "[red]different[/]", "", "", escape(line))
        for line in report.content_metadata:
            table.add_row("(content metadata)", "[red]different[/]", "", "", escape(line))
        if table.row_count:
            out.print(table)
        differing = len(report.only_a) + len(report.only_b) + len(report.tensors)
        verdict = "[bold green]identical[/]" if report.identical else "[bold red]different[/]"
        tol = f" (atol {atol:g}, rtol {rtol:g})" if atol or rtol else ""
        out.print(
            f"{count_text(report.compared, 'tensor')} compared{tol}, "
            f"{count_text(differing, 'tensor difference')}: "
            f"{verdict}"
        )
    if not report.identical:
        sys.exit(EXIT_PROBLEMS)
