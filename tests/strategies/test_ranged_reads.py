"""Resharded loads from object stores: ranged reads of the blocks they need, each checked against
its CRC32C (per-block tables ``__R_B.distcp.crc``; see distckpt/formats/blockcrc.py)."""

from __future__ import annotations

import os
import re

import google_crc32c
import numpy as np
import pytest
import torch

import distckpt
from distckpt import CheckpointingException
from distckpt import dist as ddist
from distckpt.formats import blockcrc
from distckpt.formats.manifest import read_manifest, verify_files
from distckpt.storage import open_store
from distckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from tests.support.clouds import clouds
from tests.support.harness import expect_all_ranks_raise, run_ranks

ROWS, COLS = 1024, 1024  # one rank's saved item: 4 MiB of float32, 16 blocks of 256 KiB


def _full(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(2 * ROWS, COLS, generator=g)


def _save_rows(url):
    """Two ranks, each saving one half (by rows) of ``w`` and ``v`` plus a small bias."""
    r, world = ddist.get_rank(), ddist.get_world_size()
    sd = {
        k: distckpt.ShardedTensor.from_rank_offsets(
            k, _full(k)[r * ROWS : (r + 1) * ROWS].clone(), (0, r, world)
        )
        for k in ("w", "v")
    }
    sd["b"] = distckpt.ShardedTensor.from_rank_offsets("b", torch.arange(16.0), replica_id=r)
    distckpt.save(sd, url, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=1))


def _load_interleaved(url):
    """Four row pieces, rank r taking pieces r and r + 2: half of every saved item each."""
    r = ddist.get_rank()
    rows = ROWS // 2
    sd, want = {}, {}
    for k in ("w", "v"):
        for p in (r, r + 2):
            sd[f"{k}{p}"] = distckpt.ShardedTensor.from_rank_offsets(k, torch.zeros(rows, COLS), (0, p, 4))
            want[f"{k}{p}"] = _full(k)[p * rows : (p + 1) * rows]
    strategy = TorchDistLoadShardedStrategy()
    loaded = distckpt.load(sd, url, sharded_strategy=strategy)
    wrong = [name for name, t in want.items() if not torch.equal(loaded[name], t)]
    wanted = sum(t.numel() * t.element_size() for t in want.values())
    return wrong, wanted, strategy.bytes_read


@pytest.fixture
def served(monkeypatch):
    """Every ranged GET moto serves: (object path, bytes sent). A spy on the real server."""
    from moto.s3.responses import S3Response

    log = []
    original = S3Response._handle_range_header

    def spy(self, request, response_headers, response_content):
        status, headers, body = original(self, request, response_headers, response_content)
        if request.method == "GET":
            log.append((request.path, len(body)))
        return status, headers, body

    monkeypatch.setattr(S3Response, "_handle_range_header", spy)
    return log


def test_a_resharded_load_on_s3_fetches_only_the_blocks_it_needs(s3_url, served):
    run_ranks(2, _save_rows, s3_url)
    names = set(open_store(s3_url).list())
    assert {n for n in names if n.endswith(".crc")} == {"__0_0.distcp.crc", "__1_0.distcp.crc"}
    served.clear()
    results = run_ranks(2, _load_interleaved, s3_url)
    assert [wrong for wrong, _, _ in results] == [[], []]
    wanted = sum(w for _, w, _ in results)
    data = sum(n for path, n in served if path.endswith(".distcp"))
    stored = 2 * 2 * ROWS * COLS * 4
    # Each rank needs half of each of the four items, 2 MiB starting on a block boundary of the
    # payload: the blocks fetched are the bytes wanted, with at most one block of rounding per range.
    ranges = sum(1 for path, _ in served if path.endswith(".distcp"))
    assert wanted == stored
    assert wanted <= data <= wanted + ranges * blockcrc.BLOCK_SIZE
    assert data < 0.6 * 2 * stored  # before: every item whole on both ranks (2x the bytes wanted)
    # The counter the bench reports agrees with the server: data + the tables.
    assert sum(b for _, _, b in results) >= data


@pytest.mark.parametrize("cloud", clouds())
def test_a_resharded_load_on_any_cloud_reads_the_blocks_it_needs_not_the_whole_items(cloud_url):
    """The same reshard on each cloud's server, by distckpt's own count of the bytes it fetched
    (data and block tables): about the bytes wanted, not the whole items (2x)."""
    run_ranks(2, _save_rows, cloud_url)
    results = run_ranks(2, _load_interleaved, cloud_url)
    assert [wrong for wrong, _, _ in results] == [[], []]
    stored = 2 * 2 * ROWS * COLS * 4
    assert sum(w for _, w, _ in results) == stored
    assert sum(read for _, _, read in results) < 0.6 * 2 * stored


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_flipped_byte_in_a_block_a_ranged_read_needs_is_caught(cloud_url):
    run_ranks(2, _save_rows, cloud_url)
    store = open_store(cloud_url)
    table = blockcrc.decode(store.get("__1_0.distcp.crc"), "t")
    entry = min(table.entries.values(), key=lambda e: e.item_offset)
    data = bytearray(store.get("__1_0.distcp"))
    # Rank 0 needs the first half of rank 1's items (piece 2): flip a byte in block 3 of the first.
    at = entry.item_offset + entry.payload_offset + 3 * table.block + 5
    data[at] ^= 0x01
    store.put("__1_0.distcp", bytes(data))
    expect_all_ranks_raise(
        2,
        _load_interleaved,
        cloud_url,
        match=r"key '[wv]' in \w+://.*__1_0\.distcp at offset \d+ \(rank 0\): CRC32C "
        r"mismatch in block 3",
    )


@pytest.mark.parametrize("damage", ["removed", "corrupted", "stale"])
@pytest.mark.parametrize("cloud", clouds("s3"))
def test_without_a_usable_block_table_items_are_read_whole_and_checked(cloud_url, damage):
    """Checkpoints written before block tables (and Megatron's) have none; a damaged or stale one
    is never believed. Either way the load reads whole items, checks them, and is bit-exact."""
    run_ranks(2, _save_rows, cloud_url)
    store = open_store(cloud_url)
    for name in ("__0_0.distcp.crc", "__1_0.distcp.crc"):
        raw = bytearray(store.get(name))
        if damage == "removed":
            store.delete(name)
            continue
        if damage == "corrupted":
            raw[40] ^= 0xFF
        else:  # a table of other bytes at the same offsets (an older save's, left on the store)
            t = blockcrc.decode(raw, name)
            for e in t.entries.values():
                e.blocks = [c ^ 1 for c in e.blocks]
            raw = blockcrc.encode(list(t.entries.values()), t.block)
        store.put(name, bytes(raw))
    results = run_ranks(2, _load_interleaved, cloud_url)
    assert [wrong for wrong, _, _ in results] == [[], []]
    whole = 2 * ROWS * COLS * 4 * 2  # each rank reads both files' two items whole
    assert all(read >= whole for _, _, read in results)


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_flipped_byte_is_still_caught_when_items_are_read_whole(cloud_url):
    run_ranks(2, _save_rows, cloud_url)
    store = open_store(cloud_url)
    store.delete("__1_0.distcp.crc")
    data = bytearray(store.get("__1_0.distcp"))
    data[len(data) // 4] ^= 0x01
    store.put("__1_0.distcp", bytes(data))
    expect_all_ranks_raise(2, _load_interleaved, cloud_url, match="CRC32C mismatch against the manifest")


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_removing_keys_on_an_object_store_carries_the_block_tables_of_rewritten_files(cloud_url):
    run_ranks(2, _save_rows, cloud_url)
    distckpt.remove_sharded_tensors(cloud_url, "v")
    store = open_store(cloud_url)
    names = set(store.list())
    manifest = read_manifest(store)
    assert verify_files(store, manifest) == []
    tables = sorted(n for n in names if n.endswith(".crc"))
    assert len(tables) == 2 and all(".r" in n for n in tables)  # regenerated beside the new files
    assert set(tables) <= set(manifest.files)
    for name in tables:
        t = blockcrc.decode(store.get(name), name)
        ranges = {r.offset: r for r in manifest.ranges[name[: -len(blockcrc.SUFFIX)]]}
        assert [ranges[e.item_offset].crc32c for e in t.entries.values()] == [
            e.item_crc for e in t.entries.values()
        ]


def test_removing_keys_locally_keeps_tables_consistent(tmp_path):
    w = torch.randn(512, 1024)
    sd = {k: distckpt.ShardedTensor.from_rank_offsets(k, w + i) for i, k in enumerate(("a.w", "b.w"))}
    distckpt.save(sd, tmp_path, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=1))
    assert (tmp_path / "__0_0.distcp.crc").exists()
    distckpt.remove_sharded_tensors(tmp_path, "a.")
    manifest = read_manifest(tmp_path)
    assert verify_files(tmp_path, manifest) == []
    tables = sorted(p.name for p in tmp_path.glob("*.crc"))
    assert tables == ["__0_0.r1.distcp.crc"] and tables[0] in manifest.files
    t = blockcrc.decode((tmp_path / tables[0]).read_bytes(), tables[0])
    (e,) = t.entries.values()
    assert e.item_offset == 0 and e.combined(t.block) == e.item_crc


# --------------------------------------------------------------------------- units


def _reference(data) -> int:
    """CRC32C from another library (Google's C implementation, which zarr brings)."""
    return google_crc32c.value(bytes(data))


def test_crc32c_matches_the_rfc_3720_vectors_and_an_independent_implementation():
    from distckpt.formats.manifest import crc32c

    # RFC 3720, appendix B.4
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(b"") == 0
    rng = np.random.default_rng(0)
    for n in (1, 15, 16 << 10, (16 << 10) + 3, 1 << 20, (3 << 20) + 5):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        expected = _reference(a.tobytes())
        # any buffer: numpy arrays, writable memoryviews of other formats, bytearrays
        assert crc32c(a) == crc32c(memoryview(a)) == crc32c(bytearray(a.tobytes())) == expected
        if n % 4 == 0:
            assert crc32c(memoryview(a).cast("f")) == expected
        cut = n // 3
        assert crc32c(memoryview(a)[cut:], crc32c(memoryview(a)[:cut])) == expected  # continued


@pytest.mark.parametrize("n", [0, 1, 63, 4096, blockcrc.BLOCK_SIZE, blockcrc.BLOCK_SIZE + 17, 3 << 20])
def test_crc32c_combine_matches_the_crc_of_the_concatenation(n):
    a, b = os.urandom(1000), os.urandom(n)
    assert blockcrc.combine(_reference(a), _reference(b), n) == _reference(a + b)


def test_the_writer_records_block_crcs_that_add_up_to_the_item_crc(tmp_path):
    t = torch.randn(3 * blockcrc.BLOCK_SIZE // 4 + 11)  # three blocks and a bit
    distckpt.save({"t": distckpt.ShardedTensor.from_rank_offsets("t", t)}, tmp_path)
    table = blockcrc.decode((tmp_path / "__0_0.distcp.crc").read_bytes(), "t")
    (e,) = table.entries.values()
    raw = (tmp_path / "__0_0.distcp").read_bytes()[e.item_offset : e.item_offset + e.item_length]
    payload = raw[e.payload_offset : e.payload_offset + e.payload_length]
    assert payload == t.numpy().tobytes() and e.dtype == torch.float32
    assert e.blocks == [_reference(payload[i : i + table.block]) for i in range(0, len(payload), table.block)]
    assert e.item_crc == _reference(raw) == e.combined(table.block)
    ranges = read_manifest(tmp_path).ranges["__0_0.distcp"]
    assert [r.crc32c for r in ranges if r.offset == e.item_offset] == [e.item_crc]


@pytest.mark.parametrize("cut", ["truncated", "count", "crc", "block", "payload"])
def test_hostile_block_tables_are_refused_with_a_clear_error(cut):
    import struct

    e = blockcrc.Entry(0, 3 << 20, 7, 512, 1 << 20, 1, 2, torch.float32, [5, 6, 7, 8])
    raw = bytearray(blockcrc.encode([e]))

    def resealed(b: bytearray) -> bytes:
        b[-4:] = struct.pack("<I", _reference(bytes(b[:-4])))
        return bytes(b)

    if cut == "truncated":
        bad = bytes(raw[:30])
    elif cut == "count":
        struct.pack_into("<I", raw, 16, 1 << 30)
        bad = resealed(raw)
    elif cut == "crc":
        raw[25] ^= 1
        bad = bytes(raw)
    elif cut == "block":
        struct.pack_into("<I", raw, 12, 3)
        bad = resealed(raw)
    else:  # a payload past the item's end
        struct.pack_into("<Q", raw, 20 + 20, 1 << 40)
        bad = resealed(raw)
    with pytest.raises(CheckpointingException, match=re.escape("src.crc")):
        blockcrc.decode(bad, "src.crc")


def test_spans_cover_exactly_the_elements_a_box_touches():
    # rows 1..2, columns 2..4 of a 4 x 6 item: two runs of 3 elements
    assert blockcrc.spans(8, (2, 3), (6, 1), gap=1) == [(8, 11), (14, 17)]
    assert blockcrc.spans(8, (2, 3), (6, 1), gap=4) == [(8, 17)]  # closer than the gap: merged
    assert blockcrc.block_runs([(0, 10), (25, 30), (95, 100)], 10, 10, 0) == [(0, 1), (2, 3), (9, 10)]
    assert blockcrc.block_runs([(0, 10), (25, 30), (95, 100)], 10, 10, 1) == [(0, 3), (9, 10)]
    assert blockcrc.block_runs([(0, 10), (25, 30)], 10, 10, 2) == [(0, 3)]


@pytest.mark.parametrize("damage", ["none", "stale", "blocks"])
def test_verify_checks_block_tables_against_the_items_they_describe(tmp_path, damage):
    """A table whose own bytes match the manifest (as after a faulty rewrite by a tool that also
    rewrote the manifest) but whose entries disagree with the items is a problem for verify."""
    from distckpt.formats.manifest import RangeChecksum, crc32c, read_manifest, write_manifest
    from distckpt.tools import verify

    ckpt = tmp_path / "ckpt"
    run_ranks(2, _save_rows, str(ckpt))
    name = "__1_0.distcp.crc"
    if damage != "none":
        t = blockcrc.decode((ckpt / name).read_bytes(), name)
        for e in t.entries.values():
            if damage == "stale":
                e.item_crc ^= 1  # another save's item at the same offset
            else:
                e.blocks[3] ^= 1  # block CRCs that no longer add up to the item's
        raw = blockcrc.encode(list(t.entries.values()), t.block)
        (ckpt / name).write_bytes(raw)
        manifest = read_manifest(ckpt)
        manifest.files[name] = len(raw)
        manifest.ranges[name] = [RangeChecksum(0, len(raw), crc32c(raw), name)]
        write_manifest(ckpt, manifest)
    report = verify.verify_checkpoint(ckpt)
    if damage == "none":
        assert report.ok, report.problems
        assert any("2 block CRC tables (4 items)" in c for c in report.checked), report.checked
    elif damage == "stale":
        assert len(report.problems) == 2 and all(
            name in p and "stale" in p and "key " in p for p in report.problems
        ), report.problems
    else:
        assert len(report.problems) == 2 and all(
            name in p and "do not add up" in p for p in report.problems
        ), report.problems
