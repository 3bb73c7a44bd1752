"""Corrupted checkpoints and bad input: every corruption is reported as a CheckpointingException
naming the file (or the key), never as a raw error from deep inside torch.

A truncated or bit-flipped file is detected by ``load(..., verify=True)``, by
``distckpt.formats.manifest.verify_files`` and by ``distckpt verify``. Without ``verify`` a truncation is
still detected; a flipped bit in tensor data is not (that is what ``verify`` is for).
Most tests run in a single process (no process group); the multi-rank tests use the rank pool.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor, check_is_distributed_checkpoint
from distckpt import dist as ddist
from distckpt.cli import main as cli_main
from distckpt.formats.manifest import MANIFEST_FNAME, read_manifest, read_manifest_files, verify_files
from distckpt.strategies.torch import read_metadata
from distckpt.tools.verify import verify_checkpoint
from tests.support import faults, layouts
from tests.support.harness import expect_all_ranks_raise, run_ranks

REPO = Path(__file__).resolve().parents[2]
BIG = (64, 64)


# --------------------------------------------------------------------------- the checkpoint


def _state(with_data: bool) -> dict:
    sd, _ = layouts.build("tp_dp", 0, 1, with_data, tp=1)
    big = layouts.full_tensor("big", BIG) if with_data else torch.zeros(BIG)
    sd["big"] = ShardedTensor.from_rank_offsets("big", big)
    sd["rng"] = ShardedObject(
        "rng", {"seed": 1234, "state": torch.arange(6)} if with_data else None, (1,), (0,)
    )
    if with_data:
        sd["iteration"] = 7
        sd["args"] = {"lr": 0.5, "layers": [1, 2]}
    return sd


def _mismatches(loaded: dict) -> List[str]:
    _, pieces = layouts.build("tp_dp", 0, 1, False, tp=1)
    wrong = [n for n, p in pieces.items() if not layouts.bitwise_equal(loaded[n], p.expected())]
    if not layouts.bitwise_equal(loaded["big"], layouts.full_tensor("big", BIG)):
        wrong.append("big")
    rng = loaded["rng"]
    if rng["seed"] != 1234 or not torch.equal(rng["state"], torch.arange(6)):
        wrong.append("rng")
    if loaded["iteration"] != 7 or loaded["args"] != {"lr": 0.5, "layers": [1, 2]}:
        wrong.append("common")
    return wrong


def _load(ckpt: Path, **kwargs) -> List[str]:
    return _mismatches(distckpt.load(_state(False), ckpt, **kwargs))


def _save(ckpt: Path, backend: str = "torch_dist") -> Path:
    distckpt.save(_state(True), ckpt, sharded_strategy=(backend, 1))
    return ckpt


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return _save(tmp_path / "ckpt")


@pytest.fixture
def zarr_ckpt(tmp_path) -> Path:
    return _save(tmp_path / "zarr_ckpt", "zarr")


# --------------------------------------------------------------------------- corruptions


def _item_middle(ckpt: Path, key: str) -> Tuple[str, int]:
    name, r = faults.item_range(ckpt, key)
    return name, r.offset + r.length // 2


def _whole_file_middle(name: str) -> Callable[[Path], Tuple[str, int]]:
    return lambda ckpt: (name, (ckpt / name).stat().st_size // 2)


# target -> (checkpoint fixture, where to corrupt: (file, offset in the middle of its data))
TARGETS: Dict[str, Tuple[str, Callable[[Path], Tuple[str, int]]]] = {
    "tensor-data": ("ckpt", lambda ckpt: faults.tensor_bytes_middle(ckpt, "big")),
    "object-item": ("ckpt", lambda ckpt: _item_middle(ckpt, "rng/shard_0_1")),
    "metadata-pickle": ("ckpt", _whole_file_middle(".metadata")),
    "common-state": ("ckpt", _whole_file_middle("common.pt")),
    "object-file": ("zarr_ckpt", _whole_file_middle("rng/shard_0_1.pt")),
}
CORRUPTIONS = [(target, kind) for target in TARGETS for kind in ("truncated", "flipped")]


def _corrupt(request, target: str, kind: str) -> Tuple[Path, str]:
    """Corrupt ``target`` of a fresh checkpoint; returns (checkpoint, relative name of the file).

    ``truncated`` cuts the file in the middle of the target's data, ``flipped`` flips one bit there.
    """
    fixture, where = TARGETS[target]
    ckpt = request.getfixturevalue(fixture)
    name, offset = where(ckpt)
    if kind == "truncated":
        os.truncate(ckpt / name, offset)
    else:
        faults.flip_byte(ckpt / name, offset)
    return ckpt, name


def _flip_target(ckpt: Path, name: str) -> Tuple[Path, int]:
    return ckpt / name, (ckpt / name).stat().st_size // 2


def _manifest_problems(ckpt: Path) -> List[str]:
    try:
        manifest = read_manifest(ckpt)
    except CheckpointingException as e:
        return [str(e)]
    assert manifest is not None
    return verify_files(ckpt, manifest)


def _verify_command(ckpt: Path):
    return CliRunner().invoke(cli_main, ["verify", str(ckpt)])


@pytest.mark.parametrize("target,kind", CORRUPTIONS)
def test_load_with_verify_names_the_corrupted_file(request, target, kind):
    ckpt, name = _corrupt(request, target, kind)
    with pytest.raises(CheckpointingException, match=re.escape(str(ckpt / name))):
        _load(ckpt, verify=True)


@pytest.mark.parametrize("target,kind", CORRUPTIONS)
def test_verify_files_reports_the_corrupted_file(request, target, kind):
    ckpt, name = _corrupt(request, target, kind)
    problems = _manifest_problems(ckpt)
    assert problems and all(p.startswith(f"{name}: ") for p in problems), problems


@pytest.mark.parametrize("target,kind", CORRUPTIONS)
def test_verify_command_fails_naming_the_corrupted_file(request, target, kind):
    ckpt, name = _corrupt(request, target, kind)
    result = _verify_command(ckpt)
    assert result.exit_code == 1, result.output
    assert name in result.output


@pytest.mark.parametrize("target", TARGETS)
def test_truncation_is_detected_without_verify(request, target):
    ckpt, name = _corrupt(request, target, "truncated")
    with pytest.raises(CheckpointingException, match=re.escape(str(ckpt / name))):
        _load(ckpt)


def test_bit_flip_in_tensor_data_is_caught_by_default_and_loads_wrong_values_only_with_verify_false(ckpt):
    name, offset = faults.tensor_bytes_middle(ckpt, "big")
    faults.flip_byte(ckpt / name, offset)
    for kwargs in ({}, {"verify": True}):  # the default checks the CRC32C of what it reads
        with pytest.raises(CheckpointingException, match=r"key 'big' in .*__0_0\.distcp .*CRC32C mismatch"):
            _load(ckpt, **kwargs)
    assert _load(ckpt, verify=False) == ["big"]  # the explicit opt-out checks nothing


def test_the_real_verify_command_exits_non_zero_on_a_corrupted_checkpoint(ckpt):
    faults.flip_byte(*_flip_target(ckpt, "common.pt"))
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt.cli", "verify", str(ckpt)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "common.pt" in proc.stdout + proc.stderr


def test_intact_checkpoint_passes_every_check(ckpt):
    assert _load(ckpt, verify=True) == []
    assert _manifest_problems(ckpt) == []
    assert _verify_command(ckpt).exit_code == 0


# --------------------------------------------------------------------------- every byte, every bit


def test_manifest_ranges_cover_every_byte_of_every_listed_file(ckpt):
    manifest = read_manifest(ckpt)
    for name, size in manifest.files.items():
        ranges = sorted((r.offset, r.length) for r in manifest.ranges[name])
        position = 0
        for offset, length in ranges:
            assert offset == position, (name, ranges)
            position += length
        assert position == size == (ckpt / name).stat().st_size


@pytest.fixture(scope="module")
def shared_ckpt(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("flips") / "ckpt")


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_single_bit_flip_in_a_checksummed_file_is_detected(shared_ckpt, data):
    manifest = read_manifest(shared_ckpt)
    name = data.draw(st.sampled_from(sorted(manifest.files)), label="file")
    offset = data.draw(st.integers(0, manifest.files[name] - 1), label="offset")
    mask = 1 << data.draw(st.integers(0, 7), label="bit")
    faults.flip_byte(shared_ckpt / name, offset, mask)
    try:
        assert any(p.startswith(f"{name}: ") for p in verify_files(shared_ckpt, manifest))
        with pytest.raises(CheckpointingException, match=re.escape(name)):
            _load(shared_ckpt, verify=True)
    finally:
        faults.flip_byte(shared_ckpt / name, offset, mask)


def test_every_single_bit_flip_of_metadata_json_is_rejected(ckpt):
    path = ckpt / "metadata.json"
    original = path.read_bytes()
    accepted = []
    for offset in range(len(original)):
        for bit in range(8):
            flipped = bytearray(original)
            flipped[offset] ^= 1 << bit
            path.write_bytes(flipped)
            try:
                _load(ckpt)
            except CheckpointingException:
                continue
            accepted.append(bytes(flipped))
    path.write_bytes(original)
    assert accepted == []


# --------------------------------------------------------------------------- metadata.json


@pytest.mark.parametrize("kind", ["truncated", "flipped"])
def test_corrupted_metadata_json_is_rejected_naming_it(ckpt, kind):
    path = ckpt / "metadata.json"
    if kind == "truncated":
        faults.truncate_to_half(path)
    else:
        faults.flip_byte(path, path.stat().st_size // 2)
    assert not check_is_distributed_checkpoint(ckpt)
    for verify in (False, True):
        with pytest.raises(CheckpointingException, match=re.escape(str(path))):
            _load(ckpt, verify=verify)
    result = _verify_command(ckpt)
    assert result.exit_code != 0 and "metadata.json" in result.output


def _write_config(ckpt: Path, **changes) -> Path:
    path = ckpt / "metadata.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def test_unknown_key_in_metadata_json_is_rejected_naming_file_and_key(ckpt):
    path = _write_config(ckpt, save_time="today")
    with pytest.raises(
        CheckpointingException, match=re.escape(str(path)) + r".*unexpected .*\['save_time'\]"
    ):
        _load(ckpt)


def test_metadata_json_without_a_backend_is_rejected_naming_it(ckpt):
    path = _write_config(ckpt, sharded_backend=None)
    with pytest.raises(CheckpointingException, match=re.escape(str(path)) + r".*'sharded_backend' required"):
        _load(ckpt)


def test_metadata_json_that_is_not_an_object_is_rejected_naming_it(ckpt):
    (ckpt / "metadata.json").write_text("[1, 2]")
    with pytest.raises(
        CheckpointingException, match=r"metadata\.json: checkpoint config must be a JSON object"
    ):
        _load(ckpt)


@pytest.mark.parametrize(
    "changes",
    [{"sharded_backend": "torch_dits"}, {"common_backend": "pickle"}, {"sharded_backend_version": "1"}],
    ids=["backend", "common-backend", "version-type"],
)
def test_bad_backend_in_metadata_json_is_an_error_naming_it(ckpt, changes):
    path = _write_config(ckpt, **changes)
    with pytest.raises(CheckpointingException, match=re.escape(str(path))):
        _load(ckpt)


def test_newer_format_version_is_refused(ckpt):
    _write_config(ckpt, sharded_backend_version=7)
    with pytest.raises(CheckpointingException, match=r"backend 'torch_dist' version 7"):
        _load(ckpt)


# --------------------------------------------------------------------------- the manifest


def _manifest_checks_all_fail(ckpt: Path, pattern: str) -> None:
    with pytest.raises(CheckpointingException, match=pattern):
        _load(ckpt, verify=True)
    problems = _manifest_problems(ckpt)
    assert problems and all(re.search(pattern, p) for p in problems), problems
    result = _verify_command(ckpt)
    assert result.exit_code == 1 and re.search(pattern, result.output.replace("\n", " ")), result.output


@pytest.mark.parametrize("kind", ["truncated", "syntax-flipped"])
def test_corrupted_manifest_is_reported_naming_it(ckpt, kind):
    path = ckpt / MANIFEST_FNAME
    if kind == "truncated":
        faults.truncate_to_half(path)
    else:
        faults.flip_byte(path, 0)  # '{' -> 'k'
    _manifest_checks_all_fail(ckpt, re.escape(MANIFEST_FNAME) + ": unreadable integrity manifest")


def test_the_manifests_file_list_reads_as_the_whole_manifest_does(ckpt):
    assert read_manifest_files(ckpt) == read_manifest(ckpt).files and read_manifest_files(ckpt)
    assert read_manifest_files(ckpt / "absent") is None
    faults.truncate_to_half(ckpt / MANIFEST_FNAME)
    with pytest.raises(
        CheckpointingException, match=re.escape(MANIFEST_FNAME) + ": unreadable integrity manifest"
    ):
        read_manifest_files(ckpt)


def test_default_load_refuses_a_damaged_manifest_and_verify_false_does_not_read_it(ckpt):
    faults.truncate_to_half(ckpt / MANIFEST_FNAME)
    with pytest.raises(CheckpointingException, match=re.escape(MANIFEST_FNAME)):
        _load(ckpt)
    assert _load(ckpt, verify=False) == []


def test_flipped_checksum_in_the_manifest_is_reported_as_a_mismatch_of_its_item(ckpt):
    name, r = faults.item_range(ckpt, "big")
    path = ckpt / MANIFEST_FNAME
    text = path.read_text()
    digits = f",{r.crc32c},"
    faults.flip_byte(path, text.index(digits) + 2, 0x01)  # one digit, still valid JSON
    _manifest_checks_all_fail(ckpt, rf"(?=.*{re.escape(name)})(?=.*'big')(?=.*CRC32C mismatch)")


def test_manifest_of_another_save_is_a_mismatch(ckpt, tmp_path):
    other = tmp_path / "other"
    sd = _state(True)
    sd["big"].data = sd["big"].data + 1
    distckpt.save(sd, other)
    shutil.copy(other / MANIFEST_FNAME, ckpt / MANIFEST_FNAME)
    _manifest_checks_all_fail(ckpt, r"(__0_0\.distcp|\.metadata|\.distckpt_index)")


def test_manifest_listing_a_missing_file_is_reported(ckpt):
    manifest = read_manifest(ckpt)
    (ckpt / "__0_1.distcp").unlink()
    assert "__0_1.distcp: missing (expected" in "\n".join(verify_files(ckpt, manifest))


def test_manifest_that_lost_the_checksums_of_a_file_is_reported(ckpt):
    path = ckpt / MANIFEST_FNAME
    raw = json.loads(path.read_text())
    raw["ranges"]["common.pu"] = raw["ranges"].pop("common.pt")  # 't' ^ 0x01 == 'u'
    path.write_text(json.dumps(raw))
    assert _manifest_problems(ckpt) != []
    faults.flip_byte(*_flip_target(ckpt, "common.pt"))
    with pytest.raises(CheckpointingException):
        _load(ckpt, verify=True)


# --------------------------------------------------------------------------- .metadata contents


def test_metadata_file_holding_another_object_is_rejected_naming_it(ckpt):
    (ckpt / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointingException, match=r"\.metadata: holds dict, not DCP Metadata"):
        _load(ckpt)


def test_storage_record_past_the_end_of_a_whole_file_is_blamed_on_the_metadata(ckpt):
    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn == "big")
    info = md.storage_data[index]
    md.storage_data[index] = type(info)(info.relative_path, info.offset, info.length + 4096)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / ".distckpt_index").unlink()  # a tool that edits .metadata drops the sidecar index
    size = (ckpt / info.relative_path).stat().st_size
    # The data file has the size the manifest records: the record is the lie, and is named so.
    claim = (
        rf"{re.escape(str(ckpt))}/\.metadata: claims key 'big' chunk at \[0, 0\] at offset {info.offset} of "
        rf".*/{info.relative_path} \({info.length + 4096} bytes, .*\), which holds {size} bytes, the size "
        rf".*\.distckpt_manifest\.json records for it: the metadata is damaged"
    )
    with pytest.raises(CheckpointingException, match=claim):
        _load(ckpt)
    problems = verify_checkpoint(ckpt).problems
    assert any(p.startswith(".metadata: claims key 'big' chunk at [0, 0]") for p in problems), problems


# --------------------------------------------------------------------------- one rank's file, every rank


def _save_two_ranks(ckpt):
    sd, _ = layouts.build("grid", ddist.get_rank(), 2, True, rows=1, cols=2)
    distckpt.save(sd, ckpt)


def _load_two_ranks(ckpt, verify):
    sd, pieces = layouts.build("grid", ddist.get_rank(), 2, False, rows=1, cols=2)
    out = distckpt.load(sd, ckpt, verify=verify)
    return [n for n, p in pieces.items() if not layouts.bitwise_equal(out[n], p.expected())]


def test_corruption_in_one_ranks_file_fails_every_rank_with_verify(tmp_path):
    run_ranks(2, _save_two_ranks, str(tmp_path))
    name, offset = faults.tensor_bytes_middle(tmp_path, "grid")
    assert name.startswith("__")
    owner = int(name[2])
    faults.flip_byte(tmp_path / name, offset)
    expect_all_ranks_raise(
        2,
        _load_two_ranks,
        str(tmp_path),
        True,
        match=rf"load failed on rank\(s\) {owner}: key 'grid' in .*{re.escape(name)}.*CRC32C mismatch",
    )
    wrong = run_ranks(2, _load_two_ranks, str(tmp_path), False)
    assert wrong[owner] == ["grid"] and wrong[1 - owner] == []


# --------------------------------------------------------------------------- bad sharded state dicts


@pytest.mark.parametrize(
    "field,value,match",
    [
        (
            "global_shape",
            (float("nan"), 4),
            r"every entry of global_shape \(nan, 4\) must be an integer, got nan",
        ),
        (
            "local_shape",
            (2, float("nan")),
            r"every entry of local_shape \(2, nan\) must be an integer, got nan",
        ),
        ("global_offset", (-2, 0), r"negative global_offset \(-2, 0\)"),
        ("local_shape", (-1, 4), r"negative shape entry"),
    ],
)
def test_invalid_sharded_tensor_is_refused_naming_the_key(field, value, match):
    args = {
        "key": "decoder.w",
        "data": None,
        "dtype": torch.float32,
        "local_shape": (2, 4),
        "global_shape": (4, 4),
        "global_offset": (0, 0),
        "axis_fragmentations": None,
    }
    args[field] = value
    with pytest.raises(CheckpointingException, match=r"ShardedTensor 'decoder\.w': .*" + match):
        ShardedTensor(**args)


def _save_mutated(ckpt, field, value):
    rank = ddist.get_rank()
    sh = ShardedTensor.from_rank_offsets("decoder.w", torch.ones(2, 4), (0, rank, 2))
    if rank == 1:
        setattr(sh, field, value)  # mutated after construction, on one rank only
    distckpt.save({"w": sh}, ckpt)


@pytest.mark.parametrize(
    "field,value,match",
    [
        (
            "global_shape",
            (float("nan"), 4),
            r"every entry of global_shape \(nan, 4\) must be an integer, got nan",
        ),
        ("global_offset", (-2, 0), r"negative global_offset"),
    ],
)
def test_invalid_sharded_tensor_on_one_rank_fails_save_on_every_rank(tmp_path, field, value, match):
    expect_all_ranks_raise(
        2,
        _save_mutated,
        str(tmp_path),
        field,
        value,
        match=r"failed on rank\(s\) 1: ShardedTensor 'decoder\.w': .*" + match,
    )
    assert not check_is_distributed_checkpoint(tmp_path)
    assert not any(p.suffix in (".distcp", ".pt") for p in tmp_path.iterdir())


def _save_valid(ckpt):
    rank = ddist.get_rank()
    distckpt.save({"w": ShardedTensor.from_rank_offsets("decoder.w", torch.ones(2, 4), (0, rank, 2))}, ckpt)


def _load_mutated(ckpt):
    rank = ddist.get_rank()
    sh = ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(2, 4), (0, rank, 2))
    if rank == 1:
        sh.global_offset = (0, -4)
    distckpt.load({"w": sh}, ckpt)


def test_invalid_sharded_tensor_on_one_rank_fails_load_on_every_rank(tmp_path):
    run_ranks(2, _save_valid, str(tmp_path))
    expect_all_ranks_raise(
        2,
        _load_mutated,
        str(tmp_path),
        match=r"failed on rank\(s\) 1: ShardedTensor 'decoder\.w': negative global_offset",
    )


def test_layout_outside_the_stored_tensor_is_refused_naming_key_and_shapes(ckpt):
    sd = _state(False)
    sd["big"] = ShardedTensor.from_rank_offsets("big", torch.zeros(80, 64))
    with pytest.raises(
        CheckpointingException,
        match=r"'big': global shape \[80, 64\] was requested but the "
        r"checkpoint stores \[64, 64\]",
    ):
        distckpt.load(sd, ckpt)
