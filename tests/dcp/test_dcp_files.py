"""What ``distckpt.dcp`` writes and reads, in one process (``dcp.save``/``dcp.load`` without a
process group): DCP's format both ways (DCP's ``FileSystemReader`` reads it; distckpt's reader
reads DCP's ``FileSystemWriter``; ``distckpt.load``, ``load_plain_tensors`` and the CLI read it),
checksums checked on load, an interrupted save (SIGKILL) that leaves the previous checkpoint, and
hostile files: a crafted ``.metadata`` pickle, a file name leading out, a pickled value.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

import distckpt
import distckpt.dcp
from tests.support.dcp_states import Trace, quiet
from tests.tools.test_cli import cli

W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
STATE = {
    "model": {"w": W, "b": torch.arange(5, dtype=torch.bfloat16), "scale": torch.tensor(0.5)},
    "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95)}]},
    "step": 11,
}


def _empty():
    return {
        "model": {
            "w": torch.zeros(64, 48),
            "b": torch.zeros(5, dtype=torch.bfloat16),
            "scale": torch.tensor(0.0),
        },
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]},
        "step": 0,
    }


def _assert_loaded(state):
    assert torch.equal(state["model"]["w"], W) and torch.equal(state["model"]["b"], STATE["model"]["b"])
    assert float(state["model"]["scale"]) == 0.5
    assert state["optim"] == STATE["optim"] and state["step"] == 11


def _save(path, state=STATE, **options):
    quiet(dcp.save, state, storage_writer=distckpt.dcp.StorageWriter(path, **options))


def _load(reader, state=None):
    state = state or _empty()
    quiet(dcp.load, state, storage_reader=reader)
    return state


@pytest.fixture
def saved(tmp_path) -> Path:
    _save(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_dcp_filesystem_reader_and_distckpt_read_what_the_writer_wrote(saved):
    names = sorted(p.name for p in saved.iterdir())
    assert names[:5] == [".distckpt_manifest.json", ".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt"]
    assert names[-1] == "metadata.json"
    _assert_loaded(_load(FileSystemReader(saved)))
    plain = distckpt.load_plain_tensors(saved)
    assert sorted(plain) == ["model.b", "model.scale", "model.w"] and torch.equal(plain["model.w"], W)
    assert distckpt.load_common_state_dict(saved) == {"optim": STATE["optim"], "step": 11}
    request = {"w": distckpt.ShardedTensor.from_rank_offsets("model.w", torch.zeros(32, 48), (0, 1, 2))}
    assert torch.equal(distckpt.load(request, saved, validate_access_integrity=False)["w"], W[32:])


def test_distckpt_reader_reads_dcp_filesystem_writer_checkpoints(tmp_path):
    quiet(dcp.save, STATE, checkpoint_id=str(tmp_path / "plain"))
    _assert_loaded(_load(distckpt.dcp.StorageReader(tmp_path / "plain")))


def test_the_cli_inspects_verifies_and_converts_the_writers_checkpoints(saved, tmp_path):
    assert "model" in cli("inspect", saved).stdout
    assert "OK" in cli("verify", saved).stdout
    cli("convert", saved, tmp_path / "st", "--to", "safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "st" / "model.safetensors")["model.w"], W)


def test_checkpoint_id_names_the_location_and_an_overwrite_is_atomic(saved, tmp_path):
    writer = distckpt.dcp.StorageWriter(tmp_path / "elsewhere")
    quiet(dcp.save, {**STATE, "step": 12}, storage_writer=writer, checkpoint_id=str(saved))
    assert not (tmp_path / "elsewhere").exists()
    state = _empty()
    quiet(
        dcp.load, state, storage_reader=distckpt.dcp.StorageReader(tmp_path / "x"), checkpoint_id=str(saved)
    )
    assert state["step"] == 12 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_every_byte_read_is_checked_against_its_crc32c(saved):
    data = saved / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside w's values (12 KiB of the file's ~16 KiB)
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match=r"key 'model.w' in .*__0_0.distcp .*CRC32C mismatch"):
        _load(distckpt.dcp.StorageReader(saved))
    _load(distckpt.dcp.StorageReader(saved, checksums=False))  # checks off: read as it is


# --------------------------------------------------------------------------- interrupted save


def test_a_save_killed_while_writing_leaves_the_previous_checkpoint_loadable(saved, tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.dcp_states", "save-big", str(saved)],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".ckpt.distckpt-staging-*/__0_*.distcp")):
            assert child.poll() is None and time.monotonic() < deadline, "the save ended before it was killed"
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert not (saved / "layer0").exists() and len(list(tmp_path.glob(".ckpt.distckpt-staging-*"))) == 1
    _assert_loaded(_load(distckpt.dcp.StorageReader(saved)))
    _assert_loaded(_load(FileSystemReader(saved)))
    _save(saved)  # the next save to the location removes the leftover
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# --------------------------------------------------------------------------- hostile files


def test_a_crafted_metadata_pickle_is_refused_before_it_runs(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Trace(str(marker))))
    with pytest.raises(CheckpointException, match=r"\.metadata: unreadable checkpoint metadata.*not allowed"):
        _load(distckpt.dcp.StorageReader(ckpt))
    assert not marker.exists()


def test_a_file_name_leading_out_of_the_checkpoint_is_refused(saved, tmp_path):
    (tmp_path / "outside.distcp").write_bytes((saved / "__0_0.distcp").read_bytes())
    md = pickle.loads((saved / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    (saved / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointException, match=r"\.metadata.*'\.\./outside\.distcp'"):
        _load(distckpt.dcp.StorageReader(saved, checksums=False))


def test_a_pickled_value_loads_under_the_allowlist_unless_the_checkpoint_is_trusted(tmp_path):
    marker = tmp_path / "ran"
    _save(tmp_path / "ckpt", {"w": W, "extra": Trace(str(marker))})
    assert not marker.exists()
    with pytest.raises(CheckpointException, match=r"value 'extra' in .*__0_\d\.distcp.*refusing to unpickle"):
        _load(distckpt.dcp.StorageReader(tmp_path / "ckpt"), {"w": torch.zeros_like(W), "extra": None})
    assert not marker.exists()
    state = _load(
        distckpt.dcp.StorageReader(tmp_path / "ckpt", trusted=True), {"w": torch.zeros_like(W), "extra": None}
    )
    assert marker.exists() and state["extra"] == str(marker)
    marker.unlink()
    _load(FileSystemReader(tmp_path / "ckpt"), {"w": torch.zeros_like(W), "extra": None})
    assert marker.exists()  # what DCP's own reader does with the same file


def test_distckpt_reader_reads_what_distckpt_save_wrote(tmp_path):
    sd = {"w": distckpt.ShardedTensor.from_rank_offsets("model.w", W.clone()), "step": 3}
    distckpt.save(sd, tmp_path / "ckpt")
    state = _load(distckpt.dcp.StorageReader(tmp_path / "ckpt"), {"model.w": torch.zeros_like(W)})
    assert torch.equal(state["model.w"], W)
