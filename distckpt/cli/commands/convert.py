"""``distckpt convert``: any checkpoint or tensor file into a new one of another format.

A thin face over :func:`distckpt.tools.export.convert`, which streams tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click
from rich.markup import escape

from distckpt.cli.app import (
    PATH,
    RichProgress,
    count_text,
    err_console,
    open_locations,
    out_console,
    size_text,
    storage_option,
    trust_option,
)
from distckpt.tools import export
from distckpt.tools.sources.base import parse_dtype


@click.command()
@click.argument("src", type=PATH)
@click.argument("dst", type=PATH)
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
@trust_option
@storage_option(
    "-o",
    "--storage-option",
    dest="storage_options",
    what="at SRC and DST (URLs only; DST takes --target-storage-option instead when given)",
)
@storage_option(
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
    if target_storage_options:
        src = open_locations("--storage-option", storage_options, src)
        dst = open_locations("--target-storage-option", target_storage_options, dst)
    else:
        src, dst = open_locations("--storage-option", storage_options, src, dst)

    cast = parse_dtype(dtype) if dtype else None
    shard = export.parse_size(max_shard_size) if max_shard_size else None
    if shard is not None and to_format != "safetensors":
        raise click.BadParameter("applies to --to safetensors only", param_hint="--max-shard-size")
    budget = export.parse_size(read_budget) if read_budget else None
    with RichProgress() as progress:
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
    out = out_console()
    out.print(
        f"wrote [bold]{escape(str(dst))}[/] ({to_format}): {count_text(summary['tensors'], 'tensor')}, "
        f"{size_text(summary['nbytes'])}"
    )
    dropped = [
        count_text(summary[k], what)
        for k, what in (("dropped_common_entries", "common state entry"), ("dropped_objects", "object"))
        if summary.get(k)
    ]
    if dropped:
        err_console().print(
            f"[yellow]note:[/] {to_format} output holds tensors only; left out {' and '.join(dropped)}"
        )
