"""The model-free tools behind the ``distckpt`` command: inspect/show, verify, diff, export and
import, rename and rm-prefix (``distckpt/tools/``), on multi-rank checkpoints written by distckpt
and on the Megatron-Core fixtures."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt import dist as ddist
from distckpt.formats.manifest import MANIFEST_FNAME, read_manifest
from distckpt.tools import diff as diff_tool
from distckpt.tools import export, surgery, verify
from distckpt.tools.inspection import inspect_source, key_tree_rows, open_source, parse_slice, read_tensor
from distckpt.tools.sources.base import parse_dtype
from distckpt.tools.sources.checkpoint import CheckpointSource
from tests.support import layouts
from tests.support.harness import run_ranks

DATA = Path(__file__).parents[1] / "data"
FIXTURES = {
    "tp2_basic": DATA / "megatron-0.16.1" / "tp2_basic",
    "pp_prepend": DATA / "megatron-0.16.1" / "pp_prepend",
    "flat4": DATA / "megatron-0.16.1" / "flat4",
    "flat_dp4_torch_dist": DATA / "megatron-0.15.3" / "flat_dp4_torch_dist",
    "tp2_zarr": DATA / "megatron-0.15.3" / "tp2_zarr",
}
WORLD = 4
COMMON = {"iteration": 7, "args": {"lr": 0.1}, "optimizer": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}}


# --------------------------------------------------------------------------- checkpoints


def _save_model_and_optimizer(ckpt: str, backend: str) -> None:
    """Every rank: TP2 x DP2 model, flattened distributed-optimizer state under ``optimizer.``,
    one object per rank, common state with an ``optimizer`` entry, content metadata."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, _ = layouts.build("tp_dp", rank, world, True, tp=2)
    opt, _ = layouts.build("flat_optimizer", rank, world, True, tp=2)
    for name, sh in opt.items():
        sh.key = f"optimizer.{sh.key}"
        sd[f"optimizer.{name}"] = sh
    sd["rng"] = layouts.rank_object(rank, world)
    sd.update(COMMON)
    distckpt.save(
        sd,
        ckpt,
        sharded_strategy=(backend, 2 if backend == "zarr" else 1),
        content_metadata={"format": "tools-test"},
    )


def expected_tensors() -> dict:
    """key -> the full global tensor the checkpoint above must hold."""
    out = {p.key: layouts.full_tensor(p.key, p.global_shape, p.dtype) for p in layouts.tp_dp(0, WORLD, tp=2)}
    for p in layouts.flat_optimizer(0, WORLD, tp=2):
        out[f"optimizer.{p.key}"] = layouts.full_tensor(p.key, p.global_shape, p.dtype)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The multi-rank torch_dist checkpoint (written once; tests copy it before changing it)."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(path), "torch_dist")
    return path


@pytest.fixture(scope="module")
def saved_zarr(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved_zarr") / "ckpt"
    run_ranks(WORLD, _save_model_and_optimizer, str(path), "zarr")
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the multi-rank checkpoint."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def small_checkpoint(path: Path, tensors: dict, common: dict = None) -> Path:
    """A single-process checkpoint of whole tensors (no process group)."""
    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    sd.update(common or {})
    distckpt.save(sd, path)
    return path


def fixture_tensors(name: str) -> dict:
    return torch.load(FIXTURES[name] / "expected.pt", weights_only=True)["tensors"]


class Recorder:
    """A Progress that remembers what it was told."""

    def __init__(self):
        self.phases, self.done = [], 0

    def start(self, total, description):
        self.phases.append((description, total))

    def advance(self, amount):
        self.done += amount


# --------------------------------------------------------------------------- inspect


def test_inspect_lists_every_key_with_its_global_shape_and_dtype(saved):
    info = inspect_source(saved)
    expected = expected_tensors()
    assert {t.key: (t.shape, t.dtype) for t in info.tensors} == {
        k: (tuple(v.shape), v.dtype) for k, v in expected.items()
    }
    assert info.format == "torch_dist" and info.format_version == 1
    assert sorted(o.key for o in info.objects) == [f"rng_state/shard_0.{i}_1.{WORLD}" for i in range(WORLD)]


def test_inspect_shows_flattened_keys_in_their_original_shape(saved):
    metas = {t.key: t for t in inspect_source(saved).tensors}
    flat = metas["optimizer.exp_avg"]
    assert flat.shape == (8, 6) and flat.stored_shape == (2, 1, 24)
    assert flat.chunks == 4 and flat.nbytes == 8 * 6 * 4 and flat.disk_bytes > flat.nbytes
    assert metas["col"].stored_shape is None and metas["col"].chunks == 2


def test_inspect_reports_common_state_content_metadata_and_manifest(saved):
    info = inspect_source(saved)
    assert info.common == COMMON and info.common_error is None
    assert info.content_metadata == {"format": "tools-test"}
    assert info.extra["manifest"]["files"] > 0 and info.extra["disk_bytes"] > 0
    json.dumps(info.to_json())  # a JSON document, whatever the common state holds


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_inspect_megatron_fixtures_lists_every_key_with_its_original_shape(name):
    info = inspect_source(FIXTURES[name] / "ckpt")
    expected = fixture_tensors(name)
    assert {t.key: t.shape for t in info.tensors} == {k: tuple(v.shape) for k, v in expected.items()}
    assert {t.key: t.dtype for t in info.tensors} == {k: v.dtype for k, v in expected.items()}
    assert len(info.objects) == len(torch.load(FIXTURES[name] / "expected.pt", weights_only=True)["objects"])


class Opaque:
    """A class outside the unpickling allowlist."""


def test_inspect_reports_an_untrusted_common_state_instead_of_failing(tmp_path):
    small_checkpoint(tmp_path / "c", {"w": torch.ones(2)}, {"thing": Opaque()})
    info = inspect_source(tmp_path / "c")
    assert info.common is None and "--trust" in info.common_error
    assert [t.key for t in info.tensors] == ["w"]
    assert (
        inspect_source(tmp_path / "c", trusted=True)
        .common["thing"]
        .startswith("<tests.tools.test_tools.Opaque")
    )


def test_key_tree_merges_single_child_chains_and_collapses_below_depth():
    metas = [m for m in inspect_source(FIXTURES["tp2_basic"] / "ckpt").tensors]
    labels = [r.label for r in key_tree_rows(metas)]
    assert labels[0] == "embedding.word_embeddings.weight"
    assert "decoder" in labels and any(label.endswith("layers.0") for label in labels)
    assert any(label.endswith("linear_qkv.weight") for label in labels)
    collapsed = key_tree_rows(metas, max_depth=1)
    decoder_rows = [r for r in collapsed if r.label.startswith("decoder") or "──" in r.label]
    assert all(r.depth <= 1 for r in collapsed)
    assert sum(r.count for r in decoder_rows if r.depth == 1) == 6


@pytest.mark.parametrize(
    "text,offset,size,result",
    [
        ("0:4,:", (0, 0), (4, 6), (4, 6)),
        ("-1", (7, 0), (1, 6), (6,)),
        ("...,2", (0, 2), (8, 1), (8,)),
        ("1:7:3,::2", (1, 0), (6, 6), (2, 3)),
        ("", (0, 0), (8, 6), (8, 6)),
        ("5:2", (5, 0), (0, 6), (0, 6)),
    ],
)
def test_parse_slice_gives_the_box_to_read_and_what_to_index_after(text, offset, size, result):
    off, sz, post = parse_slice(text, (8, 6))
    assert (off, sz) == (offset, size)
    assert tuple(torch.zeros(sz)[post].shape) == result


@pytest.mark.parametrize("text", ["0:4,:,1", "8", "x", "0:4:-1", "...,...", "1:2:0"])
def test_parse_slice_rejects_malformed_or_out_of_range_indices(text):
    with pytest.raises(CheckpointingException):
        parse_slice(text, (8, 6))


def test_read_tensor_slice_equals_the_slice_of_the_whole_tensor(saved):
    expected = expected_tensors()
    with CheckpointSource(saved) as src:
        for key, text in [
            ("col", "2:7,1:5"),
            ("row", "-1"),
            ("optimizer.exp_avg", "1:6,::2"),
            ("optimizer.exp_avg_bf16", "3"),
            ("steps", ""),
        ]:
            off, size, post = parse_slice(text, expected[key].shape)
            want = expected[key][tuple(slice(o, o + n) for o, n in zip(off, size))][post]
            assert layouts.bitwise_equal(read_tensor(src, key, text), want.contiguous()), key


@pytest.mark.parametrize("name", ["flat_dp4_torch_dist", "tp2_zarr", "pp_prepend"])
def test_read_tensor_reads_megatron_fixtures(name):
    with open_source(FIXTURES[name] / "ckpt") as src:
        for key, full in fixture_tensors(name).items():
            assert torch.equal(read_tensor(src, key), full), key
            if full.dim() == 2 and full.shape[0] > 1:
                assert torch.equal(read_tensor(src, key, "1:,1:"), full[1:, 1:]), key


def test_iter_tensors_reads_small_keys_in_groups_within_the_budget(saved):
    with CheckpointSource(saved) as src:
        groups = src.group_keys(budget=200)
        assert [k for g in groups for k in g] == list(src.tensors())
        for g in groups:
            assert len(g) == 1 or sum(src.meta(k).nbytes for k in g) <= 200
        assert dict(src.iter_tensors(budget=200)).keys() == src.tensors().keys()


def test_parse_dtype_accepts_short_and_torch_names():
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("torch.float16") == torch.float16
    with pytest.raises(CheckpointingException, match="unknown dtype"):
        parse_dtype("float7")


# --------------------------------------------------------------------------- verify


def test_verify_accepts_a_complete_checkpoint_and_checksums_every_range(saved):
    progress = Recorder()
    report = verify.verify_checkpoint(saved, progress=progress)
    assert report.ok, report.problems
    assert report.manifest and progress.phases[0][0] == "checksums"
    assert progress.done == progress.phases[0][1] == report.bytes_checksummed > 0


def test_verify_finds_a_truncated_data_file(ckpt):
    data = sorted(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    os.truncate(data, data.stat().st_size // 2)
    report = verify.verify_checkpoint(ckpt)
    assert not report.ok
    assert any(data.name in p and "truncated" in p for p in report.problems)


def test_verify_finds_a_flipped_byte_only_with_checksums(ckpt):
    data = sorted(ckpt.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert verify.verify_checkpoint(ckpt, checksums=False).ok
    report = verify.verify_checkpoint(ckpt)
    assert any("CRC32C mismatch" in p and data.name in p for p in report.problems)


def test_verify_reports_a_missing_data_file_and_the_keys_it_held(ckpt):
    victim = sorted(ckpt.glob("*.distcp"))[0]
    victim.unlink()
    report = verify.verify_checkpoint(ckpt)
    assert any(p.startswith(f"{victim.name}: missing (holds") for p in report.problems)


def test_verify_reports_an_uncommitted_checkpoint(ckpt):
    (ckpt / "metadata.json").unlink()
    report = verify.verify_checkpoint(ckpt)
    assert any("metadata.json: missing" in p for p in report.problems)


def test_verify_rejects_a_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(CheckpointingException, match="no such file"):
        verify.verify_checkpoint(tmp_path / "nothing")


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_verify_accepts_megatron_fixtures_without_a_manifest(name):
    report = verify.verify_checkpoint(FIXTURES[name] / "ckpt", deep=True)
    assert report.ok, report.problems
    assert not report.manifest and any("no integrity manifest" in n for n in report.notes)


def test_verify_finds_a_truncated_chunk_in_a_megatron_fixture_copy(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES["flat_dp4_torch_dist"] / "ckpt", tmp_path / "ckpt"))
    os.truncate(ckpt / "__2_1.distcp", 100)
    report = verify.verify_checkpoint(ckpt)
    assert any(p.startswith("__2_1.distcp") and "truncated" in p for p in report.problems)


def test_verify_finds_a_missing_or_short_zarr_chunk(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES["tp2_zarr"] / "ckpt", tmp_path / "ckpt"))
    (ckpt / "weight_col" / "0.1").unlink()
    os.truncate(ckpt / "weight_row" / "1.0", 7)
    problems = verify.verify_checkpoint(ckpt).problems
    assert any(p.startswith("weight_col: 1 chunk file(s) missing") for p in problems)
    assert any(p.startswith("weight_row: 1 chunk file(s) of the wrong size") for p in problems)


def test_verify_zarr_checkpoint_against_its_manifest(saved_zarr, tmp_path):
    assert verify.verify_checkpoint(saved_zarr).ok
    ckpt = Path(shutil.copytree(saved_zarr, tmp_path / "ckpt"))
    chunk = next(p for p in (ckpt / "col").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    assert any("CRC32C mismatch" in p for p in verify.verify_checkpoint(ckpt).problems)


@pytest.mark.parametrize(
    "boxes,problem",
    [
        ([((0, 0), (4, 6)), ((4, 0), (4, 6))], None),
        ([((0, 0), (4, 6))], "cover 24 of 48"),
        ([((0, 0), (5, 6)), ((4, 0), (4, 6))], "overlap"),
        ([((0, 0), (4, 6)), ((4, 0), (5, 6))], "outside"),
    ],
)
def test_coverage_problem_finds_gaps_overlaps_and_strays(boxes, problem):
    found = verify.coverage_problem((8, 6), boxes)
    assert found is None if problem is None else problem in found


# --------------------------------------------------------------------------- diff


def test_diff_of_a_checkpoint_with_itself_is_identical(saved):
    report = diff_tool.diff_sources(saved, saved)
    assert report.identical and report.compared == len(expected_tensors())


def test_diff_finds_a_planted_value_difference_and_its_size(tmp_path):
    w = torch.randn(64, 32)
    planted = w.clone()
    planted[3, 4] += 0.5
    a = small_checkpoint(tmp_path / "a", {"w": w, "b": torch.arange(5)})
    b = small_checkpoint(tmp_path / "b", {"w": planted, "b": torch.arange(5)})
    report = diff_tool.diff_sources(a, b)
    assert not report.identical
    [d] = report.tensors
    assert d.key == "w" and d.kind == "values" and d.mismatched == 1
    assert d.max_abs == pytest.approx(0.5, abs=1e-6)
    assert diff_tool.diff_sources(a, b, atol=0.6).identical


def test_diff_reports_keys_shapes_dtypes_common_state_and_objects(tmp_path):
    a = small_checkpoint(
        tmp_path / "a", {"w": torch.ones(4), "x": torch.ones(2, 2), "only_a": torch.ones(1)}, {"iteration": 1}
    )
    b = small_checkpoint(
        tmp_path / "b",
        {"w": torch.ones(4, dtype=torch.float64), "x": torch.ones(4), "only_b": torch.ones(1)},
        {"iteration": 2},
    )
    report = diff_tool.diff_sources(a, b)
    assert report.only_a == ["only_a"] and report.only_b == ["only_b"]
    assert {(t.key, t.kind) for t in report.tensors} == {("w", "dtype"), ("x", "shape")}
    assert report.common == ["different: iteration"]


def test_diff_compares_sharded_objects(saved, tmp_path):
    other = tmp_path / "other"
    run_ranks(WORLD, _save_with_other_objects, str(other))
    report = diff_tool.diff_sources(saved, other, keys="rng")
    assert report.objects_different and not report.tensors


def _save_with_other_objects(ckpt):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    obj = layouts.rank_object(rank, world)
    obj.data = {**obj.data, "state": obj.data["state"] + 1}
    distckpt.save({"rng": obj}, ckpt)


@pytest.mark.parametrize(
    "a,b,atol,rtol,expect",
    [
        ([1.0, float("nan")], [1.0, float("nan")], 0, 0, (0.0, 0)),
        ([1.0, float("inf")], [1.0, float("inf")], 0, 0, (0.0, 0)),
        ([1.0, 2.0], [1.0, float("nan")], 0, 0, (float("inf"), 1)),
        ([1.0, 2.0], [1.1, 2.0], 0, 0.2, (pytest.approx(0.1), 0)),
    ],
)
def test_compare_tensors_treats_nan_as_equal_and_applies_tolerances(a, b, atol, rtol, expect):
    max_abs, _, bad = diff_tool.compare_tensors(torch.tensor(a), torch.tensor(b), atol, rtol)
    assert (max_abs, bad) == expect


def test_compare_tensors_compares_integers_exactly_in_blocks():
    a = torch.arange(1000, dtype=torch.int64) + 2**60
    b = a.clone()
    b[999] += 1
    assert diff_tool.compare_tensors(a, b, block=64)[::2] == (1.0, 1)


def test_diff_compares_a_checkpoint_with_its_safetensors_export(saved, tmp_path):
    out = tmp_path / "hf"
    export.convert(saved, out, "safetensors")
    report = diff_tool.diff_sources(saved, out)
    assert not report.tensors and not report.only_a and report.compared == len(expected_tensors())


# --------------------------------------------------------------------------- export / import


def test_safetensors_export_loads_with_the_safetensors_library_to_the_same_tensors(saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    summary = export.convert(saved, out, "safetensors", max_shard_size=400)
    index = json.loads((out / export.INDEX_FNAME).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    expected = expected_tensors()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    loaded = {}
    for shard in shards:
        part = load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        loaded.update(part)
    assert loaded.keys() == expected.keys()
    assert all(layouts.bitwise_equal(loaded[k], v) for k, v in expected.items())
    assert summary["dropped_objects"] == WORLD and summary["dropped_common_entries"] == len(COMMON) + 1


def test_safetensors_shards_stay_within_max_shard_size_unless_one_tensor_is_larger(tmp_path):
    w = export.SafetensorsWriter(tmp_path / "out", max_shard_size=100)
    w.begin({}, {})
    for i, n in enumerate([10, 10, 30, 5]):  # float32: 40, 40, 120, 20 bytes
        w.write_tensor(f"t{i}", torch.ones(n))
    w.finish()
    index = json.loads((tmp_path / "out" / export.INDEX_FNAME).read_text())["weight_map"]
    assert index == {
        "t0": "model-00001-of-00003.safetensors",
        "t1": "model-00001-of-00003.safetensors",
        "t2": "model-00002-of-00003.safetensors",
        "t3": "model-00003-of-00003.safetensors",
    }


def test_safetensors_output_fitting_one_shard_is_a_single_model_safetensors(tmp_path):
    w = export.SafetensorsWriter(tmp_path / "out")
    w.begin({}, {})
    w.write_tensor("a", torch.ones(3))
    w.finish()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_file_writer_writes_what_torch_load_reads_weights_only(tmp_path, mmap):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "fp8": torch.ones(4).to(torch.float8_e4m3fn),
        "u16": torch.arange(6).to(torch.uint16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "view": torch.randn(6, 6)[:, 2],
        "bool": torch.tensor([True, False]),
    }
    w = export.TorchFileWriter(tmp_path / "m.pt")
    w.begin({}, {})
    for k, v in tensors.items():
        w.write_tensor(k, v)
    w.finish()
    loaded = torch.load(tmp_path / "m.pt", weights_only=True, mmap=mmap)
    assert list(loaded) == list(tensors)
    assert all(layouts.bitwise_equal(loaded[k], v.contiguous()) for k, v in tensors.items())


def test_writers_abort_without_leaving_files_and_refuse_an_existing_output(tmp_path):
    for w in (
        export.SafetensorsWriter(tmp_path / "st"),
        export.SafetensorsWriter(tmp_path / "one.safetensors"),
        export.TorchFileWriter(tmp_path / "m.pt"),
    ):
        w.begin({}, {})
        w.write_tensor("a", torch.ones(3))
        w.abort()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "m.pt").write_bytes(b"x")
    with pytest.raises(CheckpointingException, match="already exists"):
        export.TorchFileWriter(tmp_path / "m.pt")


def test_model_only_conversion_drops_optimizer_keys_and_common_entry(saved, tmp_path):
    out = tmp_path / "zarr"
    export.convert(saved, out, "zarr", model_only=True, dtype=torch.bfloat16)
    tensors = distckpt.load_plain_tensors(out)
    expected = {k: v for k, v in expected_tensors().items() if not k.startswith("optimizer.")}
    assert tensors.keys() == expected.keys()
    for k, v in expected.items():  # floats cast to bf16, the rest untouched
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert layouts.bitwise_equal(tensors[k], want), k
    assert "optimizer" not in distckpt.load_common_state_dict(out)
    assert distckpt.load_common_state_dict(out)["iteration"] == 7


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_files_import_into_a_checkpoint_that_loads_resharded(saved, tmp_path, fmt, backend):
    exported = tmp_path / ("model.pt" if fmt == "torch" else "hf")
    export.convert(saved, exported, fmt, exclude="^optimizer")
    ckpt = tmp_path / "imported"
    export.convert(exported, ckpt, backend)
    assert verify.verify_checkpoint(ckpt).ok
    results = run_ranks(WORLD, _load_model_under_tp_dp, str(ckpt))
    assert results == [True] * WORLD


def _load_model_under_tp_dp(ckpt):
    sd, pieces = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), False, tp=2)
    out = distckpt.load(sd, ckpt)
    return all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())


def test_torch_file_import_keeps_nested_paths_as_keys_and_the_rest_as_common_state(tmp_path):
    torch.save(
        {"model": {"w": torch.ones(2), "layers": [torch.zeros(3)]}, "iteration": 5, "args": {"lr": 0.1}},
        tmp_path / "m.pt",
    )
    export.convert(tmp_path / "m.pt", tmp_path / "ckpt", "torch_dist")
    assert sorted(distckpt.load_plain_tensors(tmp_path / "ckpt")) == ["model.layers.0", "model.w"]
    assert distckpt.load_common_state_dict(tmp_path / "ckpt") == {"iteration": 5, "args": {"lr": 0.1}}


def test_torch_file_source_refuses_untrusted_pickles_unless_trusted(tmp_path):
    torch.save({"w": torch.ones(2), "when": Opaque()}, tmp_path / "m.pt")
    with pytest.raises(CheckpointingException, match="--trust"):
        open_source(tmp_path / "m.pt")
    assert list(open_source(tmp_path / "m.pt", trusted=True).tensors()) == ["w"]


def test_conversion_filters_keys_with_regular_expressions(saved, tmp_path):
    export.convert(
        saved, tmp_path / "out.safetensors", "safetensors", keys="^(col|row|optimizer)", exclude="bf16"
    )
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "out.safetensors")) == ["col", "optimizer.exp_avg", "row"]


# --------------------------------------------------------------------------- surgery


def test_rename_torch_dist_in_place_touches_only_the_index_and_loads(ckpt):
    data_before = {p.name: (p.stat().st_ino, p.stat().st_size) for p in ckpt.glob("*.distcp")}
    plan = surgery.rename_keys(
        ckpt,
        [("col", "model.col")],
        [(r"^optimizer\.", "opt.")],
    )
    assert plan.tensors == {
        "col": "model.col",
        "optimizer.exp_avg": "opt.exp_avg",
        "optimizer.exp_avg_bf16": "opt.exp_avg_bf16",
    }
    assert {p.name: (p.stat().st_ino, p.stat().st_size) for p in ckpt.glob("*.distcp")} == data_before
    tensors = distckpt.load_plain_tensors(ckpt)
    expected = expected_tensors()
    assert layouts.bitwise_equal(tensors["model.col"], expected["col"])
    assert layouts.bitwise_equal(
        tensors["opt.exp_avg"], expected["optimizer.exp_avg"]
    )  # flattened: mcore_data
    assert "col" not in tensors
    report = verify.verify_checkpoint(ckpt)
    assert report.ok, report.problems
    assert not list(ckpt.parent.glob(".ckpt.*"))  # no leftovers beside


def test_rename_updates_the_manifests_range_keys(ckpt):
    surgery.rename_keys(ckpt, [("row", "renamed.row")])
    keys = {r.key for rs in read_manifest(ckpt).ranges.values() for r in rs}
    assert "renamed.row" in keys and "row" not in keys


def test_renamed_object_loads_under_its_new_key(ckpt):
    plan = surgery.rename_keys(ckpt, [("rng_state", "rng")])
    assert sorted(plan.objects.values()) == [f"rng/shard_0.{i}_1.{WORLD}" for i in range(WORLD)]
    assert run_ranks(WORLD, _load_object, str(ckpt), "rng") == [True] * WORLD


def _load_object(ckpt, key):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    obj = layouts.rank_object(rank, world, with_data=False)
    obj.key = key
    out = distckpt.load({"o": obj}, ckpt)["o"]
    want = layouts.rank_object(rank, world).data
    return out["rank"] == want["rank"] and torch.equal(out["state"], want["state"])


def test_rename_megatron_checkpoint_copy_keeps_flattened_and_metadata_extras(tmp_path):
    for name in ("flat_dp4_torch_dist", "tp2_basic"):
        ckpt = Path(shutil.copytree(FIXTURES[name] / "ckpt", tmp_path / name))
        surgery.rename_keys(ckpt, regexes=[("^", "model.")])
        tensors = distckpt.load_plain_tensors(ckpt)
        assert {k: v for k, v in tensors.items()}.keys() == {f"model.{k}" for k in fixture_tensors(name)}
        for k, v in fixture_tensors(name).items():
            assert torch.equal(tensors[f"model.{k}"], v), k
        assert verify.verify_checkpoint(ckpt, deep=True).ok


def test_rename_without_hard_links_falls_back_to_atomic_file_replacement(ckpt, monkeypatch):
    monkeypatch.setattr(surgery, "_exchange_atomic", lambda a, b: False)
    surgery.rename_keys(ckpt, [("col", "c")])
    assert "c" in distckpt.load_plain_tensors(ckpt)
    assert verify.verify_checkpoint(ckpt).ok


def test_rename_to_out_leaves_the_source_untouched(saved, tmp_path):
    surgery.rename_keys(saved, [("col", "c")], out=tmp_path / "out")
    assert "col" in distckpt.load_plain_tensors(saved)
    assert "c" in distckpt.load_plain_tensors(tmp_path / "out")
    assert verify.verify_checkpoint(tmp_path / "out").ok


def test_rename_zarr_in_place_moves_arrays_and_objects_and_loads(saved_zarr, tmp_path):
    ckpt = Path(shutil.copytree(saved_zarr, tmp_path / "ckpt"))
    surgery.rename_keys(ckpt, [("rng_state", "rng")], [(r"^optimizer\.", "opt/")])
    assert (ckpt / "opt" / "exp_avg" / "zarr.json").is_file() and (ckpt / "rng").is_dir()
    assert not (ckpt / "optimizer.exp_avg").exists() and not (ckpt / "rng_state").exists()
    tensors = distckpt.load_plain_tensors(ckpt)
    assert layouts.bitwise_equal(tensors["opt/exp_avg"], expected_tensors()["optimizer.exp_avg"])
    report = verify.verify_checkpoint(ckpt)
    assert report.ok, report.problems
    assert run_ranks(WORLD, _load_object, str(ckpt), "rng") == [True] * WORLD


def test_rename_megatron_zarr_fixture_copy(tmp_path):
    ckpt = Path(shutil.copytree(FIXTURES["tp2_zarr"] / "ckpt", tmp_path / "ckpt"))
    surgery.rename_keys(ckpt, [("weight_col", "w/col")])
    tensors = distckpt.load_plain_tensors(ckpt)
    assert torch.equal(tensors["w/col"], fixture_tensors("tp2_zarr")["weight_col"])


@pytest.mark.parametrize(
    "mapping,regexes,match",
    [
        ([("colx", "a")], [], "no key 'colx'.*did you mean 'col'"),
        ([("col", "row")], [], "would both be named 'row'"),
        ([], [("^.*$", "same")], "would both be named"),
        ([], [("nomatch", "x")], "changes no key"),
        ([], [("(", "x")], "invalid pattern"),
        ([("col", "")], [], "empty name"),
    ],
)
def test_rename_refuses_bad_requests_and_changes_nothing(ckpt, mapping, regexes, match):
    before = (ckpt / ".metadata").read_bytes()
    with pytest.raises(CheckpointingException, match=match):
        surgery.rename_keys(ckpt, mapping, regexes)
    assert (ckpt / ".metadata").read_bytes() == before


def test_rename_dry_run_changes_nothing(ckpt):
    before = (ckpt / ".metadata").read_bytes()
    plan = surgery.rename_keys(ckpt, [("col", "c")], dry_run=True)
    assert plan.tensors == {"col": "c"} and (ckpt / ".metadata").read_bytes() == before


def test_parse_pairs_splits_maps_at_the_first_and_regexes_at_the_last_equals():
    assert surgery.parse_pairs(["a=b=c"], "--map") == [("a", "b=c")]
    assert surgery.parse_pairs(["x(?=y)=z"], "--regex", split_last=True) == [("x(?=y)", "z")]
    with pytest.raises(CheckpointingException, match="OLD=NEW"):
        surgery.parse_pairs(["nothing"], "--map")


def test_remove_prefix_in_place_drops_optimizer_state_and_stays_verified(ckpt):
    removed = surgery.remove_prefix(ckpt, "optimizer.")
    assert removed == ["optimizer.exp_avg", "optimizer.exp_avg_bf16"]
    assert not any(k.startswith("optimizer.") for k in distckpt.load_plain_tensors(ckpt))
    assert verify.verify_checkpoint(ckpt).ok
    assert run_ranks(WORLD, _load_model_under_tp_dp, str(ckpt)) == [True] * WORLD


def test_remove_prefix_to_out_leaves_the_source_untouched(saved, tmp_path):
    surgery.remove_prefix(saved, "optimizer.", out=tmp_path / "model")
    assert "optimizer.exp_avg" in distckpt.load_plain_tensors(saved)
    assert "optimizer.exp_avg" not in distckpt.load_plain_tensors(tmp_path / "model")
    assert verify.verify_checkpoint(tmp_path / "model").ok


def test_remove_prefix_without_matches_suggests_keys(ckpt):
    with pytest.raises(CheckpointingException, match="no key starts with 'optimiser'"):
        surgery.remove_prefix(ckpt, "optimiser")


def test_verify_reports_a_manifest_that_lost_the_checksums_of_a_file(ckpt):
    path = ckpt / MANIFEST_FNAME
    raw = json.loads(path.read_text())
    raw["ranges"]["common.pu"] = raw["ranges"].pop("common.pt")
    path.write_text(json.dumps(raw))
    problems = verify.verify_checkpoint(ckpt).problems
    assert any(
        "manifest is inconsistent" in p
        and "unlisted files ['common.pu']" in p
        and "without checksums ['common.pt']" in p
        for p in problems
    )


def test_verify_reports_a_backend_this_distckpt_cannot_load(ckpt):
    config = json.loads((ckpt / "metadata.json").read_text())
    (ckpt / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "nope"}))
    problems = verify.verify_checkpoint(ckpt).problems
    assert any(
        p.startswith("metadata.json: no load_sharded strategy registered for backend 'nope'")
        for p in problems
    )
    with pytest.raises(CheckpointingException, match="metadata.json: no load_sharded strategy"):
        inspect_source(ckpt)


@pytest.mark.parametrize("zipfile", [True, False])
def test_torch_file_source_reads_the_same_values_every_time(tmp_path, zipfile):
    """Mapped files release a tensor's pages once it was copied; legacy files are loaded whole."""
    tensors = {"a": torch.randn(300, 300), "b": torch.arange(7), "c": torch.randn(5000)}
    torch.save(tensors, tmp_path / "m.pt", _use_new_zipfile_serialization=zipfile)
    with open_source(tmp_path / "m.pt") as src:
        for _ in range(2):
            assert all(torch.equal(src.read(k), v) for k, v in tensors.items())
        assert torch.equal(src.read("a", (3, 4), (2, 2)), tensors["a"][3:5, 4:6])


def test_rename_interrupted_between_manifest_and_index_is_finished_by_running_it_again(ckpt, monkeypatch):
    monkeypatch.setattr(surgery, "_exchange_atomic", lambda a, b: False)
    real = surgery.atomic_write_bytes

    def crash_on_index(path, data):
        if Path(path).name == ".metadata":
            raise OSError("simulated crash")
        real(path, data)

    monkeypatch.setattr(surgery, "atomic_write_bytes", crash_on_index)
    with pytest.raises(OSError):
        surgery.rename_keys(ckpt, [("col", "c")])
    # The old .metadata with a manifest describing the new names: a default load (which checks
    # each record read against the manifest) and verify both say so, naming both files.
    with pytest.raises(
        CheckpointingException, match=r"(?=.*\.metadata)(?=.*\.distckpt_manifest\.json)(?=.*'col')"
    ):
        distckpt.load_plain_tensors(ckpt)
    assert not verify.verify_checkpoint(ckpt).ok
    monkeypatch.setattr(surgery, "atomic_write_bytes", real)
    surgery.rename_keys(ckpt, [("col", "c")])
    assert "c" in distckpt.load_plain_tensors(ckpt) and verify.verify_checkpoint(ckpt).ok
