"""Every ``distckpt`` subcommand on an ``s3://`` URL (moto server of the s3_server fixture)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

import distckpt
from distckpt.storage import open_store
from tests.harness import run_ranks
from tests.test_cli import cli
from tests.test_tools import WORLD, _save_model_and_optimizer, expected_tensors


def _saved_on_s3(url):
    run_ranks(WORLD, _save_model_and_optimizer, url, "torch_dist")
    return url


def test_inspect_verify_and_show_read_an_s3_checkpoint(s3_url):
    url = _saved_on_s3(s3_url)
    info = json.loads(cli("inspect", url, "--json").stdout)
    want = expected_tensors()
    assert {t["key"] for t in info["tensors"]} == set(want)
    assert info["files"] == len(open_store(url).list())
    report = json.loads(cli("verify", url, "--json").stdout)
    assert report["ok"] and report["problems"] == []
    shown = cli("show", url, "row", "--full").stdout
    assert str(round(float(want["row"][0, 1]), 2))[:4] in shown


def test_verify_reports_a_corrupted_object_on_s3(s3_url):
    url = _saved_on_s3(s3_url)
    store = open_store(url)
    name = next(n for n in store.list() if n.endswith(".distcp"))
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 1
    store.put(name, bytes(data))
    report = json.loads(cli("verify", url, "--json", code=1).stdout)
    assert any("CRC32C mismatch" in p and name in p for p in report["problems"])


def test_convert_local_to_s3_to_local_to_safetensors_keeps_every_tensor(s3_url, tmp_path):
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "torch_dist")
    cli("convert", local, s3_url, "--to", "torch_dist")
    assert distckpt.check_is_distributed_checkpoint(s3_url)
    cli("diff", local, s3_url)  # exit 0: same tensors, objects and common state
    back = tmp_path / "back"
    cli("convert", s3_url, back, "--to", "torch_dist")
    cli("diff", s3_url, back)
    cli("convert", s3_url, tmp_path / "hf", "--to", "safetensors")
    loaded = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        loaded.update(load_file(f))
    want = expected_tensors()
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)


def test_convert_refuses_to_overwrite_a_committed_checkpoint_on_s3(s3_url, tmp_path):
    url = _saved_on_s3(s3_url)
    result = cli("convert", url, url + "-copy", "--to", "torch_dist")
    assert result.exit_code == 0
    out = cli("convert", url, url + "-copy", "--to", "torch_dist", code=2)
    assert "already holds a committed checkpoint" in out.stderr


def test_rm_prefix_and_rename_work_in_place_on_s3(s3_url):
    url = _saved_on_s3(s3_url)
    cli("rm-prefix", url, "optimizer.")
    keys = set(distckpt.load_tensors_metadata(url))
    assert keys == {k for k in expected_tensors() if not k.startswith("optimizer.")}
    cli("rename", url, "--map", "row=renamed_row")
    plain = distckpt.load_plain_tensors(url)
    assert "row" not in plain and torch.equal(plain["renamed_row"], expected_tensors()["row"])
    assert json.loads(cli("verify", url, "--json").stdout)["ok"]


def test_zarr_checkpoints_convert_to_s3_and_are_inspected_verified_and_diffed_there(s3_url, tmp_path):
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "zarr")
    cli("convert", local, s3_url, "--to", "zarr")
    info = json.loads(cli("inspect", s3_url, "--json").stdout)
    assert info["format"] == "zarr" and {t["key"] for t in info["tensors"]} == set(expected_tensors())
    assert json.loads(cli("verify", s3_url, "--json").stdout)["ok"]
    cli("diff", local, s3_url)
    plain = distckpt.load_plain_tensors(s3_url)
    assert all(torch.equal(plain[k], v) for k, v in expected_tensors().items())
