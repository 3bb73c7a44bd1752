"""Session-wide test set-up: the rank-pool fixture and the ``cuda`` marker's skip."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.support import harness


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
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{s3_server}/{name}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- Azure (Azurite)

AZURE_CONTAINER = "distckpt-test"
# Azurite's one built-in account and its published key (the Azure storage emulator's well-known
# development credentials; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary():
    """The Azurite blob server to run, or None: ``$DISTCKPT_AZURITE`` (a path), else
    ``azurite-blob`` / ``azurite`` on PATH. Azurite is an npm package (``npm install -g azurite``),
    not part of scripts/setup.sh, so the Azure tests skip where it is absent."""
    import shutil

    given = os.environ.get("DISTCKPT_AZURITE")
    if given:
        return given if shutil.which(given) else None
    return shutil.which("azurite-blob") or shutil.which("azurite")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _azurite_create_container(endpoint: str, name: str) -> None:
    """Create a container on Azurite: one Shared-Key-signed REST call (obstore has no
    create-container; this is test set-up, like the unsigned PUT that makes moto's bucket)."""
    import base64
    import hashlib
    import hmac
    import urllib.request
    from email.utils import formatdate

    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    resource = f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
    to_sign = "PUT\n" + "\n" * 11 + canonical + resource
    mac = hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(mac).decode()}"
    request = urllib.request.Request(
        f"{endpoint}/{AZURITE_ACCOUNT}/{name}?restype=container", method="PUT", headers=headers
    )
    urllib.request.urlopen(request, timeout=10)


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """A real Azure Blob server (Azurite, in memory) on 127.0.0.1 with one container, for the whole
    session; skips when no Azurite binary is found (see :func:`azurite_binary`).

    Yields ``az://<container>``. obstore reaches it through its emulator mode
    (``AZURE_STORAGE_USE_EMULATOR=true``: the well-known devstoreaccount1 key, plain http) at
    ``AZURITE_BLOB_STORAGE_URL``; both go into this process's and the rank-pool workers'
    environment, as in :func:`s3_server`.
    """
    import socket
    import subprocess
    import time
    from pathlib import Path

    binary = azurite_binary()
    if binary is None:
        pytest.skip(
            "Azurite not found: install it with `npm install -g azurite` or point DISTCKPT_AZURITE "
            "at an azurite-blob binary (npm package; not installed by scripts/setup.sh)"
        )
    port = _free_port()
    args = [
        binary,
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--inMemoryPersistence",
        "--disableTelemetry",
        "--silent",
        "--skipApiVersionCheck",
    ]
    if Path(binary).name.split(".")[0] == "azurite":  # the all-services binary: keep off the default ports
        args += ["--queuePort", str(_free_port()), "--tablePort", str(_free_port())]
    log = tmp_path_factory.mktemp("azurite") / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Azurite did not start ({' '.join(args)}): {log.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        _azurite_create_container(endpoint, AZURE_CONTAINER)
        env = {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": endpoint}
        with _server_env(env):
            yield f"az://{AZURE_CONTAINER}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def az_url(azure_server, request):
    """A fresh, empty prefix in the Azurite test container for one test."""
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{azure_server}/{name}-{uuid.uuid4().hex[:8]}"
