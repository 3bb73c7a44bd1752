"""Hostile checkpoints: metadata that names files outside the checkpoint, impossible offsets,
lengths and shapes. Each is a clear CheckpointingException naming the file — never a read
outside the checkpoint, a huge allocation or a long loop.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt.manifest import read_manifest, read_manifest_files, verify_files
from distckpt.strategies.torch import read_metadata
from distckpt.tools.verify import verify_checkpoint
from tests.faults import reseal_manifest

TB = 1 << 40


def _save(ckpt: Path, backend: str = "torch_dist") -> None:
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32))},
                  ckpt, sharded_strategy=(backend, 1))


def _load(ckpt: Path, verify: bool = False):
    return distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, ckpt, verify=verify)


def _rewrite_metadata(ckpt: Path, edit) -> None:
    """Edit ``.metadata`` and give the checkpoint a matching manifest, as an attacker would."""
    md = read_metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal_manifest(ckpt)


def _set_record(md, **changes) -> None:
    index = next(i for i in md.storage_data if i.fqn == "w")
    md.storage_data[index] = replace(md.storage_data[index], **changes)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    _save(path)
    (tmp_path / "secret.distcp").write_bytes(b"x" * 4096)   # what an escape would read
    return path


@pytest.mark.parametrize("name", ["../secret.distcp", "/etc/passwd", "sub/../../secret.distcp", "", "a//b"])
def test_a_storage_record_naming_a_file_outside_is_refused_naming_metadata(ckpt, name):
    _rewrite_metadata(ckpt, lambda md: _set_record(md, relative_path=name))
    for verify in (False, True):
        with pytest.raises(CheckpointingException, match=r"\.metadata: storage record of 'w': file name .* (outside|not a non-empty)"):
            _load(ckpt, verify)
    with pytest.raises(CheckpointingException, match="outside the checkpoint|not a non-empty"):
        distckpt.load_plain_tensors(ckpt)


def test_a_data_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(ckpt):
    name = next(p.name for p in ckpt.glob("*.distcp"))
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / name).read_bytes())
    os.remove(ckpt / name)
    os.symlink(ckpt.parent / "outside.distcp", ckpt / name)
    with pytest.raises(CheckpointingException, match=rf"{name}: named by .*\.metadata, resolves to .*outside\.distcp, outside the checkpoint"):
        _load(ckpt)


@pytest.mark.parametrize("changes, match", [
    ({"length": 1 << 50}, "file is truncated"),
    ({"offset": 1 << 50}, "file is truncated"),
    ({"offset": -1}, r"offset -1 is not an integer"),
    ({"length": 2.5}, r"length 2\.5 is not an integer"),
])
def test_impossible_offsets_and_lengths_are_refused_before_any_read(ckpt, changes, match):
    _rewrite_metadata(ckpt, lambda md: _set_record(md, **changes))
    for verify in (False, True):
        with pytest.raises(CheckpointingException, match=match):
            _load(ckpt, verify)


def _claim_global_shape(md, shape):
    meta = md.state_dict_metadata["w"]
    meta.size = torch.Size(shape)


def test_a_claimed_shape_of_2_to_the_40_elements_is_refused_without_allocating(ckpt):
    _rewrite_metadata(ckpt, lambda md: _claim_global_shape(md, (TB,)))
    start = time.monotonic()
    with pytest.raises(CheckpointingException, match=r"\.metadata: key 'w': loading \[1099511627776\] needs "
                                                     r"4398046511104 bytes, the checkpoint stores \d+"):
        distckpt.load_plain_tensors(ckpt)
    assert time.monotonic() - start < 5


def test_a_chunk_claiming_more_bytes_than_its_record_is_refused(ckpt):
    def edit(md):
        _claim_global_shape(md, (TB,))
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size((TB,))
    _rewrite_metadata(ckpt, edit)
    with pytest.raises(CheckpointingException, match=r"key 'w': chunk at \[0\] of \[1099511627776\] elements needs"):
        _load(ckpt)


def test_a_shape_beyond_any_real_tensor_is_refused(ckpt):
    _rewrite_metadata(ckpt, lambda md: _claim_global_shape(md, (1 << 30, 1 << 30)))
    with pytest.raises(CheckpointingException, match=r"global shape \[1073741824, 1073741824\] claims"):
        _load(ckpt)


def test_verify_reports_a_hostile_file_name_without_touching_it(ckpt):
    _rewrite_metadata(ckpt, lambda md: _set_record(md, relative_path="../secret.distcp"))
    report = verify_checkpoint(ckpt)
    assert any("points outside the checkpoint" in p for p in report.problems), report.problems


def test_a_manifest_listing_files_outside_is_refused_naming_it(ckpt):
    path = ckpt / ".distckpt_manifest.json"
    raw = json.loads(path.read_text())
    raw["files"]["../secret.distcp"] = 4096
    raw["ranges"]["../secret.distcp"] = [[0, 4096, 0, "x"]]
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointingException, match=r"\.distckpt_manifest\.json: listed file '\.\./secret\.distcp' points outside"):
        read_manifest(ckpt)
    with pytest.raises(CheckpointingException, match=r"listed file '\.\./secret\.distcp' points outside"):
        read_manifest_files(ckpt)
    with pytest.raises(CheckpointingException, match="points outside"):
        _load(ckpt, verify=True)


def test_a_manifest_range_past_the_end_of_its_file_is_a_problem_not_a_huge_read(ckpt):
    manifest = read_manifest(ckpt)
    name = next(n for n in manifest.files if n.endswith(".distcp"))
    manifest.ranges[name][0] = replace(manifest.ranges[name][0], length=1 << 50)
    problems = verify_files(ckpt, manifest)
    assert any("truncated" in p and name in p for p in problems), problems


# --------------------------------------------------------------------------- zarr


@pytest.fixture
def zckpt(tmp_path):
    path = tmp_path / "zckpt"
    _save(path, "zarr")
    return path


def _edit_json(path: Path, edit) -> None:
    md = json.loads(path.read_text())
    edit(md)
    path.write_text(json.dumps(md))


def test_zarr_root_listing_a_key_outside_is_refused(zckpt):
    def edit(md):
        md["attributes"]["distckpt"]["keys"] = ["../../etc"]
    _edit_json(zckpt / "zarr.json", edit)
    with pytest.raises(CheckpointingException, match=r"zarr\.json: array key '\.\./\.\./etc' points outside"):
        distckpt.load_plain_tensors(zckpt)


def test_zarr_array_folder_that_is_a_symlink_out_is_refused(zckpt, tmp_path):
    os.rename(zckpt / "w", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", zckpt / "w")
    with pytest.raises(CheckpointingException, match="outside the checkpoint"):
        _load(zckpt)


@pytest.mark.parametrize("shape, chunks, match", [
    ([TB], [TB], r"loading \[1099511627776\] needs 4398046511104 bytes, the array's chunk files hold"),
    ([64], [1 << 50], r"chunk shape 1125899906842624 is not an integer in"),
    ([64], [1 << 40], r"a chunk of \[1099511627776\] \(4398046511104 bytes\) for an array of \[64\]"),
    ([64], [0], r"chunk shape \[0\] does not fit"),
    ([1 << 40, 1 << 40], [1, 1], r"shape \[1099511627776, 1099511627776\] claims"),
    ([-1], [1], r"shape \[-1\] is not an integer|shape -1 is not"),
])
def test_zarr_impossible_shapes_and_chunks_are_refused_quickly(zckpt, shape, chunks, match):
    def edit(md):
        md["shape"] = shape
        md["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    _edit_json(zckpt / "w" / "zarr.json", edit)
    start = time.monotonic()
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_plain_tensors(zckpt)
    assert time.monotonic() - start < 5
