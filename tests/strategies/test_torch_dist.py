"""Behaviour specific to the ``torch_dist`` strategy: files, key removal, cached metadata, .metadata."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle

import pytest
import torch

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import dist as ddist
from distckpt.strategies.torch import TorchDistSaveShardedStrategy
from tests.support import layouts
from tests.support.harness import run_ranks


def _model_and_optimizer(rank, world):
    sd, pieces = layouts.build("tp_dp", rank, world, True, tp=2)
    opt, opt_pieces = layouts.build("flat_optimizer", rank, world, True, tp=2)
    for name, sh in opt.items():
        sh.key = f"optimizer.{sh.key}"
        sd[f"optimizer.{name}"] = sh
    return sd, pieces


def _save_model_and_optimizer(ckpt, hint):
    sd, _ = _model_and_optimizer(ddist.get_rank(), ddist.get_world_size())
    distckpt.save(sd, ckpt, sharded_strategy=TorchDistSaveShardedStrategy(separation_hint=hint))


def _load_model_only(ckpt):
    sd, pieces = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), False, tp=2)
    out, missing, unexpected = distckpt.load(sd, ckpt, strict="return_all")
    ok = all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())
    return ok, sorted(missing), sorted(unexpected)


def _data_bytes(ckpt):
    return sum(p.stat().st_size for p in ckpt.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("hint", ["optimizer.", None])
def test_remove_sharded_tensors_drops_the_optimizer_and_shrinks_the_checkpoint(hint, tmp_path, caplog):
    run_ranks(4, _save_model_and_optimizer, str(tmp_path), hint)
    if hint:
        assert any(p.name.startswith("optimizer.__") for p in tmp_path.iterdir())
    before = _data_bytes(tmp_path)
    opt_bytes = 8 * 6 * 4 + 4 * 10 * 2  # exp_avg (fp32) + exp_avg_bf16 (bf16)
    with caplog.at_level(logging.WARNING):
        distckpt.remove_sharded_tensors(tmp_path, "optimizer.")
    after = _data_bytes(tmp_path)
    assert before - after >= opt_bytes
    assert ("rewrote" in caplog.text) == (hint is None)
    assert not any(k.startswith("optimizer.") for k in distckpt.load_sharded_metadata(tmp_path))
    assert run_ranks(4, _load_model_only, str(tmp_path)) == [(True, [], [])] * 4


def test_remove_sharded_tensors_with_an_unknown_prefix_is_a_clear_error(tmp_path):
    distckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3))}, tmp_path)
    with pytest.raises(distckpt.CheckpointingException, match="no key starts with 'zzz'"):
        distckpt.remove_sharded_tensors(tmp_path, "zzz")


def _save_twice(base, structures):
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    reused = []
    for i, layout in enumerate(structures):
        sd, _ = layouts.build(
            layout, ddist.get_rank(), ddist.get_world_size(), True, **({"tp": 2} if layout == "tp_dp" else {})
        )
        distckpt.save(sd, f"{base}/ckpt{i}", sharded_strategy=strategy)
        reused.append(strategy.last_save_reused_metadata)
    return reused


def _check_layout(ckpt, layout):
    sd, pieces = layouts.build(
        layout, ddist.get_rank(), ddist.get_world_size(), False, **({"tp": 2} if layout == "tp_dp" else {})
    )
    out = distckpt.load(sd, ckpt, strict="raise_all")
    return all(layouts.bitwise_equal(out[n], p.expected()) for n, p in pieces.items())


def test_cached_metadata_is_reused_only_for_an_unchanged_structure(tmp_path):
    reused = run_ranks(4, _save_twice, str(tmp_path), ["tp_dp", "tp_dp", "uneven", "uneven"])
    assert reused == [[False, True, False, True]] * 4
    for i, layout in enumerate(["tp_dp", "tp_dp", "uneven", "uneven"]):
        assert run_ranks(4, _check_layout, str(tmp_path / f"ckpt{i}"), layout) == [True] * 4
    ids = {
        pickle.loads((tmp_path / f"ckpt{i}" / ".metadata").read_bytes()).storage_meta.save_id
        for i in range(2)
    }
    assert len(ids) == 2
    # The reused .metadata (saves 1 and 3) is the one pickled anew for saves 0 and 2 but for
    # storage_meta, whose ids are the new save's (its manifest names the same save id).
    for first, again in [(0, 1), (2, 3)]:
        a, b = (pickle.loads((tmp_path / f"ckpt{i}" / ".metadata").read_bytes()) for i in (first, again))
        assert b.state_dict_metadata == a.state_dict_metadata and b.storage_data == a.storage_data
        assert b.mcore_data == a.mcore_data
        manifest = json.loads((tmp_path / f"ckpt{again}" / ".distckpt_manifest.json").read_text())
        assert b.storage_meta.save_id == manifest["save_id"] != a.storage_meta.save_id
        assert b.storage_meta.checkpoint_id != a.storage_meta.checkpoint_id
        assert f"ckpt{again}" in str(b.storage_meta.checkpoint_id)


def _bumped(layout, bump, with_data=True):
    sd, pieces = layouts.build(
        layout,
        ddist.get_rank(),
        ddist.get_world_size(),
        with_data,
        **({"tp": 2} if layout == "tp_dp" else {}),
    )
    if with_data:
        for sh in sd.values():
            if sh.data.is_floating_point():
                sh.data.add_(bump)
    return sd, pieces


def _save_series(base, series):
    """Saves through fresh default strategies; ``None`` in ``series``: rank 0 forgets its last save."""
    from distckpt.strategies.torch import LAST_SAVE

    LAST_SAVE.clear()
    reused = []
    for i, step in enumerate(series):
        if step is None:
            LAST_SAVE.clear()
            continue
        strategy = TorchDistSaveShardedStrategy()
        distckpt.save(_bumped(*step)[0], f"{base}/ckpt{i}", sharded_strategy=strategy)
        reused.append(strategy.last_save_reused_metadata)
    return reused


def _check_bumped(ckpt, layout, bump):
    sd, pieces = _bumped(layout, bump, with_data=False)
    out = distckpt.load(sd, ckpt, strict="raise_all", verify=True)
    expected = {n: p.expected() for n, p in pieces.items()}
    return all(
        layouts.bitwise_equal(out[n], e + bump if e.is_floating_point() else e) for n, e in expected.items()
    )


def test_rank0_reuses_the_last_saves_metadata_only_for_the_same_records(tmp_path):
    """Without ``cached_metadata``, rank 0 remembers its last save: a save of the same records
    with new values reuses its ``.metadata`` and patches its sidecar, giving the bytes a rebuild
    gives; a save of other records is built anew."""
    series = [("tp_dp", 0), ("tp_dp", 1), ("uneven", 0), None, ("tp_dp", 1)]
    assert run_ranks(4, _save_series, str(tmp_path), series) == [[False, True, False, False]] * 4
    for i, step in enumerate(series):
        if step is not None:
            assert run_ranks(4, _check_bumped, str(tmp_path / f"ckpt{i}"), *step) == [True] * 4
    again, fresh = tmp_path / "ckpt1", tmp_path / "ckpt4"  # same records, same values, same name length
    assert (again / ".distckpt_index").read_bytes() == (fresh / ".distckpt_index").read_bytes()
    a, b = (pickle.loads((d / ".metadata").read_bytes()) for d in (fresh, again))
    assert b.state_dict_metadata == a.state_dict_metadata and b.storage_data == a.storage_data
    assert b.mcore_data == a.mcore_data
    manifest = json.loads((again / ".distckpt_manifest.json").read_text())
    assert b.storage_meta.save_id == manifest["save_id"] != a.storage_meta.save_id
    assert ".ckpt1." in str(b.storage_meta.checkpoint_id) and ".ckpt4." in str(a.storage_meta.checkpoint_id)
    first = json.loads((tmp_path / "ckpt0" / ".distckpt_manifest.json").read_text())
    assert first["save_id"] != manifest["save_id"]


def test_rank0_does_not_remember_a_save_of_more_records_than_its_bound(tmp_path, monkeypatch):
    from distckpt.strategies.torch import LAST_SAVE, LastSave

    def saved_again(name):
        strategy = TorchDistSaveShardedStrategy()
        sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4,), float(i))) for i in range(3)}
        distckpt.save(sd, tmp_path / name, sharded_strategy=strategy)
        return strategy.last_save_reused_metadata

    LAST_SAVE.clear()
    monkeypatch.setattr(LastSave, "MAX_RECORDS", 2)
    assert [saved_again("a"), saved_again("b")] == [False, False]
    monkeypatch.setattr(LastSave, "MAX_RECORDS", 3)
    assert [saved_again("c"), saved_again("d")] == [False, True]


def test_respell_replaces_the_pickled_ids_in_the_head_or_declines():
    from torch.distributed.checkpoint.metadata import StorageMeta

    from distckpt.formats.metadata_pickle import respell

    head = pickle.dumps(
        {"meta": StorageMeta(checkpoint_id="/ckpt/a", save_id="id-1"), "keys": ["x", "/ckpt/a/b"]}, protocol=2
    )[:-1]
    tail = pickle.dumps("/ckpt/a", protocol=2)[2:]  # a tail that pickles the same text again
    data = bytearray(head + b"0" + tail)  # (the dict popped, the string left as the result)
    new_head = respell(data, len(head), [("/ckpt/a", "/a/much/longer/path"), ("id-1", "id-2")])
    assert new_head == len(head) + len("/a/much/longer/path") - len("/ckpt/a")
    assert data[new_head:] == b"0" + tail  # only the head changed
    meta = pickle.loads(data[:new_head] + b".")
    assert meta["meta"].checkpoint_id == "/a/much/longer/path" and meta["meta"].save_id == "id-2"
    assert meta["keys"] == ["x", "/ckpt/a/b"]  # a string that merely contains the old one stays
    assert pickle.loads(data) == "/ckpt/a"
    # the same length: patched where it lies
    assert respell(data, new_head, [("id-2", "id-3")]) == new_head
    assert pickle.loads(data[:new_head] + b".")["meta"].save_id == "id-3"
    before = bytes(data)
    assert respell(data, new_head, [("id-3", "id-4"), ("absent", "y")]) is None
    assert data == before  # declined: untouched, the first pair included
    twice = bytearray(pickle.dumps(["same", b"same".decode()], protocol=2))  # two objects: pickled twice
    assert respell(twice, len(twice), [("same", "other")]) is None


def _save_with_threads(ckpt, threads):
    sd, _ = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    distckpt.save(sd, ckpt, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=threads))


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_sets_the_number_of_files_per_rank(threads, tmp_path):
    run_ranks(2, _save_with_threads, str(tmp_path), threads)
    names = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert names == sorted(f"__{r}_{b}.distcp" for r in range(2) for b in range(threads))
    assert run_ranks(2, _check_layout, str(tmp_path), "tp_dp") == [True, True]


def test_metadata_file_holds_only_classes_megatron_can_unpickle(tmp_path):
    flat, _ = layouts.build("flat_optimizer", 0, 1, True, tp=1)
    flat["obj"] = ShardedObject("rng", {"seed": 1}, (1,), (0,))
    distckpt.save(flat, tmp_path)
    raw = (tmp_path / ".metadata").read_bytes()
    modules = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return super().find_class(module, name)

    Recorder(io.BytesIO(raw)).load()
    assert modules <= {
        "torch",
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.serialization",
        "collections",
        "builtins",
    }, modules
    md = pickle.loads(raw)
    assert md.mcore_data == {
        "exp_avg": {"nd_reformulated_orig_global_shape": (8, 6)},
        "exp_avg_bf16": {"nd_reformulated_orig_global_shape": (4, 10)},
    }
    assert tuple(md.state_dict_metadata["exp_avg"].size) == (1, 1, 48)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/distckpt_pwned",))


def test_crafted_metadata_pickle_is_refused_and_nothing_runs(tmp_path):
    distckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3))}, tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    if os.path.exists("/tmp/distckpt_pwned"):
        os.remove("/tmp/distckpt_pwned")
    with pytest.raises(
        distckpt.CheckpointingException, match=r"posix.system is not allowed|os.system is not allowed"
    ):
        distckpt.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(3))}, tmp_path)
    assert not os.path.exists("/tmp/distckpt_pwned")
