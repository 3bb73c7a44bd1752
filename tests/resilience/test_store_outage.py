"""The object store itself fails: moto stopped in the middle of a save, a load, a tiered upload,
and started again on the same port.

A save fails on every rank within the stage timeout and commits nothing, and the previous
checkpoint loads once the store is back; a load fails on every rank and succeeds later; a tiered
upload cut by the outage is retried while the store comes back, and otherwise finished from the
local copies at restart. Real gloo ranks (the rank pool), a moto server of this module's own
(tests/support/s3_faults.py), obstore's retries bounded to about a second.
"""

from __future__ import annotations

import os
import threading

from distckpt import dist as ddist
from distckpt.tiered import TieredCheckpointManager, UploadFailedError
from tests.support import faults
from tests.support.harness import expect_all_ranks_raise, run_ranks

UNREACHABLE = "could not be reached"


def _save(url, generation, opts, overwrite=True):
    import distckpt

    rank, world = ddist.get_rank(), ddist.get_world_size()
    distckpt.save(
        faults.generation_state(rank, world, generation), url, storage_options=opts, overwrite=overwrite
    )


def _wrong(url, generation, opts):
    import distckpt

    rank, world = ddist.get_rank(), ddist.get_world_size()
    loaded = distckpt.load(
        faults.generation_state(rank, world, generation, with_data=False), url, storage_options=opts
    )
    return faults.generation_mismatches(loaded, rank, world, generation)


def _data_put(request) -> bool:
    return request.method in ("PUT", "POST") and ".distcp" in request.path


def test_the_store_stopped_during_an_overwrite_fails_it_on_every_rank_and_the_old_checkpoint_loads(s3):
    url, opts = s3.url("outage/save"), s3.options()
    run_ranks(2, _save, url, 1, opts, False)
    s3.stop_on(_data_put)
    expect_all_ranks_raise(2, _save, url, 2, opts, match=UNREACHABLE)
    assert s3.stopped
    s3.restart()
    assert run_ranks(2, _wrong, url, 1, opts) == [[], []]
    run_ranks(2, _save, url, 3, opts)
    assert run_ranks(2, _wrong, url, 3, opts) == [[], []]


def test_the_store_stopped_during_a_load_fails_it_on_every_rank_and_a_later_load_succeeds(s3):
    url, opts = s3.url("outage/load"), s3.options()
    run_ranks(2, _save, url, 1, opts, False)
    s3.stop_on(lambda r: r.method == "GET" and ".distcp" in r.path)
    expect_all_ranks_raise(2, _wrong, url, 1, opts, match=UNREACHABLE)
    s3.restart()
    assert run_ranks(2, _wrong, url, 1, opts) == [[], []]


def _node(tmp):
    return os.path.join(tmp, f"node{ddist.get_rank()}")


def _tiered_save(url, tmp, opts, step, retries, backoff):
    tiers = TieredCheckpointManager(
        url, _node(tmp), storage_options=opts, upload_retries=retries, upload_backoff_s=backoff
    )
    tiers.save(faults.generation_state(ddist.get_rank(), ddist.get_world_size(), step), step)
    try:
        tiers.close()
        return "committed"
    except UploadFailedError as e:
        return str(e)


def _tiered_restart(url, tmp, opts, step):
    tiers = TieredCheckpointManager(url, _node(tmp), storage_options=opts)
    latest = tiers.find_latest()
    rank, world = ddist.get_rank(), ddist.get_world_size()
    loaded = tiers.load(faults.generation_state(rank, world, step, with_data=False))
    return latest, faults.generation_mismatches(loaded, rank, world, step)


def test_a_tiered_upload_cut_by_an_outage_is_retried_once_the_store_is_back(s3, tmp_path):
    url, opts = s3.url("outage/tiered-back"), s3.options()
    s3.stop_on(_data_put)

    def come_back():
        if s3.wait_stopped(60):
            threading.Event().wait(1.0)
            s3.restart()

    helper = threading.Thread(target=come_back, daemon=True)
    helper.start()
    assert run_ranks(2, _tiered_save, url, str(tmp_path), opts, 4, 5, 0.5) == ["committed"] * 2
    helper.join(10)
    assert run_ranks(2, _tiered_restart, url, str(tmp_path), opts, 4) == [(4, [])] * 2


def test_a_tiered_upload_failed_by_an_outage_is_finished_from_the_local_copies_at_restart(s3, tmp_path):
    url, opts = s3.url("outage/tiered-restart"), s3.options()
    s3.stop_on(_data_put)
    out = run_ranks(2, _tiered_save, url, str(tmp_path), opts, 6, 1, 0.05)
    assert all(UNREACHABLE in text and "upload of iter_0000006" in text for text in out), out
    s3.restart()
    assert run_ranks(2, _tiered_restart, url, str(tmp_path), opts, 6) == [(6, [])] * 2
