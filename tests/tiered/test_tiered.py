"""Two-tier checkpoints (distckpt.tiered): local first, an object store in the background (S3 on
moto; GCS on fake-gcs-server and Azure on Azurite: one test each by default, the rest under
``slow``), restart from the nearest copy. Real gloo ranks; each rank gets its own local directory
(a node of its own)."""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt import dist as ddist
from distckpt.storage import open_store
from distckpt.tiered import TieredCheckpointManager
from tests.support.clouds import clouds
from tests.support.harness import run_ranks
from tests.support.train_script import load_train_script


def _node(tmp, rank=None):
    return os.path.join(tmp, f"node{ddist.get_rank() if rank is None else rank}")


def _state(step: int = 0, fill: bool = True, rows: int = 64):
    """Rank r's rows of "w" ((world * rows) x 256 float32, values from ``step``), a replicated
    "b" (rank 0 writes it) and the common step."""
    rank, world = ddist.get_rank(), ddist.get_world_size()
    w = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) + 1000 * rank + step
    b = torch.full((16,), float(step))
    if not fill:
        w, b = torch.zeros_like(w), torch.zeros_like(b)
    return {
        "w": distckpt.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": distckpt.ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
        "common": {"step": step},
    }


def _wrong(loaded, step: int, rows: int = 64):
    want = _state(step, rows=rows)
    return [k for k in ("w", "b") if not torch.equal(loaded[k], want[k].data)]


def _save_then_load(url, tmp):
    tiers = TieredCheckpointManager(url, _node(tmp), keep_local=2, keep_remote=2)
    for step in (10, 20):
        tiers.save(_state(step), step)
    tiers.close()
    latest = tiers.find_latest()
    loaded = tiers.load(_state(fill=False))
    return latest, _wrong(loaded, 20), loaded["common"], str(tiers.last_load), tiers.last_load.remote_bytes


@pytest.mark.parametrize("cloud", clouds())
def test_tiered_save_commits_remotely_and_loads_from_the_local_copies(cloud_url, tmp_path):
    out = run_ranks(2, _save_then_load, cloud_url, str(tmp_path))
    for latest, wrong, common, report, _ in out:
        assert latest == 20 and wrong == [] and common == {"step": 20}, report
    names = open_store(cloud_url).list()
    assert "iter_0000020/metadata.json" in names and "iter_0000010/metadata.json" in names
    assert distckpt.check_is_distributed_checkpoint(f"{cloud_url}/iter_0000020")


def _load_report(url, tmp, **kwargs):
    tiers = TieredCheckpointManager(url, _node(tmp), **kwargs)
    latest = tiers.find_latest()
    loaded = tiers.load(_state(fill=False))
    rep = tiers.last_load
    return latest, _wrong(loaded, latest), loaded["common"]["step"], dict(rep.files), dict(rep.rejected)


def _save_steps(url, tmp, steps, close=True, **kwargs):
    tiers = TieredCheckpointManager(url, _node(tmp), **kwargs)
    for step in steps:
        tiers.save(_state(step), step)
    if close:
        tiers.close()
    else:
        tiers.close(wait=False)
    return sorted(p.name for p in __import__("pathlib").Path(_node(tmp)).glob("iter_*"))


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_each_rank_reads_its_own_files_locally_and_the_rest_remotely(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    for rank, (latest, wrong, step, files, rejected) in enumerate(out):
        assert (latest, wrong, step, rejected) == (5, [], 5, {})
        assert files[f"__{rank}_0.distcp"] == "local"
        assert files["metadata.json"] == "remote"
    # rank 0's files (the replicated "b") are not on rank 1's node
    theirs = {v for k, v in out[1][3].items() if k.startswith("__0_")}
    assert theirs == {"remote"}


def _timings_after_load(url, tmp):
    _load_report(url, tmp)
    return distckpt.last_timings("load").sources, str(distckpt.last_timings("load"))


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_last_timings_of_the_load_says_where_the_bytes_came_from(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    for sources, text in run_ranks(2, _timings_after_load, cloud_url, str(tmp_path)):
        assert sources["local files"] >= 1 and sources["local bytes"] > 0, text
        assert "read from: local files" in text


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_lost_local_directory_falls_back_to_the_remote(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    __import__("shutil").rmtree(tmp_path / "node1")
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    assert set(out[1][3].values()) == {"remote"}


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_damaged_local_file_is_not_used_and_the_remote_is_read(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    target = tmp_path / "node0" / "iter_0000005" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    assert out[0][3]["__0_0.distcp"] == "remote"
    assert "__0_0.distcp" in out[0][4] and "CRC32C" in out[0][4]["__0_0.distcp"]


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_local_copy_of_another_save_is_not_used(cloud_url, tmp_path):
    # The same iteration saved to another remote from the same local directories: the local copy
    # now belongs to that save, and a load from the first remote must not take it.
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    run_ranks(2, _save_steps, cloud_url + "-other", str(tmp_path), [5])
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    for _, _, _, files, rejected in out:
        assert set(files.values()) == {"remote"} and "another save" in rejected["*"]


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_retention_keeps_the_newest_per_tier(cloud_url, tmp_path):
    locals_ = run_ranks(2, _save_steps, cloud_url, str(tmp_path), [1, 2, 3, 4], keep_local=1, keep_remote=2)
    assert locals_ == [["iter_0000004"]] * 2
    names = open_store(cloud_url).list()
    committed = sorted(n.split("/")[0] for n in names if n.endswith("/metadata.json"))
    assert committed == ["iter_0000003", "iter_0000004"]
    assert not any(n.startswith(("iter_0000001/", "iter_0000002/")) for n in names)
    assert open_store(cloud_url).get("latest_checkpointed_iteration.txt") == b"4"


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_an_upload_cut_off_is_finished_from_the_local_copies_at_restart(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [6], close=False)  # uploads cancelled
    names = open_store(cloud_url).list()
    assert "iter_0000006/metadata.json" not in names
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(6, [], 6)] * 2
    assert "iter_0000006/metadata.json" in open_store(cloud_url).list()


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_lost_node_without_replicas_leaves_the_previous_remote_checkpoint_newest(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [6], close=False)
    __import__("shutil").rmtree(tmp_path / "node1" / "iter_0000006")
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    assert "iter_0000006/metadata.json" not in open_store(cloud_url).list()


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_replica_on_a_peer_finishes_the_upload_of_a_lost_node(cloud_url, tmp_path):
    opts = dict(replication_factor=2, node_size=1)
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [6], close=False, **opts)
    __import__("shutil").rmtree(tmp_path / "node1")
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path), **opts)
    assert [o[:3] for o in out] == [(6, [], 6)] * 2
    assert "iter_0000006/metadata.json" in open_store(cloud_url).list()


def _async_save_then_close(url, tmp, step):
    from distckpt.strategies.async_utils import AsyncCallsQueue

    tiers = TieredCheckpointManager(url, _node(tmp))
    queue = AsyncCallsQueue()
    queue.schedule_async_request(tiers.save(_state(step), step, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    pending = tiers.pending
    tiers.close()
    queue.close()
    return pending


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_an_async_tiered_save_uploads_after_its_local_commit(cloud_url, tmp_path):
    assert run_ranks(2, _async_save_then_close, cloud_url, str(tmp_path), 7) == [[7], [7]]
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(7, [], 7)] * 2


class FlakyStore(__import__("distckpt").storage.Store):
    """A real store whose writes of data files fail the first ``failures`` times (each write
    counts), on this process only: a store that refuses uploads, as a broken network would."""

    def __init__(self, inner, failures, counter=None):
        self.inner, self.failures = inner, failures
        self.counter = counter if counter is not None else [0]
        self.supports_conditional_put = inner.supports_conditional_put

    def _maybe_fail(self, name):
        if name.endswith(".distcp") and self.counter[0] < self.failures:
            self.counter[0] += 1
            raise OSError(f"injected upload failure of {name}")

    url = property(lambda self: self.inner.url)

    def child(self, name):
        return FlakyStore(self.inner.child(name), self.failures, self.counter)

    def put(self, name, data):
        self._maybe_fail(name)
        self.inner.put(name, data)

    def open_writer(self, name):
        self._maybe_fail(name)
        return self.inner.open_writer(name)

    def put_if_absent(self, name, data):
        return self.inner.put_if_absent(name, data)

    def get(self, name):
        return self.inner.get(name)

    def get_ranges(self, name, starts, lengths):
        return self.inner.get_ranges(name, starts, lengths)

    def size(self, name):
        return self.inner.size(name)

    def delete(self, name):
        self.inner.delete(name)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def begin_save(self, commit_names, overwrite):
        self.inner.begin_save(commit_names, overwrite)

    def commit(self, name, data):
        self.inner.commit(name, data)


def _save_through_flaky(url, tmp, failures, flaky_rank):
    from distckpt.tiered import UploadFailedError

    remote = open_store(url)
    if ddist.get_rank() == flaky_rank:
        remote = FlakyStore(remote, failures)
    tiers = TieredCheckpointManager(remote, _node(tmp), upload_retries=2, upload_backoff_s=0.05)
    tiers.save(_state(8), 8)
    try:
        tiers.close()
        return "committed"
    except UploadFailedError as e:
        return str(e)


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_failed_upload_is_retried_then_committed(cloud_url, tmp_path):
    assert run_ranks(2, _save_through_flaky, cloud_url, str(tmp_path), 2, 1) == ["committed"] * 2
    assert "iter_0000008/metadata.json" in open_store(cloud_url).list()


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_an_upload_that_keeps_failing_is_reported_on_every_rank_and_keeps_the_local_copy(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    out = run_ranks(2, _save_through_flaky, cloud_url, str(tmp_path), 100, 1)
    for text in out:
        assert "upload of iter_0000008" in text and "rank 1" in text and "after 3 attempts" in text, text
        assert "injected upload failure" in text
    assert "iter_0000008/metadata.json" not in open_store(cloud_url).list()
    assert (tmp_path / "node1" / "iter_0000008" / ".distckpt_tier" / "owner00001.json").exists()
    # The local copies are complete: a restart finishes the upload from them.
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(8, [], 8)] * 2


def _save_rows(url, tmp, step, rows):
    tiers = TieredCheckpointManager(url, _node(tmp))
    tiers.save(_state(step, rows=rows), step)
    tiers.close()


def _save_and_die_mid_upload(url, tmp):
    import signal
    import time

    from distckpt.storage.throttled import ThrottledStore

    # 2 MiB per rank through a 1 MiB/s remote: the upload takes about two seconds.
    remote = ThrottledStore(open_store(url), write_bytes_per_s=1 << 20)
    tiers = TieredCheckpointManager(remote, _node(tmp))
    tiers.save(_state(20, rows=2048), 20)
    if ddist.get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    tiers.close()


def _load_rows(url, tmp, rows):
    tiers = TieredCheckpointManager(url, _node(tmp))
    latest = tiers.find_latest()
    loaded = tiers.load(_state(fill=False, rows=rows))
    return latest, _wrong(loaded, latest, rows)


def _load_remote_only(url, step, rows):
    loaded = distckpt.load(_state(fill=False, rows=rows), f"{url}/iter_{step:07d}")
    return _wrong(loaded, step, rows), loaded["common"]["step"]


@pytest.mark.slow
@pytest.mark.parametrize("cloud", clouds("s3"))
def test_sigkill_during_the_background_upload_leaves_the_previous_checkpoint_newest(cloud_url, tmp_path):
    from tests.support.harness import RankFailure

    run_ranks(2, _save_rows, cloud_url, str(tmp_path), 10, 2048)
    with __import__("pytest").raises(RankFailure) as failure:
        run_ranks(2, _save_and_die_mid_upload, cloud_url, str(tmp_path), timeout=90)
    assert "SIGKILL" in failure.value.errors[1]
    names = open_store(cloud_url).list()
    assert "iter_0000020/metadata.json" not in names and "iter_0000010/metadata.json" in names
    assert not distckpt.check_is_distributed_checkpoint(f"{cloud_url}/iter_0000020")
    assert run_ranks(2, _load_remote_only, cloud_url, 10, 2048) == [([], 10)] * 2
    # Node 1 is lost with its copy: the restart takes iteration 10 ...
    __import__("shutil").rmtree(tmp_path / "node1" / "iter_0000020")
    assert run_ranks(2, _load_rows, cloud_url, str(tmp_path), 2048) == [(10, [])] * 2
    assert "iter_0000020/metadata.json" not in open_store(cloud_url).list()


def _plant_hostile_marker(tmp, outside):
    from distckpt.tiered.markers import Marker, write_marker

    for rank in (0, 1):
        directory = __import__("pathlib").Path(_node(tmp, rank)) / "iter_0000009"
        files = {f"../../../{os.path.basename(outside)}": 6}
        write_marker(directory, Marker("tok", 9, 2, rank, {"ok": 1}))
        raw = (directory / ".distckpt_tier" / f"owner{rank:05d}.json").read_text()
        raw = raw.replace('"ok":1', ",".join(f'"{k}":{v}' for k, v in files.items()))
        (directory / ".distckpt_tier" / f"owner{rank:05d}.json").write_text(raw)


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_hostile_local_marker_is_ignored_and_nothing_outside_is_uploaded(cloud_url, tmp_path):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    outside = tmp_path / "secret"
    outside.write_bytes(b"secret")
    _plant_hostile_marker(str(tmp_path), str(outside))
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    assert not any("secret" in n or n.startswith("iter_0000009") for n in open_store(cloud_url).list())
    assert outside.read_bytes() == b"secret"


@pytest.mark.slow
@pytest.mark.parametrize("cloud", clouds("s3"))
def test_train_script_saves_tiered_to_an_object_store_crashes_and_resumes_at_the_last_save(
    cloud_url, tmp_path, capsys
):
    """The crash leaves the upload of iteration 4 committed or not (timing); either way the
    restart resumes at 4: committed, or finished from the local copies first."""
    script = load_train_script()
    argv = [
        "--layout",
        "1,1,2",
        "--resume-layout",
        "1,1,2",
        "--optimizer",
        "adam",
        "--resume-optimizer",
        "adam",
    ]
    argv += ["--steps", "5", "--resume-steps", "2", "--tiered-every", "2"]
    argv += ["--remote", cloud_url, "--dir", str(tmp_path)]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "restarted at iteration 4" in out and "losses match bitwise" in out, out
    assert "iter_0000004/metadata.json" in open_store(cloud_url).list()


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_local_copy_missing_a_file_cannot_finish_its_upload_and_the_remote_newest_is_taken(
    cloud_url, tmp_path
):
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [5])
    run_ranks(2, _save_steps, cloud_url, str(tmp_path), [6], close=False)
    (tmp_path / "node1" / "iter_0000006" / "__1_0.distcp").unlink()  # the marker still names it
    out = run_ranks(2, _load_report, cloud_url, str(tmp_path))
    assert [o[:3] for o in out] == [(5, [], 5)] * 2
    assert "iter_0000006/metadata.json" not in open_store(cloud_url).list()


def _zarr_save_then_load(url, tmp):
    from distckpt.strategies.zarr import ZarrSaveShardedStrategy

    tiers = TieredCheckpointManager(url, _node(tmp))
    tiers.save(_state(3), 3, sharded_strategy=ZarrSaveShardedStrategy())
    tiers.close()
    loaded = tiers.load(_state(fill=False))
    sources = set(tiers.last_load.files.values())
    return _wrong(loaded, 3), loaded["common"]["step"], "local" in sources


@pytest.mark.parametrize("cloud", clouds("s3"))
def test_a_zarr_tiered_checkpoint_round_trips_and_reads_local_chunks(cloud_url, tmp_path):
    assert run_ranks(2, _zarr_save_then_load, cloud_url, str(tmp_path)) == [([], 3, True)] * 2
    assert distckpt.check_is_distributed_checkpoint(f"{cloud_url}/iter_0000003")
