"""``distckpt.dcp`` under PyTorch DCP's own ``save``/``async_save``/``load``, on gloo ranks: FSDP2
and DTensor state dicts through ``get_state_dict``/``set_state_dict`` and ``Stateful`` objects,
saved on N ranks and loaded on M, read back by distckpt's reader and by DCP's
``FileSystemReader``; DCP's plan caching; a failure on one rank; an object store.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import distckpt
import distckpt.dcp
from distckpt import storage
from distckpt.io import staging
from tests.support.dcp_states import (
    AppState,
    FaultyPlanner,
    distribute_rows,
    fsdp2_model,
    full_state,
    quiet,
    train_steps,
)

W = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# --------------------------------------------------------------------------- FSDP2, N -> M ranks


def _fsdp2_save(path):
    model = fsdp2_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, optimizer, 3)
    app = AppState(model, optimizer, step=3)
    dcp.save({"app": app}, storage_writer=distckpt.dcp.StorageWriter(path))
    return full_state(app)


def _fsdp2_load(path, reader):
    model = fsdp2_model(seed=7)  # other values everywhere: the load must replace them all
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    train_steps(model, optimizer, 1, seed=9)
    app = AppState(model, optimizer)
    storage_reader = distckpt.dcp.StorageReader(path) if reader == "distckpt" else FileSystemReader(path)
    dcp.load({"app": app}, storage_reader=storage_reader)
    return full_state(app)


def test_fsdp2_model_and_optimizer_saved_on_4_ranks_load_on_2_ranks_through_both_readers(run_ranks, tmp_path):
    path = str(tmp_path / "step_3")
    saved = run_ranks(4, _fsdp2_save, path, timeout=120)[0]
    assert any(k.startswith("optim.state.") for k in saved) and saved["step"] == 3
    for reader in ("distckpt", "dcp"):
        _assert_same_state(run_ranks(2, _fsdp2_load, path, reader, timeout=120)[0], saved)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []  # no leftovers


# --------------------------------------------------------------------------- DTensor, plan caching


def _cached_plan_saves(root):
    for step in (1, 2):
        state = {"w": distribute_rows(W * step), "step": step}
        dcp.save(
            state,
            storage_writer=distckpt.dcp.StorageWriter(f"{root}/step_{step}"),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )


def _load_steps(root, steps):
    out = []
    for step in steps:
        state = {"w": distribute_rows(torch.zeros_like(W)), "step": 0}
        dcp.load(state, storage_reader=distckpt.dcp.StorageReader(f"{root}/step_{step}"))
        out.append((state["w"].full_tensor(), state["step"]))
    return out


def test_saves_with_dcp_plan_caching_each_commit_their_own_location(run_ranks, tmp_path):
    # The second save replays the first one's plans (storage data included): the staging of each
    # save must not ride on them.
    run_ranks(2, _cached_plan_saves, str(tmp_path))
    loaded = run_ranks(4, _load_steps, str(tmp_path), (1, 2))[3]
    for (w, step), expected in zip(loaded, (1, 2)):
        assert step == expected and torch.equal(w, W * expected)


# --------------------------------------------------------------------------- async_save


def _async_save_twice(root):
    state = {"w": distribute_rows(W), "step": 1}
    allocated = []
    for step in (1, 2):
        writer = distckpt.dcp.StorageWriter(f"{root}/step_{step}")
        future = dcp.async_save(state, storage_writer=writer)
        state["w"].to_local().add_(1000)  # training goes on: the save must not see it
        future.result()
        allocated.append(staging.pool().allocated_bytes)
    return allocated


def test_async_save_stages_into_the_reused_pool_and_commits_what_was_staged(run_ranks, tmp_path):
    allocated = run_ranks(2, _async_save_twice, str(tmp_path))
    assert all(a[0] > 0 and a[1] == a[0] for a in allocated)  # the second save allocated nothing
    loaded = run_ranks(2, _load_steps, str(tmp_path), (1, 2))[0]
    assert torch.equal(loaded[0][0], W) and torch.equal(loaded[1][0], W + 1000)


# --------------------------------------------------------------------------- one rank fails


def _save_with_a_failing_rank(root):
    good = f"{root}/ckpt"
    dcp.save({"w": distribute_rows(W)}, storage_writer=distckpt.dcp.StorageWriter(good))
    try:
        dcp.save(
            {"w": distribute_rows(W * 2)},
            storage_writer=distckpt.dcp.StorageWriter(good),
            planner=FaultyPlanner(ranks=[1]),
        )
        message = None
    except CheckpointException as e:
        message = str(e)
    state = {"w": distribute_rows(torch.zeros_like(W))}
    dcp.load(state, storage_reader=distckpt.dcp.StorageReader(good))
    leftovers = sorted(n for n in os.listdir(root) if n.startswith("."))
    # The coordinator's next save (anywhere) removes the failed save's staging directory.
    dcp.save({"w": distribute_rows(W)}, storage_writer=distckpt.dcp.StorageWriter(f"{root}/other"))
    return (
        message,
        state["w"].full_tensor(),
        leftovers,
        sorted(n for n in os.listdir(root) if n.startswith(".")),
    )


def test_a_failure_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(
    run_ranks, tmp_path
):
    results = run_ranks(2, _save_with_a_failing_rank, str(tmp_path))
    messages = [r[0] for r in results]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "RANK 1" in messages[0] and "injected failure resolving 'w'" in messages[0]
    assert "rank 1 could not write its files" in messages[0]
    for _, w, before, after in results:
        assert torch.equal(w, W)  # the previous checkpoint, whole
        assert len(before) == 1 and "distckpt-staging" in before[0] and after == []


# --------------------------------------------------------------------------- object store


def _s3_save(url):
    state = {"w": distribute_rows(torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512)), "step": 5}
    dcp.save(state, storage_writer=distckpt.dcp.StorageWriter(url))
    try:
        dcp.save(state, storage_writer=distckpt.dcp.StorageWriter(url))
        return None
    except CheckpointException as e:
        return str(e)


def _s3_load(url):
    state = {"w": distribute_rows(torch.zeros(512, 512)), "step": 0}
    reader = distckpt.dcp.StorageReader(url)
    dcp.load(state, storage_reader=reader)
    return state["w"].full_tensor(), state["step"], reader.bytes_read


def test_object_store_round_trip_reads_only_the_needed_ranges_and_refuses_an_overwrite(run_ranks, s3_url):
    refused = run_ranks(2, _s3_save, s3_url)
    assert refused[0] is not None and refused[0] == refused[1] and "already" in refused[0]
    results = run_ranks(4, _s3_load, s3_url)
    full = torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512)
    for w, step, nbytes in results:
        assert torch.equal(w, full) and step == 5
        # Each rank needs half of one stored item (1 MiB): the blocks holding it, not the item.
        assert nbytes < (1 << 20) * 3 // 4
    assert torch.equal(distckpt.load_plain_tensors(s3_url)["w"], full)


def _s3_overwrite(url):
    for value in (1.0, 2.0):
        state = {"w": distribute_rows(torch.full((64, 8), value)), "step": int(value)}
        dcp.save(state, storage_writer=distckpt.dcp.StorageWriter(url, overwrite=True))
    state = {"w": distribute_rows(torch.zeros(64, 8)), "step": 0}
    dcp.load(state, storage_reader=distckpt.dcp.StorageReader(url))
    return state["w"].full_tensor(), state["step"]


def test_an_overwrite_on_an_object_store_writes_its_data_files_under_its_own_names(run_ranks, s3_url):
    for w, step in run_ranks(2, _s3_overwrite, s3_url):
        assert torch.equal(w, torch.full((64, 8), 2.0)) and step == 2
    names = storage.open_store(s3_url).list_objects()
    # The overwrite's data files carry its save token (final names, recorded in .metadata): the
    # first save's stay whole until the commit record moves, then are collected, never copied.
    data = sorted(n for n in names if n.endswith(".distcp"))
    assert data and all(re.fullmatch(r"g\d+-[0-9a-f]{8}__\d_\d\.distcp", n) for n in data), data
    assert ".distckpt_commit.json" in names


# --------------------------------------------------------------------------- the tiered manager


def _tiered_save_and_load(remote, tmp):
    import torch.distributed as tdist

    from distckpt.tiered import TieredCheckpointManager

    tiers = TieredCheckpointManager(remote, os.path.join(tmp, f"node{tdist.get_rank()}"))
    tiers.save_dcp({"w": distribute_rows(W), "step": 4}, 4)
    tiers.close()  # waits for the uploads and commits them remotely
    state = {"w": distribute_rows(torch.zeros_like(W)), "step": 0}
    iteration = tiers.load_dcp(state)
    return iteration, state["w"].full_tensor(), state["step"], tiers.last_load.local_bytes


def test_the_tiered_manager_saves_dcp_state_locally_uploads_it_and_loads_the_nearest_copy(
    run_ranks, tmp_path
):
    remote = tmp_path / "remote"
    for iteration, w, step, local_bytes in run_ranks(2, _tiered_save_and_load, str(remote), str(tmp_path)):
        assert iteration == 4 and torch.equal(w, W) and step == 4 and local_bytes > 0
    # The remote copy is a committed checkpoint in DCP's format.
    state = {"w": torch.zeros_like(W), "step": 0}
    quiet(dcp.load, state, storage_reader=FileSystemReader(remote / "iter_0000004"), no_dist=True)
    assert torch.equal(state["w"], W) and state["step"] == 4
