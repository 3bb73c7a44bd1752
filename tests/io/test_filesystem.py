"""Byte-level I/O of ``.distcp`` items: the archive framer, the gathering sink, mapped reads."""

from __future__ import annotations

import io
import os
import re

import pytest
import torch

import distckpt
from distckpt import ShardedTensor
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import crc32c
from distckpt.strategies import filesystem as fs

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1000, 33), (300_000,)]


def _sample(dtype, shape):
    g = torch.Generator().manual_seed(7)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _torch_save_bytes(t):
    buf = io.BytesIO()
    with fs.zip_crc_disabled():
        torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_framed_archive_is_byte_identical_to_torch_save(dtype):
    for shape in SHAPES:
        t = _sample(dtype, shape)
        expected = _torch_save_bytes(t)
        sid = re.search(rb"serialization_id.*?([0-9]{40})", expected, re.S).group(1).decode()
        header, trailer = fs.tensor_archive_frame(t, sid)
        ours = header + t.reshape(-1).view(torch.uint8).numpy().tobytes() + trailer
        assert ours == expected, (dtype, shape)
        back = torch.load(io.BytesIO(ours), weights_only=True)
        assert back.dtype == t.dtype and torch.equal(back, t)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0),  # empty: torch frames it differently
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.arange(12.0)[2:],  # a view into a larger storage
        torch.ones(4).to(torch.float8_e4m3fn),  # no legacy storage class
    ],
    ids=["empty", "transposed", "offset-view", "fp8"],
)
def test_tensors_the_framer_declines_are_written_by_torch_save(tensor, tmp_path):
    assert fs.tensor_archive_frame(tensor, "0" * 40) is None
    path = tmp_path / "item"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    with fs.zip_crc_disabled():
        offset, length, crc = fs.write_tensor_item(sink, tensor)
    sink.drain()
    os.close(fd)
    data = path.read_bytes()
    assert (offset, length, crc) == (0, len(data), crc32c(data))
    back = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(back.float(), tensor.float())


def test_own_frames_are_recognised_from_their_header_and_trailer_only(tmp_path):
    t = _sample(torch.bfloat16, (64, 48))
    path = tmp_path / "item"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    offset, length, _ = fs.write_tensor_item(sink, t)
    sink.drain()
    os.close(fd)
    data = path.read_bytes()
    reads = []

    def read(at, n):
        reads.append(n)
        return data[at : at + n]

    layout = fs.framed_layout(None, (64, 48), torch.bfloat16, length, read)
    assert layout is not None and layout == fs.framed_layout(data, (64, 48), torch.bfloat16)
    assert sum(reads) < 4096 and len(reads) == 2  # the frame only, never the tensor bytes
    payload = data[layout.data_offset : layout.data_offset + layout.data_length]
    assert torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).reshape(64, 48), t)
    # Another shape, dtype or length, or torch.save's own archive (another serialization id):
    # not ours, so the caller parses the zip.
    assert fs.framed_layout(None, (48, 64), torch.bfloat16, length, read) is None
    assert fs.framed_layout(None, (64, 48), torch.float16, length, read) is None
    assert fs.framed_layout(None, (64, 48), torch.bfloat16, length + 1, read) is None
    theirs = _torch_save_bytes(t)
    assert (
        fs.framed_layout(None, (64, 48), torch.bfloat16, len(theirs), lambda a, n: theirs[a : a + n]) is None
    )
    assert fs.framed_layout(theirs, (64, 48), torch.bfloat16) is None


def test_an_own_item_is_read_into_its_destination_in_one_call_and_anything_else_declined(tmp_path):
    t = _sample(torch.bfloat16, (64, 48))
    path = tmp_path / "item"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    sink.write(b"x" * 100)  # the item does not start at the file's beginning
    offset, length, _ = fs.write_tensor_item(sink, t)
    sink.drain()
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        dest = torch.zeros(64, 48, dtype=torch.bfloat16)
        assert fs.read_framed_into(fd, offset, length, (64, 48), dest)
        assert torch.equal(dest, t)
        # Another shape, dtype, length or place: declined (the caller then parses the item).
        assert not fs.read_framed_into(
            fd, offset, length, (48, 64), torch.zeros(48, 64, dtype=torch.bfloat16)
        )
        assert not fs.read_framed_into(fd, offset, length, (64, 48), torch.zeros(64, 48, dtype=torch.float16))
        assert not fs.read_framed_into(fd, offset, length + 1, (64, 48), dest)
        assert not fs.read_framed_into(fd, offset + 1, length, (64, 48), dest)
    finally:
        os.close(fd)

    # A damaged header or trailer, or a file that ends inside the item: declined as well.
    def read_from(content: bytes) -> bool:
        (tmp_path / "other").write_bytes(content)
        fd = os.open(tmp_path / "other", os.O_RDONLY)
        try:
            return fs.read_framed_into(
                fd, offset, length, (64, 48), torch.zeros(64, 48, dtype=torch.bfloat16)
            )
        finally:
            os.close(fd)

    data = path.read_bytes()
    for damage in (offset + 3, offset + length - 5):
        bad = bytearray(data)
        bad[damage] ^= 0xFF
        assert not read_from(bytes(bad))
    assert not read_from(data[: offset + length - 1])
    assert read_from(data)  # the same bytes, undamaged: read


def test_an_own_item_in_memory_is_copied_into_its_destination_and_anything_else_declined(tmp_path):
    """The many-small-items path of a load: the file's span read once, each item's frame compared
    in place and its bytes moved straight into the destination."""
    t = _sample(torch.float32, (7, 5))
    path = tmp_path / "item"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    sink.write(b"x" * 100)
    offset, length, _ = fs.write_tensor_item(sink, t)
    sink.drain()
    os.close(fd)
    span = bytearray(path.read_bytes())

    def copy(data: bytearray, dest, size=(7, 5), at=offset, n=length) -> bool:
        return fs.copy_framed_from(memoryview(data)[at : at + n], at, size, dest)

    dest = torch.zeros(7, 5)
    assert fs.copy_framed_from(memoryview(span)[offset : offset + length], offset, (7, 5), dest)
    assert torch.equal(dest, t)
    # Another shape, dtype, length or file offset; a destination of other bytes: declined, untouched.
    for kwargs, target in [
        ({"size": (5, 7)}, torch.zeros(5, 7)),
        ({}, torch.zeros(7, 5, dtype=torch.int32)),
        ({"n": length - 1}, torch.zeros(7, 5)),
        ({"at": offset}, torch.zeros(8, 5)),
    ]:
        assert not copy(span, target, **kwargs)
        assert not target.any()
    moved = bytearray(b"y" + bytes(span))  # the same item one byte further into its file
    assert not copy(moved, torch.zeros(7, 5), at=offset + 1)
    # A damaged header or trailer: declined, the destination untouched.
    for damage in (offset + 3, offset + length - 5):
        bad = bytearray(span)
        bad[damage] ^= 0xFF
        target = torch.zeros(7, 5)
        assert not copy(bad, target) and not target.any()
    assert copy(bytearray(span), torch.zeros(7, 5))  # undamaged: copied


def test_tensor_bytes_are_aligned_to_64_bytes_of_the_file(tmp_path):
    """Items follow one another at any offset; the framer pads each record's data to a multiple
    of 64 bytes of the *file* (an unaligned kernel copy is ~30% slower), torch.load still reads
    every item on its own, and the load recognises the frame only at the offset it was built for."""
    items = [
        _sample(torch.bfloat16, (3, 5)),
        _sample(torch.float32, (7,)),
        _sample(torch.bfloat16, (64, 48)),
        _sample(torch.int64, (5, 3)),
    ]
    path = tmp_path / "file"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    records = []
    for t in items:
        records.append(fs.write_tensor_item(sink, t))
        fs.write_bytes_item(sink, b"x" * 5)  # knock the next item off any alignment
    sink.drain()
    os.close(fd)
    data = path.read_bytes()
    offsets = {offset % 64 for offset, _, _ in records}
    assert len(offsets) > 1  # the items themselves start anywhere
    for (offset, length, _), t in zip(records, items):
        item = data[offset : offset + length]
        layout = fs.framed_layout(item, tuple(t.shape), t.dtype, offset=offset)
        assert layout is not None and (offset + layout.data_offset) % 64 == 0, (offset, layout)
        assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), t)
        if offset % 64:
            # The frame of another offset is not this one: the caller would parse the zip instead.
            assert fs.framed_layout(item, tuple(t.shape), t.dtype, offset=offset + 1) is None
            assert (
                fs.read_archive_layout(lambda a, n, item=item: item[a : a + n], length).data_offset
                == layout.data_offset
            )


def test_sink_gathers_small_writes_and_counts_every_byte(tmp_path):
    """Many items, small and large: the file, the offsets and the per-item CRC32C all match
    what writing each item on its own produces."""
    items = [_sample(torch.float32, (n,)) for n in (1, 3, 40_000, 2, 300_000, 5)]
    path = tmp_path / "file"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    sink = fs.ChecksummingSink(fd)
    records = [fs.write_tensor_item(sink, t) for t in items]
    records.append(fs.write_bytes_item(sink, b"tail object"))
    sink.drain()
    os.close(fd)
    data = path.read_bytes()
    assert len(data) == sink.position
    for (offset, length, crc), t in zip(records, items):
        assert crc == crc32c(data[offset : offset + length])
        assert torch.equal(torch.load(io.BytesIO(data[offset : offset + length]), weights_only=True), t)
    offset, length, crc = records[-1]
    assert data[offset : offset + length] == b"tail object"


def _column_blocks(rows, cols, parts):
    """The whole tensor requested as ``parts`` column blocks (each one strided in the stored chunk)."""
    return {
        f"w{i}": ShardedTensor.from_rank_offsets("w", torch.zeros(rows, cols // parts), (1, i, parts))
        for i in range(parts)
    }


def test_column_block_load_is_exact_and_a_truncated_file_is_an_error(tmp_path):
    """A column block of a row-major chunk is copied out of a mapping of the file; when the
    file is shorter than the bytes mapped, that is a CheckpointingException, not a SIGBUS."""
    full = torch.arange(64 * 512, dtype=torch.float32).reshape(64, 512)
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path)
    out = distckpt.load(_column_blocks(64, 512, 4), tmp_path)
    assert torch.equal(torch.cat([out[f"w{i}"] for i in range(4)], dim=1), full)
    data = next(tmp_path.glob("*.distcp"))
    os.truncate(data, data.stat().st_size - 64 * 1024)
    with pytest.raises(CheckpointingException, match="truncated") as info:
        distckpt.load(_column_blocks(64, 512, 4), tmp_path)
    assert "'w'" in str(info.value) and data.name in str(info.value)


def test_mapping_past_the_end_of_a_file_is_refused_before_any_page_is_touched(tmp_path):
    from distckpt.strategies.torch import CopyOp, copy_from_mapping

    path = tmp_path / "short"
    path.write_bytes(bytes(10_000))
    dst = torch.empty(4, 100)
    op = CopyOp("w", 0, (4, 100), (600, 1), dst)  # rows 600 elements apart; ends at 1900
    fd = os.open(path, os.O_RDONLY)
    try:
        copy_from_mapping(fd, 0, 2500, torch.float32, [op], 0, "key 'w' in short")  # exactly fits
        assert torch.equal(dst, torch.zeros(4, 100))
        with pytest.raises(CheckpointingException, match="key 'w' in short: file is truncated"):
            copy_from_mapping(fd, 4, 2500, torch.float32, [op], 0, "key 'w' in short")
    finally:
        os.close(fd)
