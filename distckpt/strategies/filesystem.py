"""Byte-level I/O of ``.distcp`` files: checksummed zero-copy writes and direct reads.

Each item of a ``.distcp`` file is a complete ``torch.save`` archive (a stored, uncompressed
zip), as DCP and Megatron-Core write them, so any of them can read our files and we theirs.

Writing: ``torch.save`` streams the archive into a :class:`ChecksummingSink`, which hands the
storage bytes to ``os.write`` without a copy and folds them into a CRC32C as they pass. The zip
format's own CRC32 is switched off while we write (torch.load does not check it, and it would
cost more than the write itself); our CRC32C in the manifest covers every byte instead.

Reading: instead of ``torch.load`` (which copies the bytes twice), :func:`read_archive_layout`
parses the archive's local zip headers and its ``data.pkl`` with a restricted unpickler to find
where the tensor's bytes sit, and the caller ``preadv``s them straight into the destination.
Archives that do not have the expected shape fall back to ``torch.load`` of the item.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from distckpt.core import CheckpointingException
from distckpt.manifest import crc32c

# --------------------------------------------------------------------------- writing

_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved: Optional[bool] = None


@contextmanager
def zip_crc_disabled() -> Iterator[None]:
    """Switch off torch.save's zip CRC32 for the duration (reference-counted across threads)."""
    global _crc_users, _crc_saved
    from torch.utils.serialization import config

    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _crc_saved


class ChecksummingSink:
    """A write-only file object over a raw fd that counts bytes and keeps a running CRC32C."""

    def __init__(self, fd: int):
        self.fd = fd
        self.position = 0
        self.crc = 0

    # Checksum and write block by block: the write then copies bytes the CRC just pulled into
    # the cache, instead of reading the whole tensor from memory twice.
    BLOCK = 4 << 20

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        for start in range(0, n, self.BLOCK):
            block = view[start:start + self.BLOCK]
            self.crc = crc32c(block, self.crc)
            while block:
                block = block[os.write(self.fd, block):]
        self.position += n
        return n


    def flush(self) -> None:
        pass


class _ErrorRecorder:
    """What torch.save writes to: forwards to the sink and remembers the exception it raised,
    because torch.save replaces it with an opaque RuntimeError."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        try:
            return self.sink.write(data)
        except BaseException as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.sink.flush()


def save_to_sink(obj, sink) -> None:
    """``torch.save(obj)`` into ``sink``; a storage error (ENOSPC, EIO, ...) is raised as itself."""
    recorder = _ErrorRecorder(sink)
    try:
        torch.save(obj, recorder)
    except Exception:
        if recorder.error is not None:
            raise recorder.error from None
        raise


def write_tensor_item(sink: ChecksummingSink, tensor: torch.Tensor) -> Tuple[int, int, int]:
    """Append one tensor archive; returns (offset, length, crc32c) of the item."""
    start, sink.crc = sink.position, 0
    save_to_sink(tensor, sink)
    return start, sink.position - start, sink.crc


def write_bytes_item(sink: ChecksummingSink, data: bytes) -> Tuple[int, int, int]:
    start, sink.crc = sink.position, 0
    sink.write(data)
    return start, sink.position - start, sink.crc


# --------------------------------------------------------------------------- reading


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, 0-dim too)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, dest: torch.Tensor, offset: int, what: str) -> None:
    """Fill the contiguous CPU tensor ``dest`` with the bytes at ``offset``; short file = error."""
    if dest.numel() == 0:
        return
    view = byte_view(dest)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointingException(f"{what}: file is truncated (needed {len(view) - done} more "
                                         f"bytes at offset {offset + done})")
        done += n


_IOV_BATCH = 512  # runs per preadv call (2 iovecs each; IOV_MAX is 1024 on Linux)


def box_runs(lo, size, shape):
    """The byte-contiguous runs of the box ``[lo, lo + size)`` of a C-ordered array of ``shape``.

    Returns ``(first, run, step, count)`` in elements: ``count`` runs of ``run`` elements, the
    first at flat index ``first``, consecutive runs ``step`` apart. None unless the runs are evenly
    spaced, i.e. the box is contiguous except along one axis (true for every box of a 1-D or
    2-D array and for boxes spanning whole trailing axes, the resharding cases that matter).
    """
    ndim = len(shape)
    k = ndim
    while k > 0 and size[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        return 0, math.prod(size), 0, 1
    inner = math.prod(shape[k:])
    run = size[k - 1] * inner
    outer_axes = [a for a in range(k - 1) if size[a] != 1]
    strides = [math.prod(shape[a + 1:]) for a in range(ndim)]
    first = sum(lo_i * st for lo_i, st in zip(lo, strides))
    if not outer_axes:
        return first, run, 0, 1
    if len(outer_axes) > 1 or any(size[a] != 1 for a in range(k - 1) if a not in outer_axes):
        return None
    axis = outer_axes[0]
    return first, run, strides[axis], size[axis]


def scatter_read(fd: int, dest: torch.Tensor, base: int, itemsize: int, runs, what: str) -> int:
    """Read evenly spaced runs straight into the contiguous ``dest`` (one run after the other);
    the gaps between runs are read into a scratch buffer and dropped. Returns bytes read."""
    first, run, step, count = runs
    out = byte_view(dest)
    run_b, gap_b = run * itemsize, (step - run) * itemsize
    scratch = memoryview(bytearray(max(gap_b, 1)))
    nbytes = 0
    for start in range(0, count, _IOV_BATCH):
        stop = min(count, start + _IOV_BATCH)
        iov = []
        for i in range(start, stop):
            iov.append(out[i * run_b:(i + 1) * run_b])
            if i + 1 < stop and gap_b:
                iov.append(scratch[:gap_b])
        want = sum(len(v) for v in iov)
        offset = base + (first + start * step) * itemsize
        got = os.preadv(fd, iov, offset)
        if got != want:  # a short read: finish it the slow, exact way
            _finish_short_read(fd, iov, offset, got, what)
        nbytes += want
    return nbytes


def _finish_short_read(fd: int, iov, offset: int, done: int, what: str) -> None:
    pos = 0
    for view in iov:
        if pos + len(view) <= done:
            pos += len(view)
            continue
        skip = max(0, done - pos)
        part = view[skip:]
        while part:
            n = os.preadv(fd, [part], offset + pos + skip)
            if n == 0:
                raise CheckpointingException(f"{what}: file is truncated")
            part = part[n:]
            skip += n
        pos += len(view)


@dataclass(frozen=True)
class ArchiveLayout:
    """Where the single storage of a tensor archive sits, relative to the archive's start."""

    data_offset: int
    data_length: int
    dtype: torch.dtype
    storage_offset: int      # in elements
    size: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.size):
            expected.append(acc)
            acc *= s
        return tuple(reversed(expected)) == tuple(self.stride) or math.prod(self.size) <= 1


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
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
        cd = tail[cd_offset - tail_start:cd_offset - tail_start + cd_size]
    else:
        cd = read(cd_offset, cd_size)
    records, pos = {}, 0
    for _ in range(count):
        if pos + _CENTRAL_HEADER.size > len(cd):
            return None
        fields = _CENTRAL_HEADER.unpack_from(cd, pos)
        if fields[0] != 0x02014B50 or fields[4] != 0:  # signature, method (0 = stored)
            return None
        csize, usize, name_len, extra_len, comment_len, local = fields[8], fields[9], fields[10], fields[11], fields[12], fields[16]
        name_end = pos + _CENTRAL_HEADER.size + name_len
        name = cd[pos + _CENTRAL_HEADER.size:name_end].decode("utf-8", "replace")
        if 0xFFFFFFFF in (csize, usize, local):
            values = iter(_zip64_fields(cd[name_end:name_end + extra_len]))
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
