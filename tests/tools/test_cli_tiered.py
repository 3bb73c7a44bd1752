"""``distckpt inspect/verify --local-copy`` and ``distckpt tiers`` on tiered checkpoints: two real
gloo ranks save through TieredCheckpointManager to an object store (S3 on moto; GCS and Azure under
``slow``; tests/conftest.py),
each rank with a local directory of its own (``tmp/node{rank}``: a node each); the CLI then looks
at the remote checkpoint and one node's local copy."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import dist as ddist
from distckpt.storage import open_store
from distckpt.tiered import TieredCheckpointManager
from tests.support.clouds import clouds
from tests.support.harness import run_ranks
from tests.tools.test_cli import cli


def _state(step: int):
    """Rank r's rows of "w", a replicated "b" (rank 0 writes it) and the common step."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    w = torch.arange(64 * 128, dtype=torch.float32).reshape(64, 128) + 1000 * rank + step
    return {
        "w": distckpt.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": distckpt.ShardedTensor.from_rank_offsets("b", torch.full((16,), float(step)), replica_id=rank),
        "common": {"step": step},
    }


def _save(url, tmp, steps, wait=True):
    tiers = TieredCheckpointManager(url, os.path.join(tmp, f"node{ddist.get_rank()}"), keep_local=5)
    for step in steps:
        tiers.save(_state(step), step)
    tiers.close(wait=wait)


def _saved(url, tmp_path, steps=(5,)):
    run_ranks(2, _save, url, str(tmp_path), list(steps))
    return f"{url}/iter_0000005", tmp_path / "node0" / "iter_0000005"


def _snapshot(url, local: Path):
    """Everything both tiers hold, with a digest of each local file: to show nothing changed."""
    files = {
        str(p.relative_to(local)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(local.rglob("*"))
        if p.is_file()
    }
    return open_store(url).list(), files


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def _by_name(rows):
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_inspect_says_which_files_a_load_reads_locally_and_changes_nothing(cloud_url, tmp_path):
    remote, local = _saved(cloud_url, tmp_path)
    before = _snapshot(cloud_url, local)
    doc = json.loads(cli("inspect", remote, "--local-copy", local, "--json").stdout)
    plan = doc["local_copy"]
    rows = _by_name(plan["files"])
    assert plan["save"] == "same save" and doc["format"] == "torch_dist"
    assert rows["__0_0.distcp"]["source"] == "local" and rows["__0_0.distcp"]["reason"] == ""
    # rank 1's files are on the other node
    assert rows["__1_0.distcp"]["source"] == "remote"
    assert rows["__1_0.distcp"]["reason"] == "not in the local copy"
    assert plan["local files"] >= 1 and plan["remote files"] >= 1
    assert plan["local bytes"] == sum(r["size"] for r in rows.values() if r["source"] == "local")
    text = cli("inspect", remote, "--local-copy", local).stdout
    line = next(x for x in text.splitlines() if x.startswith("__0_0.distcp"))
    assert line.split()[-1] == "local"
    assert "carry the remote's save token" in text and "a load reads" in text
    assert _snapshot(cloud_url, local) == before


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_verify_checks_the_local_copy_and_fails_on_a_damaged_local_file(cloud_url, tmp_path):
    remote, local = _saved(cloud_url, tmp_path)
    good = json.loads(cli("verify", remote, "--local-copy", local, "--json").stdout)
    files = _by_name(good["local_copy"]["files"])
    assert good["ok"] and good["local_copy"]["ok"] and good["local_copy"]["save"] == "same save"
    assert files["__0_0.distcp"]["status"] == "ok" and files["__1_0.distcp"]["status"] == "absent"
    assert "local copy OK" in cli("verify", remote, "--local-copy", local).stdout

    _flip_a_byte(local / "__0_0.distcp")
    bad = json.loads(cli("verify", remote, "--local-copy", local, "--json", code=1).stdout)
    files = _by_name(bad["local_copy"]["files"])
    assert files["__0_0.distcp"]["status"] == "damaged" and "CRC32C" in files["__0_0.distcp"]["reason"]
    assert not bad["ok"] and bad["problems"] == []  # the remote checkpoint itself is intact
    text = cli("verify", remote, "--local-copy", local, code=1).stdout
    assert "DAMAGED" in text and "local copy: 1 problem(s)" in text
    # and a load would not take that file from the local copy
    plan = json.loads(cli("inspect", remote, "--local-copy", local, "--json").stdout)["local_copy"]
    row = _by_name(plan["files"])["__0_0.distcp"]
    assert row["source"] == "remote" and "CRC32C" in row["reason"]


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_local_copy_of_another_save_is_reported_and_fails_verify(cloud_url, tmp_path):
    remote, local = _saved(cloud_url, tmp_path)
    # The same iteration saved to another remote from the same local directories.
    run_ranks(2, _save, cloud_url + "-other", str(tmp_path), [5])
    doc = json.loads(cli("verify", remote, "--local-copy", local, "--json", code=1).stdout)
    assert doc["local_copy"]["save"] == "another save" and doc["problems"] == []
    assert any("another save" in p for p in doc["local_copy"]["problems"])
    text = cli("verify", remote, "--local-copy", local, code=1).stdout
    assert "a copy of another save" in text
    plan = json.loads(cli("inspect", remote, "--local-copy", local, "--json").stdout)["local_copy"]
    assert plan["save"] == "another save" and plan["local files"] == 0
    assert _by_name(plan["files"])["__0_0.distcp"]["reason"] == "the local copy is of another save"


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_tiers_lists_committed_and_uncommitted_iterations_and_the_local_owners(cloud_url, tmp_path):
    run_ranks(2, _save, cloud_url, str(tmp_path), [5])
    run_ranks(2, _save, cloud_url, str(tmp_path), [6], False)  # upload cancelled: not committed
    before = _snapshot(cloud_url, tmp_path / "node1")
    doc = json.loads(cli("tiers", cloud_url, "--local", tmp_path / "node1", "--json").stdout)
    rows = {r["iteration"]: r for r in doc["iterations"]}
    assert rows[5]["remote"] == "committed" and rows[5]["local_owners"] == [1]
    assert rows[5]["save"] == "same save"
    assert rows[6]["local_owners"] == [1] and rows[6]["remote"] in ("uncommitted", None)
    text = cli("tiers", cloud_url, "--local", tmp_path / "node1").stdout
    line = next(x for x in text.splitlines() if x.startswith("iter_0000005"))
    assert line.split()[1:] == ["committed", "owner", "1", "same", "save"]
    assert _snapshot(cloud_url, tmp_path / "node1") == before


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_local_copy_must_be_an_existing_directory(cloud_url, tmp_path):
    remote, _ = _saved(cloud_url, tmp_path)
    out = cli("verify", remote, "--local-copy", tmp_path / "nowhere", code=2)
    assert "--local-copy" in out.stderr


def test_help_shows_the_tier_options_with_examples():
    out = cli("tiers", "--help").stdout
    assert "Example" in out and "distckpt tiers" in out and "--local" in out
    for command in ("inspect", "verify"):
        assert (
            f"distckpt {command} s3://bucket/run/iter_0000100 --local-copy" in cli(command, "--help").stdout
        )
    assert "tiers" in cli("--help").stdout


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_verify_reports_a_file_the_marker_lists_but_the_local_copy_lost(cloud_url, tmp_path):
    remote, local = _saved(cloud_url, tmp_path)
    (local / "__0_1.distcp").unlink()
    doc = json.loads(cli("verify", remote, "--local-copy", local, "--json", code=1).stdout)
    assert _by_name(doc["local_copy"]["files"])["__0_1.distcp"]["status"] == "absent"
    assert doc["local_copy"]["problems"] == [
        "__0_1.distcp: listed by the marker of owner 0 but not in the local copy"
    ]
