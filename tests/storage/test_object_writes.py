"""What a save hands an object store's writer: memory it reuses right after (a staging buffer's
next wave, a pinned slot's next piece). The object must hold the bytes that memory had when
they were written, on each cloud's server (tests/conftest.py; S3 in the default run, GCS and Azure
under ``slow``).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import distckpt
from distckpt import ShardedTensor
from distckpt import dist as ddist
from distckpt.io.device_io import save_slot_bytes
from distckpt.storage import open_store
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.strategies.zarr import ZarrSaveShardedStrategy
from tests.support.clouds import clouds
from tests.support.devices import streamed
from tests.support.harness import run_ranks

WORLD = 2
TIMEOUT = 120


def _state(rank: int, world: int = WORLD) -> dict:
    """16 tensors of 1 MiB per rank, each value telling key and rank apart."""
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"t{i}", torch.full((1, 256, 1024), float(100 * i + rank)), (0, rank, world)
        )
        for i in range(16)
    }


def _loads_back(url: str, world: int = WORLD) -> bool:
    rank = ddist.get_rank()
    want = _state(rank, world)
    back = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(1, 256, 1024), (0, rank, world)) for k in want}
    out = distckpt.load(back, url, verify=True)
    return all(torch.equal(out[k], want[k].data) for k in want)


def _async_save_in_waves(url: str, backend: str, world: int = WORLD) -> bool:
    """An async save whose staged copies (16 MiB) are cut into waves of 3 MiB: the staging
    buffers of one wave are refilled by the next while the upload may still hold its bytes."""
    strategy = ZarrSaveShardedStrategy("zarr", 2) if backend == "zarr" else None
    distckpt.set_host_memory_budget("3MiB")
    try:
        request = distckpt.save(_state(ddist.get_rank(), world), url, strategy, async_sharded_save=True)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    finally:
        distckpt.set_host_memory_budget(None)
    return _loads_back(url, world)


@pytest.mark.parametrize("cloud", clouds("s3"))
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_an_async_save_in_waves_uploads_the_bytes_each_wave_had(cloud_url, backend):
    assert run_ranks(WORLD, _async_save_in_waves, cloud_url, backend, timeout=TIMEOUT) == [True] * WORLD


def test_an_async_save_in_waves_to_an_in_memory_store_keeps_the_bytes_each_wave_had():
    """memory:// keeps every put's buffer itself: one process (the store lives in it)."""
    url = "memory://waves-test/ckpt"
    assert run_ranks(1, _one_rank_async_save_in_waves, url, timeout=TIMEOUT) == [True]


def _one_rank_async_save_in_waves(url: str) -> bool:
    return _async_save_in_waves(url, "zarr", 1) and _async_save_in_waves(url + "2", "torch_dist", 1)


def _save_through_slots(url: str) -> tuple:
    """A plain save whose tensors go through the writer threads' slots (as CUDA tensors do)."""
    before = save_slot_bytes(reset_peak=True)[0]
    with streamed("cpu"):
        distckpt.save(_state(ddist.get_rank()), url)
    live, peak = save_slot_bytes()
    return live - before, peak - before


def _save_plain(path: str) -> None:
    distckpt.save(_state(ddist.get_rank()), path)


def _data_digests(url: str) -> dict:
    store = open_store(url)
    return {
        name: hashlib.sha256(bytes(store.get(name))).hexdigest()
        for name in store.list()
        if name.endswith(".distcp") or name.endswith(".distcp.crc")
    }


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_tensors_streamed_through_slots_to_an_object_store_are_the_bytes_a_local_save_writes(
    cloud_url, tmp_path
):
    slots = run_ranks(WORLD, _save_through_slots, cloud_url, timeout=TIMEOUT)
    assert all(live == 0 and peak > 0 for live, peak in slots), slots  # the slots were used
    run_ranks(WORLD, _save_plain, str(tmp_path / "local"), timeout=TIMEOUT)
    assert _data_digests(cloud_url) == _data_digests(str(tmp_path / "local"))
    assert run_ranks(WORLD, _loads_back, cloud_url, timeout=TIMEOUT) == [True] * WORLD
