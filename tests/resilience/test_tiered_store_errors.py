"""A tiered upload says what went wrong and retries only what another try can cure.

A remote 404 on a PUT is the remote's missing bucket (not "the local file is missing"), refused
once; a local copy whose file is a symlink out of it is refused once (the containment rule), not
retried with backoff. One process (world 1) against moto (this module's server, which answers
with injected faults).
"""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt import CheckpointingException
from distckpt.storage import open_store
from distckpt.tiered import TieredCheckpointManager, UploadFailedError
from distckpt.tiered.upload import FAILED, Upload
from tests.support.s3_faults import CountingStore


def _state(step: int):
    return {"w": distckpt.ShardedTensor.from_rank_offsets("w", torch.full((32, 32), float(step)))}


def test_a_tiered_save_to_a_missing_bucket_fails_at_once_naming_the_bucket(s3, tmp_path):
    tiers = TieredCheckpointManager(
        f"s3://no-such-bucket-{s3.port}/run", tmp_path, storage_options=s3.options()
    )
    with pytest.raises(CheckpointingException, match="bucket or container does not exist.*404 NoSuchBucket"):
        tiers.save(_state(3), 3)


def test_an_upload_answered_no_such_bucket_names_the_bucket_and_is_not_retried(s3, tmp_path):
    remote = CountingStore(open_store(s3.url("tiered-404"), s3.options()))
    tiers = TieredCheckpointManager(remote, tmp_path, upload_retries=5, upload_backoff_s=0.05)
    # The bucket goes away once the local save began: every later PUT is answered 404.
    s3.inject(404, "NoSuchBucket", times=1000, match=lambda r: r.method in ("PUT", "POST"))
    tiers.save(_state(3), 3)
    with pytest.raises(UploadFailedError) as info:
        tiers.close()
    text = str(info.value)
    assert "the bucket or container does not exist" in text and "404 NoSuchBucket" in text, text
    assert "the local file is missing" not in text and "attempts" not in text, text
    puts = [r.path.split("?")[0] for r in s3.seen if r.method in ("PUT", "POST")]
    assert puts and len(puts) == len(set(puts)), puts  # each file was tried once


def test_a_local_file_that_is_a_symlink_out_of_the_copy_is_refused_at_once(s3, tmp_path):
    local = tmp_path / "iter_0000004"
    local.mkdir()
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(b"not the checkpoint's")
    os.symlink(outside, local / "__0_0.distcp")
    remote = CountingStore(open_store(s3.url("tiered-symlink"), s3.options()))
    # With a retry, the backoff of an hour would keep it running well past the wait below.
    upload = Upload(4, local, remote, ["__0_0.distcp"], retries=5, backoff_s=3600).start()
    assert upload.wait(30), "a containment refusal was retried"
    assert upload.state == FAILED
    assert "outside the checkpoint" in str(upload.error) and "__0_0.distcp" in str(upload.error)
    assert remote.log == []  # nothing was sent
