"""The ``torch.save`` archive of one tensor, as a zip: framed here around its bytes, and parsed.

Each item of a ``.distcp`` file is a complete ``torch.save`` archive (a stored, uncompressed
zip), as DCP and Megatron-Core write them, so any of them can read our files and we theirs.

Framing: :func:`tensor_archive_frame` builds the zip records around a plain tensor's storage
(byte-identical to ``torch.save``'s output with its zip CRC32 off when the item starts at a
multiple of 64 bytes; other tensors and objects go through ``torch.save``). Its padding aligns
each record's data to 64 bytes of the *file*, not of the archive: a copy between a 64-byte
aligned tensor and a file offset that is not costs ~30% more in the kernel, reading and
writing. :func:`expected_frame` and :func:`framed_layout` recognise such a frame when reading.

Parsing: instead of ``torch.load`` (which copies the bytes twice), :func:`read_archive_layout`
parses the archive's local zip headers and its ``data.pkl`` with a restricted unpickler to find
where the tensor's bytes sit. Archives that do not have the expected shape give None (the caller
falls back to ``torch.load`` of the item).
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

# --------------------------------------------------------------------------- zip records

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")

# The archive torch.save writes for one plain tensor, framed here directly: building ~2 KB of
# zip records in Python costs less than torch.save's pickler and its forty small writes, and the
# whole item then goes out as header + storage + trailer. The records, their order, the 64-byte
# alignment of every record's data ("FB" padding in the local header's extra field), the data
# descriptors and the zip64 end records follow torch's writer, so the bytes equal what
# torch.save writes with its zip CRC32 off (a test compares them), and torch.load reads them.
# One difference: the padding aligns to 64 bytes of the file the archive sits in (``base`` is
# the archive's offset there, modulo 64), so the tensor's bytes are aligned in the file too;
# torch.save aligns within the archive, which is the same thing for an archive at offset 0.
_ARCHIVE = "archive/"
ALIGN = 64
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_SMALL_RECORDS_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
# dtype -> the legacy storage class torch.save names in data.pkl
_FRAMED_DTYPES = {
    torch.float64: torch.DoubleStorage,
    torch.float32: torch.FloatStorage,
    torch.float16: torch.HalfStorage,
    torch.bfloat16: torch.BFloat16Storage,
    torch.int64: torch.LongStorage,
    torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage,
    torch.int8: torch.CharStorage,
    torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage,
    torch.complex64: torch.ComplexFloatStorage,
    torch.complex128: torch.ComplexDoubleStorage,
}
_MAX_FRAMED = 0xFFFFFFFF - (1 << 20)  # beyond this torch.save switches to zip64 records: use it


_STORAGE = object()  # stands for the tensor's storage in the pickle; becomes a persistent id


class _TensorReduce:
    """Pickles the way torch.save pickles a plain contiguous tensor with its own storage."""

    def __init__(self, size, stride) -> None:
        self.size, self.stride = size, stride

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (
            _STORAGE,
            0,
            self.size,
            self.stride,
            False,
            collections.OrderedDict(),
        )


def _tensor_pickle(dtype: torch.dtype, size, stride, numel: int) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    storage_id = ("storage", _FRAMED_DTYPES[dtype], "0", "cpu", numel)
    pickler.persistent_id = lambda obj: storage_id if obj is _STORAGE else None
    pickler.dump(_TensorReduce(tuple(size), tuple(stride)))
    return buf.getvalue()


class _ZipFramer:
    """Builds the records of one archive around an externally written payload."""

    def __init__(self, base: int = 0) -> None:
        self.base = base  # the archive's offset in its file, modulo ALIGN
        self.out = bytearray()
        self.skipped = 0  # bytes of the archive written elsewhere, before ``out``
        self.central = bytearray()
        self.count = 0

    @property
    def position(self) -> int:
        return self.skipped + len(self.out)

    def local(self, name: str, size: int) -> None:
        """The local header of a record whose ``size`` data bytes come next."""
        encoded = (_ARCHIVE + name).encode()
        start = self.position + _LOCAL_HEADER.size + len(encoded) + 4
        pad = -(self.base + start) % ALIGN
        self.central += (
            _CENTRAL_HEADER.pack(
                0x02014B50, 0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(encoded), 0, 0, 0, 0, 0, self.position
            )
            + encoded
        )
        self.out += _LOCAL_HEADER.pack(_LOCAL_SIG, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), 4 + pad)
        self.out += encoded + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        self.count += 1

    def descriptor(self, size: int) -> None:
        self.out += struct.pack("<IIII", 0x08074B50, 0, size, size)

    def record(self, name: str, data: bytes) -> None:
        self.local(name, len(data))
        self.out += data
        self.descriptor(len(data))

    def end(self) -> None:
        cd_offset, cd_size = self.position, len(self.central)
        self.out += self.central
        z64_at = self.position
        self.out += _ZIP64_EOCD.pack(
            0x06064B50, 44, 0x031E, 0x2D, 0, 0, self.count, self.count, cd_size, cd_offset
        )
        self.out += _ZIP64_LOCATOR.pack(0x07064B50, 0, z64_at, 1)
        self.out += _EOCD.pack(0x06054B50, 0, 0, self.count, self.count, cd_size, cd_offset, 0)


def tensor_archive_frame(
    tensor: torch.Tensor, serialization_id: str, base: int = 0
) -> Optional[Tuple[bytes, bytes]]:
    """(header, trailer) such that header + the tensor's bytes + trailer is the archive
    ``torch.save(tensor)`` writes (zip CRC32 off), its records' data aligned to 64 bytes of a
    file in which the archive starts at an offset of ``base`` modulo 64. None for what
    torch.save must frame itself: other dtypes, empty or shared storages, storages near 4 GiB
    (zip64 records)."""
    nbytes = tensor.numel() * tensor.element_size()
    if (
        nbytes == 0
        or type(tensor) is not torch.Tensor
        or tensor.dtype not in _FRAMED_DTYPES
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.requires_grad
        or tensor.untyped_storage().nbytes() != nbytes
        or nbytes > _MAX_FRAMED
    ):
        return None
    return _archive_frame(
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.numel(),
        nbytes,
        serialization_id,
        base % ALIGN,
    )


# The frame depends only on dtype, shape, stride and the serialization id; the tensors of a
# model repeat a few shapes, and a save repeats the last save's: build each frame once.
@functools.lru_cache(maxsize=4096)
def _archive_frame(
    dtype: torch.dtype,
    shape: Tuple[int, ...],
    stride: Tuple[int, ...],
    numel: int,
    nbytes: int,
    serialization_id: str,
    base: int = 0,
) -> Tuple[bytes, bytes]:
    zf = _ZipFramer(base)
    zf.record("data.pkl", _tensor_pickle(dtype, shape, stride, numel))
    for name, data in _SMALL_RECORDS_BEFORE:
        zf.record(name, data)
    zf.local("data/0", nbytes)
    header = bytes(zf.out)
    zf.out, zf.skipped = bytearray(), len(header) + nbytes
    zf.descriptor(nbytes)
    zf.record("version", b"3\n")
    zf.record(".data/serialization_id", serialization_id.encode())
    zf.end()
    return header, bytes(zf.out)


def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides (in elements) of a row-major contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)
def expected_frame(
    dtype: torch.dtype, size: Tuple[int, ...], base: int
) -> Optional[Tuple[bytes, bytes, ArchiveLayout]]:
    """The header and trailer :func:`write_tensor_item` puts around a contiguous tensor of ``size``
    and ``dtype`` at a file offset of ``base`` modulo 64, with the layout they describe; None for
    tensors it leaves to ``torch.save``."""
    if dtype not in _FRAMED_DTYPES:
        return None
    numel = math.prod(size)
    nbytes = numel * dtype.itemsize
    if nbytes == 0 or nbytes > _MAX_FRAMED:
        return None
    stride = contiguous_strides(size)
    header, trailer = _archive_frame(dtype, size, stride, numel, nbytes, SERIALIZATION_ID, base)
    return header, trailer, ArchiveLayout(len(header), nbytes, dtype, 0, size, stride)


def framed_layout(
    raw,
    size: Tuple[int, ...],
    dtype: torch.dtype,
    length: Optional[int] = None,
    read: Optional[Callable[[int, int], bytes]] = None,
    offset: int = 0,
) -> Optional[ArchiveLayout]:
    """The layout of an archive that is byte for byte the frame :func:`write_tensor_item` builds
    for a contiguous tensor of ``size`` and ``dtype`` around its bytes, at file offset ``offset``
    (then nothing needs parsing); None otherwise (parse it with :func:`read_archive_layout`).

    The archive is ``raw``, or (``raw`` None) the ``length`` bytes ``read(offset, n)`` serves: then
    only its header and trailer are read, two small reads instead of the zip directory's."""
    frame = expected_frame(dtype, tuple(size), offset % ALIGN)
    if frame is None:
        return None
    header, trailer, layout = frame
    total = len(header) + layout.data_length + len(trailer)
    if raw is not None:
        view = memoryview(raw)
        if len(view) != total or view[: len(header)] != header or view[total - len(trailer) :] != trailer:
            return None
        return layout
    if (
        length != total
        or read(0, len(header)) != header
        or read(total - len(trailer), len(trailer)) != trailer
    ):
        return None
    return layout


# The serialization id every framed archive carries (torch.save writes a random one; ours is fixed,
# so that the frames of equal tensors are equal bytes).
SERIALIZATION_ID = "0" * 40


@dataclass(frozen=True)
class ArchiveLayout:
    """Where the single storage of a tensor archive sits, relative to the archive's start."""

    data_offset: int
    data_length: int
    dtype: torch.dtype
    storage_offset: int  # in elements
    size: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        return contiguous_strides(self.size) == tuple(self.stride) or math.prod(self.size) <= 1


TAIL_BYTES = 4096


def _central_directory(read, length: int) -> Optional[dict]:
    """Map record name -> (local header offset, compressed size) from the zip's central directory."""
    tail_len = min(length, TAIL_BYTES)
    tail = read(length - tail_len, tail_len)
    eocd_at = tail.rfind(b"PK\x05\x06")
    if eocd_at < 0 or eocd_at + _EOCD.size > len(tail):
        return None
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, eocd_at)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc_at = eocd_at - _ZIP64_LOCATOR.size
        if loc_at < 0:
            return None
        sig, _, z64_offset, _ = _ZIP64_LOCATOR.unpack_from(tail, loc_at)
        if sig != 0x07064B50:
            return None
        z64 = read(z64_offset, _ZIP64_EOCD.size)
        if len(z64) < _ZIP64_EOCD.size or _ZIP64_EOCD.unpack_from(z64)[0] != 0x06064B50:
            return None
        (_, _, _, _, _, _, _, count, cd_size, cd_offset) = _ZIP64_EOCD.unpack_from(z64)
    tail_start = length - tail_len
    if cd_offset >= tail_start:
        cd = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        cd = read(cd_offset, cd_size)
    records, pos = {}, 0
    for _ in range(count):
        if pos + _CENTRAL_HEADER.size > len(cd):
            return None
        fields = _CENTRAL_HEADER.unpack_from(cd, pos)
        if fields[0] != 0x02014B50 or fields[4] != 0:  # signature, method (0 = stored)
            return None
        csize, usize, name_len, extra_len, comment_len, local = (
            fields[8],
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        name_end = pos + _CENTRAL_HEADER.size + name_len
        name = cd[pos + _CENTRAL_HEADER.size : name_end].decode("utf-8", "replace")
        if 0xFFFFFFFF in (csize, usize, local):
            values = iter(_zip64_fields(cd[name_end : name_end + extra_len]))
            usize = next(values, None) if usize == 0xFFFFFFFF else usize
            csize = next(values, None) if csize == 0xFFFFFFFF else csize
            local = next(values, None) if local == 0xFFFFFFFF else local
            if None in (usize, csize, local):
                return None
        records[name] = (local, csize)
        pos = name_end + extra_len + comment_len
    return records


def _zip64_fields(extra: bytes):
    pos = 0
    while pos + 4 <= len(extra):
        header_id, size = struct.unpack_from("<HH", extra, pos)
        if header_id == 0x0001:
            return [struct.unpack_from("<Q", extra, pos + 4 + 8 * i)[0] for i in range(size // 8)]
        pos += 4 + size
    return []


def _record_data_offset(read, local_offset: int) -> Optional[int]:
    head = read(local_offset, _LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size:
        return None
    sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(head)
    if sig != _LOCAL_SIG:
        return None
    return local_offset + _LOCAL_HEADER.size + name_len + extra_len


def read_archive_layout(read, length: int) -> Optional[ArchiveLayout]:
    """Locate the tensor bytes of one archive. ``read(offset, n)`` reads relative to its start.

    Returns None when the archive is not a plain single-storage tensor (then use torch.load).
    """
    records = _central_directory(read, length)
    if not records:
        return None
    pkl = [n for n in records if n == "data.pkl" or n.endswith("/data.pkl")]
    storages = [n for n in records if "/data/" in n and not n.endswith(".pkl")]
    if len(pkl) != 1 or len(storages) != 1 or not storages[0].endswith("/data/0"):
        return None
    pkl_local, pkl_size = records[pkl[0]]
    pkl_start = _record_data_offset(read, pkl_local)
    data_local, data_size = records[storages[0]]
    data_start = _record_data_offset(read, data_local)
    if pkl_start is None or data_start is None or data_start + data_size > length:
        return None
    pickled = read(pkl_start, pkl_size)
    try:
        rebuilt = _LayoutUnpickler(io.BytesIO(pickled)).load()
    except Exception:  # noqa: BLE001 - anything unusual falls back to torch.load
        return None
    if not (isinstance(rebuilt, tuple) and rebuilt and rebuilt[0] == "tensor"):
        return None
    _, pid, storage_offset, size, stride, dtype = rebuilt
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[2] == "0"):
        return None
    storage_ref = pid[1]
    dtype = dtype or (storage_ref.dtype if isinstance(storage_ref, _StorageRef) else None)
    if dtype is None:
        return None
    return ArchiveLayout(data_start, data_size, dtype, int(storage_offset), size, stride)


class _StorageRef:
    def __init__(self, dtype: Optional[torch.dtype]):
        self.dtype = dtype


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), None)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), dtype)


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a tensor archive's data.pkl without building anything but plain values."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageRef(None)
        if module == "torch" and name.endswith("Storage"):
            storage_cls = getattr(torch, name, None)
            dtype = getattr(storage_cls, "_dtype", None) if storage_cls is not None else None
            if isinstance(dtype, torch.dtype):
                return _StorageRef(dtype)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid
