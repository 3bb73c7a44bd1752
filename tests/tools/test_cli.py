"""The ``distckpt`` command, driven as users drive it (click's CliRunner; one real subprocess), on a
multi-rank checkpoint written by distckpt and on the Megatron-Core fixtures.

Exit codes: 0 ok, 1 problems/differences found, 2 usage or input error, 3 internal error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from tests.support import layouts
from tests.support.harness import run_ranks
from tests.tools.test_tools import (
    COMMON,
    FIXTURES,
    WORLD,
    _save_model_and_optimizer,
    expected_tensors,
    fixture_tensors,
    small_checkpoint,
)

COMMANDS = ["inspect", "show", "verify", "diff", "convert", "rm-prefix", "rename", "demo"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(path), "torch_dist")
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def cli(*args, code=0):
    """Run ``distckpt ARGS``; check the exit code; return the result (stdout and stderr apart)."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, (
        f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


# --------------------------------------------------------------------------- help and errors


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    out = cli(command, "--help").stdout
    assert "Example" in out and f"distckpt {command}" in out


def test_top_level_help_lists_the_commands_and_exit_codes():
    out = cli("--help").stdout
    assert all(c in out for c in COMMANDS) and "Exit codes" in out


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "/nonexistent/ckpt"],
        ["verify", "/nonexistent/ckpt"],
        ["show", "{fixture}", "no.such.key"],
        ["show", "{fixture}", "decoder.extra.0", "--slice", "0:1,:,5"],
        ["diff", "{fixture}", "/nonexistent"],
        ["convert", "{fixture}", "{tmp}/out", "--to", "safetensors", "--keys", "("],
        ["convert", "{fixture}", "{tmp}/out", "--to", "torch", "--max-shard-size", "1GB"],
        ["convert", "{fixture}", "{tmp}/out", "--to", "torch", "--dtype", "float7"],
        ["rename", "{fixture}"],
        ["rm-prefix", "{tmp}", "x"],
        ["inspect", "{fixture}", "--depth", "-1"],
    ],
)
def test_user_errors_exit_2_with_one_line_and_no_traceback(args, tmp_path):
    fixture = FIXTURES["tp2_basic"] / "ckpt"
    args = [a.format(fixture=fixture, tmp=tmp_path) for a in args]
    result = cli(*args, code=2)
    assert "Traceback" not in result.output
    assert result.stderr.strip() and len(result.stderr.strip().splitlines()) <= 4
    assert not (tmp_path / "out").exists()


def test_not_a_checkpoint_names_the_missing_commit_marker(tmp_path):
    (tmp_path / "empty").mkdir()
    err = cli("inspect", tmp_path / "empty", code=2).stderr
    assert "metadata.json is missing" in err


def test_internal_errors_exit_3_with_a_traceback(monkeypatch):
    import distckpt.cli.commands.inspect_show as inspect_command

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(inspect_command, "inspect_source", broken)
    result = cli("inspect", FIXTURES["tp2_basic"] / "ckpt", code=3)
    assert "Traceback" in result.stderr and "boom" in result.stderr and "internal error" in result.stderr


def test_trust_is_needed_to_show_an_object_outside_the_allowlist(tmp_path):
    from tests.tools.test_tools import Opaque

    run_ranks(2, _save_opaque_object, str(tmp_path / "c"))
    key = "obj/shard_0_1"
    err = cli("show", tmp_path / "c", key, code=2).stderr
    assert "--trust" in err
    assert "Opaque" in cli("show", tmp_path / "c", key, "--trust").stdout
    assert Opaque


def _save_opaque_object(ckpt):
    from distckpt import ShardedObject
    from tests.tools.test_tools import Opaque

    rank = distckpt.dist.get_rank()
    distckpt.save({"o": ShardedObject("obj", Opaque(), (1,), (0,), replica_id=rank)}, ckpt)


# --------------------------------------------------------------------------- inspect and show


def test_inspect_lists_every_key_with_its_shape(saved):
    out = cli("inspect", saved, "--flat").stdout
    for key, tensor in expected_tensors().items():
        assert re.search(rf"^{re.escape(key)}\s+{re.escape(str(list(tensor.shape)))}\s", out, re.M), key
    assert "stored" in out and "[2, 1, 24]" in out  # the flattened optimizer key's on-disk shape
    assert "rng_state/shard_0.3_1.4" in out and "'iteration': 7" in out and "tools-test" in out


def test_inspect_tree_shows_every_key_segment_and_the_manifest(saved):
    out = cli("inspect", saved).stdout
    assert "integrity manifest:" in out and "checksummed ranges" in out
    assert re.search(r"^optimizer\s+2 tensors", out, re.M)
    assert re.search(r"└── exp_avg_bf16\s+\[4, 10\]\s+\[2, 1, 20\]\s+bfloat16", out)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_inspect_json_describes_megatron_fixtures(name):
    doc = json.loads(cli("inspect", FIXTURES[name] / "ckpt", "--json").stdout)
    assert {t["key"]: t["shape"] for t in doc["tensors"]} == {
        k: list(v.shape) for k, v in fixture_tensors(name).items()
    }
    assert doc["format"] == ("zarr" if "zarr" in name else "torch_dist")


def test_inspect_reads_safetensors_and_torch_files(saved, tmp_path):
    cli("convert", saved, tmp_path / "m.safetensors", "--to", "safetensors")
    cli("convert", saved, tmp_path / "m.pt", "--to", "torch")
    for path, fmt in ((tmp_path / "m.safetensors", "safetensors"), (tmp_path / "m.pt", "torch")):
        doc = json.loads(cli("inspect", path, "--json").stdout)
        assert doc["format"] == fmt and len(doc["tensors"]) == len(expected_tensors())


def test_show_prints_only_the_requested_slice(saved):
    out = cli("show", saved, "optimizer.exp_avg", "--slice", "1:3,0:2").stdout
    want = expected_tensors()["optimizer.exp_avg"][1:3, 0:2]
    assert "optimizer.exp_avg  [8, 6] float32 [1:3,0:2] -> [2, 2]" in out
    values = [float(v) for v in re.findall(r"-?\d+\.\d+", out.split("tensor(", 1)[1])]
    assert values == pytest.approx(want.flatten().tolist(), abs=1e-4)


def test_show_prints_an_object(saved):
    out = cli("show", saved, "rng_state/shard_0.2_1.4").stdout
    assert "'rank': 2" in out and "obj2" in out


# --------------------------------------------------------------------------- verify


def test_verify_passes_a_good_checkpoint(saved):
    out = cli("verify", saved).stdout
    assert "OK" in out and "against the manifest (sizes and CRC32C)" in out


def test_verify_fails_on_a_truncated_file(ckpt):
    data = sorted(ckpt.glob("*.distcp"))[-1]
    os.truncate(data, data.stat().st_size - 1)
    out = cli("verify", ckpt, code=1).stdout
    assert data.name in out and "problem" in out


def test_verify_fails_on_a_truncated_megatron_fixture_copy(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES["tp2_basic"] / "ckpt", tmp_path / "ckpt"))
    os.truncate(ckpt / "__1_0.distcp", 1000)
    doc = json.loads(cli("verify", ckpt, "--json", code=1).stdout)
    assert not doc["ok"] and all(p.startswith("__1_0.distcp") for p in doc["problems"])


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_verify_passes_megatron_fixtures_deep(name):
    cli("verify", FIXTURES[name] / "ckpt", "--deep")


# --------------------------------------------------------------------------- diff


def test_diff_finds_a_planted_difference(tmp_path):
    w = torch.randn(16, 16)
    changed = w.clone()
    changed[5, 7] -= 0.25
    a = small_checkpoint(tmp_path / "a", {"w": w, "v": torch.ones(3)}, {"iteration": 1})
    b = small_checkpoint(tmp_path / "b", {"w": changed, "v": torch.ones(3)}, {"iteration": 1})
    out = cli("diff", a, b, code=1).stdout
    assert re.search(r"^w\s+values\s+0\.25\s", out, re.M) and "1 of 256 elements differ" in out
    assert "different" in out
    cli("diff", a, b, "--atol", "0.3")
    cli("diff", a, b, "--exclude", "^w$")
    doc = json.loads(cli("diff", a, b, "--json", code=1).stdout)
    assert doc["tensors"][0]["key"] == "w" and doc["tensors"][0]["mismatched"] == 1


def test_diff_of_identical_checkpoints_exits_0(saved):
    assert "identical" in cli("diff", saved, saved).stdout


# --------------------------------------------------------------------------- convert


def test_convert_to_safetensors_loads_with_safetensors_to_the_same_tensors(saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    result = cli("convert", saved, out, "--to", "safetensors", "--max-shard-size", "500")
    assert "left out" in result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(out / shard))
    plain = distckpt.load_plain_tensors(saved)
    assert loaded.keys() == plain.keys() == expected_tensors().keys()
    assert all(layouts.bitwise_equal(loaded[k], plain[k]) for k in plain)


def test_convert_model_only_bf16_round_trips_through_import(saved, tmp_path):
    cli(
        "convert",
        saved,
        tmp_path / "model.safetensors",
        "--to",
        "safetensors",
        "--model-only",
        "--dtype",
        "bf16",
    )
    cli("convert", tmp_path / "model.safetensors", tmp_path / "back", "--to", "torch_dist")
    cli("verify", tmp_path / "back")
    out = cli("diff", saved, tmp_path / "back", "--no-values", "--keys", ".", code=1).stdout
    assert "optimizer.exp_avg " in out and "only in A" in out
    doc = json.loads(
        cli(
            "diff",
            saved,
            tmp_path / "back",
            "--json",
            "--exclude",
            "^optimizer",
            "--atol",
            "0.1",
            "--rtol",
            "0.01",
            code=1,
        ).stdout
    )
    assert {t["kind"] for t in doc["tensors"]} == {"dtype"}  # fp32/fp16 became bf16; values within tolerance
    assert all(t.get("mismatched", 0) == 0 for t in doc["tensors"])


@pytest.mark.parametrize("to", ["zarr", "torch_dist", "torch"])
def test_convert_between_formats_keeps_every_tensor(saved, tmp_path, to):
    out = tmp_path / ("m.pt" if to == "torch" else to)
    cli("convert", saved, out, "--to", to)
    report = json.loads(
        cli("diff", saved, out, "--json", "--keys", ".", code=1 if to == "torch" else 0).stdout
    )
    assert not report["tensors"] and not report["only_a"] and not report["only_b"]


def test_convert_megatron_zarr_fixture_to_torch_dist(tmp_path):
    cli("convert", FIXTURES["tp2_zarr"] / "ckpt", tmp_path / "td", "--to", "torch_dist")
    cli("diff", FIXTURES["tp2_zarr"] / "ckpt", tmp_path / "td")
    cli("verify", tmp_path / "td")


def test_convert_refuses_an_existing_destination_unless_overwrite(saved, tmp_path):
    (tmp_path / "m.pt").write_bytes(b"old")
    assert "already exists" in cli("convert", saved, tmp_path / "m.pt", "--to", "torch", code=2).stderr
    cli("convert", saved, tmp_path / "m.pt", "--to", "torch", "--overwrite")
    assert len(torch.load(tmp_path / "m.pt", weights_only=True)) == len(expected_tensors())


# --------------------------------------------------------------------------- surgery


def test_rm_prefix_result_loads(ckpt):
    assert "removed 2 keys" in cli("rm-prefix", ckpt, "optimizer.").stdout
    cli("verify", ckpt)
    assert not any(k.startswith("optimizer.") for k in distckpt.load_plain_tensors(ckpt))
    assert distckpt.load_common_state_dict(ckpt) == {**COMMON, "content_metadata": {"format": "tools-test"}}


def test_rm_prefix_out_writes_a_copy(saved, tmp_path):
    cli("rm-prefix", saved, "optimizer.", "--out", tmp_path / "model")
    assert len(distckpt.load_plain_tensors(tmp_path / "model")) == len(expected_tensors()) - 2
    cli("verify", saved)


def test_rename_result_loads(ckpt):
    out = cli("rename", ckpt, "--map", "col=decoder.col", "--regex", r"^optimizer\.=opt.").stdout
    assert re.search(r"^col\s+->\s+decoder\.col", out, re.M) and "renamed 3 keys" in out
    tensors = distckpt.load_plain_tensors(ckpt)
    assert layouts.bitwise_equal(tensors["decoder.col"], expected_tensors()["col"])
    assert "opt.exp_avg" in tensors
    cli("verify", ckpt)


def test_rename_dry_run_and_megatron_fixture_copy(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES["pp_prepend"] / "ckpt", tmp_path / "ckpt"))
    before = (ckpt / ".metadata").read_bytes()
    assert "would be renamed" in cli("rename", ckpt, "--regex", "^decoder=model.decoder", "--dry-run").stdout
    assert (ckpt / ".metadata").read_bytes() == before
    cli("rename", ckpt, "--regex", "^decoder=model.decoder")
    tensors = distckpt.load_plain_tensors(ckpt)
    renamed = {
        ("model." + k if k.startswith("decoder") else k): v for k, v in fixture_tensors("pp_prepend").items()
    }
    assert tensors.keys() == renamed.keys() and all(torch.equal(tensors[k], v) for k, v in renamed.items())


# --------------------------------------------------------------------------- the real command


def test_the_command_runs_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt.cli", "inspect", str(FIXTURES["flat4"] / "ckpt"), "--json"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tensors"]) == len(fixture_tensors("flat4"))
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt.cli", "verify", "/nonexistent"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
