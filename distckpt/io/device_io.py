"""File bytes into device (CUDA) tensors through pinned host memory, and device tensors' bytes
out to files the same way.

A load that copies file bytes into a CUDA tensor straight from pageable memory (a mapping of the
file, or a bytes object) pays twice: the driver stages every pageable copy through its own
pinned buffer, and the host thread waits for each copy before it reads the next bytes. Here a
reader thread ``pread``s into one of a few pinned *slots*, starts the slot's host-to-device copy
on a side stream, and reads the next bytes into the next slot while that copy runs; a slot is
reused once its copy's event has fired. ``close`` waits for every copy, so the tensors are ready
when a load returns.

A box that is not one element range of its stored item (a column block of a resharded load)
goes the same way, whole item rows at a time: the rows its box touches are read into a slot,
uploaded into a device scratch buffer of the slot's size, and the box is cut out of them on the
device (a strided device-to-device copy), all on the side stream.

A plain save goes the other way (:class:`DeviceToHost`): a writer thread's next pieces are
copied device-to-host into pinned slots on a side stream while it checksums and writes the
current one, so the copies hide behind the writes and no pageable copy of a whole tensor is made.

Pinned memory per reader or writer thread is ``slots * slot_bytes`` (default 2 x 32 MiB); slots
go back to a small process-wide pool for the next load or save (``cudaHostAlloc`` costs
milliseconds per slot), at most :data:`POOL_SLOTS` of them are kept (:func:`release_slots`
frees them).

:func:`needs_staging` says when a destination cannot take such copies directly (a tensor subclass
or a non-contiguous tensor): a load then fills a plain tensor and copies it over.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Deque, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from distckpt.io.byteio import CRC_PIECE, byte_view, pread_exact

SLOT_BYTES = 32 << 20
SLOTS = 2
POOL_SLOTS = 16  # 512 MiB of pinned memory at most stays with the process between loads and saves
# A save's slots are a multiple of this (the per-block CRC32C block, blockcrc.BLOCK_SIZE).
PIECE_ALIGN = 256 << 10

_pool_lock = threading.Lock()
_pool: Dict[tuple, List[torch.Tensor]] = {}


def _take(nbytes: int, pinned: bool) -> torch.Tensor:
    with _pool_lock:
        free = _pool.get((nbytes, pinned))
        if free:
            return free.pop()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _give(buf: torch.Tensor, pinned: bool) -> None:
    with _pool_lock:
        if sum(len(v) for (_, p), v in _pool.items() if p == pinned) < POOL_SLOTS:
            _pool.setdefault((buf.numel(), pinned), []).append(buf)


def release_slots() -> int:
    """Free the pinned (and plain) slots kept between loads and saves; returns their bytes. For
    a process-wide release (e.g. ``distckpt.release_staging_memory``)."""
    with _pool_lock:
        freed = sum(nbytes * len(bufs) for (nbytes, _), bufs in _pool.items())
        _pool.clear()
    return freed


def side_stream(
    streams: Dict[torch.device, torch.cuda.Stream],
    device: torch.device,
    after: Optional[Dict[torch.device, torch.cuda.Stream]] = None,
):
    """The side CUDA stream of ``device`` in ``streams`` (made on first use), or None off CUDA.

    A new side stream first waits for whatever the caller queued on the device's current stream
    (the tensors' last writes, the allocation and zeroing of load targets), so copies on it never
    see bytes older than the caller's work. ``after``: the caller's streams by device, taken in
    the caller's thread (:func:`caller_streams`); without it, this thread's current stream."""
    if device.type != "cuda":
        return None
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device=device)
        waited = (after or {}).get(device)
        stream.wait_stream(waited if waited is not None else torch.cuda.current_stream(device))
    return stream


def caller_streams(tensors: Sequence[torch.Tensor]) -> Dict[torch.device, torch.cuda.Stream]:
    """The calling thread's current stream on each CUDA device of ``tensors``: what the side
    streams of writer threads must wait for. A thread's current stream is its own (the default
    stream in a new thread), so a save made under ``with torch.cuda.stream(s)`` would otherwise
    copy before the work queued on ``s``."""
    out: Dict[torch.device, torch.cuda.Stream] = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device not in out:
            out[t.device] = torch.cuda.current_stream(t.device)
    return out


class _Slot:
    def __init__(self, buf: torch.Tensor, pinned: bool = False):
        self.buf = buf
        self.pinned = pinned
        self.event: Optional[torch.cuda.Event] = None


class Box(Protocol):
    """What :meth:`HostBounce.fill_boxes` needs of a copy: element ``i`` of ``dst`` (shape
    ``size``) is item element ``start + sum(i[d] * strides[d])``."""

    start: int
    size: Tuple[int, ...]
    strides: Tuple[int, ...]
    dst: torch.Tensor

    @property
    def end(self) -> int: ...


class HostBounce:
    """One reader thread's pinned slots and copy stream (created on first use).

    ``fill`` copies ``dst.numel()`` elements of a file at a byte offset into the contiguous
    tensor ``dst``. For a CUDA ``dst`` the copies are asynchronous until ``close``; for a CPU
    ``dst`` (tests) they are plain copies through the same slots.
    """

    def __init__(
        self,
        slot_bytes: int = SLOT_BYTES,
        slots: int = SLOTS,
        after: Optional[Dict[torch.device, torch.cuda.Stream]] = None,
    ):
        self.slot_bytes = max(1, int(slot_bytes))
        self.count = max(1, int(slots))
        self._slots: List[_Slot] = []
        self._next = 0
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._scratch: Dict[torch.device, torch.Tensor] = {}
        self._pinned = False
        self._after = after  # the caller's streams (see side_stream), when made in another thread

    def _slot(self, device: torch.device) -> _Slot:
        if not self._slots:
            self._pinned = device.type == "cuda"
        if len(self._slots) < self.count:
            slot = _Slot(_take(self.slot_bytes, self._pinned))
            self._slots.append(slot)
            return slot
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.count
        if slot.event is not None:
            slot.event.synchronize()  # its previous copy has left the slot
            slot.event = None
        return slot

    def _stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        return side_stream(self._streams, device, self._after)

    def _read(
        self,
        fd: int,
        offset: int,
        n: int,
        device: torch.device,
        what: str,
        check: Optional[Callable[[int, memoryview], None]] = None,
        at: int = 0,
    ) -> Tuple[_Slot, torch.Tensor]:
        """The next free slot, its first ``n`` bytes read from the file at ``offset``; with
        ``check``, read piece by piece and each piece passed to ``check(at + its position,
        bytes)`` right after its read, while it is in cache."""
        slot = self._slot(device)
        host = slot.buf[:n]
        view = byte_view(host)
        if check is None:
            pread_exact(fd, view, offset, what)
            return slot, host
        for p in range(0, n, CRC_PIECE):
            piece = view[p : p + CRC_PIECE]
            pread_exact(fd, piece, offset + p, what)
            check(at + p, piece)
        return slot, host

    @staticmethod
    def _mark(slot: _Slot, stream: torch.cuda.Stream) -> None:
        """The slot is free again once what ``stream`` has queued so far is done."""
        slot.event = torch.cuda.Event()
        slot.event.record(stream)

    def fill(
        self,
        fd: int,
        offset: int,
        dst: torch.Tensor,
        what: str,
        check: Optional[Callable[[int, memoryview], None]] = None,
    ) -> None:
        """Fill ``dst`` with its bytes from the file at ``offset``; ``check(position, bytes)``
        (optional) sees every piece as it is read, before it is copied to the device."""
        target = dst.detach().reshape(-1).view(torch.uint8)
        total = target.numel()
        on_cuda = dst.device.type == "cuda"
        stream = self._stream(dst.device)
        pos = 0
        while pos < total:
            n = min(self.slot_bytes, total - pos)
            slot, host = self._read(fd, offset + pos, n, dst.device, what, check, pos)
            if on_cuda:
                with torch.cuda.stream(stream):
                    target[pos : pos + n].copy_(host, non_blocking=True)
                    self._mark(slot, stream)
            else:
                target[pos : pos + n].copy_(host)
            pos += n

    def fill_boxes(
        self, fd: int, offset: int, dtype: torch.dtype, boxes: Sequence[Box], what: str
    ) -> List[Box]:
        """Copy each box of the item whose element 0 is at byte ``offset`` (elements of
        ``dtype``) into its ``dst``, whole item rows at a time; all ``dst`` on one device.
        Returns the boxes it cannot serve that way (to be copied otherwise): boxes of one axis,
        boxes of another row length than the first, or rows larger than a slot."""
        if not boxes:
            return []
        row = boxes[0].strides[0] if len(boxes[0].size) > 1 else 0
        itemsize = dtype.itemsize
        served, rest = [], []
        for b in boxes:
            fits = (
                len(b.size) > 1
                and b.strides[0] == row
                and row > 0
                and row * itemsize <= self.slot_bytes
                and b.start % row + (b.end - b.start - (b.size[0] - 1) * row) <= row
                and b.dst.device == boxes[0].dst.device
            )
            (served if fits else rest).append(b)
        if not served:
            return rest
        device = served[0].dst.device
        stream = self._stream(device)
        per_window = self.slot_bytes // (row * itemsize)
        first_row = min(b.start // row for b in served)
        stop_row = max((b.end - 1) // row for b in served) + 1
        stop_element = max(b.end for b in served)
        for r in range(first_row, stop_row, per_window):
            r_end = min(r + per_window, stop_row)
            n = (min(r_end * row, stop_element) - r * row) * itemsize
            slot, host = self._read(fd, offset + r * row * itemsize, n, device, what)
            if stream is not None:
                with torch.cuda.stream(stream):
                    scratch = self._scratch.get(device)
                    if scratch is None:
                        scratch = self._scratch[device] = torch.empty(
                            self.slot_bytes, dtype=torch.uint8, device=device
                        )
                    window = scratch[:n]
                    window.copy_(host, non_blocking=True)
                    self._cut(window.view(dtype), served, r, r_end, row)
                    self._mark(slot, stream)
            else:
                self._cut(host.view(dtype), served, r, r_end, row)
        return rest

    @staticmethod
    def _cut(window: torch.Tensor, boxes: Sequence[Box], r: int, r_end: int, row: int) -> None:
        """Copy the rows ``[r, r_end)`` of the item (held by ``window``) that fall in each box."""
        for b in boxes:
            b_row = b.start // row
            lo, hi = max(0, r - b_row), min(b.size[0], r_end - b_row)
            if lo >= hi:
                continue
            src = window.as_strided(
                (hi - lo,) + tuple(b.size[1:]),
                b.strides,
                window.storage_offset() + b.start + lo * row - r * row,
            )
            b.dst[lo:hi].copy_(src, non_blocking=True)

    def close(self) -> None:
        """Wait for every copy in flight, then hand the slots back to the pool."""
        slots, streams = self._slots, self._streams
        self._slots, self._streams, self._scratch = [], {}, {}
        for stream in streams.values():
            stream.synchronize()  # if this raises, the slots are not reused: a copy may be running
        for slot in slots:
            _give(slot.buf, self._pinned)


class DeviceToHost:
    """One writer thread's slots for a save: the bytes of a sequence of tensors, handed out in
    order as host pieces, the next pieces' copies running while the caller writes the current one
    (the save-direction counterpart of :class:`HostBounce`).

    :meth:`pieces` walks the tensors' bytes in slot-sized pieces; several tensors smaller than
    the room left in a slot share it, a larger one starts a fresh slot, so every piece of a tensor
    but its last is ``slot_bytes`` long and starts at a multiple of ``slot_bytes`` of its bytes
    (``slot_bytes`` is a multiple of :data:`PIECE_ALIGN`: the writer's per-block CRC32Cs come out
    as for the whole tensor). For CUDA tensors the slots are pinned and filled on a side stream,
    each slot's copies followed by an event the writer waits for; a slot is refilled once the
    writer is done with it. For CPU tensors (the tests run this path without a GPU) the same walk
    makes plain copies into unpinned slots. Host memory: at most ``slots * slot_bytes``;
    :meth:`close` waits for the copies in flight and hands the slots back to the process-wide pool.
    """

    def __init__(
        self,
        slot_bytes: int = SLOT_BYTES,
        slots: int = SLOTS,
        after: Optional[Dict[torch.device, torch.cuda.Stream]] = None,
    ):
        if slot_bytes < PIECE_ALIGN or slot_bytes % PIECE_ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {PIECE_ALIGN}, got {slot_bytes}")
        self.slot_bytes = int(slot_bytes)
        self.count = max(1, int(slots))
        self._free: List[_Slot] = []
        self._held: List[Tuple[_Slot, bool]] = []  # every slot taken: (slot, pinned)
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._after = after  # the caller's streams (see side_stream), when made in another thread

    def _stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        return side_stream(self._streams, device, self._after)

    def _slot(self, pinned: bool) -> _Slot:
        for i, slot in enumerate(self._free):
            if slot.pinned or not pinned:  # a CPU tensor's bytes may go through a pinned slot too
                return self._free.pop(i)
        slot = _Slot(_take(self.slot_bytes, pinned), pinned)
        self._held.append((slot, pinned))
        _count_slot(self.slot_bytes)
        return slot

    def pieces(self, tensors: Sequence[torch.Tensor]) -> Iterator[Tuple[int, int, memoryview]]:
        """``(index, position, bytes)`` for every piece of every tensor (each contiguous), in
        order; a piece's bytes are valid until the next piece is asked for."""
        flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        todo = deque((i, 0) for i, t in enumerate(flat) if t.numel())
        filled: Deque[Tuple[_Slot, List[Tuple[int, int, int, int]]]] = deque()

        def fill() -> bool:
            """Start the copies of the next slot; False when every byte has been started."""
            if not todo:
                return False
            device = flat[todo[0][0]].device
            slot = self._slot(device.type == "cuda")
            stream = self._stream(device)
            entries, used = [], 0
            while todo and used < self.slot_bytes:
                i, pos = todo[0]
                src = flat[i]
                left = src.numel() - pos
                if src.device != device or (used and left > self.slot_bytes - used):
                    break  # another device, or a tensor that does not fit the room left: next slot
                n = min(left, self.slot_bytes - used)
                dst = slot.buf[used : used + n]
                if stream is not None:
                    with torch.cuda.stream(stream):
                        dst.copy_(src[pos : pos + n], non_blocking=True)
                else:
                    dst.copy_(src[pos : pos + n])
                entries.append((i, pos, used, n))
                used += n
                todo.popleft()
                if pos + n < src.numel():
                    todo.appendleft((i, pos + n))
                    break  # a tensor larger than the slot: its next piece starts the next slot
            if stream is not None:
                HostBounce._mark(slot, stream)
            filled.append((slot, entries))
            return True

        while len(filled) < self.count and fill():
            pass
        while filled:
            slot, entries = filled.popleft()
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None
            view = byte_view(slot.buf)
            for i, pos, at, n in entries:
                yield i, pos, view[at : at + n]
            self._free.append(slot)
            while len(filled) < self.count and fill():
                pass

    def close(self) -> None:
        """Wait for every copy in flight, then hand the slots back to the pool."""
        held, streams = self._held, self._streams
        self._held, self._free, self._streams = [], [], {}
        for stream in streams.values():
            stream.synchronize()  # if this raises, the slots are not reused: a copy may be running
        for slot, pinned in held:
            _count_slot(-self.slot_bytes)
            _give(slot.buf, pinned)


_slot_bytes_lock = threading.Lock()
_slot_bytes_live = 0
_slot_bytes_peak = 0


def _count_slot(delta: int) -> None:
    global _slot_bytes_live, _slot_bytes_peak
    with _slot_bytes_lock:
        _slot_bytes_live += delta
        _slot_bytes_peak = max(_slot_bytes_peak, _slot_bytes_live)


def save_slot_bytes(reset_peak: bool = False) -> Tuple[int, int]:
    """(bytes, peak bytes) of :class:`DeviceToHost` slots held by saves in this process now and
    since the last reset; ``reset_peak`` starts a new peak from now."""
    global _slot_bytes_peak
    with _slot_bytes_lock:
        out = (_slot_bytes_live, _slot_bytes_peak)
        if reset_peak:
            _slot_bytes_peak = _slot_bytes_live
        return out


def is_plain(t: torch.Tensor) -> bool:
    """A plain tensor or parameter, not a subclass (e.g. an FP8 wrapper with a scale)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def needs_staging(t: torch.Tensor) -> bool:
    """True if copies cannot go into ``t`` directly (subclass, e.g. FP8 wrappers, or non-contiguous)."""
    return not is_plain(t) or not t.is_contiguous()
