"""The containment rule (distckpt/containment.py): crafted checkpoints whose names or symlinks
lead outside them, against every entry point that reads, writes or deletes — the API (load,
load_plain_tensors, load_common_state_dict, load_tensors_metadata, remove_sharded_tensors) and
the CLI (inspect, verify, diff, convert, rm-prefix, rename). Each case checks the error or exit
code and its message, and that the victim file outside is untouched and nothing was written
outside the checkpoint or the destination. tests/untrusted/test_hostile.py covers the load-path name
checks of ``.metadata`` records, the manifest and zarr root listings; this file extends them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import CheckpointingException, ShardedObject, ShardedTensor, containment
from distckpt.cli import main
from distckpt.storage import LocalStore, open_store
from distckpt.strategies.torch import read_metadata
from tests.support.faults import reseal_manifest

VICTIM = b"precious: must survive"


def _state(with_object: bool = True, object_key: str = "rng"):
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32)),
        "optimizer.m": ShardedTensor.from_rank_offsets("optimizer.m", torch.ones(32)),
        "step": 7,
    }
    if with_object:
        sd["obj"] = ShardedObject(object_key, {"seed": 1}, (1,), (0,), replica_id=0)
    return sd


def _save(path: Path, backend: str, **kw) -> Path:
    distckpt.save(_state(**kw), path, sharded_strategy=(backend, 1))
    return path


def _request():
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside every checkpoint, with a ``.crc`` sibling, that nothing may touch."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "precious.txt").write_bytes(VICTIM)
    (folder / "precious.txt.crc").write_bytes(VICTIM)
    return folder / "precious.txt"


def _untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    assert victim.with_name(victim.name + ".crc").read_bytes() == VICTIM


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _refused(result, pattern: str) -> None:
    """A CLI refusal: a non-zero exit that is not the internal-error code, the message shown."""
    assert result.exit_code not in (0, 3), (result.exit_code, result.output)
    assert "Traceback" not in result.output
    assert pattern in result.output, result.output


# --------------------------------------------------------------------------- the rule itself


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "/etc/passwd",
        "a/../../x",
        "",
        "a//b",
        "./a",
        "a/.",
        "a\\..\\b",
        "a\x00b",
        "C:/x",
        "c:x",
        7,
        None,
    ],
)
def test_the_name_rule_refuses_anything_but_a_plain_relative_path(name):
    with pytest.raises(
        CheckpointingException, match=r"^holder\.json: object .*(points outside|not a non-empty)"
    ):
        containment.check_name(name, "holder.json", "object")


@pytest.mark.parametrize(
    "name", ["a", "a/b/c.distcp", "__0_0.distcp", "w/c/0/0", ".metadata", "key:z", "a..b"]
)
def test_the_name_rule_accepts_plain_relative_paths(name):
    assert containment.check_name(name, "holder.json") == name


def test_opens_follow_relative_symlinks_inside_and_refuse_every_way_out(tmp_path, victim):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data").write_bytes(b"inside")
    os.symlink("sub/data", root / "alias")  # relative, stays inside: followed
    os.symlink("sub", root / "folder")
    os.symlink(str(root / "sub" / "data"), root / "abs_inside")  # absolute: refused even inside
    os.symlink(str(victim), root / "abs_out")
    os.symlink("../victim/precious.txt", root / "rel_out")
    os.symlink("../../victim", root / "sub" / "deep_out")
    os.symlink("ring", root / "ring")
    assert containment.read_beneath(root, "alias", "src") == b"inside"
    assert containment.read_beneath(root, "folder/data", "src") == b"inside"
    for name in ("abs_inside", "abs_out", "rel_out", "sub/deep_out/precious.txt"):
        with pytest.raises(
            CheckpointingException, match=rf"{name}: named by src, resolves to .*outside the checkpoint"
        ):
            containment.read_beneath(root, name, "src")
        with pytest.raises(CheckpointingException, match="outside the checkpoint"):
            containment.size_beneath(root, name, "src")
    with pytest.raises(CheckpointingException, match="more than 40 symlinks"):
        containment.read_beneath(root, "ring", "src")
    # Writes: the folders on the way are resolved the same way, a new folder is created inside.
    with pytest.raises(CheckpointingException, match="outside the checkpoint"):
        containment.open_beneath(root, "sub/deep_out/new.txt", "src", flags=os.O_WRONLY | os.O_CREAT)
    fd = containment.open_beneath(
        root, "made/here.txt", "src", flags=os.O_WRONLY | os.O_CREAT, make_parents=True
    )
    os.close(fd)
    assert (root / "made" / "here.txt").is_file()
    # Deletes remove the symlink itself, never its target.
    assert containment.remove_beneath(root, "abs_out", "src")
    assert not os.path.lexists(root / "abs_out")
    _untouched(victim)
    assert not (victim.parent / "new.txt").exists()


def test_a_fifo_or_a_folder_is_refused_without_blocking(tmp_path):
    root = tmp_path / "root"
    (root / "folder").mkdir(parents=True)
    os.mkfifo(root / "pipe")
    done = []

    def read():
        for name in ("pipe", "folder"):
            with pytest.raises(
                CheckpointingException, match=rf"{name}: named by src, is (not a regular file|a directory)"
            ):
                containment.read_beneath(root, name, "src")
        done.append(True)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert done == [True]


def test_the_stores_refuse_names_outside_them(tmp_path, victim):
    store = LocalStore(tmp_path / "ckpt")
    store.root.mkdir()
    for op in (
        lambda n: store.get(n),
        lambda n: store.size(n),
        lambda n: store.get_ranges(n, [0], [1]),
        lambda n: store.put(n, b"x"),
        lambda n: store.open_writer(n),
        lambda n: store.delete(n),
    ):
        for name in ("../victim/precious.txt", str(victim)):
            with pytest.raises(CheckpointingException, match="points outside the checkpoint"):
                op(name)
    _untouched(victim)
    memory = open_store("memory://containment/ckpt")
    memory.put("inside", b"x")
    for name in ("../escaped", "/escaped", "a/../../escaped"):
        with pytest.raises(CheckpointingException, match="points outside the checkpoint"):
            memory.put(name, b"x")
        with pytest.raises(CheckpointingException, match="points outside the checkpoint"):
            memory.get(name)
    assert list(open_store("memory://containment").list()) == ["ckpt/inside"]


# --------------------------------------------------------------------------- deleting: rm-prefix


def _name_optimizer_file(ckpt: Path, name: str) -> None:
    """Point every storage record of ``optimizer.m`` at ``name`` (and reseal the manifest)."""
    md = read_metadata(ckpt)
    for index, info in list(md.storage_data.items()):
        if index.fqn == "optimizer.m":
            md.storage_data[index] = replace(info, relative_path=name)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal_manifest(ckpt)


@pytest.mark.parametrize("outside", ["relative", "absolute"])
def test_remove_sharded_tensors_never_deletes_a_file_named_outside(tmp_path, victim, outside):
    ckpt = _save(tmp_path / "ckpt", "torch_dist")
    name = "../victim/precious.txt" if outside == "relative" else str(victim)
    _name_optimizer_file(ckpt, name)
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(
        CheckpointingException,
        match=r"\.metadata: storage record of 'optimizer\.m': file name .* points outside",
    ):
        distckpt.remove_sharded_tensors(ckpt, "optimizer.")
    _untouched(victim)
    assert sorted(p.name for p in ckpt.iterdir()) == before
    _refused(cli("rm-prefix", ckpt, "optimizer."), "points outside the checkpoint")
    _untouched(victim)
    out = tmp_path / "trimmed"
    _refused(cli("rm-prefix", ckpt, "optimizer.", "--out", out), "points outside the checkpoint")
    _untouched(victim)
    assert not out.exists()


def test_remove_sharded_tensors_removes_a_symlink_not_its_target(tmp_path, victim):
    ckpt = _save(tmp_path / "ckpt", "torch_dist")
    md = read_metadata(ckpt)
    name = next(i.relative_path for k, i in md.storage_data.items() if k.fqn == "optimizer.m")
    # The file that holds optimizer.m becomes a symlink out: reading it to rewrite kept items
    # is refused, so the checkpoint stays as it was and the victim is untouched.
    shutil.copy(ckpt / name, victim.parent / "copy.distcp")
    os.remove(ckpt / name)
    os.symlink(victim.parent / "copy.distcp", ckpt / name)
    with pytest.raises(CheckpointingException, match="outside the checkpoint"):
        distckpt.remove_sharded_tensors(ckpt, "optimizer.")
    assert (victim.parent / "copy.distcp").is_file()
    _untouched(victim)


# --------------------------------------------------------------------------- reading: symlinks out


def _symlink_out(ckpt: Path, name: str, tmp_path: Path) -> None:
    """Move ``name`` outside the checkpoint and leave a symlink to it in its place."""
    outside = tmp_path / "outside" / name.replace("/", "_")
    outside.parent.mkdir(exist_ok=True)
    shutil.move(str(ckpt / name), outside)
    os.symlink(outside, ckpt / name)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
@pytest.mark.parametrize("name", ["common.pt", "metadata.json", "backend"])
def test_symlinks_out_of_the_checkpoint_are_refused_by_every_load(tmp_path, backend, name):
    ckpt = _save(tmp_path / "ckpt", backend)
    if name == "backend":
        name = ".metadata" if backend == "torch_dist" else "zarr.json"
    _symlink_out(ckpt, name, tmp_path)
    pattern = rf"{name}: named by .*outside the checkpoint"
    # A zarr load opens the arrays it needs by key; the root group (zarr.json) is for listings.
    for verify in (False, True) if name != "zarr.json" else ():
        with pytest.raises(CheckpointingException, match=pattern):
            distckpt.load(_request(), ckpt, verify=verify)
    with pytest.raises(CheckpointingException, match=pattern):
        if name == "common.pt":
            distckpt.load_common_state_dict(ckpt)
        else:
            distckpt.load_tensors_metadata(ckpt)
    if name != "common.pt":
        with pytest.raises(CheckpointingException, match=pattern):
            distckpt.load_plain_tensors(ckpt)
    result = cli("inspect", ckpt)
    if name == "common.pt":  # inspect shows the common state's error in its place
        assert result.exit_code != 3 and "outside the checkpoint" in result.output, result.output
    else:
        _refused(result, "outside the checkpoint")
    result = cli("verify", ckpt)
    assert result.exit_code not in (0, 3) and "outside the checkpoint" in result.output, result.output


def test_a_zarr_chunk_file_that_is_a_symlink_out_is_refused(tmp_path):
    ckpt = _save(tmp_path / "ckpt", "zarr")
    chunk = next(p for p in (ckpt / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    _symlink_out(ckpt, chunk.relative_to(ckpt).as_posix(), tmp_path)
    for verify in (False, True):
        with pytest.raises(CheckpointingException, match="outside the checkpoint"):
            distckpt.load(_request(), ckpt, verify=verify)
    with pytest.raises(CheckpointingException, match="outside the checkpoint"):
        distckpt.load_plain_tensors(ckpt)
    result = cli("verify", ckpt)
    assert result.exit_code == 1 and "outside the checkpoint" in result.output, result.output


def test_a_sharded_object_file_that_is_a_symlink_out_is_refused(tmp_path):
    ckpt = _save(tmp_path / "ckpt", "zarr")
    name = next(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("shard_*.pt"))
    _symlink_out(ckpt, name, tmp_path)
    request = {"obj": ShardedObject("rng", None, (1,), (0,), replica_id=0)}
    with pytest.raises(CheckpointingException, match=rf"{name}: named by .*outside the checkpoint"):
        distckpt.load(request, ckpt)


def test_a_zarr_array_key_that_is_an_absolute_path_is_refused(tmp_path):
    ckpt = _save(tmp_path / "ckpt", "zarr")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ckpt / "w", elsewhere)
    md = json.loads((ckpt / "zarr.json").read_text())
    md["attributes"]["distckpt"]["keys"] = [str(elsewhere), "optimizer.m"]
    (ckpt / "zarr.json").write_text(json.dumps(md))
    with pytest.raises(CheckpointingException, match=r"zarr\.json: array key '/.*elsewhere' points outside"):
        distckpt.load_plain_tensors(ckpt)
    for command in ("inspect", "verify"):
        _refused(cli(command, ckpt), "points outside the checkpoint")


# --------------------------------------------------------------------------- writing: convert, rename


@pytest.mark.parametrize("key", ["../escaped/x", "ABSOLUTE"])
@pytest.mark.parametrize("to", ["zarr", "torch_dist"])
def test_convert_never_writes_outside_its_destination(tmp_path, key, to):
    if key == "ABSOLUTE":
        key = str(tmp_path / "escaped" / "x")
    src = _save(tmp_path / "src", "torch_dist", object_key=key)
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    _refused(cli("convert", src, dst, "--to", to), "points outside the checkpoint")
    assert not (tmp_path / "escaped").exists()
    assert not (tmp_path / "out" / "escaped").exists()
    assert [p.name for p in dst.parent.iterdir() if p.name != "dst"] == []


def test_saving_a_sharded_object_key_outside_the_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointingException, match="points outside the checkpoint"):
        _save(tmp_path / "ckpt", "zarr", object_key="../escaped/x")
    assert not (tmp_path / "escaped").exists()


def test_show_diff_and_rename_refuse_a_data_file_that_is_a_symlink_out(tmp_path, victim):
    ckpt = _save(tmp_path / "ckpt", "torch_dist")
    other = _save(tmp_path / "other", "torch_dist")
    md = read_metadata(ckpt)
    name = next(i.relative_path for k, i in md.storage_data.items() if k.fqn == "w")
    _symlink_out(ckpt, name, tmp_path)
    _refused(cli("show", ckpt, "w"), "outside the checkpoint")
    _refused(cli("diff", ckpt, other), "outside the checkpoint")
    out = tmp_path / "renamed"
    _refused(cli("rename", ckpt, "--map", "w=v", "--out", out), "outside the checkpoint")
    assert not out.exists()
    _refused(cli("rename", ckpt, "--map", "w=v"), "outside the checkpoint")
    assert os.path.islink(ckpt / name)
    _untouched(victim)


def test_a_zarr_array_folder_symlinked_out_is_refused_by_rename_and_rm_prefix(tmp_path):
    ckpt = _save(tmp_path / "ckpt", "zarr")
    _symlink_out(ckpt, "w", tmp_path)
    outside = tmp_path / "outside" / "w"
    before = sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*"))
    _refused(cli("rename", ckpt, "--map", "w=v"), "outside the checkpoint")
    _refused(cli("rm-prefix", ckpt, "w"), "outside the checkpoint")
    assert sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*")) == before


def test_a_local_tier_piece_that_is_a_symlink_out_is_never_read(tmp_path, caplog):
    from distckpt.local import LocalCheckpointManager
    from distckpt.local.manager import NoLocalCheckpointError, iteration_dir, piece_name

    root = tmp_path / "local"
    manager = LocalCheckpointManager(root, replication_factor=1)
    manager.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32))}, 3)
    # The piece moved out and linked back, bytes intact: following the link would load it.
    piece = next(p for p in iteration_dir(root, 3).iterdir() if p.name == piece_name(0, 0))
    _symlink_out(piece.parent, piece.name, tmp_path)
    again = LocalCheckpointManager(root, replication_factor=1)
    with pytest.raises(NoLocalCheckpointError, match="no iteration restored"):
        again.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))})
    assert f"{piece.name}: named by" in caplog.text and "outside the checkpoint" in caplog.text, caplog.text
