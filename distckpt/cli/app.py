"""The face of the ``distckpt`` command: the group, its exit codes, shared options and output.

:data:`main` is the click group every command is added to (:mod:`distckpt.cli` does that); it
turns user errors into one red line and exit code 2, and bugs into a traceback and exit code 3.
The commands (:mod:`distckpt.cli.commands`) share the options defined here (``--trust``,
``--json``, the storage options and the ``path|url`` argument type) and print through the
helpers here: rich consoles on stdout and stderr, a progress bar over bytes, sizes and counts.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import click
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from distckpt import storage
from distckpt.core import CheckpointingException

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# --------------------------------------------------------------------------- output helpers


def out_console() -> Console:
    """The console commands print their results to (stdout; 200 columns wide when piped)."""
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 0) or 0) or 200
    return Console(highlight=False, width=width, soft_wrap=True)


def err_console() -> Console:
    """The console for notes and errors (stderr)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    """One red ``error:`` line on stderr."""
    err_console().print(f"[bold red]error:[/] {escape(message)}")


class RichProgress:
    """A :class:`distckpt.tools.sources.base.Progress` drawn as a rich progress bar over bytes on
    stderr (only when stderr is a terminal, so pipes and logs stay clean)."""

    def __init__(self) -> None:
        console = err_console()
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

    def __enter__(self) -> RichProgress:
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


def size_text(n: Optional[int]) -> str:
    """Bytes as ``"24.5 kB"`` (decimal units); ``""`` for None."""
    return "" if n is None else decimal(n)


def count_text(n: int, noun: str) -> str:
    """``"1 tensor"``, ``"3 tensors"``, ``"2 entries"``."""
    plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def json_out(doc: Any) -> None:
    """Print ``doc`` as indented JSON (what ``--json`` prints)."""
    click.echo(json.dumps(doc, indent=2, default=str))


# --------------------------------------------------------------------------- the group


class _Group(click.Group):
    """Turns user errors into one red line and exit code 2, bugs into a traceback and 3."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (CheckpointingException, OSError) as e:
            print_error(
                str(e)
                if isinstance(e, CheckpointingException)
                else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            )
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            print_error("interrupted")
            ctx.exit(130)
        except Exception:  # noqa: BLE001 - anything else is a bug: show it
            traceback.print_exc()
            print_error("internal error (a bug in distckpt; please report it with the traceback above)")
            ctx.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings=CONTEXT_SETTINGS)
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


trust_option = click.option(
    "--trust",
    is_flag=True,
    help="Unpickle metadata, common state and objects without the safety allowlist "
    "(only for checkpoints whose origin you trust).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead of tables.")


class LocationType(click.ParamType):
    """A checkpoint location: a local path (a ``Path``) or an object-store URL (kept as a str)."""

    name = "path|url"

    def convert(self, value, param, ctx):
        if isinstance(value, (Path, str)) and storage.is_remote(str(value)):
            return str(value)
        return Path(value)


PATH = LocationType()
"""The ``path|url`` argument type of every command that takes a checkpoint."""


def storage_option(*names: str, dest: str, what: str):
    """A repeatable ``KEY=VALUE`` option of the object store ``what`` says."""
    return click.option(
        *names,
        dest,
        multiple=True,
        metavar="KEY=VALUE",
        help=f"Option of the object store {what}; repeatable. Keys: endpoint, region, "
        f"credentials, allow_http, part_size, ... (docs/storage.md); they override the "
        f"environment.",
    )


storage_options_option = storage_option(
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


def open_locations(flag: str, pairs, *locations):
    """``locations`` with every object-store URL among them opened as a Store with the options
    ``pairs`` (local paths stay as they are). Options with no URL to apply to are a usage error."""
    options = _parse_storage_options(pairs, flag)
    remote = [loc is not None and storage.is_remote(loc) for loc in locations]
    if options and not any(remote):
        raise click.BadParameter(
            "storage options apply to object-store URLs (s3://, gs://, az://, ...) only", param_hint=flag
        )
    opened = [storage.open_store(loc, options) if r else loc for loc, r in zip(locations, remote)]
    return opened[0] if len(opened) == 1 else opened
