"""Writing and reading the items of ``.distcp`` files: checksummed zero-copy writes, direct reads.

Each item of a ``.distcp`` file is a complete ``torch.save`` archive (a stored, uncompressed
zip; the format is :mod:`distckpt.formats.zip_archive`'s).

Writing: a :class:`ChecksummingSink` writes a plain tensor's storage straight from the tensor's
memory inside the frame :func:`~distckpt.formats.zip_archive.tensor_archive_frame` builds,
gathers the small writes, and folds every byte into a CRC32C for the manifest. The zip format's
own CRC32 stays 0 (torch.load does not check it, and it would cost more than the write).

Reading: an item whose frame is the expected one is read with one ``preadv`` straight into the
destination (:func:`read_framed_into`); others are located by
:func:`~distckpt.formats.zip_archive.read_archive_layout`, and the caller ``preadv``s their
bytes, or falls back to ``torch.load`` of the item.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from distckpt.checksum import crc32c
from distckpt.core import write_all
from distckpt.formats import blockcrc
from distckpt.formats.zip_archive import (
    ALIGN,
    SERIALIZATION_ID,
    expected_frame,
    framed_layout,
    tensor_archive_frame,
)
from distckpt.io.byteio import byte_view, pread_crc

__all__ = [
    "ChecksummingSink",
    "WriterSink",
    "copy_framed_from",
    "framed",
    "read_framed_crc",
    "read_framed_into",
    "save_to_sink",
    "write_bytes_item",
    "write_tensor_item",
    "write_tensor_pieces",
    "zip_crc_disabled",
]

# --------------------------------------------------------------------------- writing


@contextmanager
def zip_crc_disabled() -> Iterator[None]:
    """Switch off torch.save's zip CRC32 in the calling thread for the duration.

    torch keeps its serialization config per context (a ``ContextVar``): a new thread starts
    with the defaults, CRC32 on. So every thread that may ``torch.save`` an item (each writer
    thread) enters this itself; a setting made by the thread that started the save does not
    reach them (it did not before: a writer thread's ``torch.save`` items carried a zip CRC32,
    and their bytes depended on which thread wrote them)."""
    from torch.utils.serialization import config

    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = saved


class ChecksummingSink:
    """A write-only file object over a raw fd that counts bytes and keeps a running CRC32C.

    ``torch.save`` frames each tensor with about forty small writes (zip headers, the pickle,
    the trailer). Those are gathered in memory and go out together with the next large write
    (one ``writev``) or at :meth:`drain`, so an item costs a few syscalls, not forty.
    ``position`` and ``crc`` count every byte accepted, written out yet or not.
    """

    # Checksum and write block by block: the write then copies bytes the CRC just pulled into
    # the cache, instead of reading the whole tensor from memory twice.
    BLOCK = 1 << 20
    SMALL = 64 << 10  # writes below this are gathered

    def __init__(self, fd: int):
        self.fd = fd
        self.position = 0
        self.crc = 0
        self._pending = bytearray()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < self.SMALL:
            self.crc = crc32c(view, self.crc)
            self._pending += view
            if len(self._pending) >= self.BLOCK:
                self.drain()
        else:
            for start in range(0, n, self.BLOCK):
                block = view[start : start + self.BLOCK]
                self.crc = crc32c(block, self.crc)
                self._emit(block)
        self.position += n
        return n

    def write_blocks(self, data, block: int) -> List[int]:
        """Write ``data`` like :meth:`write` and return the CRC32C of each ``block``-byte piece of it
        (the last may be shorter). The running CRC is combined from the full pieces' CRCs (see
        :mod:`distckpt.formats.blockcrc`), so those bytes are checksummed once."""
        view = memoryview(data).cast("B")
        n = len(view)
        crcs: List[int] = []
        for start in range(0, n, self.BLOCK):  # BLOCK is a multiple of ``block``
            chunk = view[start : start + self.BLOCK]
            self.crc = blockcrc.extend(self.crc, chunk, crcs, block)
            self._emit(chunk)
        self.position += n
        return crcs

    def _emit(self, block) -> None:
        """Write a large block, with the gathered small writes before it."""
        if self._pending:
            self._writev([memoryview(self._pending), block])
            self._pending = bytearray()
        else:
            self._out(block)

    def _out(self, view) -> None:
        write_all(self.fd, view)

    def _writev(self, views) -> None:
        done, total = os.writev(self.fd, views), sum(len(v) for v in views)
        if done < total:  # a short write: finish it view by view
            for v in views:
                if done >= len(v):
                    done -= len(v)
                    continue
                write_all(self.fd, v[done:])
                done = 0

    def drain(self) -> None:
        """Write out the gathered small writes."""
        if self._pending:
            self._out(self._pending)
            self._pending = bytearray()

    def fsync(self) -> None:
        """Drain, then fsync: the file is complete and durable."""
        self.drain()
        os.fsync(self.fd)

    def flush(self) -> None:
        pass


class WriterSink(ChecksummingSink):
    """A :class:`ChecksummingSink` over a storage :class:`~distckpt.storage.Writer` (an object
    store's multipart upload): same gathering and checksums; durability comes with the writer's
    ``close``."""

    def __init__(self, writer):
        super().__init__(-1)
        self.writer = writer

    def _out(self, view) -> None:
        self.writer.write(view)

    def _writev(self, views) -> None:
        for v in views:
            self.writer.write(v)

    def fsync(self) -> None:
        self.drain()


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


def write_tensor_item(
    sink: ChecksummingSink, tensor: torch.Tensor, blocks: Optional[List[blockcrc.Entry]] = None
) -> Tuple[int, int, int]:
    """Append one tensor archive; returns (offset, length, crc32c) of the item. With ``blocks``,
    an item whose tensor bytes span at least ``blockcrc.MIN_PAYLOAD`` appends its per-block
    CRC32Cs there (see :mod:`distckpt.formats.blockcrc`)."""
    start, sink.crc = sink.position, 0
    frame = tensor_archive_frame(tensor, SERIALIZATION_ID, start)
    if frame is None:
        save_to_sink(tensor, sink)
        return start, sink.position - start, sink.crc
    header, trailer = frame
    payload = tensor.reshape(-1).view(torch.uint8).numpy()
    if payload.nbytes < sink.SMALL:
        # A small tensor: its whole item is gathered anyway, so one write (one CRC32C call and
        # one append) instead of three.
        sink.write(b"".join((header, payload, trailer)))
        return start, sink.position - start, sink.crc
    sink.write(header)
    if blocks is None or payload.nbytes < blockcrc.MIN_PAYLOAD:
        sink.write(payload)
        sink.write(trailer)
        return start, sink.position - start, sink.crc
    head_crc = sink.crc  # the CRC restarted at the item's first byte
    crcs = sink.write_blocks(payload, blockcrc.BLOCK_SIZE)
    sink.write(trailer)
    blocks.append(
        blockcrc.Entry(
            start,
            sink.position - start,
            sink.crc,
            len(header),
            payload.nbytes,
            head_crc,
            crc32c(trailer),
            tensor.dtype,
            crcs,
        )
    )
    return start, sink.position - start, sink.crc


def write_tensor_pieces(
    sink: ChecksummingSink,
    dtype: torch.dtype,
    size: Tuple[int, ...],
    pieces: Iterable,
    blocks: Optional[List[blockcrc.Entry]] = None,
) -> Optional[Tuple[int, int, int]]:
    """:func:`write_tensor_item` for a contiguous tensor of ``dtype`` and ``size`` whose bytes
    arrive as ``pieces`` (bytes-like, in order; every piece but the last a multiple of
    ``blockcrc.BLOCK_SIZE`` long), e.g. from a device through pinned slots, or a view into a
    larger CPU storage: the same bytes, CRC32C and block entry as :func:`write_tensor_item` of a
    tensor owning exactly those bytes, without that copy. None (nothing written) for a tensor
    :func:`write_tensor_item` leaves to ``torch.save`` (see :func:`framed`)."""
    start = sink.position
    frame = expected_frame(dtype, tuple(size), start % ALIGN)
    if frame is None:
        return None
    header, trailer, layout = frame
    sink.crc = 0
    sink.write(header)
    head_crc, crcs, done = sink.crc, [], 0
    with_blocks = blocks is not None and layout.data_length >= blockcrc.MIN_PAYLOAD
    for piece in pieces:
        if done % blockcrc.BLOCK_SIZE:
            raise ValueError("a piece of a tensor's bytes other than the last is not whole blocks long")
        if with_blocks:
            crcs.extend(sink.write_blocks(piece, blockcrc.BLOCK_SIZE))
            done += len(piece)
        else:
            done += sink.write(piece)
    if done != layout.data_length:
        raise ValueError(f"{done} bytes of a tensor of {layout.data_length} bytes were written")
    sink.write(trailer)
    if with_blocks:
        blocks.append(
            blockcrc.Entry(
                start,
                sink.position - start,
                sink.crc,
                len(header),
                layout.data_length,
                head_crc,
                crc32c(trailer),
                dtype,
                crcs,
            )
        )
    return start, sink.position - start, sink.crc


def framed(dtype: torch.dtype, size: Tuple[int, ...]) -> bool:
    """Whether :func:`write_tensor_pieces` can write a contiguous tensor of ``dtype`` and ``size``
    (its frame does not depend on where the item starts)."""
    return expected_frame(dtype, tuple(size), 0) is not None


def write_bytes_item(sink: ChecksummingSink, data: bytes) -> Tuple[int, int, int]:
    start, sink.crc = sink.position, 0
    sink.write(data)
    return start, sink.position - start, sink.crc


# --------------------------------------------------------------------------- reading


def read_framed_crc(
    fd: int, offset: int, length: int, size: Tuple[int, ...], dest: torch.Tensor, what: str
) -> Optional[int]:
    """:func:`read_framed_into` with the item's CRC32C computed as its bytes arrive: the CRC32C
    of the whole item (header, tensor bytes, trailer) when its frame is the expected one, else
    None (then the caller reads the item the long way, which overwrites ``dest``)."""
    frame = expected_frame(dest.dtype, tuple(size), offset % ALIGN)
    if frame is None:
        return None
    header, trailer, layout = frame
    if (
        len(header) + layout.data_length + len(trailer) != length
        or dest.numel() * dest.element_size() != layout.data_length
    ):
        return None
    head = os.pread(fd, len(header), offset)
    if head != header:
        return None
    crc = pread_crc(fd, byte_view(dest), offset + len(header), what, crc32c(head))
    tail = os.pread(fd, len(trailer), offset + length - len(trailer))
    if tail != trailer:
        return None
    return crc32c(tail, crc)


# Linux moves at most 0x7ffff000 bytes per read call; a longer item goes the long way.
_ONE_PREADV = 0x7FFFF000


def read_framed_into(fd: int, offset: int, length: int, size: Tuple[int, ...], dest: torch.Tensor) -> bool:
    """Read a whole item that :func:`write_tensor_item` framed around a contiguous tensor of
    ``size`` straight into ``dest`` (a contiguous CPU tensor of its dtype and bytes) with one
    ``preadv``: header, tensor bytes, trailer. True if the header and trailer are the frame the
    item was expected to have; False if not (another writer's archive, a short file), and then
    ``dest`` holds whatever was read: the caller reads the item the long way, which overwrites it.
    One call instead of three (two small reads to check the frame, then the bytes)."""
    frame = expected_frame(dest.dtype, tuple(size), offset % ALIGN)
    if frame is None:
        return False
    header, trailer, layout = frame
    if (
        len(header) + layout.data_length + len(trailer) != length
        or length > _ONE_PREADV
        or dest.numel() * dest.element_size() != layout.data_length
    ):
        return False
    head, tail = bytearray(len(header)), bytearray(len(trailer))
    try:
        n = os.preadv(fd, [head, byte_view(dest), tail], offset)
    except OSError:
        return False
    return n == length and head == header and tail == trailer


def copy_framed_from(item: memoryview, offset: int, size: Tuple[int, ...], dest: torch.Tensor) -> bool:
    """Like :func:`read_framed_into` for an item already in memory (``item``, a writable view of
    the bytes read from file offset ``offset``): if it is byte for byte the frame
    :func:`write_tensor_item` builds around a contiguous tensor of ``size`` and ``dest``'s dtype,
    copy its tensor bytes into ``dest`` (a contiguous CPU tensor of exactly those bytes) and
    return True; else False, ``dest`` untouched. The frame is compared in place and the bytes
    moved with one ``memmove``: a few microseconds for the small items of a many-tensor load."""
    layout = framed_layout(item, size, dest.dtype, offset=offset)
    if layout is None or dest.numel() * dest.element_size() != layout.data_length:
        return False
    src = (ctypes.c_char * layout.data_length).from_buffer(item, layout.data_offset)
    ctypes.memmove(dest.data_ptr(), src, layout.data_length)
    return True
