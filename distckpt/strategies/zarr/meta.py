"""What one Zarr array is: its ``zarr.json`` (or legacy ``.zarray``) parsed, checked and built.

Holds the data-type tables (torch <-> Zarr v3 names, Zarr v2 typestrs), :class:`ArrayMeta` (the
description every reader and writer works from), the ``zarr.json`` distckpt writes, the bounds a
stored array must respect before anything is read or allocated for it, and the comparison of an
array's metadata with what the integrity manifest says the writer wrote. No I/O happens here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from distckpt import bounds
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import MANIFEST_FNAME, dtype_name
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
    # What the ``zarr.json`` says about the array but its attributes (Zarr v3; None for v2): what
    # the writer records in the integrity manifest's ``arrays`` and a reader compares with it.
    description: Optional[Dict[str, Any]] = dataclasses.field(default=None, compare=False)

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


# The codecs a Zarr v3 array may name, by kind (zarr v3 spec): array -> array codecs first,
# then exactly one array -> bytes codec, then bytes -> bytes codecs. Their configurations are
# checked below as far as distckpt reads them; tensorstore (which decodes all but plain "bytes")
# checks the rest when the array is opened, which ``distckpt verify`` does too.
_ARRAY_TO_ARRAY = {"transpose"}
_ARRAY_TO_BYTES = {"bytes", "sharding_indexed"}
_BYTES_TO_BYTES = {"gzip", "zstd", "blosc", "crc32c"}
_V3_MEMBERS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "storage_transformers",
    "dimension_names",
}
# Zarr v2 compressors tensorstore decodes.
_V2_COMPRESSORS = {"blosc", "zlib", "gzip", "bz2", "zstd"}


def _expect(ok: bool, field: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{field} is {json_text(value)}, not {want}")


def json_text(value: Any, limit: int = 80) -> str:
    """``value`` as JSON for a message (cut at ``limit`` characters)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config(codec: Dict[str, Any], field: str, allowed: Sequence[str], required: Sequence[str] = ()) -> Dict:
    config = codec.get("configuration", {})
    _expect(type(config) is dict, f"{field}.configuration", config, "an object")
    extra = sorted(set(config) - set(allowed))
    _expect(not extra, f"{field}.configuration", config, f"an object of {sorted(allowed)} only")
    missing = [k for k in required if k not in config]
    _expect(not missing, f"{field}.configuration", config, f"an object with {list(required)}")
    return config


def _one_of(config: Dict[str, Any], member: str, default: str, choices: Sequence[str], field: str) -> None:
    value = config.get(member, default)
    _expect(value in choices, f"{field}.{member}", value, " or ".join(map(repr, choices)))


def _document(md: Any, zarr_format: int) -> None:
    """An array metadata document: a JSON object of this ``zarr_format`` (the integer)."""
    _expect(type(md) is dict, "the array metadata", md, "a JSON object")
    fmt = md.get("zarr_format")
    _expect(_int_in(fmt, zarr_format, zarr_format), "zarr_format", fmt, str(zarr_format))


def _shape(value: Any, field: str) -> None:
    _expect(
        type(value) is list and all(_int_in(n, 0, bounds.MAX_NUMEL) for n in value),
        field,
        value,
        "a list of naturals",
    )


def _chunk_shape(value: Any, ndim: int, field: str) -> None:
    _expect(
        type(value) is list and len(value) == ndim and all(_int_in(c, 1, bounds.MAX_NUMEL) for c in value),
        field,
        value,
        f"a list of {ndim} positive integers",
    )


def _int_in(value: Any, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _check_codecs(codecs: Any, field: str, ndim: int, itemsize: int) -> None:
    """The codec chain of a Zarr v3 array (or of the inner chunks of a sharded one)."""
    _expect(type(codecs) is list and len(codecs) <= 16, field, codecs, "a list of at most 16 codecs")
    stage = 0  # 0: array -> array codecs; 1: after the array -> bytes codec
    for i, codec in enumerate(codecs):
        where = f"{field}[{i}]"
        _expect(type(codec) is dict, where, codec, "an object")
        _expect(
            set(codec) <= {"name", "configuration"}, where, codec, "an object of 'name' and 'configuration'"
        )
        name = codec.get("name")
        known = _ARRAY_TO_ARRAY | _ARRAY_TO_BYTES | _BYTES_TO_BYTES
        if name not in known:
            raise ValueError(f"{where}: unknown codec {json_text(name)} (known: {', '.join(sorted(known))})")
        kind = 0 if name in _ARRAY_TO_ARRAY else 1 if name in _ARRAY_TO_BYTES else 2
        if kind == 0 and stage or kind == 1 and stage or kind == 2 and not stage:
            raise ValueError(
                f"{where}: codec {name!r} out of order (array -> array codecs, then one array -> bytes "
                f"codec, then bytes -> bytes codecs)"
            )
        stage = max(stage, 1 if kind else 0)
        if name == "transpose":
            order = _config(codec, where, ("order",), ("order",))["order"]
            _expect(
                type(order) is list
                and sorted(order) == list(range(ndim))
                and all(type(o) is int for o in order),
                f"{where}.configuration.order",
                order,
                f"a permutation of 0..{ndim - 1}",
            )
        elif name == "bytes":
            config = _config(codec, where, ("endian",), ("endian",) if itemsize > 1 else ())
            _one_of(config, "endian", "little", ("little", "big"), f"{where}.configuration")
        elif name == "sharding_indexed":
            config = _config(
                codec,
                where,
                ("chunk_shape", "codecs", "index_codecs", "index_location"),
                ("chunk_shape", "codecs"),
            )
            _chunk_shape(config["chunk_shape"], ndim, f"{where}.configuration.chunk_shape")
            _check_codecs(config["codecs"], f"{where}.configuration.codecs", ndim, itemsize)
            if "index_codecs" in config:
                _check_codecs(config["index_codecs"], f"{where}.configuration.index_codecs", 1, 8)
            _one_of(config, "index_location", "end", ("start", "end"), f"{where}.configuration")
        elif name == "gzip":
            level = _config(codec, where, ("level",), ("level",))["level"]
            _expect(_int_in(level, 0, 9), f"{where}.configuration.level", level, "an integer in [0, 9]")
        elif name == "zstd":
            config = _config(codec, where, ("level", "checksum"), ("level",))
            _expect(
                _int_in(config["level"], -131072, 22),
                f"{where}.configuration.level",
                config["level"],
                "an integer in [-131072, 22]",
            )
            _expect(
                type(config.get("checksum", False)) is bool,
                f"{where}.configuration.checksum",
                config.get("checksum"),
                "a boolean",
            )
        elif name == "blosc":
            config = _config(codec, where, ("cname", "clevel", "shuffle", "typesize", "blocksize"))
            for member, ok, want in (
                (
                    "cname",
                    lambda v: v in ("blosclz", "lz4", "lz4hc", "snappy", "zlib", "zstd"),
                    "a blosc compressor",
                ),
                ("clevel", lambda v: _int_in(v, 0, 9), "an integer in [0, 9]"),
                ("shuffle", lambda v: v in ("noshuffle", "shuffle", "bitshuffle"), "a blosc shuffle"),
                ("typesize", lambda v: _int_in(v, 1, 255), "an integer in [1, 255]"),
                ("blocksize", lambda v: _int_in(v, 0, bounds.MAX_BYTES), "a natural"),
            ):
                if member in config:
                    _expect(ok(config[member]), f"{where}.configuration.{member}", config[member], want)
        else:  # crc32c
            _config(codec, where, ())
    _expect(stage == 1, field, codecs, "a chain with one array -> bytes codec (such as 'bytes')")


def _check_fill_value(value: Any, dtype: torch.dtype, field: str = "fill_value") -> None:
    """A Zarr v3 ``fill_value`` of ``dtype``: a boolean, an integer in the dtype's range, a
    floating-point number (or ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, ``"0x"`` and the
    hex of its bytes), or a pair of those for complex dtypes."""
    if dtype == torch.bool:
        _expect(type(value) is bool, field, value, "a boolean")
    elif dtype.is_complex:
        _expect(type(value) is list and len(value) == 2, field, value, "a pair [real, imaginary]")
        part = torch.float32 if dtype == torch.complex64 else torch.float64
        for i, v in enumerate(value):
            _check_fill_value(v, part, f"{field}[{i}]")
    elif dtype.is_floating_point:
        itemsize = torch.empty((), dtype=dtype).element_size()
        hex_ok = (
            isinstance(value, str)
            and value.startswith("0x")
            and len(value) == 2 + 2 * itemsize
            and all(c in "0123456789abcdefABCDEF" for c in value[2:])
        )
        _expect(
            (isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value))
            or value in ("NaN", "Infinity", "-Infinity")
            or hex_ok,
            field,
            value,
            "a number, 'NaN', 'Infinity', '-Infinity' or '0x' and the hex of its bytes",
        )
    else:
        info = torch.iinfo(dtype)
        _expect(_int_in(value, info.min, info.max), field, value, f"an integer in [{info.min}, {info.max}]")


def meta_from_v3(key: str, path: Path, md: Any) -> ArrayMeta:
    """An :class:`ArrayMeta` from a Zarr v3 ``zarr.json``, parsed by schema: every member has the
    type and range the spec gives it (shapes of naturals, known codecs in a valid chain, a fill
    value of the data type); ValueError naming the member otherwise."""
    _document(md, 3)
    for member, value in md.items():
        if member not in _V3_MEMBERS and not (type(value) is dict and value.get("must_understand") is False):
            raise ValueError(f"unknown member {member!r} (an extension not marked must_understand: false)")
    _expect(md.get("node_type") == "array", "node_type", md.get("node_type"), "'array'")
    data_type = md.get("data_type")
    dtype = _ZARR_TO_TORCH.get(data_type) if isinstance(data_type, str) else None
    if dtype is None:
        raise ValueError(f"data_type {json_text(data_type)} has no torch equivalent")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = md.get("shape")
    _shape(shape, "shape")
    grid = md.get("chunk_grid")
    _expect(type(grid) is dict and set(grid) <= {"name", "configuration"}, "chunk_grid", grid, "an object")
    if grid.get("name") != "regular":
        raise ValueError(f"chunk_grid.name {json_text(grid.get('name'))} is not supported (only 'regular')")
    config = grid.get("configuration")
    _expect(
        type(config) is dict and set(config) == {"chunk_shape"},
        "chunk_grid.configuration",
        config,
        "an object of 'chunk_shape'",
    )
    chunks = config["chunk_shape"]
    _chunk_shape(chunks, len(shape), "chunk_grid.configuration.chunk_shape")
    enc = md.get("chunk_key_encoding", {"name": "default"})
    _expect(
        type(enc) is dict and set(enc) <= {"name", "configuration"}, "chunk_key_encoding", enc, "an object"
    )
    _expect(
        enc.get("name") in ("default", "v2"), "chunk_key_encoding.name", enc.get("name"), "'default' or 'v2'"
    )
    enc_config = enc.get("configuration", {})
    _expect(
        type(enc_config) is dict and set(enc_config) <= {"separator"},
        "chunk_key_encoding.configuration",
        enc_config,
        "an object of 'separator'",
    )
    sep = enc_config.get("separator", "/" if enc["name"] == "default" else ".")
    _expect(sep in ("/", "."), "chunk_key_encoding.configuration.separator", sep, "'/' or '.'")
    prefix = "c" if enc["name"] == "default" else ""
    if "fill_value" not in md:
        raise ValueError("fill_value is missing")
    _check_fill_value(md["fill_value"], dtype)
    codecs = md.get("codecs")
    _check_codecs(codecs, "codecs", len(shape), itemsize)
    transformers = md.get("storage_transformers", [])
    _expect(transformers == [], "storage_transformers", transformers, "empty (none is supported)")
    names = md.get("dimension_names")
    _expect(
        names is None
        or (
            type(names) is list
            and len(names) == len(shape)
            and all(n is None or type(n) is str for n in names)
        ),
        "dimension_names",
        names,
        f"a list of {len(shape)} names (or nulls)",
    )
    _expect(type(md.get("attributes", {})) is dict, "attributes", md.get("attributes"), "an object")
    raw = (
        len(codecs) == 1
        and codecs[0]["name"] == "bytes"
        and (codecs[0].get("configuration") or {}).get("endian", "little") == "little"
        and sys.byteorder == "little"
    )
    native = all(
        c["name"] != "transpose"
        and (c["name"] != "bytes" or (c.get("configuration") or {}).get("endian", "little") == "little")
        for c in codecs
    )
    description = {k: v for k, v in md.items() if k != "attributes"}
    return ArrayMeta(
        key,
        path,
        3,
        tuple(shape),
        tuple(chunks),
        dtype,
        raw,
        prefix,
        sep,
        native=native,
        description=description,
    )


def meta_from_v2(key: str, path: Path, md: Any) -> ArrayMeta:
    """An :class:`ArrayMeta` from a legacy Zarr v2 ``.zarray`` (Megatron-Core <= 0.15), its
    members checked as far as a reader uses them; ValueError naming the member otherwise."""
    _document(md, 2)
    dtype, little = _v2_dtype(md.get("dtype"))
    if dtype is None:
        raise ValueError(f"dtype {json_text(md.get('dtype'))} has no torch equivalent")
    shape, chunks = md.get("shape"), md.get("chunks")
    _shape(shape, "shape")
    _chunk_shape(chunks, len(shape), "chunks")
    compressor = md.get("compressor")
    _expect(
        compressor is None or (type(compressor) is dict and compressor.get("id") in _V2_COMPRESSORS),
        "compressor",
        compressor,
        f"null or one of {sorted(_V2_COMPRESSORS)}",
    )
    _expect(md.get("filters") in (None, []), "filters", md.get("filters"), "null (filters are not supported)")
    _expect(md.get("order", "C") in ("C", "F"), "order", md.get("order"), "'C' or 'F'")
    sep = md.get("dimension_separator", ".")
    _expect(sep in ("/", "."), "dimension_separator", sep, "'/' or '.'")
    raw = compressor is None and md.get("order", "C") == "C" and little and sys.byteorder == "little"
    return ArrayMeta(
        key, path, 2, tuple(shape), tuple(chunks), dtype, raw, "", sep, native=False
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
    what the writer wrote (dtype and shape in its ``keys``, the whole description in its
    ``arrays``), naming both files and the member; None when they agree, when the manifest has
    no record of the key, or when there is no manifest (``manifest`` is None). Loads and
    ``distckpt verify`` ask this one function."""
    declared = None if manifest is None else manifest.keys.get(meta.key)
    described = None if manifest is None else manifest.arrays.get(meta.key)
    if declared is None and described is None:
        return None
    if not meta.native:
        return (
            f"key {meta.key!r}: {meta_file(meta)} describes its elements in another layout (byte order, "
            f"element order or format) than the little-endian C-order Zarr v3 chunks distckpt writes, "
            f"and the "
            f"integrity manifest {MANIFEST_FNAME} says distckpt wrote this key: the array metadata is damaged"
        )
    if declared is not None and (dtype_name(meta.dtype), tuple(meta.shape)) != (
        declared[0],
        tuple(declared[1]),
    ):
        return (
            f"key {meta.key!r}: {meta_file(meta)} says {dtype_name(meta.dtype)} of shape {list(meta.shape)}, "
            f"the integrity manifest {MANIFEST_FNAME} says the writer wrote {declared[0]} of shape "
            f"{list(declared[1])}: the array metadata or the manifest is damaged"
        )
    if described is not None and described != meta.description:
        mine = meta.description or {}
        member = next(k for k in sorted(set(mine) | set(described)) if mine.get(k) != described.get(k))
        return (
            f"key {meta.key!r}: {meta_file(meta)} says {member} is {json_text(mine.get(member))}, the "
            f"integrity manifest {MANIFEST_FNAME} says the writer wrote {json_text(described.get(member))}: "
            f"the array metadata or the manifest is damaged"
        )
    return None


def listing_disagreement(keys: Sequence[str], manifest: Any, where: Any) -> Optional[str]:
    """Why the array ``keys`` the root group ``where`` lists contradict the manifest: arrays it
    says the writer wrote that the listing lacks (a query returns every key: one must not just
    drop out of it); None when it agrees or there is no manifest. Loads and verify ask this."""
    missing = sorted(set(manifest.keys) - set(keys)) if manifest is not None else []
    if not missing:
        return None
    return (
        f"{where}: does not list array key(s) {missing[:3]}{' ...' if len(missing) > 3 else ''} that "
        f"{MANIFEST_FNAME} says the writer wrote (the root metadata is damaged)"
    )
