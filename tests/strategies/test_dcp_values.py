"""Checkpoints written by plain PyTorch DCP (``dcp.save``): safe metadata reading and byte items.

``dcp.save`` records its checkpoint id (a ``pathlib`` path) in ``.metadata`` and stores every
non-tensor value (``step``, the leaves of nested dicts) as a byte item under its flattened name.
Those values are the checkpoint's common state: they load back under their own keys.
Most directories here get a ``metadata.json`` of the ``torch_dist`` backend (as a user may mark a
DCP directory); tests/interop/test_dcp_native.py reads them without one.
"""

from __future__ import annotations

import logging
import pathlib
import warnings
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt.core import CheckpointingConfig, save_config
from distckpt.strategies.torch import read_metadata
from distckpt.tools.convert import convert_checkpoint
from distckpt.tools.verify import verify_checkpoint
from tests.tools.test_cli import cli

VALUES = {"step": 42, "extra": {"lr": 0.1, "names": ["a", "b"], "nested": {"pair": (1, 2)}}}


def _dcp_save(path: Path, mark: bool = True) -> Path:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, **VALUES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(state, checkpoint_id=str(path))
    if mark:
        save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), path)
    return path


def test_dcp_metadata_with_a_path_loads_under_the_safe_unpickler(tmp_path):
    md = read_metadata(_dcp_save(tmp_path / "ckpt", mark=False))
    assert isinstance(md.storage_meta.checkpoint_id, pathlib.PurePath)
    assert str(md.storage_meta.checkpoint_id) == str(tmp_path / "ckpt")


def test_other_pathlib_names_stay_refused(tmp_path):
    import io
    import pickle

    from distckpt.strategies.torch import _MetadataUnpickler

    raw = pickle.dumps(pathlib.Path)  # the class itself, not an instance of an allowed one
    with pytest.raises(pickle.UnpicklingError, match="pathlib.Path is not allowed"):
        _MetadataUnpickler(io.BytesIO(raw)).load()


def test_dcp_values_load_back_under_their_own_keys(tmp_path, caplog):
    ckpt = _dcp_save(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        assert distckpt.load_common_state_dict(ckpt) == VALUES
        assert sorted(distckpt.load_sharded_metadata(ckpt)) == ["model.b", "model.w"]
    assert "skipped" not in caplog.text
    request = {"model": {"w": distckpt.ShardedTensor.from_rank_offsets("model.w", torch.zeros(2, 3))}}
    loaded = distckpt.load(request, ckpt, strict="raise_unexpected")
    assert torch.equal(loaded.pop("model")["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded == VALUES


def test_dcp_values_are_refused_without_trust_when_they_need_a_class(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "when": logging.Formatter()}, checkpoint_id=str(tmp_path))
    save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), tmp_path)
    with pytest.raises(distckpt.CheckpointingException, match=r"value 'when' in .*refusing to unpickle"):
        distckpt.load_common_state_dict(tmp_path)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_convert_carries_dcp_values_into_the_common_state(tmp_path, backend):
    ckpt = _dcp_save(tmp_path / "ckpt")
    convert_checkpoint(ckpt, tmp_path / "out", to_backend=backend)
    assert distckpt.load_common_state_dict(tmp_path / "out") == VALUES
    assert sorted(distckpt.load_plain_tensors(tmp_path / "out")) == ["model.b", "model.w"]


def test_verify_counts_dcp_values_and_reads_them_back(tmp_path):
    ckpt = _dcp_save(tmp_path / "ckpt")
    report = verify_checkpoint(ckpt, deep=True)
    assert report.ok, report.problems
    assert any("2 tensors, 4 DCP values and 0 objects" in line for line in report.checked)


def test_verify_without_metadata_json_takes_dcp_metadata_as_the_commit_marker(tmp_path):
    ckpt = _dcp_save(tmp_path / "ckpt", mark=False)
    report = verify_checkpoint(ckpt)
    assert report.problems == []
    assert "commit marker (.metadata)" in report.checked
    assert any("4 DCP values" in line for line in report.checked)
    (ckpt / "common.pt").write_bytes(b"")  # now it looks like an interrupted torch_dist save
    assert verify_checkpoint(ckpt).problems[0].startswith("metadata.json: missing")


def test_cli_convert_and_verify_take_dcp_values(tmp_path):
    ckpt = _dcp_save(tmp_path / "ckpt")
    cli("convert", ckpt, tmp_path / "out", "--to", "zarr")
    assert distckpt.load_common_state_dict(tmp_path / "out")["step"] == 42
    result = cli("verify", ckpt, "--deep")
    assert "DCP values" in result.stdout and "not a ShardedObject" not in result.stdout + result.stderr
