"""Conversion between backends (distckpt.tools.convert): bit-identical, streaming, atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedObject, check_is_distributed_checkpoint
from distckpt import dist as ddist
from distckpt.formats.manifest import read_manifest, verify_files
from distckpt.strategies.base import StrategyAction, get_default_strategy
from distckpt.tools import convert
from distckpt.tools.convert import convert_checkpoint, register_writer
from tests.support import layouts
from tests.support.harness import run_ranks

DATA = Path(__file__).parents[1] / "data"
OBJECT_KEYS = ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]


# --------------------------------------------------------------------------- helpers


def _model(rank, world, with_data):
    sd, pieces = {}, {}
    for layout, params in [("tp_dp", {"tp": 2}), ("flat_optimizer", {"tp": 2}), ("fp8", {})]:
        s, p = layouts.build(layout, rank, world, with_data, **params)
        sd.update(s)
        pieces.update(p)
    return sd, pieces


def _save_model(ckpt, backend):
    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, _ = _model(rank, world, True)
    sd["rng"] = layouts.rank_object(rank, world, True, replicas=2)
    sd["iteration"] = 42
    sd["args"] = {"lr": 0.25}
    distckpt.save(
        sd, ckpt, sharded_strategy=(backend, 1), content_metadata={"distrib_optim": "dp_reshardable"}
    )


def _load_model(ckpt):
    sd, pieces = _model(ddist.get_rank(), ddist.get_world_size(), False)
    loaded = distckpt.load(sd, ckpt)
    return [
        n
        for n, p in pieces.items()
        if loaded[n].dtype != p.expected().dtype or not torch.equal(loaded[n], p.expected())
    ]


def _bits(t):
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _objects(ckpt):
    sharded = get_default_strategy(StrategyAction.LOAD_SHARDED, *_backend(ckpt))
    request = {uk: ShardedObject.empty_from_unique_key(uk) for uk in OBJECT_KEYS}
    common = get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1)
    out = (
        sharded.load(request, ckpt)
        if sharded.can_handle_sharded_objects
        else common.load_sharded_objects(request, ckpt)
    )
    return {k: repr(v) for k, v in out.items()}


def _backend(ckpt):
    md = json.loads((Path(ckpt) / "metadata.json").read_text())
    return md["sharded_backend"], md["sharded_backend_version"]


def _assert_same_tensors(a, b):
    ta, tb = distckpt.load_plain_tensors(a), distckpt.load_plain_tensors(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and ta[key].shape == tb[key].shape, key
        assert torch.equal(_bits(ta[key]), _bits(tb[key])), key


@pytest.fixture(scope="module")
def torch_dist_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "ckpt"
    run_ranks(4, _save_model, str(path), "torch_dist")
    return path


# --------------------------------------------------------------------------- round trips


def test_torch_dist_to_zarr_to_torch_dist_is_bit_identical(torch_dist_ckpt, tmp_path):
    report = convert_checkpoint(torch_dist_ckpt, tmp_path / "zarr", "zarr")
    convert_checkpoint(tmp_path / "zarr", tmp_path / "back", "torch_dist")
    assert _backend(tmp_path / "zarr") == ("zarr", 2) and _backend(tmp_path / "back") == ("torch_dist", 1)
    assert report.src_backend == "torch_dist" and report.dst_backend == "zarr"
    assert sorted(report.objects) == OBJECT_KEYS and report.skipped == [] and report.cast == []
    for ckpt in (tmp_path / "zarr", tmp_path / "back"):
        _assert_same_tensors(torch_dist_ckpt, ckpt)
        content = {"distrib_optim": "dp_reshardable"}
        common = {"iteration": 42, "args": {"lr": 0.25}, "content_metadata": content}
        assert distckpt.load_common_state_dict(ckpt) == common
        assert distckpt.load_content_metadata(ckpt) == {"distrib_optim": "dp_reshardable"}
        assert _objects(ckpt) == _objects(torch_dist_ckpt)
        assert verify_files(ckpt, read_manifest(ckpt)) == []


def test_converted_checkpoints_load_resharded(torch_dist_ckpt, tmp_path):
    convert_checkpoint(torch_dist_ckpt, tmp_path / "zarr", "zarr")
    convert_checkpoint(tmp_path / "zarr", tmp_path / "back", "torch_dist")
    for ckpt in (tmp_path / "zarr", tmp_path / "back"):
        assert run_ranks(2, _load_model, str(ckpt)) == [[], []]
        assert run_ranks(4, _load_model, str(ckpt)) == [[]] * 4


def test_zarr_to_zarr_with_small_chunks_is_bit_identical(torch_dist_ckpt, tmp_path):
    convert_checkpoint(torch_dist_ckpt, tmp_path / "a", "zarr")
    convert_checkpoint(tmp_path / "a", tmp_path / "b", "zarr", writer_options={"max_chunk_bytes": 16})
    assert json.loads((tmp_path / "b" / "col" / "zarr.json").read_text())["chunk_grid"]["configuration"][
        "chunk_shape"
    ] == [1, 6]
    _assert_same_tensors(torch_dist_ckpt, tmp_path / "b")


@pytest.mark.parametrize(
    "fixture,to",
    [
        ("megatron-0.15.3/tp2_zarr", "torch_dist"),
        ("megatron-0.15.3/flat_dp4_torch_dist", "zarr"),
        ("megatron-0.16.1/tp2_basic", "zarr"),
    ],
)
def test_megatron_checkpoints_convert_exactly(fixture, to, tmp_path):
    expected = torch.load(DATA / fixture / "expected.pt", weights_only=True)
    convert_checkpoint(DATA / fixture / "ckpt", tmp_path / "out", to)
    plain = distckpt.load_plain_tensors(tmp_path / "out")
    assert sorted(plain) == sorted(expected["tensors"])
    assert all(plain[k].dtype == v.dtype and torch.equal(plain[k], v) for k, v in expected["tensors"].items())
    assert distckpt.load_common_state_dict(tmp_path / "out") == expected["common"]
    sharded = get_default_strategy(StrategyAction.LOAD_SHARDED, *_backend(tmp_path / "out"))
    common = get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1)
    request = {uk: ShardedObject.empty_from_unique_key(uk) for uk in expected["objects"]}
    objs = (
        sharded.load(request, tmp_path / "out")
        if sharded.can_handle_sharded_objects
        else common.load_sharded_objects(request, tmp_path / "out")
    )
    assert {k: repr(v) for k, v in objs.items()} == {k: repr(v) for k, v in expected["objects"].items()}


# --------------------------------------------------------------------------- selection, cast, progress


def test_keys_exclude_and_dtype_select_and_cast(torch_dist_ckpt, tmp_path):
    report = convert_checkpoint(
        torch_dist_ckpt,
        tmp_path / "out",
        "zarr",
        keys=r"^(col|row|emb|count|rng_state)$",
        exclude=r"^row$",
        dtype=torch.bfloat16,
    )
    assert sorted(report.tensors) == ["col", "count", "emb"]
    assert report.cast == ["col"]
    assert "row" in report.skipped and "exp_avg" in report.skipped and sorted(report.objects) == OBJECT_KEYS
    plain = distckpt.load_plain_tensors(tmp_path / "out")
    src = distckpt.load_plain_tensors(torch_dist_ckpt)
    assert plain["col"].dtype == torch.bfloat16 and torch.equal(plain["col"], src["col"].to(torch.bfloat16))
    assert torch.equal(plain["count"], src["count"]) and torch.equal(plain["emb"], src["emb"])


def test_progress_reports_every_tensor(torch_dist_ckpt, tmp_path):
    calls = []
    convert_checkpoint(
        torch_dist_ckpt,
        tmp_path / "a",
        "zarr",
        progress=lambda done, total, key: calls.append((done, total, key)),
    )
    total = calls[-1][1]
    assert calls[-1][0] == total > 0 and len(calls) == len(distckpt.load_tensors_metadata(torch_dist_ckpt))

    class Bar:
        def __init__(self):
            self.total, self.done = None, 0

        def start(self, total, description):
            self.total = total

        def advance(self, amount):
            self.done += amount

    bar = Bar()
    convert_checkpoint(torch_dist_ckpt, tmp_path / "b", "torch_dist", progress=bar)
    assert bar.done == bar.total == total


def test_conversion_holds_at_most_one_group_of_keys(torch_dist_ckpt, tmp_path, monkeypatch):
    groups = []
    original = convert._Source.load_tensors

    def spy(self, metas):
        groups.append(sorted(metas))
        return original(self, metas)

    monkeypatch.setattr(convert._Source, "load_tensors", spy)
    convert_checkpoint(torch_dist_ckpt, tmp_path / "one", "zarr", read_budget_bytes=0)
    assert all(len(g) == 1 for g in groups) and len(groups) == len(
        distckpt.load_tensors_metadata(torch_dist_ckpt)
    )
    groups.clear()
    convert_checkpoint(torch_dist_ckpt, tmp_path / "budget", "zarr", read_budget_bytes=200)
    assert len(groups) > 1 and max(len(g) for g in groups) > 1


# --------------------------------------------------------------------------- atomicity, errors


def test_failed_conversion_leaves_nothing_that_looks_like_a_checkpoint(torch_dist_ckpt, tmp_path):
    src = tmp_path / "src"
    convert_checkpoint(torch_dist_ckpt, src, "zarr")
    chunk = next((src / "row" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    chunk.unlink()
    with pytest.raises(CheckpointingException, match=r"key 'row': chunk file .* is missing"):
        convert_checkpoint(src, tmp_path / "new", "torch_dist")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointingException, match=r"key 'row'"):
        convert_checkpoint(src, tmp_path / "old", "torch_dist", overwrite=True)
    assert not check_is_distributed_checkpoint(tmp_path / "old") and (tmp_path / "old" / "notes.txt").exists()


def test_overwrite_replaces_an_earlier_checkpoint(torch_dist_ckpt, tmp_path):
    convert_checkpoint(torch_dist_ckpt, tmp_path / "out", "torch_dist", keys="^col$")
    with pytest.raises(CheckpointingException, match="destination is not empty"):
        convert_checkpoint(torch_dist_ckpt, tmp_path / "out", "zarr")
    convert_checkpoint(torch_dist_ckpt, tmp_path / "out", "zarr", overwrite=True)
    assert _backend(tmp_path / "out") == ("zarr", 2)
    _assert_same_tensors(torch_dist_ckpt, tmp_path / "out")


def test_source_must_be_a_committed_checkpoint_and_not_the_destination(torch_dist_ckpt, tmp_path):
    with pytest.raises(CheckpointingException, match="its own folder"):
        convert_checkpoint(torch_dist_ckpt, torch_dist_ckpt, "zarr", overwrite=True)
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointingException, match="not a committed checkpoint"):
        convert_checkpoint(tmp_path / "junk", tmp_path / "out", "zarr")
    with pytest.raises(
        CheckpointingException, match=r"no checkpoint writer 'hdf5'; known: .*torch_dist.*zarr"
    ):
        convert_checkpoint(torch_dist_ckpt, tmp_path / "out", "hdf5")
    with pytest.raises(CheckpointingException, match="invalid key pattern"):
        convert_checkpoint(torch_dist_ckpt, tmp_path / "out", "zarr", keys="(")


class _RecordingWriter:
    def __init__(self, dst, overwrite=False, fail_on=None):
        self.dst, self.fail_on = dst, fail_on
        self.events = []

    def begin(self, common, objects):
        self.events.append(("begin", sorted(common), sorted(objects)))

    def write_tensor(self, key, tensor):
        if key == self.fail_on:
            raise RuntimeError("injected")
        self.events.append(("tensor", key, tuple(tensor.shape)))

    def finish(self):
        self.events.append(("finish",))
        return "done"

    def abort(self):
        self.events.append(("abort",))


def test_writers_plug_in_by_name(torch_dist_ckpt, tmp_path):
    made = []
    register_writer(
        "recording", lambda dst, overwrite=False, **kw: made.append(_RecordingWriter(dst, **kw)) or made[-1]
    )
    try:
        convert_checkpoint(torch_dist_ckpt, tmp_path / "x", "recording", keys="^(col|steps|rng_state)$")
        events = made[0].events
        assert events[0] == ("begin", ["args", "content_metadata", "iteration"], OBJECT_KEYS)
        assert sorted(events[1:3]) == [("tensor", "col", (8, 6)), ("tensor", "steps", ())]
        assert events[3] == ("finish",)
        with pytest.raises(RuntimeError, match="injected"):
            convert_checkpoint(
                torch_dist_ckpt, tmp_path / "y", "recording", writer_options={"fail_on": "col"}
            )
        assert made[1].events[-1] == ("abort",)
    finally:
        convert._WRITERS.pop("recording")
