"""``distckpt verify`` and ``load`` give one verdict (issue #45), and errors name the file that lies.

Each crafted checkpoint below once made the two disagree (``verify`` said OK where ``load``
refused, or both accepted a malformed file), or made a load blame the wrong file. Now a load
(default and ``verify=True``) and ``distckpt verify`` run the same checks and refuse it naming
the same file and the field. The generated cases of ``tests/support/hostile_fuzz.py`` assert the
same property at large.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import CheckpointingException
from distckpt.cli import main as cli_main
from distckpt.formats.index_read import IndexReader
from distckpt.formats.manifest import read_manifest
from distckpt.strategies.torch import read_metadata
from distckpt.strategies.torch_dcp import TorchDCPLoadShardedStrategy
from distckpt.tiered import markers
from tests.support import hostile_fuzz as hf
from tests.support.faults import reseal_manifest


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    hf.build_bases(root)
    return root


@pytest.fixture(params=hf.BACKENDS)
def any_ckpt(request, bases, tmp_path):
    return Path(shutil.copytree(bases / request.param, tmp_path / "ckpt"))


@pytest.fixture
def torch_dist(bases, tmp_path):
    return Path(shutil.copytree(bases / "torch_dist", tmp_path / "ckpt"))


@pytest.fixture
def zarr(bases, tmp_path):
    return Path(shutil.copytree(bases / "zarr", tmp_path / "ckpt"))


def _verify(ckpt: Path):
    """``distckpt verify CKPT``: (exit code, output); never a traceback."""
    result = CliRunner().invoke(cli_main, ["verify", str(ckpt)])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _refused_by_both(ckpt: Path, match: str, verify_match: Optional[str] = None) -> None:
    """A load (default and ``verify=True``) refuses ``ckpt`` with a message matching ``match``,
    and ``distckpt verify`` exits 1 with a problem matching it too (or ``verify_match``)."""
    for verify in (None, True):
        with pytest.raises(CheckpointingException, match=match):
            distckpt.load(hf.base_state(False), ckpt, verify=verify)
    code, out = _verify(ckpt)
    assert code == 1, out
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert any(re.search(verify_match or match, line) for line in problems), out


def _edit_zarr_json(ckpt: Path, edit, reseal: bool = True) -> None:
    path = ckpt / "w" / "zarr.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    if reseal:
        reseal_manifest(ckpt)


def _edit_metadata(ckpt: Path, edit) -> None:
    md = read_metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    hf.reseal(ckpt, ".metadata")  # the sidecar rebuilt from it (or dropped) and the manifest resealed


# --------------------------------------------------------------------------- verify OK, load refused


@pytest.mark.parametrize("value", [[1, 2], torch.zeros(3)], ids=["list", "tensor"])
def test_a_common_state_that_is_not_a_dict_is_a_problem_for_verify_as_for_load(any_ckpt, value):
    torch.save(value, any_ckpt / "common.pt")
    reseal_manifest(any_ckpt)
    _refused_by_both(any_ckpt, rf"common\.pt: the common state is a {type(value).__name__}, not a dict")


def test_an_object_needing_a_class_outside_the_allowlist_is_a_problem_for_verify_as_for_load(zarr):
    torch.save(fractions.Fraction(1, 3), zarr / "rng" / "shard_0_1.pt")
    reseal_manifest(zarr)
    _refused_by_both(zarr, r"rng/shard_0_1\.pt.*refusing to unpickle a class outside the allowlist")


def test_a_zarr_json_naming_an_unknown_codec_is_refused_naming_the_field(zarr):
    _edit_zarr_json(zarr, lambda d: d["codecs"].append({"name": "frobnicate"}))
    _refused_by_both(zarr, r"w/zarr\.json: unreadable Zarr metadata of key 'w'.*codecs\[1\]: unknown codec")


def test_a_zarr_json_only_tensorstore_refuses_is_refused_by_verify_as_by_load(zarr):
    # A valid codec chain by the schema, whose inner chunks do not divide the shard: tensorstore
    # refuses to open the array. Without a manifest (a foreign checkpoint) nothing else says so.
    shard = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [2, 8],
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
    }
    _edit_zarr_json(zarr, lambda d: d.__setitem__("codecs", [shard]), reseal=False)
    (zarr / ".distckpt_manifest.json").unlink()
    _refused_by_both(zarr, r"w/zarr\.json: key 'w': tensorstore cannot open the array")


# --------------------------------------------------------------------------- malformed, accepted


@pytest.mark.parametrize(
    "member, value, match",
    [
        ("shape", [6.5, 8], r"shape is \[6\.5, 8\], not a list of naturals"),
        ("shape", [6, True], r"shape is \[6, true\], not a list of naturals"),
        ("fill_value", "x", r"fill_value is \"x\", not a number"),
        ("zarr_format", "3", r"zarr_format is \"3\", not 3"),
        ("extension", {"must_understand": True}, r"unknown member 'extension'"),
    ],
)
def test_a_zarr_json_member_of_the_wrong_type_is_refused_naming_it(zarr, member, value, match):
    _edit_zarr_json(zarr, lambda d: d.__setitem__(member, value))
    _refused_by_both(zarr, r"w/zarr\.json: unreadable Zarr metadata of key 'w'.*" + match)


# --------------------------------------------------------------------------- the manifest's record


def test_a_zarr_json_changed_after_the_save_is_refused_by_verify_true(zarr):
    _edit_zarr_json(zarr, lambda d: d.__setitem__("fill_value", 7.0), reseal=False)
    # The manifest's checksum of the file: a load that reads the manifest compares it.
    _refused_by_both(
        zarr,
        r"w/zarr\.json: contents do not match the integrity manifest",
        r"w/zarr\.json: key 'w' at offset 0: CRC32C mismatch",
    )


def test_a_zarr_json_whose_checksum_was_brought_up_to_date_still_disagrees_with_the_manifest(zarr):
    _edit_zarr_json(zarr, lambda d: d.__setitem__("fill_value", 7.0))  # and the CRC32C resealed
    assert read_manifest(zarr).arrays["w"]["fill_value"] == 0.0  # what the writer wrote
    _refused_by_both(
        zarr, r"w/zarr\.json says fill_value is 7\.0, the integrity manifest .* says the writer wrote 0\.0"
    )


def test_re_encoding_an_arrays_chunks_in_its_zarr_json_is_refused_by_verify_as_by_load(zarr):
    # gzip on raw chunks: tensorstore would fail to inflate them; verify never decoded them.
    _edit_zarr_json(zarr, lambda d: d["codecs"].append({"name": "gzip", "configuration": {"level": 1}}))
    _refused_by_both(zarr, r"w/zarr\.json says codecs is .*gzip.*, the integrity manifest")


# --------------------------------------------------------------------------- .metadata by schema


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda md: md.state_dict_metadata.__setitem__("w", "oops"), r"the metadata of key 'w' is str"),
        (lambda md: setattr(md.state_dict_metadata["w"], "chunks", "x"), r"key 'w': chunks is str"),
        (lambda md: setattr(md.state_dict_metadata["w"], "properties", 3), r"key 'w': properties is int"),
        (
            lambda md: md.storage_data.__setitem__(next(iter(md.storage_data)), ("__0_0.distcp", 0, 8)),
            r"storage record of '.*' is tuple",
        ),
    ],
    ids=["key-metadata", "chunks", "properties", "storage-record"],
)
def test_metadata_values_of_the_wrong_type_are_refused_naming_the_field(torch_dist, edit, match):
    _edit_metadata(torch_dist, edit)
    _refused_by_both(torch_dist, r"\.metadata: " + match)
    result = CliRunner().invoke(cli_main, ["inspect", str(torch_dist)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def test_a_key_no_state_dict_can_hold_in_the_rebuilt_sidecar_is_a_problem_of_the_sidecar_for_verify_too(
    torch_dist,
):
    """Key 'b' renamed to '.' in ``.metadata``, the sidecar rebuilt from it and the manifest
    resealed (the fuzzer's md-key+reseal, seed 1000159): ``load_tensors_metadata`` and
    ``inspect`` read the sidecar's directory and blame it; ``verify`` names it too (it once named
    only ``.metadata`` and the manifest, so the two blamed different files)."""

    def rename(md):
        md.state_dict_metadata["."] = md.state_dict_metadata.pop("b")
        md.storage_data = {
            (dataclasses.replace(i, fqn=".") if i.fqn == "b" else i): v for i, v in md.storage_data.items()
        }

    _edit_metadata(torch_dist, rename)
    assert (torch_dist / ".distckpt_index").is_file()
    sidecar = re.escape(str(torch_dist / ".distckpt_index")) + r": key '\.' is not a key name"
    with pytest.raises(CheckpointingException, match=sidecar):
        distckpt.load_tensors_metadata(torch_dist)
    code, out = _verify(torch_dist)
    assert code == 1, out
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert any(re.search(sidecar, line) for line in problems), out


def test_a_record_of_dcp_storage_transforms_is_refused_not_read_as_plain_bytes(torch_dist):
    def transformed(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[index].transform_descriptors = ["zstd"]

    _edit_metadata(torch_dist, transformed)
    (torch_dist / ".distckpt_index").unlink(missing_ok=True)  # loads read .metadata (the sidecar
    hf.reseal(torch_dist, "")  # records no transforms: a load through it reads the bytes as stored)
    _refused_by_both(torch_dist, r"\.metadata: storage record of 'w': stored with DCP storage transforms")


# --------------------------------------------------------------------------- the file that lies


def _record_at(ckpt: Path, offset: int) -> tuple:
    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn == "w")
    info = md.storage_data[index]
    md.storage_data[index] = dataclasses.replace(info, offset=offset)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / ".distckpt_index").unlink(missing_ok=True)
    return info.relative_path, (ckpt / info.relative_path).stat().st_size


def test_a_record_past_the_end_of_a_whole_data_file_blames_the_metadata(torch_dist):
    name, size = _record_at(torch_dist, 10**9)
    claim = (
        rf"\.metadata: claims key 'w' chunk at \[0, 0\] at offset 1000000000 of .*{name} \(\d+ bytes, "
        rf"up to byte \d+\), which holds {size} bytes, the size .*manifest\.json records for it: "
        rf"the metadata is damaged"
    )
    with pytest.raises(CheckpointingException, match=claim):
        distckpt.load(hf.base_state(False), torch_dist)
    code, out = _verify(torch_dist)
    assert code == 1 and f"which holds {size} bytes" in out and "the metadata is damaged" in out, out
    assert "truncated)" not in out, out


def test_a_truncated_data_file_is_named_as_truncated(torch_dist):
    md = read_metadata(torch_dist)
    index = next(i for i in md.storage_data if i.fqn == "w")
    name = md.storage_data[index].relative_path
    data = (torch_dist / name).read_bytes()
    (torch_dist / name).write_bytes(data[:100])
    (torch_dist / ".distckpt_index").unlink(missing_ok=True)
    with pytest.raises(
        CheckpointingException,
        match=rf"{name}: truncated: holds 100 bytes, .*manifest\.json records {len(data)}",
    ):
        distckpt.load(hf.base_state(False), torch_dist, sharded_strategy=TorchDCPLoadShardedStrategy())


# --------------------------------------------------------------------------- the torch_dcp reader


def _tensors_only() -> dict:
    return {k: v for k, v in hf.base_state(False).items() if isinstance(v, distckpt.ShardedTensor)}


def test_the_torch_dcp_reader_refuses_a_file_name_outside_the_checkpoint(torch_dist):
    (torch_dist.parent / "secret.distcp").write_bytes(hf.CANARY * 256)

    def outside(md):
        index = next(i for i in md.storage_data if i.fqn == "w")
        md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../secret.distcp")

    _edit_metadata(torch_dist, outside)
    # The strategy alone (a load would refuse at the common state first): DCP's engine would
    # open whatever .metadata names.
    with pytest.raises(CheckpointingException, match=r"\.metadata: storage record of 'w': file name"):
        TorchDCPLoadShardedStrategy().load(_tensors_only(), torch_dist)


def test_the_torch_dcp_reader_checks_what_it_reads_against_the_manifest(torch_dist):
    md = read_metadata(torch_dist)
    info = next(v for i, v in md.storage_data.items() if i.fqn == "w")
    data = bytearray((torch_dist / info.relative_path).read_bytes())
    data[info.offset + info.length - 2] ^= 0xFF  # inside w's tensor bytes
    (torch_dist / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(CheckpointingException, match=rf"key 'w' in .*{info.relative_path}.*CRC32C mismatch"):
        distckpt.load(hf.base_state(False), torch_dist, sharded_strategy=TorchDCPLoadShardedStrategy())


def test_a_flattened_keys_chunk_that_is_no_cell_of_its_grid_is_refused_by_the_torch_dcp_reader_too(
    torch_dist,
):
    def edit(md):
        chunks = md.state_dict_metadata["opt.f"].chunks
        chunks[1] = dataclasses.replace(chunks[1], sizes=torch.Size([1, 0, 14]))

    _edit_metadata(torch_dist, edit)
    # DCP read no element of a chunk box of none, and returned the request unfilled.
    match = r"\.metadata: key 'opt\.f': chunk at \[0, 0, 10\] of size \[1, 0, 14\] is not one cell"
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load(hf.base_state(False), torch_dist, sharded_strategy=TorchDCPLoadShardedStrategy())
    code, out = _verify(torch_dist)
    assert code == 1 and re.search(match, out), out


# --------------------------------------------------------------------------- the other files by schema


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["ranges"][next(iter(m["ranges"]))][0].__setitem__(0, 2.5), r"is not \[offset, length"),
        (lambda m: m["ranges"][next(iter(m["ranges"]))][0].__setitem__(1, "5"), r"is not \[offset, length"),
        (lambda m: m["files"].__setitem__(next(iter(m["files"])), True), r"files\[.*\]: size True"),
        (lambda m: m.__setitem__("version", 1.0), r"unsupported format .* version 1\.0"),
        (lambda m: m.__setitem__("keys", {"w": ["float32", [6.0, 8]]}), r"keys\['w'\]"),
    ],
    ids=["offset-float", "length-str", "size-bool", "version-float", "shape-float"],
)
def test_a_manifest_member_of_the_wrong_type_is_refused_naming_it(any_ckpt, edit, match):
    path = any_ckpt / ".distckpt_manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    match = r"\.distckpt_manifest\.json: malformed integrity manifest: .*" + match
    with pytest.raises(CheckpointingException, match=match):
        distckpt.load(hf.base_state(False), any_ckpt, verify=True)
    code, out = _verify(any_ckpt)
    assert code == 1 and re.search(match, out), out
    # A default load reads the members it uses (a torch_dist load served by the sidecar none of
    # the ranges): it refuses, or returns the saved values.
    try:
        assert hf.same(distckpt.load(hf.base_state(False), any_ckpt), hf.expected_load())
    except CheckpointingException as e:
        assert re.search(match, str(e)), e


def test_a_sidecar_version_of_the_wrong_type_is_refused(torch_dist):
    from distckpt.checksum import crc32c
    from distckpt.formats.index_format import HEADER

    path = torch_dist / ".distckpt_index"
    raw = path.read_bytes()
    _magic, n, _crc = HEADER.unpack_from(raw)
    directory = json.loads(raw[HEADER.size : HEADER.size + n])
    directory["version"] = "1"
    body = json.dumps(directory).encode()
    path.write_bytes(HEADER.pack(raw[:8], len(body), crc32c(body)) + body + raw[HEADER.size + n :])
    with pytest.raises(CheckpointingException, match=r"\.distckpt_index: malformed sidecar index: .*version"):
        IndexReader.open(torch_dist)


def test_a_tier_marker_version_of_the_wrong_type_is_refused(tmp_path):
    marker = markers.Marker("token", 100, 1, 0, {"__0_0.distcp": 4})
    markers.write_marker(tmp_path, marker)
    path = tmp_path / markers.marker_name(0)
    doc = json.loads(path.read_text())
    doc["version"] = True  # == 1 in Python, not the integer 1
    path.write_text(json.dumps(doc))
    with pytest.raises(
        CheckpointingException, match=r"owner00000\.json: not a version 1 distckpt-tier marker"
    ):
        markers.read_marker(tmp_path, 0)
