"""Bounds before work, and every error a CheckpointingException naming the file (issue #34).

Each class of hostile or damaged checkpoint below once ended in a traceback, a RecursionError, a
raw OS error, a loop of minutes or gigabytes of memory. Each is now refused quickly, within the
memory budget, by a CheckpointingException (CLI: exit 1 or 2, never 3) that names the file. The
attacker is assumed to control the whole checkpoint, so each crafted one gets a matching
integrity manifest (:func:`tests.support.faults.reseal_manifest`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt.cli import main as cli_main
from distckpt.strategies.torch import TorchDistLoadShardedStrategy, read_metadata
from distckpt.tools.convert import convert_checkpoint
from distckpt.tools.sources.checkpoint import CheckpointSource
from distckpt.tools.verify import coverage_problem, verify_checkpoint
from tests.support.faults import reseal_manifest

TB = 1 << 40
DEEP = 100_000


def _save(path: Path, backend: str) -> Path:
    distckpt.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32)),
            "common": {"lr": 0.1},
        },
        path,
        sharded_strategy=(backend, 1),
    )
    return path


@pytest.fixture
def ckpt(tmp_path):
    return _save(tmp_path / "ckpt", "torch_dist")


@pytest.fixture
def zckpt(tmp_path):
    return _save(tmp_path / "zckpt", "zarr")


def _load(path: Path):
    return distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, path)


def _cli(*args, codes=(1, 2)) -> tuple:
    result = CliRunner().invoke(cli_main, [str(a) for a in args])
    assert result.exit_code in codes, (result.exit_code, result.output)  # 3 is "internal error"
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _edit_metadata(path: Path, edit) -> None:
    md = read_metadata(path)
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal_manifest(path)


def _edit_json(path: Path, edit) -> None:
    md = json.loads(path.read_text())
    edit(md)
    path.write_text(json.dumps(md))


# --------------------------------------------------------------------------- claimed sizes


def test_a_key_claiming_2_to_the_40_elements_is_refused_by_reads_before_allocating(ckpt):
    def edit(md):
        md.state_dict_metadata["w"].size = torch.Size((TB,))
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size((TB,))

    _edit_metadata(ckpt, edit)
    start = time.monotonic()
    with pytest.raises(
        CheckpointingException, match=r"\.metadata: key 'w': chunk at \[0\] of \[1099511627776\]"
    ):
        CheckpointSource(ckpt).read("w")
    report = verify_checkpoint(ckpt, deep=True)
    assert any(".metadata: key 'w'" in p for p in report.problems), report.problems
    assert time.monotonic() - start < 5
    code, out = _cli("verify", "--deep", ckpt)
    assert code == 1 and "1099511627776" in out
    _cli("show", ckpt, "w")


def test_a_zarr_grid_of_2_to_the_40_chunks_is_reported_without_looping_over_it(zckpt, tmp_path):
    _edit_json(
        zckpt / "w" / "zarr.json",
        lambda md: (md.update(shape=[TB]), md["chunk_grid"]["configuration"].update(chunk_shape=[1])),
    )
    reseal_manifest(zckpt)
    start = time.monotonic()
    report = verify_checkpoint(zckpt)
    assert any(f"w: its grid of {TB} chunks has only 1 chunk files" in p for p in report.problems), (
        report.problems
    )
    with pytest.raises(
        CheckpointingException,
        match=r"w/zarr\.json: key 'w': loading \[1099511627776\] needs|"
        r"w/zarr\.json says float32 of shape \[1099511627776\]",
    ):
        convert_checkpoint(zckpt, tmp_path / "out", "torch_dist")
    assert time.monotonic() - start < 5
    _cli("convert", zckpt, tmp_path / "out2", "--to", "zarr")


def _strips_and_columns(n: int):
    """``n`` chunks of a (n/2 + 1, n/2 + 1) tensor in two families, n/2 long rows and n/2 long
    columns, laid out so that a sweep along either axis keeps half of them active: quadratic
    for a pairwise overlap search."""
    half = n // 2
    rows = [((i, 0), (1, half)) for i in range(half)]  # rows 0..half-1, columns 0..half-1
    cols = [((0, half), (half + 1, 1))]  # the last column, whole
    cols += [((half, j), (1, 1)) for j in range(half)]  # the last row, cell by cell
    return (half + 1, half + 1), rows + cols


def test_tiling_check_of_20000_chunks_is_near_linear():
    shape, boxes = _strips_and_columns(20_000)
    start = time.monotonic()
    assert coverage_problem(shape, boxes) is None
    assert "missing data" in coverage_problem(shape, boxes[:-1])
    overlapping = boxes[:-1] + [((shape[0] - 1, 0), (1, 2))]
    assert "overlap" in coverage_problem(shape, overlapping)
    assert time.monotonic() - start < 5


def test_verify_of_20000_chunks_of_one_key_in_one_row_is_quick(ckpt):
    n = 20_000

    def edit(md):
        meta = md.state_dict_metadata["w"]
        index = next(i for i in md.storage_data if i.fqn == "w")
        info = md.storage_data.pop(index)
        meta.size = torch.Size((1, n))
        meta.chunks = [
            ChunkStorageMetadata(offsets=torch.Size((0, j)), sizes=torch.Size((1, 1))) for j in range(n)
        ]
        for j in range(n):
            md.storage_data[MetadataIndex("w", torch.Size((0, j)))] = info

    _edit_metadata(ckpt, edit)
    assert (ckpt / ".metadata").stat().st_size > 1 << 20
    start = time.monotonic()
    report = verify_checkpoint(ckpt, checksums=False)
    assert time.monotonic() - start < 10
    assert not any("cover" in p or "overlap" in p for p in report.problems), report.problems


# --------------------------------------------------------------------------- zip bomb


def _zip_bomb(inflated: int) -> bytes:
    """A torch archive whose one tensor record is ``inflated`` zero bytes, deflated: what
    ``torch.load`` would inflate in full (built streaming, never ``inflated`` bytes at once)."""
    buf = io.BytesIO()
    torch.save({"big": torch.zeros(1024, dtype=torch.uint8)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    zeros = bytes(1 << 20)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data/0"):
                with z.open(info.filename, "w", force_zip64=True) as f:
                    for _ in range(inflated >> 20):
                        f.write(zeros)
                continue
            if info.filename.endswith("data.pkl"):
                # the numel and size 1024 (BININT2) become ``inflated`` (BININT): protocol 2 has no frames
                assert data.count(b"M\x00\x04") == 2
                data = data.replace(b"M\x00\x04", b"J" + struct.pack("<i", inflated))
            z.writestr(info.filename, data)
    return out.getvalue()


_MEASURE = textwrap.dedent("""
    import sys, time, distckpt
    from distckpt.core import CheckpointingException
    def hwm():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) << 10
    before, start = hwm(), time.monotonic()
    try:
        if sys.argv[2] == "load":
            distckpt.load({}, sys.argv[1])
        else:
            distckpt.load_common_state_dict(sys.argv[1])
        print("LOADED")
    except CheckpointingException as e:
        print("REFUSED", e)
    print(hwm() - before, time.monotonic() - start)
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures VmHWM in /proc")
def test_a_zip_bomb_common_pt_is_refused_before_inflating(ckpt):
    inflated = 320 << 20
    (ckpt / "common.pt").write_bytes(_zip_bomb(inflated))
    reseal_manifest(ckpt)
    assert (ckpt / "common.pt").stat().st_size < 1 << 20
    for entry in ("load_common_state_dict", "load"):
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(ckpt), entry], capture_output=True, text=True, timeout=120
        )
        lines = proc.stdout.strip().splitlines()
        assert lines and lines[0].startswith("REFUSED"), (proc.stdout, proc.stderr)
        assert "common.pt: compressed archive entries inflate to" in lines[0]
        grew, took = lines[-1].split()
        assert int(grew) < 200 << 20 and float(took) < 5, lines
    code, out = _cli("inspect", ckpt, codes=(0, 1, 2))  # inspect shows what it can read
    assert "zip bomb" in out


def test_a_stored_archive_entry_claiming_more_than_it_holds_is_refused(ckpt):
    data = bytearray((ckpt / "common.pt").read_bytes())
    # The central directory's uncompressed size of the first entry (offset 24 of its header).
    at = data.rfind(b"PK\x01\x02")
    while data.rfind(b"PK\x01\x02", 0, at) >= 0:
        at = data.rfind(b"PK\x01\x02", 0, at)
    struct.pack_into("<I", data, at + 24, 0x7FFFFFFF)
    (ckpt / "common.pt").write_bytes(bytes(data))
    reseal_manifest(ckpt)
    with pytest.raises(
        CheckpointingException, match=r"common\.pt: stored archive entry .* claims 2147483647 bytes"
    ):
        distckpt.load_common_state_dict(ckpt)


# --------------------------------------------------------------------------- nesting


def _deep_json() -> bytes:
    return b'{"a":' * DEEP + b"1" + b"}" * DEEP


@pytest.mark.parametrize(
    "backend, name",
    [
        ("torch_dist", "metadata.json"),
        ("torch_dist", ".distckpt_manifest.json"),
        ("zarr", "zarr.json"),
        ("zarr", "w/zarr.json"),
        ("zarr", ".distckpt_manifest.json"),
    ],
)
def test_json_nested_100000_deep_is_refused_naming_the_file(tmp_path, backend, name):
    path = _save(tmp_path / "ckpt", backend)
    (path / name).write_bytes(_deep_json())
    if name != ".distckpt_manifest.json":
        reseal_manifest(path)
    with pytest.raises(CheckpointingException, match=rf"{name}: .*(nested too deeply|recursion)"):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, path, verify=True)
    if name == "metadata.json":
        assert not distckpt.check_is_distributed_checkpoint(path)
    for command in (["inspect"], ["verify"], ["convert", "--to", "zarr"]):
        extra = [tmp_path / f"out_{command[0]}"] if command[0] == "convert" else []
        code, out = _cli(command[0], path, *extra, *command[1:])
        assert name in out


def test_a_sidecar_index_nested_100000_deep_is_refused_naming_it(ckpt):
    from distckpt.formats.manifest import crc32c
    from distckpt.strategies.index import _HEADER, INDEX_FNAME, MAGIC, IndexReader

    head = _deep_json()
    (ckpt / INDEX_FNAME).write_bytes(_HEADER.pack(MAGIC, len(head), crc32c(head)) + head)
    reseal_manifest(ckpt)
    with pytest.raises(CheckpointingException, match=rf"{INDEX_FNAME}: malformed sidecar index"):
        IndexReader.open(ckpt)


def test_a_common_state_nested_100000_deep_is_refused_naming_common_pt(ckpt, tmp_path):
    # Written opcode by opcode: torch.save itself cannot pickle it (it recurses).
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pickled = b"\x80\x02}X\x01\x00\x00\x00a" + b"]" * DEEP + b"a" * (DEEP - 1) + b"s."
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(
                info.filename, pickled if info.filename.endswith("data.pkl") else src.read(info.filename)
            )
    (ckpt / "common.pt").write_bytes(out.getvalue())
    reseal_manifest(ckpt)
    for load in (distckpt.load_common_state_dict, _load):
        with pytest.raises(
            CheckpointingException, match=r"common\.pt: the unpickled state nests containers more than"
        ):
            load(ckpt)
    code, out = _cli("inspect", ckpt, codes=(0, 1, 2))  # inspect shows what it can read
    assert "common.pt: the unpickled state nests containers" in out
    _cli("diff", ckpt, ckpt)


# --------------------------------------------------------------------------- raw Python errors


def test_a_common_pt_that_is_a_directory_or_a_list_is_a_checkpointing_error(ckpt):
    os.remove(ckpt / "common.pt")
    os.mkdir(ckpt / "common.pt")
    with pytest.raises(CheckpointingException, match=r"common\.pt"):
        distckpt.load_common_state_dict(ckpt)
    os.rmdir(ckpt / "common.pt")
    torch.save([1, 2], ckpt / "common.pt")
    reseal_manifest(ckpt)
    for load in (distckpt.load_common_state_dict, _load):
        with pytest.raises(
            CheckpointingException, match=r"common\.pt: the common state is a list, not a dict"
        ):
            load(ckpt)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\xff\xfe\x00{not json", r"zarr\.json: unreadable root group metadata"),
        (b"[1, 2]", r"zarr\.json: root group metadata is a JSON list"),
        (
            json.dumps(
                {
                    "zarr_format": 3,
                    "node_type": "group",
                    "attributes": {"distckpt": {"format": "zarr", "keys": "w"}},
                }
            ).encode(),
            r"zarr\.json: root group metadata lists its array keys as str, not a list",
        ),
    ],
)
def test_a_damaged_root_zarr_json_is_an_error_naming_it_not_a_load(zckpt, content, match):
    (zckpt / "zarr.json").write_bytes(content)
    reseal_manifest(zckpt)
    for load in (_load, distckpt.load_plain_tensors):
        with pytest.raises(CheckpointingException, match=match):
            load(zckpt)
    code, out = _cli("verify", zckpt)
    assert "zarr.json" in out


def test_an_array_zarr_json_that_is_not_utf8_is_an_error_naming_it(zckpt):
    raw = bytearray((zckpt / "w" / "zarr.json").read_bytes())
    raw[5] = 0xFF
    (zckpt / "w" / "zarr.json").write_bytes(bytes(raw))
    reseal_manifest(zckpt)
    with pytest.raises(CheckpointingException, match=r"w/zarr\.json: unreadable Zarr metadata of key 'w'"):
        _load(zckpt)
    code, out = _cli("verify", zckpt)
    assert code == 1 and "w/zarr.json" in out


def test_metadata_replaced_by_random_bytes_is_reported_by_the_tools(ckpt):
    size = (ckpt / ".metadata").stat().st_size
    (ckpt / ".metadata").write_bytes(os.urandom(size))
    reseal_manifest(ckpt)
    # A default load takes every key, shape and record from the sidecar index and never reads
    # .metadata (at scale every rank would unpickle all of it): what it returns is intact.
    assert torch.equal(distckpt.load_plain_tensors(ckpt)["w"], torch.arange(64, dtype=torch.float32))
    with pytest.raises(CheckpointingException, match=r"\.metadata: unreadable checkpoint metadata"):
        distckpt.load_plain_tensors(ckpt, sharded_strategy=TorchDistLoadShardedStrategy(use_index=False))
    with pytest.raises(CheckpointingException, match=r"\.metadata"):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, ckpt, verify=True)
    for command in ("inspect", "verify"):
        code, out = _cli(command, ckpt)
        assert ".metadata: unreadable checkpoint metadata" in out


# --------------------------------------------------------------------------- claims against real sizes


def _timed_cli(*args, codes=(0, 1, 2)) -> tuple:
    """A CLI call on a hostile checkpoint: a clear outcome (never exit 3) within 5 s."""
    start = time.monotonic()
    code, out = _cli(*args, codes=codes)
    assert time.monotonic() - start < 5, (args, time.monotonic() - start)
    return code, out


def test_a_zarr_listing_of_100000_keys_over_one_array_is_one_problem_naming_zarr_json(zckpt, tmp_path):
    _edit_json(
        zckpt / "zarr.json",
        lambda md: md["attributes"]["distckpt"].update(keys=[f"k{i}" for i in range(100_000)] + ["w"]),
    )
    reseal_manifest(zckpt)
    for deep in (False, True):
        start = time.monotonic()
        report = verify_checkpoint(zckpt, deep=deep)
        assert time.monotonic() - start < 5
        assert [p for p in report.problems if "k0" in p] == [
            f"{zckpt / 'zarr.json'}: lists 100000 of its 100001 array keys with no array metadata (missing): "
            f"'k0', 'k1', 'k2' ..."
        ], report.problems[:3]
    code, out = _timed_cli("verify", zckpt)
    assert code == 1 and "zarr.json: lists 100000 of its 100001 array keys" in out
    other = _save(tmp_path / "other", "zarr")
    for args in (
        ["inspect", zckpt],
        ["show", zckpt, "w"],
        ["diff", zckpt, other],
        ["convert", zckpt, tmp_path / "out", "--to", "torch_dist"],
        ["rm-prefix", zckpt, "w"],
        ["rename", zckpt, "--map", "w=w2"],
    ):
        code, out = _timed_cli(*args, codes=(2,))
        assert "'k0'" in out, (args, out)


def test_a_zarr_listing_naming_one_array_100000_times_is_refused_naming_zarr_json(zckpt, tmp_path):
    _edit_json(zckpt / "zarr.json", lambda md: md["attributes"]["distckpt"].update(keys=["w"] * 100_000))
    reseal_manifest(zckpt)
    message = f"{zckpt / 'zarr.json'}: lists array key 'w' more than once (damaged)"
    start = time.monotonic()
    with pytest.raises(CheckpointingException, match=re.escape(message)):
        distckpt.load_plain_tensors(zckpt)
    assert verify_checkpoint(zckpt).problems == [message]
    assert time.monotonic() - start < 5
    other = _save(tmp_path / "other", "zarr")
    for args in (
        ["verify", zckpt],
        ["inspect", zckpt],
        ["show", zckpt, "w"],
        ["diff", zckpt, other],
        ["convert", zckpt, tmp_path / "out", "--to", "torch_dist"],
        ["rm-prefix", zckpt, "w"],
        ["rename", zckpt, "--map", "w=w2"],
    ):
        code, out = _timed_cli(*args, codes=(1, 2))
        assert message in out.replace("\n", ""), (args, out)


def _20000_chunks(md, record) -> None:
    """``w`` claims 20,000 chunks of one element; chunk ``j``'s storage record is
    ``record(original record, j)``."""
    n = 20_000
    meta = md.state_dict_metadata["w"]
    index = next(i for i in md.storage_data if i.fqn == "w")
    info = md.storage_data.pop(index)
    meta.size = torch.Size((n,))
    meta.chunks = [ChunkStorageMetadata(offsets=torch.Size((j,)), sizes=torch.Size((1,))) for j in range(n)]
    for j in range(n):
        md.storage_data[MetadataIndex("w", torch.Size((j,)))] = record(info, j)


@pytest.mark.slow
def test_20000_chunks_sharing_one_record_get_a_clear_outcome_from_every_tool_quickly(ckpt, tmp_path):
    other = _save(tmp_path / "other", "torch_dist")
    _edit_metadata(ckpt, lambda md: _20000_chunks(md, lambda info, j: info))  # every record the same bytes
    start = time.monotonic()
    report = verify_checkpoint(ckpt, deep=True)
    assert time.monotonic() - start < 5
    assert (
        ".metadata: key 'w' is float32 of shape [20000], .distckpt_manifest.json says the writer "
        "wrote float32 of shape [64]" in report.problems
    ), report.problems
    code, out = _timed_cli("verify", "--deep", ckpt)
    assert code == 1 and "says the writer wrote float32 of shape [64]" in out
    code, out = _timed_cli("diff", ckpt, other)
    assert code == 1 and "[20000] vs [64]" in out
    for args in (
        ["inspect", ckpt],
        ["show", ckpt, "w"],
        ["convert", ckpt, tmp_path / "out", "--to", "zarr"],
        ["rm-prefix", ckpt, "opt."],
        ["rename", ckpt, "--map", "w=w2"],
    ):
        code, out = _timed_cli(*args)
        assert code == 0 if args[0] == "inspect" else code == 2, (args, out)
    # Without a manifest (Megatron's checkpoints) the shared bytes are what give it away.
    (ckpt / ".distckpt_manifest.json").unlink()
    report = verify_checkpoint(ckpt)
    assert report.problems == [
        ".metadata: 19999 storage record(s) claim bytes of __0_0.distcp that another record claims "
        "(first: key 'w' chunk at [1] and key 'w' chunk at [0], at offset 0): damaged metadata"
    ], report.problems


def test_verify_prints_the_first_100_of_20000_odd_problems_and_counts_the_rest(ckpt):
    import dataclasses

    # Chunk j's record: bytes 4j.. (one element each), which the manifest lists no range for,
    # most of them past the end of the file.
    _edit_metadata(
        ckpt, lambda md: _20000_chunks(md, lambda info, j: dataclasses.replace(info, offset=4 * j, length=4))
    )
    start = time.monotonic()
    problems = verify_checkpoint(ckpt).problems
    assert time.monotonic() - start < 5
    assert len(problems) > 20_000
    code, out = _timed_cli("verify", ckpt)
    # Printing every line took seconds (20,000 of them), the first ones say what is wrong.
    assert code == 1 and out.count("PROBLEM") == 101, out[-500:]
    assert (
        f"... and {len(problems) - 100} more (--json lists them all)" in out
        and f"{len(problems)} problem(s)" in out
    )
    code, out = _timed_cli("verify", "--json", ckpt)
    assert json.loads(out)["problems"] == problems


def test_a_load_strategy_parses_metadata_again_once_its_bytes_change(ckpt):
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    strategy = TorchDistLoadShardedStrategy()

    def load():
        return strategy.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, ckpt)["w"]

    assert torch.equal(load(), torch.arange(64, dtype=torch.float32))
    assert torch.equal(load(), torch.arange(64, dtype=torch.float32))  # parsed once, read twice

    def halve(md):
        md.state_dict_metadata["w"].size = torch.Size((32,))
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size((32,))

    _edit_metadata(ckpt, halve)
    # (refused by the manifest's declaration of 'w' where the load reads .metadata, else by the
    # shape check)
    with pytest.raises(
        CheckpointingException,
        match=r"global shape \[64\] was requested but the checkpoint "
        r"stores \[32\]|key 'w' is float32 of shape \[32\]",
    ):
        load()
