"""One rank's whole state as one file (a *piece*): what it holds, how it is written and read.

A piece is everything one rank passes to ``LocalCheckpointManager.save``: every ShardedTensor it
holds (replicas included: the piece alone restores the rank, without asking anyone), every
ShardedObject and the common (non-sharded) values. Nothing is validated or gathered across ranks:
the layout is the same on restore, so each rank gets back exactly what it saved.

File layout (version 1)::

    b"DCKLOCAL"          8 bytes
    header length H      8 bytes, little-endian
    header CRC32C        4 bytes, little-endian (the header is checked before it is believed)
    header               H bytes of JSON (below)
    tensor bytes         one tensor after the other, at the offsets the header gives
                         (counted from the end of the header, like every "at" below)
    object bytes         torch.save({"common": ..., "objects": {unique_key: data}})
    b"DCKLEND1"          8 bytes
    CRC32C               4 bytes, little-endian: of every byte before this trailer

    header = {"version": 1,
              "tensors": [{"key": str, "offset": [int], "flat": [start, stop] | null,
                           "dtype": "bfloat16", "shape": [int], "at": int, "nbytes": int}],
              "objects": {"at": int, "nbytes": int}}

Tensors are identified as in the rest of distckpt, by key, global offset and flattened range.
Their bytes are written straight from the (staged) tensor memory and read straight into the
caller's tensors. The object part is read back with the allowlisted ``torch.load(weights_only=True)``
of :func:`distckpt.strategies.common.safe_torch_load`: nothing is unpickled beyond plain data,
tensors and the allowlist unless ``trusted``.

The file carries its own CRC32C (the trailer), so a piece can be checked on its own; the CRC32C
of the whole file, trailer included, is also kept in the holder's commit marker (see
:mod:`distckpt.local.manager`). Reading checks both in the same pass that fills the tensors, so
a corrupt piece is detected before anything is returned.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from distckpt import containment, dist
from distckpt.core import CheckpointingException, fsync_dir
from distckpt.dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from distckpt.formats.manifest import crc32c
from distckpt.io.byteio import byte_view, pread_exact
from distckpt.io.filesystem import ChecksummingSink
from distckpt.io.staging_buffers import StagedBatch, StagingBuffers
from distckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from distckpt.strategies.common import safe_torch_load
from distckpt.validation import validate_local_integrity

MAGIC = b"DCKLOCAL"
VERSION = 1
_PREFIX = struct.Struct("<8sQI")
END_MAGIC = b"DCKLEND1"
_TRAILER = struct.Struct("<8sI")
_SCRATCH = 16 << 20  # bytes read at a time from stored tensors that the caller did not ask for
_BLOCK = 1 << 20  # bytes read and checksummed at a time

TensorId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]


class CorruptPieceError(CheckpointingException):
    """A stored piece is missing, truncated or does not match its CRC32C."""


def tensor_id(sh: ShardedTensor) -> TensorId:
    fr = sh.flattened_range
    return (
        sh.key,
        tuple(int(o) for o in sh.global_offset),
        None if fr is None else (int(fr.start), int(fr.stop)),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _parse_dtype(name: str, what: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptPieceError(f"{what}: unknown dtype {name!r} in the header")
    return dtype


@dataclass
class SplitState:
    """A sharded state dict taken apart the way ``distckpt.save``/``load`` do it (factories
    applied: split a state dict once, then read into it as often as needed)."""

    factories: Any
    nonpersistent: Any
    sharded: Any
    common: Any
    shards: List[ShardedBase]


def split_state_dict(sharded_state_dict: ShardedStateDict) -> SplitState:
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    nonpersistent, rest = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    sharded, common = extract_matching_values(rest, lambda v: isinstance(v, ShardedBase))
    shards = list(nested_values(sharded))
    validate_local_integrity(shards)
    return SplitState(factories, nonpersistent, sharded, common, shards)


# --------------------------------------------------------------------------- saving


@dataclass
class StagedPiece:
    """A piece ready to be written by any thread: host tensors, the object bytes, the header."""

    header: bytes
    tensors: List[torch.Tensor]
    objects: bytes
    nbytes: int
    staged: Optional[StagedBatch] = None  # pooled buffers to give back once written


def stage_piece(
    sharded_state_dict: ShardedStateDict, staging: Optional[StagingBuffers] = None
) -> StagedPiece:
    """Take a rank's state apart and stage its bytes (the training thread calls this).

    With ``staging`` (one save's view of the process-wide pool) every tensor is copied into a
    pooled host buffer, so training may change the tensors while the piece is written in the
    background; the pool's free buffers this piece does not need are dropped first, and the
    copies must fit the host memory budget. Without it CPU tensors are written from their own
    memory (the caller must not change them until the write is done) and device tensors are
    copied to the host.

    Raises:
        CheckpointingException: a ShardedTensor without data, two leaves with the same id, or
            (with ``staging``) more bytes than the host memory budget.
    """
    if staging is None:
        return _stage_piece(sharded_state_dict, None)
    try:
        return _stage_piece(sharded_state_dict, staging)
    except BaseException:
        staging.discard_unsealed()
        raise


def _stage_piece(sharded_state_dict: ShardedStateDict, staging: Optional[StagingBuffers]) -> StagedPiece:
    rank = dist.get_rank()
    split = split_state_dict(sharded_state_dict)
    records, tensors, objects = [], [], {}
    seen = set()
    position = 0
    if staging is not None:
        needed: Dict[Any, int] = {}
        for sh in split.shards:
            if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.Tensor):
                key = staging.key_of(sh.data)
                needed[key] = needed.get(key, 0) + 1
        staging.keep_only(needed)
    for sh in split.shards:
        if isinstance(sh, ShardedObject):
            if sh.unique_key in objects:
                raise CheckpointingException(f"ShardedObject {sh.unique_key!r} appears twice on rank {rank}")
            objects[sh.unique_key] = sh.data
            continue
        if not isinstance(sh, ShardedTensor):
            raise CheckpointingException(
                f"{type(sh).__name__} {sh.key!r} cannot be saved locally (rank {rank})"
            )
        if not isinstance(sh.data, torch.Tensor):
            raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save (rank {rank})")
        tid = tensor_id(sh)
        if tid in seen:
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r} at offset {tid[1]} appears twice on rank {rank}"
            )
        seen.add(tid)
        data = sh.data.detach()
        if staging is not None:
            host = staging.acquire(data)
        elif data.device.type != "cpu" or not data.is_contiguous() or type(data) is not torch.Tensor:
            host = torch.empty(data.shape, dtype=data.dtype)
            host.copy_(data)
        else:
            host = data
        nbytes = host.numel() * host.element_size()
        records.append(
            {
                "key": tid[0],
                "offset": list(tid[1]),
                "flat": None if tid[2] is None else list(tid[2]),
                "dtype": _dtype_name(host.dtype),
                "shape": list(host.shape),
                "at": position,
                "nbytes": nbytes,
            }
        )
        tensors.append(host)
        position += nbytes
    batch = staging.seal() if staging is not None else None
    buffer = io.BytesIO()
    torch.save({"common": split.common, "objects": objects}, buffer)
    blob = buffer.getvalue()

    header = json.dumps(
        {"version": VERSION, "tensors": records, "objects": {"at": position, "nbytes": len(blob)}},
        separators=(",", ":"),
    ).encode()
    prefix = _PREFIX.pack(MAGIC, len(header), crc32c(header))
    nbytes = len(prefix) + len(header) + position + len(blob) + _TRAILER.size
    return StagedPiece(prefix + header, tensors, blob, nbytes, batch)


def write_piece(piece: StagedPiece, path: Path) -> Tuple[int, int]:
    """Write ``piece`` to ``path`` atomically (temp file, fsync, rename); return (size, crc32c).

    Uses no process group: it may run in a background thread. Gives the staged buffers back to
    their pool when done (written or not).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            sink = ChecksummingSink(fd)
            sink.write(piece.header)
            for t in piece.tensors:
                sink.write(byte_view(t))
            sink.write(piece.objects)
            sink.write(_TRAILER.pack(END_MAGIC, sink.crc))
            sink.fsync()
        finally:
            os.close(fd)
    finally:
        piece.tensors = []
        if piece.staged is not None:
            piece.staged.release()
    if sink.position != piece.nbytes:
        raise CheckpointingException(f"{path}: wrote {sink.position} bytes, expected {piece.nbytes}")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return sink.position, sink.crc


# --------------------------------------------------------------------------- loading


def _read_header(fd: int, size: int, what: str) -> Tuple[dict, bytes]:
    if size < _PREFIX.size:
        raise CorruptPieceError(f"{what}: {size} bytes, too short for a local checkpoint piece")
    prefix = bytearray(_PREFIX.size)
    pread_exact(fd, memoryview(prefix), 0, what)
    magic, length, header_crc = _PREFIX.unpack(prefix)
    if magic != MAGIC or length > size - _PREFIX.size:
        raise CorruptPieceError(f"{what}: not a local checkpoint piece (bad magic or header length)")
    raw = bytearray(length)
    pread_exact(fd, memoryview(raw), _PREFIX.size, what)
    if crc32c(raw) != header_crc:
        raise CorruptPieceError(f"{what}: CRC32C mismatch in the header")
    try:
        header = json.loads(bytes(raw))
        if header["version"] != VERSION:
            raise ValueError(f"version {header['version']!r}")
        records = header["tensors"]
        for r in records:
            r["id"] = (
                str(r["key"]),
                tuple(int(o) for o in r["offset"]),
                None if r["flat"] is None else (int(r["flat"][0]), int(r["flat"][1])),
            )
            r["at"], r["nbytes"] = int(r["at"]), int(r["nbytes"])
            r["dtype"], r["shape"] = _parse_dtype(r["dtype"], what), tuple(int(n) for n in r["shape"])
        int(header["objects"]["at"]), int(header["objects"]["nbytes"])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptPieceError(f"{what}: malformed header ({e})") from None
    return header, bytes(prefix) + bytes(raw)


def read_piece(path: Path, split: SplitState, size: int, crc: int, trusted: bool = False) -> StateDict:
    """Restore a rank's state (``split`` of its sharded state dict) from the piece at ``path``,
    whose size and CRC32C are known.

    ShardedTensors given with data are filled in place, others get new CPU tensors; the result is
    the common state merged with the loaded sharded part, factories merged back and
    LocalNonpersistentObjects unwrapped, as ``distckpt.load`` returns it. Every byte is checked
    against ``crc`` in the same pass that fills the tensors, and nothing is returned unless it
    matches (tensors filled in place may then hold the corrupt bytes).

    Raises:
        CorruptPieceError: the file is missing, has another size, a bad header or CRC32C.
        CheckpointingException: the request asks for a tensor or object the piece does not hold,
            or with another dtype or shape.
    """
    rank = dist.get_rank()
    what = f"local checkpoint piece {path} (rank {rank})"
    try:
        # Opened beneath its iteration folder: a piece that is a symlink out is refused.
        fd = containment.open_beneath(path.parent, path.name, path.parent, "local piece")
    except FileNotFoundError:
        raise CorruptPieceError(f"{what}: file is missing") from None
    except CheckpointingException as e:
        raise CorruptPieceError(f"{what}: {e}") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptPieceError(f"{what}: {actual} bytes, its commit marker says {size}")
        header, head = _read_header(fd, size, what)
        running = crc32c(head)
        records = {r["id"]: r for r in header["tensors"]}
        wanted: Dict[int, Tuple[ShardedTensor, dict]] = {}
        for sh in split.shards:
            if not isinstance(sh, ShardedTensor):
                continue
            record = records.get(tensor_id(sh))
            if record is None:
                raise CheckpointingException(
                    f"{what}: holds no tensor {sh.key!r} at offset {tuple(sh.global_offset)}"
                    + (f" range {sh.flattened_range}" if sh.flattened_range is not None else "")
                    + " (the local tier restores the layout it saved)"
                )
            dtype, shape = record["dtype"], record["shape"]
            if dtype != sh.dtype:
                raise CheckpointingException(f"{what}: tensor {sh.key!r} is {dtype}, requested {sh.dtype}")
            if sh.data is not None and tuple(sh.data.shape) != shape:
                raise CheckpointingException(
                    f"{what}: tensor {sh.key!r} has shape {shape}, requested {tuple(sh.data.shape)}"
                )
            wanted[id(record)] = (sh, record)
        base = position = len(head)
        values: Dict[int, Any] = {}
        scratch: Optional[torch.Tensor] = None
        for record in sorted(header["tensors"], key=lambda r: r["at"]):
            if base + record["at"] != position:
                raise CorruptPieceError(
                    f"{what}: tensor {record['key']!r} at offset {base + record['at']}, expected {position}"
                )
            if id(record) not in wanted:
                scratch = scratch if scratch is not None else torch.empty(_SCRATCH, dtype=torch.uint8)
                for start in range(0, record["nbytes"], _SCRATCH):
                    view = byte_view(scratch)[: min(_SCRATCH, record["nbytes"] - start)]
                    pread_exact(fd, view, position + start, what)
                    running = crc32c(view, running)
            else:
                sh, _ = wanted[id(record)]
                dtype, shape = record["dtype"], record["shape"]
                dest = sh.data
                direct = (
                    dest is not None
                    and type(dest) is torch.Tensor
                    and dest.device.type == "cpu"
                    and dest.is_contiguous()
                )
                target = dest if direct else torch.empty(shape, dtype=dtype)
                view = byte_view(target)
                if len(view) != record["nbytes"]:
                    raise CorruptPieceError(
                        f"{what}: tensor {record['key']!r} holds {record['nbytes']} "
                        f"bytes, its shape needs {len(view)}"
                    )
                for start in range(0, len(view), _BLOCK):
                    # Block by block: the checksum reads bytes the read just left in the cache.
                    block = view[start : start + _BLOCK]
                    pread_exact(fd, block, position + start, what)
                    running = crc32c(block, running)
                if dest is not None and not direct:
                    dest.copy_(target)
                    target = dest
                values[id(sh)] = target
            position += record["nbytes"]
        objects = header["objects"]
        if base + objects["at"] != position or position + objects["nbytes"] + _TRAILER.size != size:
            raise CorruptPieceError(
                f"{what}: object bytes at [{base + objects['at']}, +{objects['nbytes']}) do not "
                f"end the {size}-byte file"
            )
        blob = bytearray(objects["nbytes"])
        pread_exact(fd, memoryview(blob), position, what)
        running = crc32c(blob, running)
        trailer = bytearray(_TRAILER.size)
        pread_exact(fd, memoryview(trailer), size - _TRAILER.size, what)
        end, own_crc = _TRAILER.unpack(trailer)
        if end != END_MAGIC or own_crc != running:
            raise CorruptPieceError(
                f"{what}: CRC32C mismatch (the file's trailer says {own_crc:#010x}, "
                f"its bytes give {running:#010x})"
            )
        running = crc32c(trailer, running)
    finally:
        os.close(fd)
    if running != crc:
        raise CorruptPieceError(f"{what}: CRC32C mismatch (commit marker {crc:#010x}, file {running:#010x})")
    stored = safe_torch_load(bytes(blob), what=f"{what}: common state and objects", trusted=trusted)
    for sh in split.shards:
        if isinstance(sh, ShardedObject):
            if sh.unique_key not in stored["objects"]:
                raise CheckpointingException(f"{what}: holds no ShardedObject {sh.unique_key!r}")
            values[id(sh)] = stored["objects"][sh.unique_key]
    loaded = dict_list_map_inplace(lambda sh: values[id(sh)], split.sharded)
    common = stored["common"]
    dict_list_map_inplace(lambda o: o.unwrap(), split.nonpersistent)
    merge(common, split.nonpersistent)
    merge(common, loaded)
    return apply_factory_merges(common, split.factories)
