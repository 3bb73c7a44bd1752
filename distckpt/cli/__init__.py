"""The ``distckpt`` command: a thin face over the library (see ``distckpt --help``).

Every command runs in one process, on CPU, with no model code and no process group; the work is
done by :mod:`distckpt.tools`. Exit codes (docs/cli.md):

    0  success: the checkpoint is fine / the two sides are identical
    1  problems found (verify) / differences found (diff) / the demo's reload did not match
    2  usage or input error: bad option, missing path, not a checkpoint, unreadable file,
       refusing to unpickle without --trust, ... (one red line on stderr, no traceback)
    3  internal error: a bug in distckpt (a traceback is printed; please report it)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

import click

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# --------------------------------------------------------------------------- output helpers


def _stdout():
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 0) or 0) or 200
    return Console(highlight=False, width=width, soft_wrap=True)


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _error(message: str) -> None:
    from rich.markup import escape

    _stderr().print(f"[bold red]error:[/] {escape(message)}")


class _RichProgress:
    """A :class:`distckpt.tools.inspect.Progress` drawn as a rich progress bar over bytes on
    stderr (only when stderr is a terminal, so pipes and logs stay clean)."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        console = _stderr()
        self.bar = Progress(
            TextColumn("{task.description:>12}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task = None

    def __enter__(self) -> _RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def start(self, total: int, description: str) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(description, total=max(total, 1))

    def advance(self, amount: int) -> None:
        if self.task is not None:
            self.bar.advance(self.task, amount)


def _size(n: Optional[int]) -> str:
    from rich.filesize import decimal

    return "" if n is None else decimal(n)


def _count(n: int, noun: str) -> str:
    plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def _json_out(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


# --------------------------------------------------------------------------- the group


class _Group(click.Group):
    """Turns user errors into one red line and exit code 2, bugs into a traceback and 3."""

    def invoke(self, ctx: click.Context) -> Any:
        from distckpt.core import CheckpointingException

        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (CheckpointingException, OSError) as e:
            _error(
                str(e)
                if isinstance(e, CheckpointingException)
                else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            )
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            _error("interrupted")
            ctx.exit(130)
        except Exception:  # noqa: BLE001 - anything else is a bug: show it
            traceback.print_exc()
            _error("internal error (a bug in distckpt; please report it with the traceback above)")
            ctx.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings=_CONTEXT)
@click.version_option(package_name="distckpt")
def main() -> None:
    """Save, load and inspect distributed (tensor/pipeline/data-parallel) checkpoints.

    Every command works on one machine, on CPU, without model code: on distckpt checkpoints,
    Megatron-Core ones (torch_dist and zarr) and, where it makes sense, safetensors and
    torch.save files.

    \b
    Exit codes: 0 ok, 1 problems or differences found, 2 usage or input error, 3 internal error.

    \b
    Examples:
      distckpt inspect ckpt/
      distckpt verify ckpt/
      distckpt convert ckpt/ hf-model/ --to safetensors --model-only --dtype bf16
      distckpt demo --world-size 2
    """


_trust = click.option(
    "--trust",
    is_flag=True,
    help="Unpickle metadata, common state and objects without the safety allowlist "
    "(only for checkpoints whose origin you trust).",
)
_as_json = click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead of tables.")


class _Location(click.ParamType):
    """A checkpoint location: a local path (a ``Path``) or an object-store URL (kept as a str)."""

    name = "path|url"

    def convert(self, value, param, ctx):
        from distckpt import storage

        if isinstance(value, (Path, str)) and storage.is_remote(str(value)):
            return str(value)
        return Path(value)


_path = _Location()


def _storage_option(*names: str, dest: str, what: str):
    return click.option(
        *names,
        dest,
        multiple=True,
        metavar="KEY=VALUE",
        help=f"Option of the object store {what}; repeatable. Keys: endpoint, region, "
        f"credentials, allow_http, part_size, ... (docs/storage.md); they override the "
        f"environment.",
    )


_storage_options = _storage_option(
    "-o", "--storage-option", dest="storage_options", what="at the location (URLs only)"
)


def _parse_storage_options(pairs, flag: str) -> dict:
    """``KEY=VALUE`` pairs as a dict (split at the first ``=``; values stay strings)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint=flag)
        options[key] = value
    return options


def _open_locations(flag: str, pairs, *locations):
    """``locations`` with every object-store URL among them opened as a Store with the options
    ``pairs`` (local paths stay as they are). Options with no URL to apply to are a usage error."""
    from distckpt import storage

    options = _parse_storage_options(pairs, flag)
    remote = [loc is not None and storage.is_remote(loc) for loc in locations]
    if options and not any(remote):
        raise click.BadParameter(
            "storage options apply to object-store URLs (s3://, gs://, az://, ...) only", param_hint=flag
        )
    opened = [storage.open_store(loc, options) if r else loc for loc, r in zip(locations, remote)]
    return opened[0] if len(opened) == 1 else opened


# --------------------------------------------------------------------------- inspect


@main.command()
@click.argument("ckpt", type=_path)
@_as_json
@click.option("--flat", is_flag=True, help="List full keys instead of a tree.")
@click.option(
    "--depth",
    type=click.IntRange(min=0),
    default=None,
    help="Collapse the key tree below this depth into one row per subtree.",
)
@click.option("--keys", "pattern", metavar="REGEX", help="Only keys matching this regular expression.")
@_trust
@_storage_options
def inspect(
    ckpt: Path,
    as_json: bool,
    flat: bool,
    depth: Optional[int],
    pattern: Optional[str],
    trust: bool,
    storage_options,
) -> None:
    """Describe CKPT from its metadata: format, keys with shape, dtype, chunks and bytes, objects,
    common state, content metadata. Reads no tensor data.

    CKPT may be a checkpoint directory (torch_dist, zarr; distckpt's or Megatron-Core's), a
    safetensors file or folder, or a torch.save file. Flattened (distributed-optimizer) keys
    show their original shape; "stored" is their shape on disk.

    \b
    Examples:
      distckpt inspect ckpt/
      distckpt inspect ckpt/ --depth 2
      distckpt inspect ckpt/ --flat --keys 'layers\\.0\\.'
      distckpt inspect ckpt/ --json | jq '.tensors[].key'
      distckpt inspect s3://bucket/run/iter_100 -o endpoint=http://minio:9000 -o allow_http=true
    """
    import re

    from distckpt.tools.inspect import inspect_source

    ckpt = _open_locations("--storage-option", storage_options, ckpt)
    info = inspect_source(ckpt, trusted=trust)
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise click.BadParameter(str(e), param_hint="--keys") from None
        info.tensors = [t for t in info.tensors if rx.search(t.key)]
        info.objects = [o for o in info.objects if rx.search(o.key)]
    if as_json:
        _json_out(info.to_json())
        return
    _print_info(info, flat, depth)


def _print_info(info, flat: bool, depth: Optional[int]) -> None:
    from rich.markup import escape
    from rich.pretty import Pretty
    from rich.table import Table

    from distckpt.tools.inspect import dtype_name, key_tree_rows

    out = _stdout()
    version = f" v{info.format_version}" if info.format_version is not None else ""
    out.print(f"[bold]{escape(info.path)}[/]")
    facts = [f"format: [cyan]{info.format}{version}[/]"]
    if info.extra.get("dcp_native"):
        facts.append("plain PyTorch DCP (no metadata.json; read-only)")
    elif "common_backend" in info.extra:
        facts.append(f"common: {info.extra['common_backend']}")
    out.print("  " + "   ".join(facts))
    disk = info.extra.get("disk_bytes")
    out.print(
        f"  {_count(len(info.tensors), 'tensor')} ({_size(info.nbytes)} of values), "
        f"{_count(len(info.objects), 'object')}, {_count(info.extra.get('files', 0), 'file')}, "
        f"{_size(disk)} on disk"
    )
    manifest = info.extra.get("manifest")
    if manifest:
        out.print(
            f"  integrity manifest: {manifest['files']} files, {manifest['checksummed_ranges']} "
            f"checksummed ranges (save id {manifest['save_id']})"
        )
    elif info.format in ("torch_dist", "zarr"):
        out.print("  integrity manifest: [yellow]none[/] (verify checks structure and sizes only)")
    if info.extra.get("metadata"):
        out.print(f"  file metadata: {escape(json.dumps(info.extra['metadata']))}")

    if info.tensors:
        flattened = any(t.stored_shape is not None for t in info.tensors)
        table = Table(title="Tensors", title_justify="left", title_style="bold", box=None, pad_edge=False)
        table.add_column("key", overflow="fold")
        table.add_column("shape", no_wrap=True)
        if flattened:
            table.add_column("stored", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        table.add_column("chunks", justify="right", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        table.add_column("on disk", justify="right", no_wrap=True)
        if flat:
            rows = [(t.key, t, 1, t.nbytes, t.disk_bytes) for t in info.tensors]
        else:
            rows = [
                (r.label, r.meta, r.count, r.nbytes, r.disk_bytes) for r in key_tree_rows(info.tensors, depth)
            ]
        for label, meta, count, nbytes, disk_bytes in rows:
            if meta is not None:
                cells = [escape(label), str(list(meta.shape))]
                if flattened:
                    cells.append(str(list(meta.stored_shape)) if meta.stored_shape is not None else "")
                cells += [dtype_name(meta.dtype), "" if meta.chunks is None else str(meta.chunks)]
            else:
                cells = (
                    [f"[bold]{escape(label)}[/]", f"[dim]{count} tensors[/]"]
                    + ([""] if flattened else [])
                    + ["", ""]
                )
            table.add_row(*cells, _size(nbytes), _size(disk_bytes))
        out.print()
        out.print(table)
    if info.objects:
        table = Table(title="Objects", title_justify="left", title_style="bold", box=None, pad_edge=False)
        table.add_column("unique key", overflow="fold")
        table.add_column("stored at", overflow="fold")
        table.add_column("on disk", justify="right", no_wrap=True)
        for o in info.objects:
            table.add_row(escape(o.key), escape(o.where or ""), _size(o.disk_bytes))
        out.print()
        out.print(table)
    out.print()
    if info.common_error:
        out.print(f"[bold]Common state:[/] [yellow]not read[/]: {escape(info.common_error)}")
    elif info.format in ("safetensors",):
        pass
    else:
        out.print("[bold]Common state:[/]")
        out.print(Pretty(info.common, indent_guides=True, max_length=20, max_string=80))
    if info.content_metadata is not None:
        out.print("[bold]Content metadata:[/]")
        out.print(Pretty(info.content_metadata, indent_guides=True))


# --------------------------------------------------------------------------- show


@main.command()
@click.argument("ckpt", type=_path)
@click.argument("key")
@click.option(
    "--slice",
    "slice_text",
    metavar="INDEX",
    help="Numpy-style index, e.g. '0:4,:' or '-1' or '...,0:8:2'; only these elements are read.",
)
@click.option("--full", is_flag=True, help="Print every element (default: torch's summary of big tensors).")
@click.option(
    "--precision",
    type=click.IntRange(min=0, max=20),
    default=4,
    show_default=True,
    help="Digits after the decimal point.",
)
@_trust
@_storage_options
def show(
    ckpt: Path, key: str, slice_text: Optional[str], full: bool, precision: int, trust: bool, storage_options
) -> None:
    """Print tensor KEY of CKPT (or a slice of it), or ShardedObject KEY, without loading the rest.

    Only the stored chunks that overlap the requested slice are read.

    \b
    Examples:
      distckpt show ckpt/ decoder.layers.0.mlp.linear_fc1.weight --slice 0:4,:
      distckpt show ckpt/ embedding.word_embeddings.weight --slice -1 --full
      distckpt show ckpt/ rng_state/shard_0_2
    """
    import torch
    from rich.markup import escape
    from rich.pretty import Pretty

    from distckpt.tools.inspect import dtype_name, open_source, read_tensor

    ckpt = _open_locations("--storage-option", storage_options, ckpt)
    out = _stdout()
    with open_source(ckpt, trusted=trust) as src:
        if key not in src.tensors() and key in src.objects():
            out.print(f"[bold]{escape(key)}[/] (ShardedObject)")
            out.print(Pretty(src.read_object(key), max_length=None if full else 50))
            return
        meta = src.meta(key)
        tensor = read_tensor(src, key, slice_text)
    where = f"[{escape(slice_text)}] -> {list(tensor.shape)}" if slice_text else ""
    out.print(f"[bold]{escape(key)}[/]  {list(meta.shape)} {dtype_name(meta.dtype)} {where}".rstrip())
    values = tensor
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        values = tensor.to(torch.float32)  # float8 has no printing or reductions of its own
        out.print(f"[dim](shown as float32; stored as {dtype_name(tensor.dtype)})[/]")
    if values.numel() and not values.dtype.is_complex and values.dtype != torch.bool:
        v = values.to(torch.float64)
        finite = v[torch.isfinite(v)]
        stats = f"min {float(v.min()):.6g}  max {float(v.max()):.6g}"
        if finite.numel():
            stats += f"  mean {float(finite.mean()):.6g}  std {float(finite.std()) if finite.numel() > 1 else 0.0:.6g}"
        nonfinite = v.numel() - finite.numel()
        if nonfinite:
            stats += f"  non-finite {nonfinite}"
        out.print(f"[dim]{stats}[/]")
    with _print_options(full, precision):
        click.echo(repr(values))


class _print_options:
    def __init__(self, full: bool, precision: int):
        self.full, self.precision = full, precision

    def __enter__(self) -> None:
        import torch

        torch.set_printoptions(profile="full" if self.full else "default")
        torch.set_printoptions(precision=self.precision, linewidth=120)

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.set_printoptions(profile="default")


# --------------------------------------------------------------------------- verify

# Problems `distckpt verify` prints (the rest are counted; --json lists them all).
_PROBLEMS_SHOWN = 100


@main.command()
@click.argument("ckpt", type=_path)
@click.option("--no-checksums", is_flag=True, help="Check the manifest's file sizes only, not CRC32C (fast).")
@click.option(
    "--deep",
    is_flag=True,
    help="Also read every tensor, object and the common state back (checks content where there is "
    "no manifest, e.g. Megatron checkpoints).",
)
@_as_json
@_trust
@_storage_options
def verify(ckpt: Path, no_checksums: bool, deep: bool, as_json: bool, trust: bool, storage_options) -> None:
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
    """
    from rich.markup import escape

    from distckpt.tools.verify import verify_checkpoint

    ckpt = _open_locations("--storage-option", storage_options, ckpt)
    with _RichProgress() as progress:
        report = verify_checkpoint(
            ckpt, checksums=not no_checksums, deep=deep, trusted=trust, progress=progress
        )
    if as_json:
        _json_out(report.to_json())
    else:
        out = _stdout()
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
            f"{_size(n)} {what}"
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
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


# --------------------------------------------------------------------------- diff


@main.command()
@click.argument("a", type=_path)
@click.argument("b", type=_path)
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
@_as_json
@_trust
@_storage_option(
    "-o",
    "--storage-option",
    dest="storage_options",
    what="at A and B (URLs only; B takes --b-storage-option instead when given)",
)
@_storage_option("--b-storage-option", dest="b_storage_options", what="at B (URL only), instead of -o")
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
    from rich.markup import escape
    from rich.table import Table

    from distckpt.tools.diff import diff_sources

    if b_storage_options:
        a = _open_locations("--storage-option", storage_options, a)
        b = _open_locations("--b-storage-option", b_storage_options, b)
    else:
        a, b = _open_locations("--storage-option", storage_options, a, b)
    with _RichProgress() as progress:
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
        _json_out(report.to_json())
    else:
        out = _stdout()
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
            f"{_count(report.compared, 'tensor')} compared{tol}, {_count(differing, 'tensor difference')}: "
            f"{verdict}"
        )
    if not report.identical:
        sys.exit(EXIT_PROBLEMS)


# --------------------------------------------------------------------------- convert


@main.command()
@click.argument("src", type=_path)
@click.argument("dst", type=_path)
@click.option(
    "--to",
    "to_format",
    required=True,
    type=click.Choice(["torch_dist", "zarr", "torch", "safetensors"]),
    help="Output format.",
)
@click.option("--keys", metavar="REGEX", help="Keep only keys matching this regular expression.")
@click.option("--exclude", metavar="REGEX", help="Drop keys matching this regular expression.")
@click.option("--dtype", metavar="DTYPE", help="Cast floating-point tensors (bf16, fp16, fp32, ...).")
@click.option(
    "--model-only",
    is_flag=True,
    help="Drop optimizer state: keys starting with 'optimizer.' and the common 'optimizer' entry.",
)
@click.option(
    "--max-shard-size", metavar="SIZE", help="safetensors folder output: bytes per shard (default 5GB)."
)
@click.option(
    "--read-budget",
    metavar="SIZE",
    default=None,
    help="Read small tensors together up to this many bytes; memory stays near max(this, largest "
    "tensor). Default: the host memory budget (DISTCKPT_HOST_MEMORY_BUDGET).",
)
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
@_trust
@_storage_option(
    "-o",
    "--storage-option",
    dest="storage_options",
    what="at SRC and DST (URLs only; DST takes --target-storage-option instead when given)",
)
@_storage_option(
    "-O", "--target-storage-option", dest="target_storage_options", what="at DST (URL only), instead of -o"
)
def convert(
    src: Path,
    dst: Path,
    to_format: str,
    keys: Optional[str],
    exclude: Optional[str],
    dtype: Optional[str],
    model_only: bool,
    max_shard_size: Optional[str],
    read_budget: str,
    overwrite: bool,
    trust: bool,
    storage_options,
    target_storage_options,
) -> None:
    """Convert SRC into a new DST, streaming tensor by tensor (memory stays near the largest tensor).

    \b
    SRC  a checkpoint (torch_dist or zarr, distckpt's or Megatron-Core's), a safetensors file or
         folder (single file or HF index), or a torch.save state dict.
    DST  a new path: a checkpoint directory (--to torch_dist/zarr); a folder of HF-style shards
         model-00001-of-0000N.safetensors + model.safetensors.index.json, or one file if DST
         ends in .safetensors (--to safetensors); one torch.save file (--to torch).

    safetensors and torch output hold tensors only (common state and objects are left out).

    \b
    Examples:
      distckpt convert ckpt/ ckpt-zarr/ --to zarr
      distckpt convert ckpt/ hf/ --to safetensors --model-only --dtype bf16 --max-shard-size 2GB
      distckpt convert ckpt/ model.pt --to torch --exclude '^optimizer\\.'
      distckpt convert model.safetensors ckpt/ --to torch_dist     # import
      distckpt convert ckpt/ s3://bucket/run/iter_100 --to torch_dist -o endpoint=http://minio:9000
      distckpt convert s3://a/ckpt gs://b/ckpt --to torch_dist -o region=us-east-1 \\
          -O service_account_path=/keys/gcs.json
    """
    from rich.markup import escape

    from distckpt.tools import export
    from distckpt.tools.inspect import parse_dtype

    if target_storage_options:
        src = _open_locations("--storage-option", storage_options, src)
        dst = _open_locations("--target-storage-option", target_storage_options, dst)
    else:
        src, dst = _open_locations("--storage-option", storage_options, src, dst)

    cast = parse_dtype(dtype) if dtype else None
    shard = export.parse_size(max_shard_size) if max_shard_size else None
    if shard is not None and to_format != "safetensors":
        raise click.BadParameter("applies to --to safetensors only", param_hint="--max-shard-size")
    budget = export.parse_size(read_budget) if read_budget else None
    with _RichProgress() as progress:
        summary = export.convert(
            src,
            dst,
            to_format,
            keys=keys,
            exclude=exclude,
            dtype=cast,
            model_only=model_only,
            max_shard_size=shard,
            trusted=trust,
            overwrite=overwrite,
            read_budget=budget,
            progress=progress,
        )
    out = _stdout()
    out.print(
        f"wrote [bold]{escape(str(dst))}[/] ({to_format}): {_count(summary['tensors'], 'tensor')}, "
        f"{_size(summary['nbytes'])}"
    )
    dropped = [
        _count(summary[k], what)
        for k, what in (("dropped_common_entries", "common state entry"), ("dropped_objects", "object"))
        if summary.get(k)
    ]
    if dropped:
        _stderr().print(
            f"[yellow]note:[/] {to_format} output holds tensors only; left out {' and '.join(dropped)}"
        )


# --------------------------------------------------------------------------- surgery


@main.command("rm-prefix")
@click.argument("ckpt", type=_path)
@click.argument("prefix")
@click.option("--out", type=_path, help="Write the result as a new checkpoint here; CKPT stays untouched.")
@_storage_options
def rm_prefix(ckpt: Path, prefix: str, out: Optional[Path], storage_options) -> None:
    """Remove every tensor (and object) whose key starts with PREFIX from CKPT.

    In place the removal is crash-safe (files are rewritten under new names, the index is
    replaced atomically, old files are deleted last). With --out, CKPT is copied first.

    \b
    Examples:
      distckpt rm-prefix ckpt/ optimizer.                 # drop the optimizer state in place
      distckpt rm-prefix ckpt/ optimizer. --out model/    # keep ckpt/, write a model-only copy
    """
    from rich.markup import escape

    from distckpt.tools.surgery import remove_prefix

    ckpt = _open_locations("--storage-option", storage_options, ckpt)
    with _RichProgress() as progress:
        removed = remove_prefix(ckpt, prefix, out, progress=progress)
    _stdout().print(
        f"removed {_count(len(removed), 'key')} starting with {escape(repr(prefix))} "
        f"from {escape(str(out or ckpt))}"
    )


@main.command()
@click.argument("ckpt", type=_path)
@click.option("--map", "maps", multiple=True, metavar="OLD=NEW", help="Rename key OLD to NEW (repeatable).")
@click.option(
    "--regex",
    "regexes",
    multiple=True,
    metavar="PATTERN=REPL",
    help="re.sub(PATTERN, REPL, key) on every key (repeatable; applied in order, after --map; "
    "split at the last '=').",
)
@click.option("--out", type=_path, help="Write the result as a new checkpoint here; CKPT stays untouched.")
@click.option("--dry-run", is_flag=True, help="Show what would be renamed; change nothing.")
@_trust
@_storage_options
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
    from rich.markup import escape
    from rich.table import Table

    from distckpt.tools.surgery import parse_pairs, rename_keys

    if not maps and not regexes:
        raise click.UsageError("give at least one --map OLD=NEW or --regex PATTERN=REPL")
    ckpt = _open_locations("--storage-option", storage_options, ckpt)
    mapping = parse_pairs(maps, "--map")
    patterns = parse_pairs(regexes, "--regex", split_last=True)
    with _RichProgress() as progress:
        plan = rename_keys(ckpt, mapping, patterns, out, trusted=trust, dry_run=dry_run, progress=progress)
    out_console = _stdout()
    table = Table(box=None, pad_edge=False)
    table.add_column("old key", overflow="fold")
    table.add_column("", no_wrap=True)
    table.add_column("new key", overflow="fold")
    for old, new in list(plan.tensors.items()) + list(plan.objects.items()):
        table.add_row(escape(old), "->", escape(new))
    out_console.print(table)
    n = len(plan.tensors) + len(plan.objects)
    if dry_run:
        out_console.print(f"{_count(n, 'key')} would be renamed (dry run: nothing changed)")
    else:
        out_console.print(f"renamed {_count(n, 'key')} in {escape(str(out or ckpt))}")


# --------------------------------------------------------------------------- demo


@main.command()
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
    # Imported here so that `distckpt --help` does not pay for importing torch.
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
