"""Object storage: save and load through real servers on 127.0.0.1, one per cloud (S3: moto, GCS:
fake-gcs-server, Azure Blob: Azurite; tests/conftest.py). Each test names the clouds it runs on in
the default run; the others run it under ``slow`` (tests/support/clouds.py)."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, check_is_distributed_checkpoint
from distckpt import dist as ddist
from distckpt.storage import open_store
from distckpt.strategies.zarr import ZarrSaveShardedStrategy
from tests.support import layouts
from tests.support.clouds import clouds
from tests.support.harness import expect_all_ranks_raise, run_ranks


def _save_layout(url, layout, params, **kwargs):
    sd, _ = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), True, **params)
    sd["common"] = {"step": 3}
    distckpt.save(sd, url, **kwargs)


def _load_layout(url, layout, params, **kwargs):
    sd, pieces = layouts.build(layout, ddist.get_rank(), ddist.get_world_size(), False, **params)
    loaded = distckpt.load(sd, url, **kwargs)
    wrong = [
        name for name, piece in pieces.items() if not layouts.bitwise_equal(loaded[name], piece.expected())
    ]
    return len(pieces), wrong, loaded["common"]


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_multi_rank_save_on_an_object_store_loads_under_another_layout_bit_exactly(cloud_url):
    run_ranks(4, _save_layout, cloud_url, "tp_dp", {"tp": 2})
    assert check_is_distributed_checkpoint(cloud_url)
    names = set(open_store(cloud_url).list())
    assert {"metadata.json", "common.pt", ".metadata", ".distckpt_manifest.json"} <= names
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    results = run_ranks(2, _load_layout, cloud_url, "tp_dp", {"tp": 1})
    assert [(n > 0, wrong, common) for n, wrong, common in results] == [(True, [], {"step": 3})] * 2


def test_memory_url_round_trips_in_one_process():
    sd, pieces = layouts.build("tp_dp", 0, 1, True, tp=1)
    distckpt.save(sd, "memory://unit/ckpt")
    sd, _ = layouts.build("tp_dp", 0, 1, False, tp=1)
    loaded = distckpt.load(sd, "memory://unit/ckpt")
    for name, piece in pieces.items():
        assert torch.equal(loaded[name], piece.expected())


# --------------------------------------------------------------------------- commit protocol


@pytest.mark.parametrize("cloud", clouds())
@pytest.mark.parametrize("stage", ["prepare", "write", "finalize", "commit", "common"])
def test_a_save_that_fails_before_its_commit_is_not_a_checkpoint_on_an_object_store(cloud_url, stage):
    from tests.support.faults import Fault, save_with_fault

    expect_all_ranks_raise(
        2, save_with_fault, cloud_url, 1, Fault(stage, (1,)), match="injected|InjectedFault|EIO"
    )
    assert not check_is_distributed_checkpoint(cloud_url)
    assert "metadata.json" not in open_store(cloud_url).list()
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        distckpt.load_common_state_dict(cloud_url)


@pytest.mark.parametrize("cloud", clouds())
def test_a_committed_checkpoint_on_an_object_store_is_not_overwritten_silently(cloud_url):
    from tests.support.faults import load_with_fault, save_with_fault

    run_ranks(2, save_with_fault, cloud_url, 1, None)
    expect_all_ranks_raise(
        2, save_with_fault, cloud_url, 2, None, match="already holds a committed checkpoint"
    )
    assert run_ranks(2, load_with_fault, cloud_url, 1) == [[], []]  # generation 1 untouched


def _save_generation_overwriting(url, generation):
    from tests.support.faults import generation_state

    distckpt.save(generation_state(ddist.get_rank(), ddist.get_world_size(), generation), url, overwrite=True)


@pytest.mark.parametrize("cloud", clouds())
def test_overwrite_true_replaces_a_checkpoint_on_an_object_store(cloud_url):
    from tests.support.faults import load_with_fault, save_with_fault

    run_ranks(2, save_with_fault, cloud_url, 1, None)
    run_ranks(2, _save_generation_overwriting, cloud_url, 2)
    assert run_ranks(2, load_with_fault, cloud_url, 2) == [[], []]


@pytest.mark.parametrize("cloud", clouds())
def test_the_commit_is_a_conditional_put_so_a_second_commit_fails(cloud_url):
    """S3: ``If-None-Match: *`` (412); GCS: ``x-goog-if-generation-match: 0`` (412); Azure:
    ``If-None-Match: *`` (409 BlobAlreadyExists)."""
    store = open_store(cloud_url)
    assert store.supports_conditional_put and not store.supports_rename
    store.commit("metadata.json", b'{"sharded_backend": "torch_dist"}')
    with pytest.raises(CheckpointingException, match="another save committed"):
        store.commit("metadata.json", b'{"sharded_backend": "zarr"}')
    assert bytes(store.get("metadata.json")) == b'{"sharded_backend": "torch_dist"}'


def test_local_directories_keep_replacing_by_default_and_refuse_with_overwrite_false(tmp_path):
    sd, _ = layouts.build("tp_dp", 0, 1, True, tp=1)
    distckpt.save(sd, tmp_path)
    distckpt.save(sd, tmp_path)  # today's behaviour: replaced
    with pytest.raises(CheckpointingException, match="overwrite=False"):
        distckpt.save(sd, tmp_path, overwrite=False)
    assert check_is_distributed_checkpoint(tmp_path)


# --------------------------------------------------------------------------- reads and writes


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_flipped_byte_on_an_object_store_is_caught_by_the_item_checksum(cloud_url):
    from tests.support.faults import load_with_fault, save_with_fault

    run_ranks(2, save_with_fault, cloud_url, 1, None)
    store = open_store(cloud_url)
    name = next(n for n in store.list() if n.endswith(".distcp"))
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 0x10
    store.put(name, bytes(data))
    expect_all_ranks_raise(2, load_with_fault, cloud_url, 1, match="CRC32C mismatch")


def _save_big(url, numel, part_size):
    t = torch.arange(numel, dtype=torch.float32) + ddist.get_rank()
    sd = {
        "big": distckpt.ShardedTensor.from_rank_offsets(
            "big", t, (0, ddist.get_rank(), ddist.get_world_size())
        )
    }
    distckpt.save(sd, url, storage_options={"part_size": part_size, "max_concurrency": 2})


@pytest.mark.parametrize("cloud", clouds())
def test_large_objects_go_up_as_multipart_uploads(cloud, cloud_url):
    """S3 multipart upload; GCS XML multipart upload; Azure Put Block + Put Block List."""
    numel = (6 << 20) // 4  # 6 MiB per rank: two parts of S3's minimum 5 MiB
    run_ranks(2, _save_big, cloud_url, numel, 5 << 20)
    store = open_store(cloud_url)
    sizes = {n: s for n, s in store.list().items() if n.endswith(".distcp")}
    assert len(sizes) == 2 and all(s > (6 << 20) for s in sizes.values())
    if cloud == "s3":  # only S3 says in the ETag that an object was uploaded in parts (its count)
        assert _etag(cloud_url, next(iter(sizes))).strip('"').endswith("-2")
    loaded = distckpt.load_plain_tensors(cloud_url)["big"]
    assert torch.equal(loaded, torch.cat([torch.arange(numel, dtype=torch.float32) + r for r in range(2)]))


def _etag(url, name):
    import obstore
    from obstore.store import from_url

    return obstore.head(from_url(url), name)["e_tag"]


def test_an_interrupted_multipart_upload_is_aborted(s3_url):
    import urllib.request

    store = open_store(s3_url, {"part_size": 5 << 20})
    with pytest.raises(RuntimeError, match="disk on fire"):
        with store.open_writer("partial.distcp") as w:
            w.write(b"x" * (11 << 20))  # two parts are in flight or done
            raise RuntimeError("disk on fire")
    assert not store.exists("partial.distcp")
    import os

    bucket = s3_url.split("/")[2]
    listing = urllib.request.urlopen(f"{os.environ['AWS_ENDPOINT_URL']}/{bucket}?uploads", timeout=10).read()
    assert b"partial.distcp" not in listing  # no multipart upload left behind


def _save_zarr(url, compression):
    sd, _ = layouts.build("tp_dp", ddist.get_rank(), ddist.get_world_size(), True, tp=2)
    distckpt.save(sd, url, sharded_strategy=ZarrSaveShardedStrategy(compression=compression))


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_zarr_on_an_object_store_writes_a_zarr_hierarchy_and_refuses_compression(cloud_url):
    run_ranks(2, _save_zarr, cloud_url, None)
    names = set(open_store(cloud_url).list())
    assert {"zarr.json", "row/zarr.json", "metadata.json"} <= names
    assert any(n.startswith("row/c/") for n in names)  # chunks are objects of their own
    other = cloud_url + "-zstd"
    expect_all_ranks_raise(2, _save_zarr, other, "zstd", match="uncompressed arrays only")
    assert not check_is_distributed_checkpoint(other)


def test_an_unknown_scheme_is_a_clear_error():
    with pytest.raises(CheckpointingException, match="unsupported storage scheme 'ftp'"):
        distckpt.load({}, "ftp://host/ckpt")


# --------------------------------------------------------------------------- async, fully parallel


def _async_fully_parallel_save_then_load(url):
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from distckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

    rank, world = ddist.get_rank(), ddist.get_world_size()
    sd, _ = layouts.build("tp_dp", rank, world, True, tp=2)
    queue = AsyncCallsQueue()
    request = distckpt.save(
        sd, url, FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()), async_sharded_save=True
    )
    queue.schedule_async_request(request)
    committed_early = check_is_distributed_checkpoint(url)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    sd, pieces = layouts.build("tp_dp", rank, world, False, tp=1)
    loaded = distckpt.load(sd, url, FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))
    wrong = [n for n, p in pieces.items() if not layouts.bitwise_equal(loaded[n], p.expected())]
    return committed_early, finalized, wrong


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_async_and_fully_parallel_save_and_load_on_an_object_store(cloud_url):
    results = run_ranks(4, _async_fully_parallel_save_then_load, cloud_url)
    assert [(early, fin, wrong) for early, fin, wrong in results] == [(False, [0], [])] * 4
    assert check_is_distributed_checkpoint(cloud_url)


# --------------------------------------------------------------------------- killed saves, request counts

_KILLED_SAVE = """
import pathlib, sys, time
import torch
import distckpt
from distckpt.storage import object as object_store
url, marker, window = sys.argv[1:4]

def stall(*args, **kwargs):
    pathlib.Path(marker).write_text(window)
    time.sleep(600)

if window == "commit":
    object_store.ObjectStore.commit = stall          # every data object written, commit pending
else:
    object_store._ObjectWriter.close = stall         # a data object's upload not completed
distckpt.save({"w": distckpt.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0))}, url)
"""


# A killed save costs a fresh interpreter (~3 s): on GCS and Azure it runs under ``slow``; the
# default run covers their commit protocol with the in-process faults above.
@pytest.mark.parametrize("cloud", clouds("s3"))
@pytest.mark.parametrize("window", ["mid_upload", "commit"])
def test_a_save_killed_before_its_commit_is_not_a_checkpoint_on_an_object_store(cloud_url, tmp_path, window):
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, cloud_url, str(marker), window], env=dict(os.environ)
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the save never reached its {window} window (exit {proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    names = set(open_store(cloud_url).list())
    assert "metadata.json" not in names
    assert ("common.pt" in names) and (("__0_0.distcp" in names) == (window == "commit"))
    assert not check_is_distributed_checkpoint(cloud_url)
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        distckpt.load_tensors_metadata(cloud_url)


def test_a_load_addresses_everything_from_the_metadata_without_listing(s3_url, caplog):
    import logging

    run_ranks(4, _save_layout, s3_url, "tp_dp", {"tp": 2})
    with caplog.at_level(logging.INFO, logger="werkzeug"):  # moto's server logs every request it serves
        results = run_ranks(2, _load_layout, s3_url, "tp_dp", {"tp": 1})
    assert [wrong for _, wrong, _ in results] == [[], []]
    requests = [r.getMessage() for r in caplog.records if r.name == "werkzeug"]
    assert any(".distcp" in m for m in requests)  # the log does reach us
    assert not [m for m in requests if "list-type" in m or "?prefix" in m]


def test_zarr_python_reads_a_zarr_checkpoint_straight_from_s3(s3_url):
    import numpy as np
    import zarr
    from obstore.store import from_url

    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    distckpt.save(
        {"w": distckpt.ShardedTensor.from_rank_offsets("layer/w", w)}, s3_url, sharded_strategy=("zarr", 1)
    )
    group = zarr.open_group(zarr.storage.ObjectStore(from_url(s3_url), read_only=True), mode="r")
    assert np.array_equal(group["layer/w"][:], w.numpy())


@pytest.mark.parametrize("cloud", clouds("s3"))
@pytest.mark.parametrize("name", ["flat_dp4_torch_dist", "tp2_zarr"])
def test_megatron_checkpoints_copied_to_an_object_store_load_bit_exactly(cloud_url, name):
    from tests.tools.test_tools import FIXTURES, fixture_tensors

    root, store = FIXTURES[name] / "ckpt", open_store(cloud_url)
    for path in root.rglob("*"):
        if path.is_file():
            store.put(path.relative_to(root).as_posix(), path.read_bytes())
    assert check_is_distributed_checkpoint(cloud_url)
    plain = distckpt.load_plain_tensors(cloud_url)
    want = fixture_tensors(name)
    assert set(want) <= set(plain)
    assert all(torch.equal(plain[k], v) for k, v in want.items())


def test_storage_options_take_client_settings_flat_and_values_of_any_type(s3_url, monkeypatch):
    """``allow_http`` is an HTTP-client setting (obstore refuses it in a store's own config) and
    ``True`` / ``2`` are no strings: both are accepted, so one flat dict configures a store."""
    import os

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://unreachable.invalid")
    store = open_store(
        s3_url,
        {
            "endpoint": endpoint,
            "allow_http": True,
            "virtual_hosted_style_request": False,
            "max_concurrency": 2,
            "timeout": "30s",
        },
    )
    store.put("x", b"abc")
    assert bytes(store.get("x")) == b"abc" and store.max_concurrency == 2
    with pytest.raises(CheckpointingException, match="max_concurrency=0 must be an integer >= 1"):
        open_store(s3_url, {"max_concurrency": 0})
