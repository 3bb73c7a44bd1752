"""Fixtures of the store-fault tests: a moto S3 server of their own that they may stop, restart
and make answer with faults, and a fresh prefix on every store the overwrite tests run on."""

from __future__ import annotations

import uuid

import pytest

from tests.support.s3_faults import FaultyS3Server

# The stores the overwrite tests run on. "memory": obstore's in-process store (the same
# ObjectStore code, no server); "s3": moto, "gcs": fake-gcs-server, "az": Azurite (the session's
# servers, tests/conftest.py).
OVERWRITE_STORES = ["s3", "memory", "gcs", "az"]


@pytest.fixture(params=OVERWRITE_STORES)
def store_url(request):
    """A fresh, empty checkpoint prefix on each store of :data:`OVERWRITE_STORES`."""
    if request.param == "memory":
        return f"memory://overwrite-{uuid.uuid4().hex[:8]}/ckpt"
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(scope="module")
def faulty_s3():
    """A moto S3 server of this module's own (stoppable, with fault injection); faults are
    cleared after each test, and a stopped server restarted."""
    with FaultyS3Server() as server:
        yield server


@pytest.fixture
def s3(faulty_s3):
    yield faulty_s3
    if faulty_s3.stopped:
        faulty_s3.restart()
    faulty_s3.clear()
