"""The sidecar index ``.distckpt_index``: its file layout, names and constants.

DCP's ``.metadata`` is one pickle holding every chunk of every key; at 16k ranks it is hundreds
of MB that every loading rank would fetch and unpickle. The sidecar holds the same records
(plus each item's CRC32C) in a layout a rank reads partially: a small directory of keys, and per
tensor key a packed tree of sorted chunk records whose nodes carry bounding boxes, so a load
fetches only the nodes whose boxes meet the boxes it asks for. It is written by rank 0 at commit
beside ``.metadata`` (which stays, for Megatron-Core and PyTorch), covered by the manifest, and
read through the storage layer (ranged reads, so it works on object stores too).
:mod:`distckpt.formats.index_write` builds it, :mod:`distckpt.formats.index_read` queries it.

Layout (version 1; see docs/formats.md)::

    header     b"DCKIDX01" | u64 directory length | u32 CRC32C of the directory  (20 bytes)
    directory  JSON: {"format", "version", "metadata_bytes", "fanout", "keys": {fqn: entry}}
    nodes      node blobs; offsets below are relative to the end of the directory

A tensor key's entry: ``{"dtype", "size", "orig_shape", "count", "nbytes", "depth", "root":
[offset, length, crc32c], "bbox": [lo, hi]}`` (``nbytes``, the bytes of the key's records, is
absent from sidecars written before it existed); an object/byte key's entry: ``{"bytes": true,
"item": [file, offset, length, crc32c]}`` (``item`` absent if it has no stored bytes). The
directory alone answers the metadata queries (keys, dtypes, shapes), so they never read the
records, nor ``.metadata``.
A leaf node: ``u32 n_names | JSON list of file names | int64[n, 2*ndim + 4]`` rows
``offset[ndim], size[ndim], name index, file offset, length, crc32c`` sorted by ``offset``.
An inner node: ``int64[m, 3 + 2*ndim]`` rows ``child offset, child length, child crc32c,
lo[ndim], hi[ndim]`` (``hi`` exclusive: the child's bounding box). ``depth`` 1 means the root is
a leaf. Every node is checked against the CRC32C its parent (or the directory) records.
"""

from __future__ import annotations

import struct
from typing import Dict, Tuple

import torch

from distckpt.formats.manifest import dtype_name  # noqa: F401  (the sidecar spells dtypes as the manifest does)

INDEX_FNAME = ".distckpt_index"
MAGIC = b"DCKIDX01"
FORMAT = "distckpt-index"
VERSION = 1
FANOUT = 64  # children per inner node
LEAF = 16  # chunk records per leaf: what a rank reads beyond its own records is at most a leaf per box
HEADER = struct.Struct("<8sQI")  # magic, directory length, CRC32C of the directory

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, size)


# The dtypes named so far (only real ones: a sidecar's names are claims).
_DTYPES: Dict[str, torch.dtype] = {}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a sidecar names; ValueError for anything but the name of a real one."""
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        if type(name) is not str:
            raise ValueError(f"dtype {name!r} is not a name")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
        _DTYPES[name] = dtype
    return dtype
