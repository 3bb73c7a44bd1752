"""``distckpt inspect`` and ``distckpt show``: a checkpoint's metadata, and one key's values.

Both read through :mod:`distckpt.tools.inspection`: ``inspect`` only metadata, ``show`` only the
stored chunks that overlap the requested slice (or one ShardedObject).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import click
import torch
from rich.markup import escape
from rich.pretty import Pretty
from rich.table import Table

from distckpt.cli.app import (
    PATH,
    count_text,
    json_option,
    json_out,
    open_locations,
    out_console,
    size_text,
    storage_options_option,
    trust_option,
)
from distckpt.cli.commands.tiers import local_copy_option, print_read_plan, read_plan
from distckpt.storage import open_store
from distckpt.tools.inspection import inspect_source, key_tree_rows, open_source, read_tensor
from distckpt.tools.sources.base import dtype_name


@click.command()
@click.argument("ckpt", type=PATH)
@json_option
@click.option("--flat", is_flag=True, help="List full keys instead of a tree.")
@click.option(
    "--depth",
    type=click.IntRange(min=0),
    default=None,
    help="Collapse the key tree below this depth into one row per subtree.",
)
@click.option("--keys", "pattern", metavar="REGEX", help="Only keys matching this regular expression.")
@trust_option
@storage_options_option
@local_copy_option
def inspect(
    ckpt: Path,
    as_json: bool,
    flat: bool,
    depth: Optional[int],
    pattern: Optional[str],
    trust: bool,
    storage_options,
    local_copy: Optional[Path],
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
      distckpt inspect s3://bucket/run/iter_0000100 --local-copy /local_nvme/run/iter_0000100

    With --local-copy (a tiered save's node-local copy of CKPT), also lists every file of CKPT's
    manifest with where a load would read it from (local or remote) and why a local file would
    not be used; the local files are checksummed against the manifest, nothing is written.
    """
    ckpt = open_locations("--storage-option", storage_options, ckpt)
    info = inspect_source(ckpt, trusted=trust)
    plan = read_plan(open_store(ckpt), local_copy) if local_copy is not None else None
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise click.BadParameter(str(e), param_hint="--keys") from None
        info.tensors = [t for t in info.tensors if rx.search(t.key)]
        info.objects = [o for o in info.objects if rx.search(o.key)]
    if as_json:
        doc = info.to_json()
        if plan is not None:
            doc["local_copy"] = plan.to_json()
        json_out(doc)
        return
    _print_info(info, flat, depth)
    if plan is not None:
        print_read_plan(plan)


def _print_info(info, flat: bool, depth: Optional[int]) -> None:

    out = out_console()
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
        f"  {count_text(len(info.tensors), 'tensor')} ({size_text(info.nbytes)} of values), "
        f"{count_text(len(info.objects), 'object')}, {count_text(info.extra.get('files', 0), 'file')}, "
        f"{size_text(disk)} on disk"
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
            table.add_row(*cells, size_text(nbytes), size_text(disk_bytes))
        out.print()
        out.print(table)
    if info.objects:
        table = Table(title="Objects", title_justify="left", title_style="bold", box=None, pad_edge=False)
        table.add_column("unique key", overflow="fold")
        table.add_column("stored at", overflow="fold")
        table.add_column("on disk", justify="right", no_wrap=True)
        for o in info.objects:
            table.add_row(escape(o.key), escape(o.where or ""), size_text(o.disk_bytes))
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


@click.command()
@click.argument("ckpt", type=PATH)
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
@trust_option
@storage_options_option
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
    ckpt = open_locations("--storage-option", storage_options, ckpt)
    out = out_console()
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
            stats += (
                f"  mean {float(finite.mean()):.6g}  "
                f"std {float(finite.std()) if finite.numel() > 1 else 0.0:.6g}"
            )
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

        torch.set_printoptions(profile="full" if self.full else "default")
        torch.set_printoptions(precision=self.precision, linewidth=120)

    def __exit__(self, *exc: Any) -> None:

        torch.set_printoptions(profile="default")
