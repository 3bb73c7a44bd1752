"""Session-wide test set-up: the rank-pool fixture and the ``cuda`` marker's skip."""

from __future__ import annotations

import pytest

from tests import harness


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not needs_cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in needs_cuda:
        item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness.shutdown_pools()


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(world_size, fn, *args, timeout=60, **kwargs) -> list`` of per-rank values.

    Runs ``fn`` (a module-level function) on every rank of a gloo process group of
    ``world_size`` processes; the pools are spawned once per session and reused. See
    ``tests/harness.py``.
    """
    return harness.run_ranks


S3_BUCKET = "distckpt-test"


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on 127.0.0.1 with one bucket, for the whole session.

    Yields ``s3://<bucket>``. The endpoint and test credentials go into this process's
    environment and into every rank-pool worker's (``harness.WORKER_ENV``), so any code that opens
    an ``s3://`` URL reaches this server, as it would reach AWS from ``AWS_ENDPOINT_URL``.
    """
    import os

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    harness.WORKER_ENV.update(env)
    try:
        import urllib.request

        from obstore.store import S3Store

        # moto creates a bucket on an unsigned PUT /<bucket>; no SDK needed.
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/{S3_BUCKET}", method="PUT"), timeout=10)
        S3Store.from_url(f"s3://{S3_BUCKET}")  # the env is complete enough to build a client
        yield f"s3://{S3_BUCKET}"
    finally:
        for k in env:
            harness.WORKER_ENV.pop(k, None)
            if saved[k] is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = saved[k]
        server.stop()


@pytest.fixture
def s3_url(s3_server, request):
    """A fresh, empty prefix in the test bucket for one test."""
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{s3_server}/{name}-{uuid.uuid4().hex[:8]}"
