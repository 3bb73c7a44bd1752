"""Kept for old imports (re-exports only): the integrity manifest ``.distckpt_manifest.json``.

It now lives in :mod:`distckpt.formats.manifest`. On-disk formats have a floor of their own, below
the strategies (docs/architecture.md). Every public name importable from here before the move still
is, as the same object.
"""

from __future__ import annotations

from distckpt.formats.manifest import (
    BLOCK_SIZE,
    FORMAT,
    MANIFEST_FNAME,
    VERSION,
    Manifest,
    RangeChecksum,
    add_whole_files,
    build_manifest,
    check_whole_bytes,
    check_whole_file,
    crc32c,
    dtype_name,
    extend,
    pack_block_crcs,
    read_declared_keys,
    read_manifest,
    read_manifest_files,
    verify_files,
    write_manifest,
)

__all__ = [
    "BLOCK_SIZE",
    "FORMAT",
    "MANIFEST_FNAME",
    "Manifest",
    "RangeChecksum",
    "VERSION",
    "add_whole_files",
    "build_manifest",
    "check_whole_bytes",
    "check_whole_file",
    "crc32c",
    "dtype_name",
    "extend",
    "pack_block_crcs",
    "read_declared_keys",
    "read_manifest",
    "read_manifest_files",
    "verify_files",
    "write_manifest",
]
