"""What one Zarr array is: its ``zarr.json`` (or legacy ``.zarray``) parsed, checked and built.

Holds the data-type tables (torch <-> Zarr v3 names, Zarr v2 typestrs), :class:`ArrayMeta` (the
description every reader and writer works from), the ``zarr.json`` distckpt writes, the bounds a
stored array must respect before anything is read or allocated for it, and the comparison of an
array's metadata with what the integrity manifest says the writer wrote. No I/O happens here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from distckpt import bounds
from distckpt.core import CheckpointingException
from distckpt.manifest import MANIFEST_FNAME, dtype_name
from distckpt.storage import Store

BACKEND = "zarr"
FORMAT_VERSION = 2  # Zarr v3 layout written by distckpt
LEGACY_VERSION = 1  # Megatron-Core <= 0.15 Zarr v2 layout (read only)
ARRAY_META = "zarr.json"
LEGACY_ARRAY_META = ".zarray"

Shape = Tuple[int, ...]

# A chunk may be larger than its array (zarr pads the last chunk), but not absurdly so.
CHUNK_SLACK_BYTES = 64 << 20


# --------------------------------------------------------------------------- data types

# Zarr v3 data_type names. bfloat16 and the float8 types use the names of the zarr-extensions
# registry, tensorstore and ml_dtypes (= torch's names).
_TORCH_TO_ZARR: Dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _TORCH_TO_ZARR[getattr(torch, _name)] = _name
_ZARR_TO_TORCH: Dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_ZARR.items()}

# Zarr v2 ``dtype`` strings (numpy typestr; Megatron wrote bfloat16 as "bfloat16").
_V2_KINDS = {
    "b": {1: torch.bool},
    "i": {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64},
    "u": {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64},
    "f": {2: torch.float16, 4: torch.float32, 8: torch.float64},
    "c": {8: torch.complex64, 16: torch.complex128},
}


def zarr_data_type(dtype: torch.dtype, key: str = "?") -> str:
    """The Zarr v3 ``data_type`` name of a torch dtype.

    Raises:
        CheckpointingException: the dtype has no exact Zarr representation here.
    """
    try:
        return _TORCH_TO_ZARR[dtype]
    except KeyError:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: dtype {dtype} cannot be stored by the zarr backend "
            f"(supported: {', '.join(sorted(map(str, _TORCH_TO_ZARR)))})"
        ) from None


def _fill_value_json(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    if dtype.is_complex:
        return [0.0, 0.0]
    return 0.0 if dtype.is_floating_point else 0


def _v2_dtype(typestr: Any) -> Tuple[Optional[torch.dtype], bool]:
    """(torch dtype or None, little-endian or single byte) of a Zarr v2 ``dtype`` string."""
    if typestr == "bfloat16":
        return torch.bfloat16, True
    if not isinstance(typestr, str) or len(typestr) < 3 or typestr[0] not in "<>|=":
        return None, False
    try:
        size = int(typestr[2:])
    except ValueError:
        return None, False
    dtype = _V2_KINDS.get(typestr[1], {}).get(size)
    return dtype, typestr[0] in "<|" or (typestr[0] == "=" and sys.byteorder == "little")


# --------------------------------------------------------------------------- array metadata


@dataclass(frozen=True)
class ArrayMeta:
    """One stored array as the engines see it: where it is, its geometry and its encoding.

    ``raw`` says that each chunk file holds exactly the little-endian C-order bytes of a full
    chunk, which the raw engine reads and writes itself; any other encoding is tensorstore's.
    """

    key: str
    path: Path  # the array's directory
    zarr_format: int  # 2 or 3
    shape: Shape
    chunks: Shape
    dtype: torch.dtype
    raw: bool
    key_prefix: str  # "c" for the v3 default encoding, "" otherwise
    separator: str
    store: Optional[Store] = None  # the object store holding the array (None: local ``path``)
    # The element layout distckpt writes (little-endian, C order; compressed or not): an array
    # whose key the integrity manifest lists must have it, whoever decodes its chunks.
    native: bool = True

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def chunk_name(self, index: Sequence[int]) -> str:
        if self.key_prefix:
            return self.key_prefix + "".join(f"{self.separator}{i}" for i in index)
        return self.separator.join(map(str, index)) if index else "0"

    def chunk_path(self, index: Sequence[int]) -> Path:
        return self.path / self.chunk_name(index)

    def chunk_relpath(self, index: Sequence[int]) -> str:
        """Name of the chunk file relative to the checkpoint folder (the manifest's key for it)."""
        return f"{self.key}/{self.chunk_name(index)}"

    def chunk_box(self, index: Sequence[int]) -> Tuple[Shape, Shape]:
        """Where chunk ``index`` starts in the array and its extent, cut at the array's edge."""
        lo = tuple(i * c for i, c in zip(index, self.chunks))
        return lo, tuple(min(c, s - o) for o, c, s in zip(lo, self.chunks, self.shape))

    def chunks_overlapping(self, offset: Sequence[int], size: Sequence[int]) -> Iterator[Shape]:
        ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(offset, size, self.chunks)]
        return itertools.product(*ranges)


def array_metadata_json(
    key: str, shape: Shape, chunks: Shape, dtype: torch.dtype, compression: Optional[str] = None
) -> Dict[str, Any]:
    """The ``zarr.json`` distckpt writes for one array."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_codec: Dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    codecs = [bytes_codec]
    if compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    elif compression == "gzip":
        codecs.append({"name": "gzip", "configuration": {"level": 5}})
    elif compression is not None:
        raise CheckpointingException(f"unknown zarr compression {compression!r} (use None, 'zstd' or 'gzip')")
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zarr_data_type(dtype, key),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_value_json(dtype),
        "codecs": codecs,
        "attributes": {"distckpt": {"key": key, "torch_dtype": str(dtype)}},
    }


def meta_from_v3(key: str, path: Path, md: Dict[str, Any]) -> ArrayMeta:
    """An :class:`ArrayMeta` from a Zarr v3 ``zarr.json`` (ValueError/KeyError/... if unusable)."""
    if md.get("node_type") != "array":
        raise ValueError(f"node_type is {md.get('node_type')!r}, not 'array'")
    data_type = md["data_type"]
    dtype = _ZARR_TO_TORCH.get(data_type) if isinstance(data_type, str) else None
    if dtype is None:
        raise ValueError(f"data_type {data_type!r} has no torch equivalent")
    grid = md["chunk_grid"]
    if grid.get("name") != "regular":
        raise ValueError(f"chunk grid {grid.get('name')!r} is not supported (only 'regular')")
    chunks = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    shape = tuple(int(s) for s in md["shape"])
    enc = md.get("chunk_key_encoding", {"name": "default"})
    sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name") == "default" else ".")
    prefix = "c" if enc.get("name") == "default" else ""
    codecs = md.get("codecs", [])
    raw = (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and (codecs[0].get("configuration") or {}).get("endian", "little") == "little"
        and not md.get("storage_transformers")
        and sys.byteorder == "little"
    )
    native = all(
        isinstance(c, dict)
        and c.get("name") != "transpose"
        and (c.get("name") != "bytes" or (c.get("configuration") or {}).get("endian", "little") == "little")
        for c in codecs
    )
    return ArrayMeta(key, path, 3, shape, chunks, dtype, raw, prefix, sep, native=native)


def meta_from_v2(key: str, path: Path, md: Dict[str, Any]) -> ArrayMeta:
    """An :class:`ArrayMeta` from a legacy Zarr v2 ``.zarray`` (ValueError/KeyError/... if unusable)."""
    dtype, little = _v2_dtype(md.get("dtype"))
    if dtype is None:
        raise ValueError(f"dtype {md.get('dtype')!r} has no torch equivalent")
    raw = (
        md.get("compressor") is None
        and not md.get("filters")
        and md.get("order", "C") == "C"
        and little
        and sys.byteorder == "little"
    )
    return ArrayMeta(
        key,
        path,
        2,
        tuple(md["shape"]),
        tuple(md["chunks"]),
        dtype,
        raw,
        "",
        md.get("dimension_separator", "."),
        native=False,
    )  # distckpt writes Zarr v3


def checked_meta(meta: ArrayMeta, source: Any) -> ArrayMeta:
    """``meta`` if its shape, chunk shape and chunk-key separator are ones a real array can have;
    anything else is refused, since it would make a read allocate or loop far past any request."""
    shape = bounds.shape(meta.shape, source, "shape")
    chunks = bounds.shape(meta.chunks, source, "chunk shape")
    if len(chunks) != len(shape) or any(c < 1 for c in chunks):
        raise CheckpointingException(
            f"{source}: chunk shape {list(chunks)} does not fit the shape {list(shape)}"
        )
    array_bytes = math.prod(shape) * meta.itemsize
    if meta.chunk_nbytes > 2 * array_bytes + CHUNK_SLACK_BYTES:
        raise CheckpointingException(
            f"{source}: a chunk of {list(chunks)} ({meta.chunk_nbytes} bytes) for an array of "
            f"{list(shape)} ({array_bytes} bytes); refusing it"
        )
    if not isinstance(meta.separator, str) or meta.separator not in ("/", "."):
        raise CheckpointingException(f"{source}: chunk key separator {meta.separator!r} is not '/' or '.'")
    return dataclasses.replace(meta, shape=shape, chunks=chunks)


def meta_file(meta: ArrayMeta) -> str:
    """The ``zarr.json`` or ``.zarray`` that ``meta`` came from, as messages name it."""
    where = meta.store.where(meta.key) if meta.store is not None else str(meta.path)
    return f"{where}/{ARRAY_META if meta.zarr_format == 3 else LEGACY_ARRAY_META}"


def manifest_disagreement(meta: ArrayMeta, manifest: Any) -> Optional[str]:
    """The reason array ``meta`` (its ``zarr.json``) contradicts the integrity manifest's record of
    what the writer wrote (dtype and shape), naming both files; None when they agree, when the
    manifest has no record of the key, or when there is no manifest (``manifest`` is None)."""
    declared = None if manifest is None else manifest.keys.get(meta.key)
    if declared is None:
        return None
    if not meta.native:
        return (
            f"key {meta.key!r}: {meta_file(meta)} describes its elements in another layout (byte order, "
            f"element order or format) than the little-endian C-order Zarr v3 chunks distckpt writes, "
            f"and the "
            f"integrity manifest {MANIFEST_FNAME} says distckpt wrote this key: the array metadata is damaged"
        )
    if (dtype_name(meta.dtype), tuple(meta.shape)) == (declared[0], tuple(declared[1])):
        return None
    return (
        f"key {meta.key!r}: {meta_file(meta)} says {dtype_name(meta.dtype)} of shape {list(meta.shape)}, the "
        f"integrity manifest {MANIFEST_FNAME} says the writer wrote {declared[0]} of shape "
        f"{list(declared[1])}: the array metadata or the manifest is damaged"
    )
