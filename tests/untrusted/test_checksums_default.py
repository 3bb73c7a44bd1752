"""Checksums on by default (issue #34, items 4 and 5).

A default ``load`` checks the CRC32C of every byte it copies (whole items, and the block CRC
tables for partial reads), both backends; ``verify=False`` opts out; checkpoints without a
manifest load as before. ``verify=True`` and ``distckpt verify`` cross-check the metadata's
claims (storage records, dtypes) against what the manifest says the writer wrote.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import ShardedTensor
from distckpt.cli import main as cli_main
from distckpt.core import CheckpointingException
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.manifest import MANIFEST_FNAME, read_manifest, write_manifest
from distckpt.strategies.torch import METADATA_FNAME
from tests.support import faults

ROWS, COLS = 512, 512  # 1 MiB of float32: the item gets a block CRC table entry (4 blocks)


def _full(key: str) -> torch.Tensor:
    seed = sum(map(ord, key))
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 + seed


def _save(path: Path, backend: str) -> Path:
    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k)) for k in ("w", "b")}
    distckpt.save(sd, path, sharded_strategy=(backend, 1))
    return path


def _load_whole(path: Path, **kwargs) -> dict:
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(ROWS, COLS)) for k in ("w", "b")}
    return distckpt.load(sd, path, **kwargs)


def _load_part(path: Path, columns: bool, **kwargs) -> torch.Tensor:
    """The second half of ``w`` (rows, or columns: a strided box), as a 2-way split would load it."""
    axis = 1 if columns else 0
    shape = (ROWS, COLS // 2) if columns else (ROWS // 2, COLS)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(shape), (axis, 1, 2))}
    return distckpt.load(sd, path, validate_access_integrity=False, **kwargs)["w"]


def _expected_part(columns: bool) -> torch.Tensor:
    return _full("w")[:, COLS // 2 :] if columns else _full("w")[ROWS // 2 :]


def _data_byte(path: Path, backend: str, element: int):
    """(file, byte offset) of float element ``element`` of ``w`` (row-major)."""
    if backend == "zarr":
        return path / "w" / "c" / "0" / "0", 4 * element
    name, r = faults.item_range(path, "w")
    middle = faults.tensor_bytes_middle(path, "w")[1]
    start = middle - 4 * (ROWS * COLS // 2)  # the tensor bytes' first byte
    return path / name, start + 4 * element


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def _relist(path: Path, name: str) -> None:
    """Make the manifest agree with file ``name`` as it is now (a buggy writer or an edit)."""
    manifest = read_manifest(path)
    manifest.set_bytes(name, (path / name).read_bytes())
    write_manifest(path, manifest)


def _drop_sidecar(path: Path) -> None:
    (path / INDEX_FNAME).unlink(missing_ok=True)
    manifest = read_manifest(path)
    manifest.drop(INDEX_FNAME)
    write_manifest(path, manifest)


def _cli_verify(path: Path):
    return CliRunner().invoke(cli_main, ["verify", str(path)])


# --------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_default_load_detects_a_flipped_byte_in_a_whole_item_read(tmp_path, backend):
    path = _save(tmp_path / "ckpt", backend)
    file, offset = _data_byte(path, backend, ROWS * COLS // 2 + 7)
    _flip(file, offset)
    with pytest.raises(
        CheckpointingException, match=rf"(?=.*{re.escape(str(file))})(?=.*'w')(?=.*CRC32C mismatch)"
    ):
        _load_whole(path)
    # The explicit opt-out checks nothing: the damaged value loads.
    out = _load_whole(path, verify=False)
    assert not torch.equal(out["w"], _full("w"))
    assert torch.equal(out["b"], _full("b"))


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_default_load_detects_a_flipped_byte_in_a_partial_read(tmp_path, backend, columns):
    path = _save(tmp_path / "ckpt", backend)
    assert torch.equal(_load_part(path, columns), _expected_part(columns))
    # An element inside the loaded half: last row, last column.
    file, offset = _data_byte(path, backend, ROWS * COLS - 1)
    _flip(file, offset)
    match = rf"(?=.*{re.escape(str(file))})(?=.*'w')(?=.*CRC32C mismatch)"
    if backend == "torch_dist":
        match += r"(?=.*block 3 .*\.distcp\.crc)"  # checked against the block table, not read whole
    with pytest.raises(CheckpointingException, match=match):
        _load_part(path, columns)
    assert not torch.equal(_load_part(path, columns, verify=False), _expected_part(columns))


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_a_checkpoint_without_a_manifest_loads_by_default(tmp_path, backend):
    path = _save(tmp_path / "ckpt", backend)
    (path / MANIFEST_FNAME).unlink()
    out = _load_whole(path)
    assert torch.equal(out["w"], _full("w")) and torch.equal(out["b"], _full("b"))
    assert torch.equal(_load_part(path, True), _expected_part(True))


def test_a_partial_read_with_a_damaged_block_table_falls_back_to_the_whole_item(tmp_path):
    path = _save(tmp_path / "ckpt", "torch_dist")
    name, _ = faults.item_range(path, "w")
    table = path / (name + ".crc")
    _flip(table, 40)
    assert torch.equal(_load_part(path, True), _expected_part(True))


BLOCK = 256 << 10  # the block of the manifest's block CRC32Cs: 128 rows of ``w``
BLOCK_ROWS = BLOCK // (4 * COLS)


def _load_rows(path: Path, piece: int, **kwargs) -> torch.Tensor:
    """Rows ``[piece * 128, (piece + 1) * 128)`` of ``w``: piece ``piece`` of a 4-way row split."""
    sd = {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.zeros(BLOCK_ROWS, COLS), (0, piece, ROWS // BLOCK_ROWS)
        )
    }
    return distckpt.load(sd, path, validate_access_integrity=False, **kwargs)["w"]


def _chunk_reads(monkeypatch, chunk: Path) -> list:
    """(offset, bytes) of every ``preadv`` of file ``chunk`` from now on."""
    reads, original = [], os.preadv

    def counting(fd, buffers, offset):
        n = original(fd, buffers, offset)
        if os.readlink(f"/proc/self/fd/{fd}") == str(chunk):
            reads.append((offset, n))
        return n

    monkeypatch.setattr(os, "preadv", counting)
    return reads


def test_zarr_partial_default_load_reads_and_checks_only_the_touched_blocks(tmp_path, monkeypatch):
    path = _save(tmp_path / "ckpt", "zarr")
    chunk = path / "w" / "c" / "0" / "0"
    expected = _full("w")[2 * BLOCK_ROWS : 3 * BLOCK_ROWS]
    reads = _chunk_reads(monkeypatch, chunk)
    assert torch.equal(_load_rows(path, 2), expected)
    # Block 2 of the 1 MiB chunk file, straight into place: not the chunk whole.
    assert sum(n for _, n in reads) == BLOCK and all(2 * BLOCK <= o < 3 * BLOCK for o, _ in reads), reads
    # Damage in an untouched block (3) does not stop the load; verify=True reads the chunk whole
    # and finds it.
    _flip(chunk, 3 * BLOCK + 100)
    assert torch.equal(_load_rows(path, 2), expected)
    with pytest.raises(CheckpointingException, match=r"CRC32C mismatch against the manifest"):
        _load_rows(path, 2, verify=True)
    # Damage in the touched block is caught, naming file, key, block and where its CRC32C is.
    _flip(chunk, 2 * BLOCK + 100)
    match = (
        rf"(?=.*{re.escape(str(chunk))})(?=.*'w')(?=.*CRC32C mismatch in block 2 )"
        rf"(?=.*{re.escape(MANIFEST_FNAME)})"
    )
    with pytest.raises(CheckpointingException, match=match):
        _load_rows(path, 2)
    # Half of every row needs every block of this small chunk: it is read whole and checked.
    whole = rf"(?=.*{re.escape(str(chunk))})(?=.*'w')(?=.*CRC32C mismatch against the manifest)"
    with pytest.raises(CheckpointingException, match=whole):
        _load_part(path, True)


@pytest.mark.parametrize("how", ["older manifest", "stale entry"])
def test_zarr_partial_load_without_usable_block_crcs_reads_the_chunk_whole(tmp_path, monkeypatch, how):
    path = _save(tmp_path / "ckpt", "zarr")
    raw = json.loads((path / MANIFEST_FNAME).read_text())
    if how == "older manifest":
        raw.pop("blocks")  # as distckpt wrote it before block CRC32Cs
    else:
        raw["blocks"]["w/c/0/0"][1] ^= 1  # not the CRC32C the manifest lists for the file
    (path / MANIFEST_FNAME).write_text(json.dumps(raw))
    chunk = path / "w" / "c" / "0" / "0"
    reads = _chunk_reads(monkeypatch, chunk)
    assert torch.equal(_load_rows(path, 2), _full("w")[2 * BLOCK_ROWS : 3 * BLOCK_ROWS])
    assert sum(n for _, n in reads) == ROWS * COLS * 4
    _flip(chunk, 3 * BLOCK + 100)  # checked against the whole file's CRC32C
    with pytest.raises(CheckpointingException, match=rf"{re.escape(str(chunk))}.*CRC32C mismatch"):
        _load_rows(path, 2)


def test_distckpt_verify_checks_the_zarr_block_crcs(tmp_path):
    path = _save(tmp_path / "ckpt", "zarr")
    assert _cli_verify(path).exit_code == 0
    raw = json.loads((path / MANIFEST_FNAME).read_text())
    packed = bytearray(base64.b64decode(raw["blocks"]["w/c/0/0"][2]))
    packed[4 * 2] ^= 1  # block 2's CRC32C, the file intact
    raw["blocks"]["w/c/0/0"][2] = base64.b64encode(bytes(packed)).decode()
    (path / MANIFEST_FNAME).write_text(json.dumps(raw))
    result = _cli_verify(path)
    assert result.exit_code == 1, result.output
    assert "w/c/0/0" in result.output and "block CRC32Cs of blocks [2]" in result.output


# --------------------------------------------------------------------------- item 4


def _swap_records(path: Path) -> None:
    """Swap the storage records of the same-sized keys ``w`` and ``b`` in ``.metadata``, the
    manifest kept consistent with the damaged file."""
    md = pickle.loads((path / METADATA_FNAME).read_bytes())
    idx = {i.fqn: i for i in md.storage_data}
    md.storage_data[idx["w"]], md.storage_data[idx["b"]] = (
        md.storage_data[idx["b"]],
        md.storage_data[idx["w"]],
    )
    (path / METADATA_FNAME).write_bytes(pickle.dumps(md))
    _relist(path, METADATA_FNAME)
    _drop_sidecar(path)


def test_swapped_storage_records_are_an_error_naming_both_files(tmp_path):
    path = _save(tmp_path / "ckpt", "torch_dist")
    _swap_records(path)
    both = rf"(?=.*{re.escape(METADATA_FNAME)})(?=.*{re.escape(MANIFEST_FNAME)})(?=.*'w')"
    for kwargs in ({"verify": True}, {}):  # the default's cheap cross-check catches it too
        with pytest.raises(CheckpointingException, match=both):
            _load_whole(path, **kwargs)
    result = _cli_verify(path)
    assert result.exit_code == 1, result.output
    assert METADATA_FNAME in result.output and MANIFEST_FNAME in result.output


def test_zarr_json_with_the_wrong_dtype_is_an_error_naming_both_files(tmp_path):
    path = _save(tmp_path / "ckpt", "zarr")
    meta_file = path / "w" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    assert meta["data_type"] == "float32"
    meta["data_type"] = "int32"
    meta["fill_value"] = 0
    meta_file.write_text(json.dumps(meta))
    _relist(path, "w/zarr.json")
    both = rf"(?=.*{re.escape(str(meta_file))})(?=.*{re.escape(MANIFEST_FNAME)})(?=.*int32)(?=.*float32)"
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS, dtype=torch.int32))}
    for kwargs in ({"verify": True}, {}):
        with pytest.raises(CheckpointingException, match=both):
            distckpt.load(sd, path, **kwargs)
    result = _cli_verify(path)
    assert result.exit_code == 1, result.output
    assert "int32" in result.output and MANIFEST_FNAME in result.output


def test_a_storage_record_of_length_zero_fails_verify(tmp_path):
    path = _save(tmp_path / "ckpt", "torch_dist")
    md = pickle.loads((path / METADATA_FNAME).read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "w")
    info = md.storage_data[index]
    md.storage_data[index] = type(info)(info.relative_path, info.offset, 0)
    (path / METADATA_FNAME).write_bytes(pickle.dumps(md))
    _relist(path, METADATA_FNAME)
    _drop_sidecar(path)
    result = _cli_verify(path)
    assert result.exit_code == 1, result.output
    assert "'w'" in result.output
    with pytest.raises(CheckpointingException, match=r"'w'"):
        _load_whole(path, verify=True)


def test_intact_checkpoints_pass_the_cross_check(tmp_path):
    for backend in ("torch_dist", "zarr"):
        path = _save(tmp_path / backend, backend)
        out = _load_whole(path, verify=True)
        assert torch.equal(out["w"], _full("w"))
        result = _cli_verify(path)
        assert result.exit_code == 0, result.output


def test_a_manifest_without_the_layout_fields_still_loads_and_verifies(tmp_path):
    path = _save(tmp_path / "ckpt", "torch_dist")
    raw = json.loads((path / MANIFEST_FNAME).read_text())
    raw.pop("keys"), raw.pop("chunks")  # as an older distckpt wrote it
    (path / MANIFEST_FNAME).write_text(json.dumps(raw))
    assert torch.equal(_load_whole(path, verify=True)["w"], _full("w"))
    assert _cli_verify(path).exit_code == 0


def test_a_zarr_load_of_many_objects_reads_the_manifest_once_and_checks_each(tmp_path, monkeypatch):
    from distckpt import ShardedObject
    from distckpt.strategies import common

    def state(value):
        return {f"o{i}": ShardedObject(f"o{i}", value, (1,), (0,), replica_id=0) for i in range(20)}

    distckpt.save(state({"x": 1}), tmp_path, sharded_strategy=("zarr", 1))
    reads = []
    real = common.read_manifest
    monkeypatch.setattr(common, "read_manifest", lambda *a, **k: reads.append(a) or real(*a, **k))
    out = distckpt.load(state(None), tmp_path)
    assert all(out[f"o{i}"] == {"x": 1} for i in range(20)) and len(reads) == 1
    faults.flip_byte(tmp_path / "o7" / "shard_0_1.pt", 40)
    with pytest.raises(
        CheckpointingException, match=r"o7/shard_0_1\.pt: contents do not match the integrity manifest"
    ):
        distckpt.load(state(None), tmp_path)


def _load_half_counting_manifest_parses(path: str):
    import torch.distributed as tdist

    from distckpt.formats import manifest

    calls = []
    real = manifest._parsed
    manifest._parsed = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        rank = tdist.get_rank()
        out = distckpt.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 8), (0, rank, 2))}, path
        )
    finally:
        manifest._parsed = real
    return len(calls), bool(torch.equal(out["w"], torch.arange(32.0).reshape(4, 8)[2 * rank : 2 * rank + 2]))


def test_in_a_group_only_the_first_rank_reads_the_manifest_and_its_verdict_reaches_all(tmp_path, run_ranks):
    from tests.support.harness import expect_all_ranks_raise

    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.arange(32.0).reshape(4, 8)), "step": 3}, tmp_path
    )
    (parses0, ok0), (parses1, ok1) = run_ranks(2, _load_half_counting_manifest_parses, str(tmp_path))
    # Rank 1 reads its share through the sidecar index and common.pt unchecked: no manifest at all.
    assert ok0 and ok1 and parses0 >= 1 and parses1 == 0, (parses0, parses1)
    torch.save({"step": 4}, tmp_path / "common.pt")  # loads fine, but is not what was written
    expect_all_ranks_raise(
        2,
        _load_half_counting_manifest_parses,
        str(tmp_path),
        match=r"common\.pt: contents do not match the integrity manifest",
    )
