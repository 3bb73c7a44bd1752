"""distckpt reads checkpoints of plain PyTorch DCP: a directory with ``.metadata`` and no
``metadata.json`` (``dcp.save`` of tensors and of DTensors, ``torch_save_to_dcp``, Megatron-Core's
``torch_dcp`` format). They load as ``torch_dist`` checkpoints whose config is implied; tensor
keys are DCP's flattened names (``model.w``), non-tensor values are the common state, nested.
Every comparison is bit-exact against what PyTorch itself saved.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import dist
from distckpt.dcp_native import is_dcp_native
from tests.tools.test_cli import cli

W = torch.arange(48, dtype=torch.float32).reshape(6, 8)
E = (torch.arange(40, dtype=torch.float32) * 0.5).reshape(8, 5).to(torch.bfloat16)
STATE = {
    "model": {"w": W, "layer": {"bias": torch.arange(5, dtype=torch.int64)}},
    "optim": {"state": {"w": {"exp_avg": W * 3, "step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.01}]},
    "emb": E,
    "step": 11,
}
FLAT = {
    "model.w": W,
    "model.layer.bias": torch.arange(5, dtype=torch.int64),
    "optim.state.w.exp_avg": W * 3,
    "optim.state.w.step": torch.tensor(7.0),
    "emb": E,
}
COMMON = {"optim": {"param_groups": [{"lr": 0.01}]}, "step": 11}


def _quiet_dcp_save(state, path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save(state, checkpoint_id=str(path))


@pytest.fixture
def plain(tmp_path) -> Path:
    _quiet_dcp_save(STATE, tmp_path / "dcp")
    return tmp_path / "dcp"


def test_a_dcp_directory_is_a_checkpoint_and_an_interrupted_save_is_not(plain, tmp_path):
    assert sorted(p.name for p in plain.iterdir() if not p.name.endswith(".distcp")) == [".metadata"]
    assert is_dcp_native(plain) and distckpt.check_is_distributed_checkpoint(plain)
    # A torch_dist save that died between .metadata and metadata.json: common.pt gives it away.
    (plain / "common.pt").write_bytes(b"x")
    assert not is_dcp_native(plain) and not distckpt.check_is_distributed_checkpoint(plain)
    with pytest.raises(distckpt.CheckpointingException, match="interrupted torch_dist save"):
        distckpt.load_tensors_metadata(plain)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        distckpt.CheckpointingException, match="metadata.json is missing .* and so is DCP's .metadata"
    ):
        distckpt.load({}, tmp_path / "empty")


def test_queries_answer_with_dcp_names_and_nested_common_state(plain):
    meta = distckpt.load_tensors_metadata(plain)
    assert sorted(meta) == sorted(FLAT)
    assert all(
        tuple(meta[k].global_shape) == tuple(v.shape) and meta[k].dtype == v.dtype for k, v in FLAT.items()
    )
    plain_tensors = distckpt.load_plain_tensors(plain)
    assert sorted(plain_tensors) == sorted(FLAT)
    for k, v in FLAT.items():
        assert torch.equal(plain_tensors[k], v) and plain_tensors[k].dtype == v.dtype, k
    assert distckpt.load_common_state_dict(plain) == COMMON
    assert distckpt.load_content_metadata(plain) is None
    with pytest.raises(distckpt.CheckpointingException, match="read-only to distckpt"):
        distckpt.remove_sharded_tensors(plain, "optim.")
    assert sorted(distckpt.load_tensors_metadata(plain)) == sorted(FLAT)


def test_load_reshards_and_returns_common_state(plain):
    request = {
        "model": {"w": distckpt.ShardedTensor.from_rank_offsets("model.w", torch.zeros(6, 4), (1, 1, 2))},
        "emb": distckpt.ShardedTensor.from_rank_offsets(
            "emb", torch.zeros(4, 5, dtype=torch.bfloat16), (0, 1, 2)
        ),
    }
    loaded = distckpt.load(request, plain, strict="raise_unexpected", validate_access_integrity=False)
    assert torch.equal(loaded["model"]["w"], W[:, 4:])
    assert torch.equal(loaded["emb"], E[4:])
    assert loaded["step"] == 11 and loaded["optim"] == COMMON["optim"]


def test_torch_save_to_dcp_output_loads(tmp_path):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    torch.save({"a": W, "b": {"c": E}, "n": 3}, tmp_path / "model.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "dcp")
    out = distckpt.load_plain_tensors(tmp_path / "dcp")
    assert sorted(out) == ["a", "b.c"] and torch.equal(out["a"], W) and torch.equal(out["b.c"], E)
    assert distckpt.load_common_state_dict(tmp_path / "dcp") == {"n": 3}


def test_megatron_torch_dcp_layout_loads(tmp_path):
    # Megatron-Core's --ckpt-format torch_dcp: dcp.save of its whole training state dict.
    state = {
        "args": argparse.Namespace(lr=0.1),
        "checkpoint_version": 3.0,
        "iteration": 20,
        "model": {"decoder.layers.0.mlp.linear_fc1.weight": W},
        "optimizer": {"state": {"decoder.layers.0.mlp.linear_fc1.weight": {"exp_avg": W + 1}}},
        "rng_state": [{"random_rng_state": (3, (1, 2), None)}],
    }
    _quiet_dcp_save(state, tmp_path / "iter_0000020")
    ckpt = tmp_path / "iter_0000020"
    common = distckpt.load_common_state_dict(ckpt)  # argparse.Namespace is on the allowlist
    assert common["args"].lr == 0.1 and common["rng_state"] == [{"random_rng_state": (3, (1, 2), None)}]
    key = "model.decoder.layers.0.mlp.linear_fc1.weight"
    request = {"w": distckpt.ShardedTensor.from_rank_offsets(key, torch.zeros(3, 8), (0, 0, 2))}
    loaded = distckpt.load(request, ckpt, validate_access_integrity=False)
    assert torch.equal(loaded["w"], W[:3]) and loaded["iteration"] == 20 and loaded["args"].lr == 0.1
    assert torch.equal(
        distckpt.load_plain_tensors(ckpt)["optimizer.state." + key.split(".", 1)[1] + ".exp_avg"], W + 1
    )


# --------------------------------------------------------------------------- DTensors, 2 ranks


def _save_dtensors(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {
        "model": {
            "w": distribute_tensor(W, mesh, [Shard(0)]),
            "e": distribute_tensor(E, mesh, [Shard(1)]),
            "r": distribute_tensor(W[0], mesh, [Replicate()]),
        },
        "step": 5,
    }
    dcp.save(state, checkpoint_id=path)


def _load_on_two_ranks(path: str):
    r = dist.get_rank()
    # Other split than saved: w by columns, e by rows, r by halves.
    request = {
        "w": distckpt.ShardedTensor.from_rank_offsets("model.w", torch.zeros(6, 4), (1, r, 2)),
        "e": distckpt.ShardedTensor.from_rank_offsets(
            "model.e", torch.zeros(4, 5, dtype=torch.bfloat16), (0, r, 2)
        ),
        "r": distckpt.ShardedTensor.from_rank_offsets("model.r", torch.zeros(4), (0, r, 2)),
    }
    out = distckpt.load(request, path, strict="raise_unexpected")
    return {k: v for k, v in out.items()}


@pytest.mark.parametrize("save_world", [1, 2])
def test_dtensors_saved_on_one_or_two_ranks_load_resharded_on_one_and_two(run_ranks, tmp_path, save_world):
    ckpt = tmp_path / "dtensor"
    run_ranks(save_world, _save_dtensors, str(ckpt), timeout=120)
    assert is_dcp_native(ckpt)
    md = distckpt.load_tensors_metadata(ckpt)
    assert sorted(md) == ["model.e", "model.r", "model.w"]
    whole = distckpt.load_plain_tensors(ckpt)
    assert (
        torch.equal(whole["model.w"], W)
        and torch.equal(whole["model.e"], E)
        and torch.equal(whole["model.r"], W[0])
    )
    for r, out in enumerate(run_ranks(2, _load_on_two_ranks, str(ckpt), timeout=120)):
        assert torch.equal(out["w"], W[:, 4 * r : 4 * r + 4])
        assert torch.equal(out["e"], E[4 * r : 4 * r + 4])
        assert torch.equal(out["r"], W[0][4 * r : 4 * r + 4])
        assert out["step"] == 5


# --------------------------------------------------------------------------- CLI


def test_every_reading_command_works_on_a_dcp_directory(plain, tmp_path):
    out = cli("inspect", plain, "--flat").stdout
    assert "model.w" in out and "optim.state.w.exp_avg" in out and "plain PyTorch DCP" in out
    verdict = cli("verify", plain, "--deep").stdout
    assert "commit marker (.metadata)" in verdict and "read back 5 tensors (0 failed)" in verdict
    assert verdict.rstrip().splitlines()[-1].startswith("OK")
    shown = cli("show", plain, "model.w", "--slice", "1").stdout
    assert "8." in shown and "15." in shown
    for fmt, name in (("torch_dist", "td"), ("zarr", "zr")):
        cli("convert", plain, tmp_path / name, "--to", fmt)
        assert distckpt.check_is_distributed_checkpoint(tmp_path / name)
        back = distckpt.load_plain_tensors(tmp_path / name)
        assert all(torch.equal(back[k], v) for k, v in FLAT.items())
        assert distckpt.load_common_state_dict(tmp_path / name) == COMMON
        cli("diff", plain, tmp_path / name)
    cli("convert", plain, tmp_path / "m.safetensors", "--to", "safetensors")
    from safetensors.torch import load_file

    st = load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(st[k], v) for k, v in FLAT.items())
    err = cli("rm-prefix", plain, "optim.", code=2).stderr
    assert "read-only" in err and "convert" in err
