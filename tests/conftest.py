"""Session-wide test set-up: the rank-pool fixture, the ``cuda`` marker's skip, and the object-store
servers (S3: moto; Azure: Azurite; GCS: fake-gcs-server), one of each per session, started on first
use."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.support import clouds, harness, servers


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
    ``tests/support/harness.py``.
    """
    return harness.run_ranks


S3_BUCKET = "distckpt-test"
GCS_BUCKET = "distckpt-test"
AZURE_CONTAINER = "distckpt-test"


@contextlib.contextmanager
def _server_env(env):
    """``env`` in this process's environment and every rank-pool worker's, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    harness.WORKER_ENV.update(env)
    try:
        yield
    finally:
        for k in env:
            harness.WORKER_ENV.pop(k, None)
            if saved[k] is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = saved[k]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on 127.0.0.1 with one bucket, for the whole session.

    Yields ``s3://<bucket>``. The endpoint and test credentials go into this process's
    environment and into every rank-pool worker's (``harness.WORKER_ENV``), so any code that opens
    an ``s3://`` URL reaches this server, as it would reach AWS from ``AWS_ENDPOINT_URL``.
    """
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
    try:
        import urllib.request

        from obstore.store import S3Store

        # moto creates a bucket on an unsigned PUT /<bucket>; no SDK needed.
        urllib.request.urlopen(
            urllib.request.Request(f"http://{host}:{port}/{S3_BUCKET}", method="PUT"), timeout=10
        )
        with _server_env(env):
            S3Store.from_url(f"s3://{S3_BUCKET}")  # the env is complete enough to build a client
            yield f"s3://{S3_BUCKET}"
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server, request):
    """A fresh, empty prefix in the test bucket for one test."""
    return _prefix_for(s3_server, request)


# --------------------------------------------------------------------------- Azure and GCS


@contextlib.contextmanager
def _serving(server: servers.Server, url: str):
    """``url`` on ``server``, with the environment that reaches it set (:func:`_server_env`); the
    server is stopped afterwards, whatever happened."""
    try:
        with _server_env(server.env):
            yield url
    finally:
        server.stop()


def _prefix_for(base: str, request) -> str:
    """A fresh, empty prefix below ``base`` for one test, named after it."""
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{base}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """A real Azure Blob server (Azurite, in memory; installed by scripts/setup.sh) on 127.0.0.1 with
    one container, for the whole session. Yields ``az://<container>``.

    It is reached as an Azure CLI user reaches an account: ``AZURE_STORAGE_CONNECTION_STRING``
    (account ``devstoreaccount1``, Azurite's published key, the server's blob endpoint), set in this
    process and in every rank-pool worker, as in :func:`s3_server`. A missing Azurite is an error of
    the set-up, not a skip.
    """
    server = servers.start_azurite(AZURE_CONTAINER, tmp_path_factory.mktemp("azurite"))
    with _serving(server, f"az://{AZURE_CONTAINER}") as url:
        yield url


@pytest.fixture
def az_url(azure_server, request):
    """A fresh, empty prefix in the Azurite test container for one test."""
    return _prefix_for(azure_server, request)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A real GCS server (fake-gcs-server, in memory; installed by scripts/setup.sh, behind the
    XML-upload gateway of tests/support/gcs_gateway.py) on 127.0.0.1 with one bucket, for the whole
    session. Yields ``gs://<bucket>``.

    It is reached as a user of Google's client libraries reaches an emulator:
    ``STORAGE_EMULATOR_HOST``, set in this process and in every rank-pool worker.
    """
    server = servers.start_gcs(GCS_BUCKET, tmp_path_factory.mktemp("fake-gcs-server"))
    with _serving(server, f"gs://{GCS_BUCKET}") as url:
        yield url


@pytest.fixture
def gcs_url(gcs_server, request):
    """A fresh, empty prefix in the GCS test bucket for one test."""
    return _prefix_for(gcs_server, request)


@pytest.fixture
def cloud_url(request, cloud):
    """A fresh prefix on the server of the test's ``cloud`` parameter (``s3``, ``gcs``, ``azure``;
    see :func:`tests.support.clouds.clouds`)."""
    return request.getfixturevalue(clouds.URL_FIXTURES[cloud])
