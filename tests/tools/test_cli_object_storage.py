"""Every ``distckpt`` subcommand on object-store URLs (``s3://``, ``gs://``, ``az://``: the servers of
tests/conftest.py), with the store reached through the environment each cloud's own tools read or
through ``--storage-option`` alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import distckpt
from distckpt.storage import open_store
from tests.support import servers
from tests.support.clouds import clouds
from tests.support.harness import run_ranks
from tests.tools.test_cli import cli
from tests.tools.test_tools import WORLD, _save_model_and_optimizer, expected_tensors


def _saved_on(url):
    run_ranks(WORLD, _save_model_and_optimizer, url, "torch_dist")
    return url


@pytest.mark.parametrize("cloud", clouds())
def test_inspect_verify_and_show_read_a_checkpoint_on_an_object_store(cloud_url):
    url = _saved_on(cloud_url)
    info = json.loads(cli("inspect", url, "--json").stdout)
    want = expected_tensors()
    assert {t["key"] for t in info["tensors"]} == set(want)
    assert info["files"] == len(open_store(url).list())
    report = json.loads(cli("verify", url, "--json").stdout)
    assert report["ok"] and report["problems"] == []
    shown = cli("show", url, "row", "--full").stdout
    assert str(round(float(want["row"][0, 1]), 2))[:4] in shown


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_verify_reports_a_corrupted_object_on_an_object_store(cloud_url):
    url = _saved_on(cloud_url)
    store = open_store(url)
    name = next(n for n in store.list() if n.endswith(".distcp"))
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 1
    store.put(name, bytes(data))
    report = json.loads(cli("verify", url, "--json", code=1).stdout)
    assert any("CRC32C mismatch" in p and name in p for p in report["problems"])


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_convert_local_to_an_object_store_to_local_to_safetensors_keeps_every_tensor(cloud_url, tmp_path):
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "torch_dist")
    cli("convert", local, cloud_url, "--to", "torch_dist")
    assert distckpt.check_is_distributed_checkpoint(cloud_url)
    cli("diff", local, cloud_url)  # exit 0: same tensors, objects and common state
    back = tmp_path / "back"
    cli("convert", cloud_url, back, "--to", "torch_dist")
    cli("diff", cloud_url, back)
    cli("convert", cloud_url, tmp_path / "hf", "--to", "safetensors")
    loaded = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        loaded.update(load_file(f))
    want = expected_tensors()
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_convert_refuses_to_overwrite_a_committed_checkpoint_on_an_object_store(cloud_url, tmp_path):
    url = _saved_on(cloud_url)
    result = cli("convert", url, url + "-copy", "--to", "torch_dist")
    assert result.exit_code == 0
    out = cli("convert", url, url + "-copy", "--to", "torch_dist", code=2)
    assert "already holds a committed checkpoint" in out.stderr


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_rm_prefix_and_rename_work_in_place_on_an_object_store(cloud_url):
    url = _saved_on(cloud_url)
    cli("rm-prefix", url, "optimizer.")
    keys = set(distckpt.load_tensors_metadata(url))
    assert keys == {k for k in expected_tensors() if not k.startswith("optimizer.")}
    cli("rename", url, "--map", "row=renamed_row")
    plain = distckpt.load_plain_tensors(url)
    assert "row" not in plain and torch.equal(plain["renamed_row"], expected_tensors()["row"])
    assert json.loads(cli("verify", url, "--json").stdout)["ok"]


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_zarr_checkpoints_convert_to_an_object_store_and_are_inspected_verified_and_diffed_there(
    cloud_url, tmp_path
):
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "zarr")
    cli("convert", local, cloud_url, "--to", "zarr")
    info = json.loads(cli("inspect", cloud_url, "--json").stdout)
    assert info["format"] == "zarr" and {t["key"] for t in info["tensors"]} == set(expected_tensors())
    assert json.loads(cli("verify", cloud_url, "--json").stdout)["ok"]
    cli("diff", local, cloud_url)
    plain = distckpt.load_plain_tensors(cloud_url)
    assert all(torch.equal(plain[k], v) for k, v in expected_tensors().items())


# --------------------------------------------------------------------------- --storage-option


def _s3_options(flag="-o"):
    """The moto server's endpoint and credentials as ``flag KEY=VALUE`` arguments."""
    import os

    options = {
        "endpoint": os.environ["AWS_ENDPOINT_URL"],
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "region": "us-east-1",
        "allow_http": "true",
    }
    return [a for k, v in options.items() for a in (flag, f"{k}={v}")]


# Environment in which S3 cannot be reached: no credentials, an endpoint that obstore refuses at
# once (plain http, not allowed), instance metadata on a closed local port. Anything that works in
# it got its endpoint and credentials from --storage-option.
_NO_S3_ENV = {"AWS_ENDPOINT_URL": "http://unreachable.invalid", "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9"}


def _without_s3_env(monkeypatch):
    import os

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in _NO_S3_ENV.items():
        monkeypatch.setenv(k, v)


def test_storage_options_alone_reach_s3_from_a_process_without_aws_environment(s3_url):
    import os
    import subprocess
    import sys

    url = _saved_on(s3_url)
    options = _s3_options()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | _NO_S3_ENV

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "distckpt.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run("verify", url, "--json", *options)  # one process (a CLI start costs seconds)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["backend"] == "torch_dist"


def test_convert_diff_and_surgery_take_storage_options_for_each_side(s3_url, tmp_path, monkeypatch):
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "torch_dist")
    options, target_options = _s3_options(), _s3_options("--target-storage-option")
    _without_s3_env(monkeypatch)
    out = cli(
        "convert",
        local,
        s3_url,
        "--to",
        "torch_dist",
        "-O",
        "access_key_id=testing",
        "-O",
        "secret_access_key=testing",
        code=2,
    )  # no endpoint among the options
    assert "unreachable.invalid" in out.stderr
    assert not distckpt.check_is_distributed_checkpoint(s3_url, dict(o.split("=", 1) for o in options[1::2]))
    cli("convert", local, s3_url, "--to", "torch_dist", *target_options)
    # --b-storage-option replaces -o for B: B gets credentials but no endpoint, so the environment's
    out = cli(
        "diff",
        s3_url,
        s3_url,
        *options,
        "--b-storage-option",
        "access_key_id=testing",
        "--b-storage-option",
        "secret_access_key=testing",
        code=2,
    )
    assert "unreachable.invalid" in out.stderr
    cli("diff", local, s3_url, *options)  # -o: to every URL; identical, exit 0
    copy = s3_url + "-copy"
    cli("convert", s3_url, copy, "--to", "torch_dist", *options)  # -o: both sides
    cli("rm-prefix", copy, "optimizer.", *options)
    cli("rename", copy, "--map", "row=renamed_row", *options)
    info = json.loads(cli("inspect", copy, "--json", *options).stdout)
    want = {k for k in expected_tensors() if not k.startswith("optimizer.") and k != "row"} | {"renamed_row"}
    assert {t["key"] for t in info["tensors"]} == want
    shown = cli("show", copy, "renamed_row", "--full", *options).stdout
    assert str(round(float(expected_tensors()["row"][0, 1]), 2))[:4] in shown


def test_a_bad_storage_option_is_a_clear_usage_error(s3_url, tmp_path):
    out = cli("inspect", s3_url, "-o", "no_such_option=1", code=2)
    assert "no_such_option" in out.stderr and "not valid for store 'S3'" in out.stderr
    out = cli("inspect", s3_url, "-o", "endpoint", code=2)
    assert "expected KEY=VALUE" in out.stderr
    out = cli("inspect", s3_url, "-o", "part_size=big", code=2)
    assert "part_size='big' must be an integer" in out.stderr
    out = cli("inspect", tmp_path, "-o", "region=us-east-1", code=2)
    assert "object-store URLs" in out.stderr


def _gcs_options(tmp_path):
    """The GCS emulator as obstore's own emulator mode: a service-account key file holding its
    ``gcs_base_url`` and ``disable_oauth`` (no token asked for)."""
    import os

    key = {
        "gcs_base_url": os.environ["STORAGE_EMULATOR_HOST"],
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps(key))
    return ["-o", f"service_account_path={path}"]


def _azure_options(tmp_path):
    """Azurite's account, key and blob endpoint (``http://...``, hence ``allow_http``)."""
    import os

    endpoint = dict(p.split("=", 1) for p in os.environ["AZURE_STORAGE_CONNECTION_STRING"].split(";") if p)[
        "BlobEndpoint"
    ]
    options = {
        "account_name": servers.AZURITE_ACCOUNT,
        "account_key": servers.AZURITE_KEY,
        "endpoint": endpoint,
        "allow_http": "true",
    }
    return [a for k, v in options.items() for a in ("-o", f"{k}={v}")]


@pytest.mark.parametrize("cloud", ["gcs", "azure"])  # S3: the tests above
def test_storage_options_alone_reach_gcs_and_azure(cloud, cloud_url, tmp_path, monkeypatch):
    """GCS and Azure through ``--storage-option`` alone, with the variable the fixture set for that
    cloud's tools removed: convert there, verify, diff back, surgery, inspect."""
    options = _gcs_options(tmp_path) if cloud == "gcs" else _azure_options(tmp_path)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST" if cloud == "gcs" else "AZURE_STORAGE_CONNECTION_STRING")
    local = tmp_path / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(local), "torch_dist")
    cli("convert", local, cloud_url, "--to", "torch_dist", *options)
    assert json.loads(cli("verify", cloud_url, "--json", *options).stdout)["ok"]
    cli("diff", local, cloud_url, *options)
    cli("rm-prefix", cloud_url, "optimizer.", *options)
    info = json.loads(cli("inspect", cloud_url, "--json", *options).stdout)
    assert {t["key"] for t in info["tensors"]} == {
        k for k in expected_tensors() if not k.startswith("optimizer.")
    }
