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
from typing import Optional

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt.formats.manifest import read_manifest, read_manifest_files, verify_files
from distckpt.strategies.torch import read_metadata
from distckpt.tools.verify import verify_checkpoint
from tests.support.faults import reseal_manifest

TB = 1 << 40


def _save(ckpt: Path, backend: str = "torch_dist") -> None:
    distckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32))},
        ckpt,
        sharded_strategy=(backend, 1),
    )


def _load(ckpt: Path, verify: Optional[bool] = False):
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
    (tmp_path / "secret.distcp").write_bytes(b"x" * 4096)  # what an escape would read
    return path


@pytest.mark.parametrize("name", ["../secret.distcp", "/etc/passwd", "sub/../../secret.distcp", "", "a//b"])
def test_a_storage_record_naming_a_file_outside_is_refused_naming_metadata(ckpt, name):
    _rewrite_metadata(ckpt, lambda md: _set_record(md, relative_path=name))
    for verify in (False, True):
        with pytest.raises(
            CheckpointingException,
            match=r"\.metadata: storage record of 'w': file name .* (outside|not a non-empty)",
        ):
            _load(ckpt, verify)
    with pytest.raises(CheckpointingException, match="outside the checkpoint|not a non-empty"):
        distckpt.load_plain_tensors(ckpt)


def test_a_data_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(ckpt):
    name = next(p.name for p in ckpt.glob("*.distcp"))
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / name).read_bytes())
    os.remove(ckpt / name)
    os.symlink(ckpt.parent / "outside.distcp", ckpt / name)
    with pytest.raises(
        CheckpointingException,
        match=rf"{name}: named by .*\.metadata, resolves to .*outside\.distcp, outside the checkpoint",
    ):
        _load(ckpt)


@pytest.mark.parametrize(
    "changes, match",
    [
        # The metadata is named as the liar: by the cross-check with the manifest (verify=True)
        # or, by default, because the data file has the size the manifest records.
        ({"length": 1 << 50}, r"\.metadata: .*(says the writer wrote \d+ bytes|the metadata is damaged)"),
        ({"offset": 1 << 50}, r"\.metadata: .*(lists no range there|the metadata is damaged)"),
        ({"offset": -1}, r"offset -1 is not an integer"),
        ({"length": 2.5}, r"length 2\.5 is not an integer"),
    ],
)
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
    # The manifest says what the writer declared; without one, the stored bytes bound the claim.
    with pytest.raises(
        CheckpointingException,
        match=r"\.metadata: key 'w' is float32 of shape \[1099511627776\], "
        r".*manifest\.json says the writer wrote float32 of shape \[64\]",
    ):
        distckpt.load_plain_tensors(ckpt)
    os.remove(ckpt / ".distckpt_manifest.json")
    with pytest.raises(
        CheckpointingException,
        match=r"\.metadata: key 'w': loading \[1099511627776\] needs "
        r"4398046511104 bytes, the checkpoint stores \d+",
    ):
        distckpt.load_plain_tensors(ckpt)
    assert time.monotonic() - start < 5


def test_a_chunk_claiming_more_bytes_than_its_record_is_refused(ckpt):
    def edit(md):
        _claim_global_shape(md, (TB,))
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size((TB,))

    _rewrite_metadata(ckpt, edit)
    with pytest.raises(
        CheckpointingException, match=r"key 'w': chunk at \[0\] of \[1099511627776\] elements needs"
    ):
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
    with pytest.raises(
        CheckpointingException,
        match=r"\.distckpt_manifest\.json: listed file '\.\./secret\.distcp' points outside",
    ):
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


@pytest.mark.parametrize(
    "shape, chunks, match",
    [
        # With the manifest (which says [64]) the claim is refused as a disagreement with it first.
        (
            [TB],
            [TB],
            r"loading \[1099511627776\] needs 4398046511104 bytes, the array's chunk files hold|"
            r"w/zarr\.json says float32 of shape \[1099511627776\], the integrity manifest",
        ),
        ([64], [1 << 50], r"chunk_shape is \[1125899906842624\], not a list of 1 positive integers"),
        ([64], [1 << 40], r"a chunk of \[1099511627776\] \(4398046511104 bytes\) for an array of \[64\]"),
        ([64], [0], r"chunk_shape is \[0\], not a list of 1 positive integers"),
        ([1 << 40, 1 << 40], [1, 1], r"shape \[1099511627776, 1099511627776\] claims"),
        ([-1], [1], r"shape is \[-1\], not a list of naturals"),
    ],
)
def test_zarr_impossible_shapes_and_chunks_are_refused_quickly(zckpt, shape, chunks, match):
    def edit(md):
        md["shape"] = shape
        md["chunk_grid"]["configuration"]["chunk_shape"] = chunks

    _edit_json(zckpt / "w" / "zarr.json", edit)
    start = time.monotonic()
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_plain_tensors(zckpt)
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------- surgery and queries on damaged metadata


def _save_three(path: Path, backend: str = "torch_dist") -> None:
    """``w`` [6, 8] in two chunks, ``b`` [4, 5] and ``opt.f`` [4, 6] held flat in two ranges,
    all in one file (removing ``opt.`` rewrites the file around the kept keys)."""
    f = torch.arange(24, dtype=torch.float32)
    distckpt.save(
        {
            "w0": ShardedTensor.from_rank_offsets("w", torch.ones(3, 8), (0, 0, 2)),
            "w1": ShardedTensor.from_rank_offsets("w", torch.full((3, 8), 2.0), (0, 1, 2)),
            "b": ShardedTensor.from_rank_offsets("b", torch.arange(20.0).reshape(4, 5)),
            "f0": ShardedTensor.from_rank_offsets_flat(
                "opt.f", f[:10].clone(), (4, 6), flattened_range=slice(0, 10)
            ),
            "f1": ShardedTensor.from_rank_offsets_flat(
                "opt.f", f[10:].clone(), (4, 6), flattened_range=slice(10, 24)
            ),
        },
        path,
        sharded_strategy=(backend, 1),
    )


def _tree(path: Path) -> dict:
    return {
        p.relative_to(path).as_posix(): (p.read_bytes() if p.is_file() else "dir")
        for p in sorted(path.rglob("*"))
    }


def _surgery_cli(*args) -> tuple:
    from click.testing import CliRunner

    from distckpt.cli import main as cli_main

    result = CliRunner().invoke(cli_main, [str(a) for a in args])
    assert result.exit_code in (1, 2), (result.exit_code, result.output)  # 3 is "internal error"
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _rename_key(md, old: str, new: str) -> None:
    md.state_dict_metadata = {(new if k == old else k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {(replace(i, fqn=new) if i.fqn == old else i): s for i, s in md.storage_data.items()}


@pytest.fixture
def three(tmp_path):
    path = tmp_path / "three"
    _save_three(path)
    return path


@pytest.mark.parametrize("resealed", [False, True])
def test_surgery_refuses_metadata_the_manifest_contradicts_and_changes_nothing(three, resealed):
    md = read_metadata(three)
    _rename_key(md, "w", "v")  # a damaged .metadata: w's records now claim another key
    (three / ".metadata").write_bytes(pickle.dumps(md))
    if resealed:
        reseal_manifest(three)  # the whole-file CRC agrees; the manifest's range keys still say 'w'
    before = _tree(three)
    # Not resealed: the CRC mismatch, with the claims that differ; resealed: the cross-check.
    match = r"\.metadata: key 'v'.*\.distckpt_manifest\.json says the writer wrote \d+ bytes of key 'w'"
    with pytest.raises(CheckpointingException, match=match):
        distckpt.remove_sharded_tensors(three, "opt.")
    for args in (
        ["rm-prefix", three, "opt."],
        ["rename", three, "--map", "v=w2"],
        ["rename", three, "--map", "b=c"],
    ):
        code, out = _surgery_cli(*args)
        assert ".metadata" in out and ".distckpt_manifest.json" in out, out
    assert _tree(three) == before  # nothing rewritten, nothing deleted


def test_surgery_refuses_a_chunk_box_the_claims_check_refuses(three):
    def edit(md):
        meta = md.state_dict_metadata["b"]
        meta.chunks[0] = replace(meta.chunks[0], offsets=torch.Size((3, 0)))
        _rename_key(md, "b", "b")
        md.storage_data = {
            (replace(i, offset=torch.Size((3, 0))) if i.fqn == "b" else i): s
            for i, s in md.storage_data.items()
        }

    _rewrite_metadata(three, edit)
    before = _tree(three)
    with pytest.raises(
        CheckpointingException, match=r"\.metadata: key 'b': chunk at \[3, 0\] of size \[4, 5\] lies outside"
    ):
        distckpt.remove_sharded_tensors(three, "opt.")
    assert _tree(three) == before


def test_a_key_of_only_dots_is_refused_naming_metadata(three):
    os.remove(three / ".distckpt_manifest.json")
    os.remove(three / ".distckpt_index")
    md = read_metadata(three)
    _rename_key(md, "w", ".")
    (three / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointingException, match=r"\.metadata: key '\.' is not a key name"):
        distckpt.load_plain_tensors(three)
    with pytest.raises(CheckpointingException, match=r"\.metadata: key '\.' is not a key name"):
        distckpt.remove_sharded_tensors(three, "opt.")


def test_a_reformulated_grid_finer_than_its_tensor_is_refused_not_divided_by(three):
    def edit(md):
        meta = md.state_dict_metadata["opt.f"]
        meta.size = torch.Size((TB,) + tuple(meta.size)[1:])  # [2^40, 1, 24] for a [4, 6] tensor

    _rewrite_metadata(three, edit)
    match = r"\.metadata: key 'opt\.f': stored shape \[1099511627776, 1, 24\] is not an N-D reformulation"
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_plain_tensors(three)
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_tensors_metadata(three)


def test_removal_refuses_a_missing_data_file_or_a_sidecar_that_is_a_folder(three, tmp_path):
    data = three / "__0_1.distcp"  # w's second chunk and both ranges of opt.f
    os.remove(data)
    before = _tree(three)
    with pytest.raises(CheckpointingException, match=rf"{data.name}: data file is missing \(holds kept keys"):
        distckpt.remove_sharded_tensors(three, "opt.")
    assert _tree(three) == before

    other = tmp_path / "other"
    _save_three(other)
    os.remove(other / ".distckpt_index")
    os.mkdir(other / ".distckpt_index")
    before = _tree(other)
    with pytest.raises(CheckpointingException, match=r"\.distckpt_index: not a regular file"):
        distckpt.remove_sharded_tensors(other, "opt.")
    code, out = _surgery_cli("rename", other, "--map", "b=c")
    assert ".distckpt_index: not a regular file" in out
    assert _tree(other) == before


def _edit_sidecar_directory(path: Path, edit) -> None:
    """Rewrite the sidecar's directory JSON with a matching CRC32C, then reseal the manifest (a
    damaged writer, or an edit that fixes every checksum)."""
    import struct

    from distckpt.formats.manifest import crc32c

    raw = (path / ".distckpt_index").read_bytes()
    magic, n, _ = struct.unpack_from("<8sQI", raw)
    directory = json.loads(raw[20 : 20 + n])
    head = edit(directory)
    (path / ".distckpt_index").write_bytes(
        struct.pack("<8sQI", magic, len(head), crc32c(head)) + head + raw[20 + n :]
    )
    reseal_manifest(path)


def test_a_sidecar_entry_of_the_wrong_type_is_refused_naming_the_sidecar(three):
    def edit(d):
        d["keys"]["opt.f"]["bbox"][1][0] = {"x": 1}
        return json.dumps(d).encode()

    _edit_sidecar_directory(three, edit)
    match = r"\.distckpt_index: malformed sidecar index: key 'opt\.f': bbox"
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_plain_tensors(three)
    report = verify_checkpoint(three)
    assert any(".distckpt_index: malformed sidecar index: key 'opt.f': bbox" in p for p in report.problems), (
        report.problems
    )


def test_verify_reads_the_sidecar_and_reports_a_directory_nested_too_deep(three):
    def edit(d):
        text = json.dumps(d)
        return text.replace('"bbox": [', '"bbox": [' + "[" * 100_000 + "]" * 100_000 + ", ", 1).encode()

    _edit_sidecar_directory(three, edit)
    report = verify_checkpoint(three)
    assert any(".distckpt_index: malformed sidecar index" in p for p in report.problems), report.problems
    code, out = _surgery_cli("verify", three)
    assert code == 1 and ".distckpt_index" in out


def test_verify_checks_the_sidecar_records_against_metadata(three):
    report = verify_checkpoint(three)
    assert report.ok and any(".distckpt_index against .metadata" in c for c in report.checked), report.checked

    def edit(d):  # b declared with another shape: a load through the sidecar would trust it
        d["keys"]["b"]["size"] = [5, 4]
        return json.dumps(d).encode()

    _edit_sidecar_directory(three, edit)
    report = verify_checkpoint(three)
    assert any(".distckpt_index: key 'b' is declared as" in p for p in report.problems), report.problems


def test_tensor_metadata_of_a_damaged_metadata_is_refused_when_a_manifest_exists(three):
    # Without the sidecar, .metadata answers the queries (with it, its directory does).
    _metadata_lie(three, lambda md: None, sidecar=False)
    raw = (three / ".metadata").read_bytes()
    # One byte: opt.f's original shape [4, 6] becomes [4, 7], a claim consistent with the rest.
    at = raw.index(b"K\x04K\x06", raw.index(b"nd_reformulated_orig_global_shape"))  # BININT1 4, BININT1 6
    (three / ".metadata").write_bytes(raw[: at + 3] + b"\x07" + raw[at + 4 :])
    with pytest.raises(
        CheckpointingException, match=r"\.metadata: contents do not match the integrity manifest"
    ):
        distckpt.load_tensors_metadata(three)
    with pytest.raises(
        CheckpointingException, match=r"\.metadata: contents do not match the integrity manifest"
    ):
        distckpt.load_sharded_metadata(three)
    os.remove(three / ".distckpt_manifest.json")  # no manifest: the claims are all there is
    assert distckpt.load_tensors_metadata(three)["opt.f"].global_shape == (4, 7)


def test_zarr_metadata_swapped_between_arrays_is_refused_naming_it(tmp_path):
    path = tmp_path / "z"
    _save_three(path, "zarr")
    w, f = (path / "w" / "zarr.json").read_bytes(), (path / "opt.f" / "zarr.json").read_bytes()
    (path / "w" / "zarr.json").write_bytes(f)
    (path / "opt.f" / "zarr.json").write_bytes(w)
    match = r"key 'w': .*w/zarr\.json says float32 of shape \[4, 6\], the integrity manifest"
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, path)
    with pytest.raises(CheckpointingException, match=r"zarr\.json says float32 of shape \[(4, 6|6, 8)\]"):
        distckpt.load_tensors_metadata(path)
    os.remove(path / ".distckpt_manifest.json")
    with pytest.raises(
        CheckpointingException,
        match=r"'w': global shape \[6, 8\] was requested but the checkpoint "
        r"stores \[4, 6\] \(in .*w/zarr\.json",
    ):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, path)


# --------------------------------------------------------------------------- default loads of lying metadata


def _metadata_lie(path: Path, edit, sidecar: bool) -> None:
    """Edit ``.metadata`` and make every checksum agree, as a buggy writer or a careful edit would
    leave it; with ``sidecar``, rebuild the sidecar from the edited ``.metadata`` (so a load reads
    the lie from there), else drop it (a load reads ``.metadata``)."""
    from distckpt.formats.index_write import index_from_metadata

    md = read_metadata(path)
    edit(md)
    raw = pickle.dumps(md)
    (path / ".metadata").write_bytes(raw)
    if sidecar:
        index = index_from_metadata(md, read_manifest(path).range_index(), len(raw))
        (path / ".distckpt_index").write_bytes(index)
    else:
        os.remove(path / ".distckpt_index")
        manifest = read_manifest(path)
        manifest.drop(".distckpt_index")
        from distckpt.formats.manifest import write_manifest

        write_manifest(path, manifest)
    reseal_manifest(path)


def _set_dtype(md, key, dtype):
    meta = md.state_dict_metadata[key]
    meta.properties = replace(meta.properties, dtype=dtype)


def _set_size(md, key, size):
    md.state_dict_metadata[key].size = torch.Size(size)


def _drop_key(md, key):
    del md.state_dict_metadata[key]
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}


@pytest.mark.parametrize("sidecar", [False, True])
@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda md: _set_dtype(md, "b", torch.float64),
            r"key 'b' is float64 of shape \[4, 5\], .*\.distckpt_manifest\.json "
            r"says the writer wrote float32 of shape \[4, 5\]",
        ),
        (
            lambda md: _set_size(md, "w", (6, 9)),
            r"key 'w' is float32 of shape \[6, 9\], .*\.distckpt_manifest\.json says "
            r"the writer wrote float32 of shape \[6, 8\]",
        ),
        (
            lambda md: _rename_key(md, "b", "../precious.txt"),
            r"declares tensor key '\.\./precious\.txt', which "
            r".*\.distckpt_manifest\.json says the writer never wrote",
        ),
        (
            lambda md: _drop_key(md, "b"),
            r"does not declare tensor key\(s\) \['b'\] that "
            r".*\.distckpt_manifest\.json says the writer wrote",
        ),
        # Same elements, other original shape: no coverage check can tell, the manifest can.
        (
            lambda md: md.mcore_data["opt.f"].update(nd_reformulated_orig_global_shape=(6, 4)),
            r"key 'opt\.f' is float32 of shape \[1, 1, 24\] \(flattened, of original shape \[6, 4\]\), "
            r".*\.distckpt_manifest\.json says the writer wrote float32 of shape \[1, 1, 24\] "
            r"\(flattened, of original shape \[4, 6\]\)",
        ),
    ],
)
def test_default_queries_refuse_key_declarations_the_manifest_contradicts(three, edit, match, sidecar):
    _metadata_lie(three, edit, sidecar)
    # With a sidecar the queries read its directory (never .metadata): the error names it.
    source = r"\.distckpt_index: " if sidecar else r"\.metadata: "
    for query in (
        distckpt.load_plain_tensors,
        distckpt.load_tensors_metadata,
        distckpt.load_sharded_metadata,
    ):
        with pytest.raises(CheckpointingException, match=source + match):
            query(three)


def test_a_default_load_through_metadata_checks_the_keys_it_reads_against_the_manifest(three):
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    _metadata_lie(three, lambda md: _set_dtype(md, "b", torch.float16), sidecar=False)
    strategy = TorchDistLoadShardedStrategy()
    with pytest.raises(
        CheckpointingException,
        match=r"\.metadata: key 'b' is float16 of shape \[4, 5\], "
        r".*\.distckpt_manifest\.json says the writer wrote float32",
    ):
        strategy.load(
            {"b": ShardedTensor.from_rank_offsets("b", torch.zeros(4, 5, dtype=torch.float16))}, three
        )
    # Keys it does not read are not its business (nor a cost): w loads.
    got = strategy.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, three)["w"]
    assert not strategy.last_load_used_index and torch.equal(got[3:], torch.full((3, 8), 2.0))


@pytest.mark.parametrize("sidecar", [False, True])
def test_an_item_whose_header_says_another_dtype_than_the_metadata_is_refused(three, sidecar):
    # No manifest to ask: the item's own header contradicts the claim.
    _metadata_lie(three, lambda md: _set_dtype(md, "b", torch.float16), sidecar)
    os.remove(three / ".distckpt_manifest.json")
    with pytest.raises(
        CheckpointingException,
        match=r"key 'b' in .*\.distcp at offset \d+ \(rank 0\): the item holds "
        r"float32 values, .*(\.metadata|\.distckpt_index) says the key is float16",
    ):
        distckpt.load_plain_tensors(three)


def _save_with_object(path: Path) -> None:
    from distckpt import ShardedObject

    distckpt.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
            "rng": ShardedObject("rng", {"seed": 7}, (1,), (0,)),
            "iteration": 3,
        },
        path,
        sharded_strategy=("torch_dist", 1),
    )


@pytest.mark.parametrize("resealed", [False, True])
def test_an_object_key_renamed_in_metadata_is_not_returned_as_a_common_value(tmp_path, resealed):
    path = tmp_path / "obj"
    _save_with_object(path)
    (tmp_path / "precious.txt").write_bytes(b"canary")
    md = read_metadata(path)
    _rename_key(md, "rng/shard_0_1", "../precious.txt")  # no longer an object key: a DCP value
    raw = pickle.dumps(md)
    (path / ".metadata").write_bytes(raw)
    if resealed:
        from distckpt.formats.index_write import index_from_metadata

        (path / ".distckpt_index").write_bytes(
            index_from_metadata(md, read_manifest(path).range_index(), len(raw))
        )
        reseal_manifest(path)
    match = (
        r"value '\.\./precious\.txt' in .*__0_0\.distcp \(rank 0\): \.metadata records \d+ bytes of key "
        r"'\.\./precious\.txt' .*\.distckpt_manifest\.json says the writer wrote \d+ bytes of key "
        r"'rng/shard_0_1'"
    )
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_common_state_dict(path)
    assert (tmp_path / "precious.txt").read_bytes() == b"canary"


def _move_chunk(md, key, old, new):
    """Chunk ``old`` of ``key`` claimed at offset ``new`` (its box and its storage record)."""
    meta = md.state_dict_metadata[key]
    meta.chunks = [replace(c, offsets=torch.Size(new)) if tuple(c.offsets) == old else c for c in meta.chunks]
    md.storage_data = {
        (replace(i, offset=torch.Size(new)) if i.fqn == key and tuple(i.offset) == old else i): s
        for i, s in md.storage_data.items()
    }


def _resize_chunk(md, key, size):
    meta = md.state_dict_metadata[key]
    meta.chunks = [replace(meta.chunks[0], sizes=torch.Size(size))] + meta.chunks[1:]


@pytest.mark.parametrize("manifest", [True, False])
@pytest.mark.parametrize("sidecar", [False, True])
@pytest.mark.parametrize(
    "size, request_offsets, problem",
    [
        (
            (3, 4),
            (0, 0, 2),
            r"region at \[0, 0\] of size \[3, 8\] exactly once: chunks cover 12 of 24 elements",
        ),
        (
            (4, 8),
            (),
            r"region at \[0, 0\] of size \[6, 8\] exactly once: chunks at \[0, 0\] and \[3, 0\] overlap",
        ),
    ],
)
def test_chunks_that_do_not_cover_a_requested_piece_exactly_once_are_refused(
    three, sidecar, manifest, size, request_offsets, problem
):
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy

    # w's first chunk (rows 0-2) claimed as [3, 4] (a gap) or [4, 8] (row 3 held twice).
    _metadata_lie(three, lambda md: _resize_chunk(md, "w", size), sidecar)
    if not manifest:
        os.remove(three / ".distckpt_manifest.json")
    source = r"\.distckpt_index" if sidecar else r"\.metadata"
    strategy = TorchDistLoadShardedStrategy()  # one rank's piece: distckpt.load checks requests cover all
    rows = 3 if request_offsets else 6
    with pytest.raises(
        CheckpointingException,
        match=source + r": key 'w': the stored chunks do not hold the "
        r"requested " + problem,
    ):
        strategy.load(
            {
                "w": ShardedTensor.from_rank_offsets(
                    "w", torch.zeros(rows, 8), *filter(None, [request_offsets])
                )
            },
            three,
        )
    assert strategy.last_load_used_index == sidecar


@pytest.mark.parametrize("sidecar", [False, True])
def test_a_chunk_claimed_smaller_leaves_its_region_refused_not_uninitialized(three, sidecar):
    def edit(md):
        meta = md.state_dict_metadata["b"]
        meta.chunks = [replace(meta.chunks[0], sizes=torch.Size((2, 5)))]

    _metadata_lie(three, edit, sidecar)
    source = r"\.distckpt_index" if sidecar else r"\.metadata"
    with pytest.raises(
        CheckpointingException,
        match=source + r": key 'b': the stored chunks do not hold the requested "
        r"region at \[0, 0\] of size \[4, 5\] exactly once: chunks cover 10 of 20",
    ):
        distckpt.load({"b": ShardedTensor.from_rank_offsets("b", torch.zeros(4, 5))}, three)
    with pytest.raises(CheckpointingException, match=source + r": key 'b': .* chunks cover 10 of 20"):
        distckpt.load_plain_tensors(three)


@pytest.mark.parametrize("sidecar", [False, True])
def test_overlapping_flattened_ranges_are_refused_though_their_lengths_add_up(three, sidecar):
    # opt.f's second range [10, 24) claimed at [5, 19): 10 + 14 elements for 24, [5, 10) twice,
    # [19, 24) never.
    _metadata_lie(three, lambda md: _move_chunk(md, "opt.f", (0, 0, 10), (0, 0, 5)), sidecar)
    os.remove(three / ".distckpt_manifest.json")  # (with it, the record's chunk would not match either)
    source = r"\.distckpt_index" if sidecar else r"\.metadata"
    with pytest.raises(
        CheckpointingException,
        match=source + r": key 'opt\.f': stored flattened ranges of chunk \[0, 0\] "
        r"overlap at elements \[5, 10\)",
    ):
        distckpt.load_plain_tensors(three)


@pytest.mark.parametrize("manifest", [True, False])
@pytest.mark.parametrize("io_engine", ["raw", "tensorstore"])
def test_a_deleted_zarr_chunk_file_is_refused_not_read_as_fill_values(tmp_path, manifest, io_engine):
    # Zarr's "missing chunk = fill value" does not hold for a checkpoint, which has every chunk:
    # with or without a manifest listing it, the load names the file.
    from distckpt.strategies.zarr import ZarrLoadShardedStrategy

    path = tmp_path / "z"
    _save_three(path, "zarr")
    os.remove(path / "w" / "c" / "0" / "0")
    if not manifest:
        os.remove(path / ".distckpt_manifest.json")
    strategy = ZarrLoadShardedStrategy(io_engine=io_engine)
    with pytest.raises(CheckpointingException, match=r"key 'w': chunk file .*w/c/0/0 \(rank 0\) is missing"):
        strategy.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, path)
    with pytest.raises(CheckpointingException, match=r"key 'w': chunk file .*w/c/0/0 \(rank 0\) is missing"):
        distckpt.load_plain_tensors(path)


def test_a_zarr_key_dropped_from_the_root_listing_is_refused_not_left_out(tmp_path):
    path = tmp_path / "z"
    _save_three(path, "zarr")
    _edit_json(path / "zarr.json", lambda md: md["attributes"]["distckpt"]["keys"].remove("opt.f"))
    match = (
        r"zarr\.json: does not list array key\(s\) \['opt\.f'\] that \.distckpt_manifest\.json "
        r"says the writer wrote"
    )
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_plain_tensors(path)
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load_tensors_metadata(path)


def test_a_zarr_array_described_big_endian_or_transposed_is_refused_when_distckpt_wrote_it(zckpt):
    # The chunk bytes and their CRC32Cs are untouched: only the decoding zarr.json describes
    # changed, which would load every value byte-swapped (or transposed) without this check.
    for codecs in (
        [{"name": "bytes", "configuration": {"endian": "big"}}],
        [
            {"name": "transpose", "configuration": {"order": [0]}},
            {"name": "bytes", "configuration": {"endian": "little"}},
        ],
    ):

        def edit(md, codecs=codecs):
            md["codecs"] = codecs

        original = (zckpt / "w" / "zarr.json").read_bytes()
        _edit_json(zckpt / "w" / "zarr.json", edit)
        reseal_manifest(zckpt)
        for load in (lambda: _load(zckpt, verify=None), lambda: distckpt.load_plain_tensors(zckpt)):
            with pytest.raises(
                CheckpointingException, match=r"w/zarr\.json describes its elements in another layout"
            ):
                load()
        (zckpt / "w" / "zarr.json").write_bytes(original)
        reseal_manifest(zckpt)
    assert torch.equal(_load(zckpt, verify=None)["w"], torch.arange(64, dtype=torch.float32))


def test_a_manifest_checksum_beyond_32_bits_is_refused_naming_the_manifest(ckpt):
    path = ckpt / ".distckpt_manifest.json"
    md = json.loads(path.read_text())
    name = next(n for n in md["ranges"] if n.endswith(".distcp"))
    md["ranges"][name][0][2] = 10**40
    path.write_text(json.dumps(md))
    with pytest.raises(
        CheckpointingException, match=r"distckpt_manifest\.json: .*\] is not \[offset, length, CRC32C, key\]"
    ):
        read_manifest(ckpt)
    with pytest.raises(CheckpointingException, match=r"distckpt_manifest\.json"):
        distckpt.remove_sharded_tensors(ckpt, "nothing.")


@pytest.mark.parametrize("field", ["length", "properties"])
def test_the_tools_refuse_metadata_objects_missing_a_field_naming_metadata(ckpt, tmp_path, field):
    def edit(md):
        if field == "length":
            del next(iter(md.storage_data.values())).length
        else:
            del next(iter(md.state_dict_metadata.values())).properties

    _rewrite_metadata(ckpt, edit)
    for args in (("inspect", ckpt), ("diff", ckpt, ckpt), ("show", ckpt, "w")):
        _, output = _surgery_cli(*args)
        assert ".metadata: malformed checkpoint metadata" in output, (args, output)


def test_a_zarr_rename_refuses_array_metadata_it_cannot_carry_over(zckpt):
    def edit(md):
        md["attributes"] = []

    _edit_json(zckpt / "w" / "zarr.json", edit)
    reseal_manifest(zckpt)
    before = _tree(zckpt)
    _, output = _surgery_cli("rename", zckpt, "--map", "w=v")
    assert "w/zarr.json: unreadable Zarr metadata of key 'w'" in output, output
    assert "attributes is [], not an object" in output, output
    assert _tree(zckpt) == before
