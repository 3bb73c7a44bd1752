"""Safe loading: nothing from a checkpoint is unpickled with arbitrary globals unless the caller
opts in with ``trusted=True`` (CLI ``--trust``) or admits a class with ``distckpt.add_safe_globals``.

The malicious payloads below would create a marker file when unpickled; every test checks that
the marker never appears and that the refusal is a CheckpointingException naming the file. The
attacker is assumed to control the whole checkpoint, so each crafted checkpoint gets a matching
integrity manifest: the checksums are no defence here, the allowlist is.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor
from distckpt.cli import main as cli_main
from distckpt.formats.manifest import RangeChecksum, crc32c
from distckpt.strategies import common as common_strategy
from distckpt.strategies.torch import read_metadata
from tests.support import faults


class RunsCode:
    """Unpickling this runs ``touch <marker>``: the canary of every test here."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@dataclasses.dataclass
class TrainingArgs:
    """A harmless custom class, as training code stores in its checkpoints."""

    lr: float
    schedule: str


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "unpickling ran code from the checkpoint"


@pytest.fixture
def allowlist():
    """Undo ``add_safe_globals`` after the test (it changes a process-wide list)."""
    saved = list(common_strategy._SAFE_GLOBALS)
    yield
    common_strategy._SAFE_GLOBALS[:] = saved


def _state(with_data: bool) -> dict:
    sd = {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.arange(12.0).reshape(3, 4) if with_data else torch.zeros(3, 4)
        ),
        "rng": ShardedObject("rng", {"seed": 3} if with_data else None, (1,), (0,)),
    }
    if with_data:
        sd["iteration"] = 5
    return sd


def _save(ckpt: Path, backend: str = "torch_dist", **common) -> Path:
    sd = _state(True)
    sd.update(common)
    distckpt.save(sd, ckpt, sharded_strategy=(backend, 1))
    return ckpt


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _replace_item(ckpt: Path, key: str, payload: bytes) -> None:
    """Point the stored item ``key`` of a torch_dist checkpoint at ``payload`` (appended to its
    file), rewriting ``.metadata`` and resealing the manifest as an attacker would."""
    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    path = ckpt / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(payload)
    md.storage_data[index] = type(info)(info.relative_path, offset, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    faults.reseal_manifest(
        ckpt, [(info.relative_path, RangeChecksum(offset, len(payload), crc32c(payload), key))]
    )


def _refused(ckpt: Path, file: str, verify: bool, pattern: str = "refusing to unpickle") -> None:
    with pytest.raises(CheckpointingException, match=re.escape(file) + ".*" + pattern):
        distckpt.load(_state(False), ckpt, verify=verify)


def _cli_refuses(ckpt: Path, *args: str) -> None:
    result = CliRunner().invoke(cli_main, [*args, str(ckpt)])
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output, result.output


# --------------------------------------------------------------------------- code in the checkpoint


@pytest.mark.parametrize("verify", [False, True])
def test_code_in_common_state_is_refused_and_never_runs(tmp_path, marker, verify):
    ckpt = _save(tmp_path / "ckpt")
    (ckpt / "common.pt").write_bytes(_torch_bytes({"iteration": 5, "hook": RunsCode(marker)}))
    faults.reseal_manifest(ckpt)
    _refused(ckpt, str(ckpt / "common.pt"), verify)
    for query in (distckpt.load_common_state_dict, distckpt.load_content_metadata):
        with pytest.raises(CheckpointingException, match=r"common\.pt.*refusing to unpickle"):
            query(ckpt)


@pytest.mark.parametrize("verify", [False, True])
def test_code_in_dcp_metadata_is_refused_and_never_runs(tmp_path, marker, verify):
    ckpt = _save(tmp_path / "ckpt")
    md = read_metadata(ckpt)
    md.mcore_data = {"w": RunsCode(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    faults.reseal_manifest(ckpt)
    _refused(ckpt, str(ckpt / ".metadata"), verify, r"posix\.system is not allowed in checkpoint metadata")
    for query in (
        distckpt.load_tensors_metadata,
        distckpt.load_sharded_metadata,
        distckpt.load_plain_tensors,
    ):
        with pytest.raises(CheckpointingException, match=r"\.metadata: unreadable checkpoint metadata"):
            query(ckpt)


@pytest.mark.parametrize("verify", [False, True])
def test_code_in_an_object_item_is_refused_and_never_runs(tmp_path, marker, verify):
    ckpt = _save(tmp_path / "ckpt")
    _replace_item(ckpt, "rng/shard_0_1", _torch_bytes([RunsCode(marker)]))
    _refused(ckpt, "ShardedObject 'rng/shard_0_1'", verify)


@pytest.mark.parametrize("verify", [False, True])
def test_code_in_an_object_file_is_refused_and_never_runs(tmp_path, marker, verify):
    ckpt = _save(tmp_path / "ckpt", "zarr")
    (ckpt / "rng" / "shard_0_1.pt").write_bytes(_torch_bytes(RunsCode(marker)))
    faults.reseal_manifest(ckpt)
    _refused(ckpt, str(ckpt / "rng" / "shard_0_1.pt"), verify)


@pytest.mark.parametrize("verify", [False, True])
def test_code_in_a_tensor_item_is_refused_and_never_runs(tmp_path, marker, verify):
    ckpt = _save(tmp_path / "ckpt")
    _replace_item(ckpt, "w", _torch_bytes(RunsCode(marker)))
    _refused(ckpt, "key 'w' in ", verify)


@pytest.mark.parametrize("where", ["common.pt", ".metadata", "object"])
def test_cli_commands_refuse_code_in_a_checkpoint_without_running_it(tmp_path, marker, where):
    ckpt = _save(tmp_path / "ckpt")
    if where == "common.pt":
        (ckpt / "common.pt").write_bytes(_torch_bytes({"hook": RunsCode(marker)}))
    elif where == ".metadata":
        md = read_metadata(ckpt)
        md.mcore_data = {"w": RunsCode(marker)}
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    else:
        _replace_item(ckpt, "rng/shard_0_1", _torch_bytes([RunsCode(marker)]))
    faults.reseal_manifest(ckpt)
    _cli_refuses(ckpt, "verify", "--deep")
    if where == ".metadata":
        _cli_refuses(ckpt, "inspect")


# --------------------------------------------------------------------------- the explicit opt-ins


def test_custom_class_in_common_state_is_refused_by_default_naming_file_and_class(tmp_path):
    ckpt = _save(tmp_path / "ckpt", args=TrainingArgs(0.1, "cosine"))
    with pytest.raises(
        CheckpointingException, match=r"common\.pt: refusing to unpickle .*TrainingArgs.*trusted=True"
    ):
        distckpt.load(_state(False), ckpt)


def test_trusted_load_admits_a_custom_class(tmp_path):
    ckpt = _save(tmp_path / "ckpt", args=TrainingArgs(0.1, "cosine"))
    assert distckpt.load(_state(False), ckpt, trusted=True)["args"] == TrainingArgs(0.1, "cosine")


def test_add_safe_globals_admits_a_custom_class_without_trust(tmp_path, allowlist):
    ckpt = _save(tmp_path / "ckpt", args=TrainingArgs(0.1, "cosine"))
    distckpt.add_safe_globals([TrainingArgs])
    assert distckpt.load(_state(False), ckpt)["args"] == TrainingArgs(0.1, "cosine")


def _save_custom_object(ckpt: Path) -> Path:
    sd = _state(True)
    sd["rng"] = ShardedObject("rng", TrainingArgs(0.2, "linear"), (1,), (0,))
    distckpt.save(sd, ckpt)
    return ckpt


def test_custom_class_in_an_object_needs_trust_or_the_allowlist(tmp_path, allowlist):
    ckpt = _save_custom_object(tmp_path / "ckpt")
    with pytest.raises(CheckpointingException, match=r"ShardedObject 'rng/shard_0_1'.*refusing to unpickle"):
        distckpt.load(_state(False), ckpt)
    assert distckpt.load(_state(False), ckpt, trusted=True)["rng"] == TrainingArgs(0.2, "linear")
    distckpt.add_safe_globals([TrainingArgs])
    assert distckpt.load(_state(False), ckpt)["rng"] == TrainingArgs(0.2, "linear")


def test_custom_class_in_dcp_metadata_needs_trust(tmp_path, allowlist):
    ckpt = _save(tmp_path / "ckpt")
    md = read_metadata(ckpt)
    md.mcore_data = {"w": {"note": TrainingArgs(0.3, "const")}}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    faults.reseal_manifest(ckpt)
    distckpt.add_safe_globals([TrainingArgs])  # admits classes in common state and objects only
    with pytest.raises(CheckpointingException, match=r"TrainingArgs is not allowed in checkpoint metadata"):
        distckpt.load(_state(False), ckpt)
    loaded = distckpt.load(_state(False), ckpt, trusted=True, verify=True)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4))


def test_checkpoints_of_plain_data_load_without_trust(tmp_path):
    ckpt = _save(tmp_path / "ckpt", args=argparse.Namespace(lr=0.1), rng_state=np.arange(4, dtype=np.uint32))
    loaded = distckpt.load(_state(False), ckpt, verify=True)
    assert loaded["args"] == argparse.Namespace(lr=0.1) and loaded["rng_state"].tolist() == [0, 1, 2, 3]
