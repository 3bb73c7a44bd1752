"""Object-store failures are classified (distckpt.storage.failures): each says which remote, what
the server answered, and only the transient ones are retried.

Against a moto S3 server of this module's own (tests/support/s3_faults.py), answering with
injected faults the way AWS words them, or stopped; obstore's retries bounded to about a second.
"""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt import CheckpointingException
from distckpt.storage.failures import (
    AccessDeniedError,
    BucketNotFoundError,
    RequestRefusedError,
    ThrottledError,
    UnavailableError,
)
from distckpt.storage.object import ObjectStore


def _state(value: float = 1.0):
    return {"w": distckpt.ShardedTensor.from_rank_offsets("w", torch.full((64, 64), value))}


def _puts(s3, name: str):
    return [r for r in s3.seen if r.method == "PUT" and r.path.split("?")[0].endswith(name)]


def test_a_save_to_a_missing_bucket_names_the_bucket_and_keeps_the_servers_answer(s3):
    url = f"s3://no-such-bucket-{s3.port}/run/iter_1"
    with pytest.raises(CheckpointingException) as info:
        distckpt.save(_state(), url, storage_options=s3.options())
    text = str(info.value)
    assert f"s3://no-such-bucket-{s3.port}/run/iter_1/" in text
    assert "the bucket or container does not exist" in text
    assert "404 NoSuchBucket: The specified bucket does not exist" in text
    assert f"[GET http://127.0.0.1:{s3.port}/no-such-bucket-{s3.port}/run/iter_1/" in text
    assert "FileNotFoundError" not in text


def test_a_put_into_a_missing_bucket_is_a_bucket_error_not_a_missing_file(s3):
    store = ObjectStore(f"s3://no-such-bucket-{s3.port}/x", s3.options())
    with pytest.raises(BucketNotFoundError, match="404 NoSuchBucket") as info:
        store.put("common.pt", b"x")
    assert not isinstance(info.value, FileNotFoundError) and "[PUT http://" in str(info.value)


def test_a_load_from_a_missing_bucket_says_so_instead_of_not_a_checkpoint(s3):
    with pytest.raises(CheckpointingException, match="bucket or container does not exist.*404 NoSuchBucket"):
        distckpt.load(_state(0.0), f"s3://no-such-bucket-{s3.port}/x", storage_options=s3.options())


def test_a_load_from_an_empty_prefix_says_nothing_is_stored_there(s3):
    with pytest.raises(CheckpointingException, match="no object at all is stored under this prefix"):
        distckpt.load_common_state_dict(s3.url("never-written"), storage_options=s3.options())
    ObjectStore(s3.url("half-written"), s3.options()).put("common.pt", b"x")
    with pytest.raises(CheckpointingException, match="metadata.json is missing"):
        distckpt.load_common_state_dict(s3.url("half-written"), storage_options=s3.options())


def test_refused_access_is_reported_once_and_not_retried(s3):
    url = s3.url("denied")
    s3.inject(403, "AccessDenied", times=100, match=lambda r: r.method == "PUT")
    with pytest.raises(CheckpointingException) as info:
        distckpt.save(_state(), url, storage_options=s3.options())
    assert "access denied" in str(info.value) and "403 AccessDenied: Access Denied" in str(info.value)
    assert len(_puts(s3, "common.pt")) == 1  # no retry
    with pytest.raises(AccessDeniedError) as direct:
        ObjectStore(url, s3.options()).put("x", b"1")
    assert direct.value.transient is False


def test_throttling_within_the_clients_retries_is_absorbed_and_the_save_succeeds(s3):
    url = s3.url("throttled-briefly")
    s3.inject(503, "SlowDown", times=2, match=lambda r: r.method == "PUT")
    distckpt.save(_state(2.0), url, storage_options=s3.options())
    assert len(_puts(s3, "common.pt")) == 3  # twice "slow down", then stored
    loaded = distckpt.load(_state(0.0), url, storage_options=s3.options())
    assert torch.equal(loaded["w"], torch.full((64, 64), 2.0))


def test_throttling_that_lasts_is_a_throttled_error_after_the_retries(s3):
    s3.inject(503, "SlowDown", times=1000)
    with pytest.raises(ThrottledError) as info:
        ObjectStore(s3.url("throttled"), s3.options()).put("x", b"1")
    text = str(info.value)
    assert "throttling" in text and "still after 3 retries" in text
    assert "503 SlowDown: Please reduce your request rate." in text
    assert info.value.transient is True


def test_a_server_error_that_lasts_is_transient_and_names_the_request(s3):
    s3.inject(500, "InternalError", times=1000, match=lambda r: r.method == "GET")
    with pytest.raises(UnavailableError) as info:
        ObjectStore(s3.url("failing"), s3.options()).get("x")
    assert "500 InternalError" in str(info.value) and "[GET http://" in str(info.value)
    assert info.value.transient is True


def test_a_request_the_server_does_not_implement_is_refused_not_retried(s3):
    # 501 is a 5xx, but another try gets the same answer: not a transient error.
    s3.inject(501, "NotImplemented", times=1000, match=lambda r: r.method == "GET")
    with pytest.raises(RequestRefusedError) as info:
        ObjectStore(s3.url("unsupported"), s3.options()).get("x")
    assert "501 NotImplemented" in str(info.value)
    assert info.value.transient is False


def test_a_missing_object_stays_a_file_not_found_error(s3):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        ObjectStore(s3.url("p"), s3.options()).get("nothing-here")


def test_a_name_the_containment_rule_refuses_is_never_sent(s3):
    store = ObjectStore(s3.url("p"), s3.options())
    before = len(s3.seen)
    with pytest.raises(CheckpointingException, match="points outside the checkpoint"):
        store.put("../escape", b"x")
    assert len(s3.seen) == before


def test_a_multipart_upload_cut_by_a_refused_part_reports_the_part_not_its_abort(s3):
    store = ObjectStore(s3.url("mp"), s3.options(part_size=5 << 20))
    s3.inject(403, "AccessDenied", times=10, match=lambda r: "partNumber=" in r.path)
    with pytest.raises(AccessDeniedError) as info:
        with store.open_writer("big") as writer:
            for _ in range(4):
                writer.write(b"x" * (3 << 20))
    text = str(info.value)
    assert "upload failed" in text and "partNumber=" in text and "DELETE" not in text
    assert any(r.method == "DELETE" and "uploadId=" in r.path for r in s3.seen)  # aborted


def test_a_multipart_upload_cut_by_an_outage_reports_the_upload_as_unreachable(s3):
    store = ObjectStore(s3.url("mp-outage"), s3.options(part_size=5 << 20))
    s3.stop_on(lambda r: "partNumber=2" in r.path)
    with pytest.raises(UnavailableError) as info:
        with store.open_writer("big") as writer:
            for _ in range(6):
                writer.write(b"x" * (3 << 20))
    text = str(info.value)
    assert text.startswith(f"{s3.url('mp-outage')}/big: upload failed: the store could not be reached")
    assert "a part or the completion of this multipart upload failed and its abort failed too" in text
